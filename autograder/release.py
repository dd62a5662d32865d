"""Generate the student release course/NAME/ from the source solutions/NAME/ with nbgrader.

    python -m autograder.release                 # every notebook in solutions/ (what `make release` runs)
    python -m autograder.release 02_sampling     # one
    python -m autograder.release --out DIR       # somewhere else (the sync test compares DIR with course/)

nbgrader runs in a throw-away course folder (its own gradebook), with the repository's
nbgrader_config.py: solution regions become the `raise NotImplementedError(...)` stub, hidden
tests and outputs are removed, test cells are locked and checksummed. A prediction's answer cell
(``q_<name>``, see decodelab.course.predictions) gets ``q_<name> = None`` instead of the stub, so
that the release runs past it; its graded cell prints that the prediction is unanswered (and the
grader, whose hidden block fails on None, scores it 0). Each released notebook
then records the version of `decodelab` it was made for, in its metadata:
``{"decodelab": {"version": "0.2.0"}}`` (`decodelab.__version__`); the class grader notes a
submission whose recorded version differs from the one grading it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from autograder import cells

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
COURSE = ROOT / "course"
_IGNORE = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.pyc")
VERSION_KEY = "decodelab"  # notebook metadata: {"decodelab": {"version": ...}}


def library_version() -> str:
    """The installed decodelab's version (`decodelab.__version__`, the one place it is written)."""
    import decodelab

    return decodelab.__version__


def record_version(path: Path, version: str | None = None) -> None:
    """Write into a released notebook's metadata the decodelab version it is made for."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    nb.setdefault("metadata", {})[VERSION_KEY] = {"version": version or library_version()}
    path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def recorded_version(nb) -> str | None:
    """The decodelab version a notebook (a dict or NotebookNode) records, or None if it records none."""
    metadata = nb.get("metadata") if isinstance(nb, dict) else None
    entry = metadata.get(VERSION_KEY) if isinstance(metadata, dict) else None
    version = entry.get("version") if isinstance(entry, dict) else None
    return str(version) if version else None


def open_predictions(path: Path) -> None:
    """In a released notebook, turn each prediction cell's stub (`raise NotImplementedError`) into
    `q_<name> = None  # ...`, and record the cell's new checksum as nbgrader computes it."""
    import nbformat
    from nbgrader.utils import compute_checksum

    nb = json.loads(path.read_text(encoding="utf-8"))
    stub = load_config().ClearSolutions.code_stub["python"]
    changed = False
    for cell in nb.get("cells", []):
        meta = cells.meta(cell)
        name = meta.get("grade_id") or ""
        source = "".join(cell["source"]) if isinstance(cell.get("source"), list) else cell.get("source", "")
        if cell.get("cell_type") == "code" and meta.get("solution") and name.startswith("q_") and stub in source:
            source = source.replace(stub, f"{name} = None  # your prediction: replace None with a number")
            cell["source"] = source.splitlines(keepends=True)
            if "checksum" in meta:
                meta["checksum"] = compute_checksum(nbformat.from_dict({**cell, "source": source}))
            changed = True
    if changed:
        path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def load_config():
    """The repository's nbgrader_config.py as a traitlets Config."""
    from traitlets.config.loader import PyFileConfigLoader

    return PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()


def assignments(solutions: Path = SOLUTIONS) -> list[str]:
    """Names of the source notebooks: folders solutions/NAME/ holding NAME.ipynb."""
    return sorted(p.parent.name for p in solutions.glob("*/*.ipynb") if p.stem == p.parent.name)


def ensure_tools_on_path() -> None:
    """nbgrader's gradebook runs the `alembic` command: find it beside this Python (a venv whose
    bin/ is not on PATH, e.g. `.venv/bin/python -m autograder.release`)."""
    import os

    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def generate(names: list[str] | None = None, out: Path = COURSE, solutions: Path = SOLUTIONS) -> list[Path]:
    """Write out/NAME/ (replacing it) for each name; returns the released notebooks."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    ensure_tools_on_path()
    names = names or assignments(solutions)
    missing = [n for n in names if not (solutions / n / f"{n}.ipynb").exists()]
    if missing:
        raise FileNotFoundError(f"no source notebook for {missing}: expected solutions/NAME/NAME.ipynb")
    written = []
    with tempfile.TemporaryDirectory(prefix="decodelab-release-") as tmp:
        config = load_config()
        config.CourseDirectory.root = tmp
        for name in names:
            shutil.copytree(solutions / name, Path(tmp) / "solutions" / name, ignore=_IGNORE)
        api = NbGraderAPI(CourseDirectory(config=config), config=config)
        for name in names:
            result = api.generate_assignment(name, force=True, create=True)
            if not result["success"]:
                raise RuntimeError(
                    f"nbgrader generate_assignment {name} failed:\n{result.get('error', '')}\n{result.get('log', '')}"
                )
            target = Path(out) / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(Path(tmp) / "course" / name, target, ignore=_IGNORE)
            open_predictions(target / f"{name}.ipynb")
            record_version(target / f"{name}.ipynb")
            written.append(target / f"{name}.ipynb")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.release", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="assignments to release (default: all in solutions/)")
    parser.add_argument("--out", type=Path, default=COURSE, help="folder to write NAME/ into (default: course/)")
    args = parser.parse_args(argv)
    for path in generate(args.names or None, args.out):
        print(f"released {path.relative_to(args.out.resolve()) if path.is_relative_to(args.out.resolve()) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Grading a class: `python -m autograder grade --workers 2` (sandboxed, parallel) against
nbgrader's own serial autograde, on the same submissions, in one run.

    .venv/bin/python bench/grading.py [--submissions 30] [--workers 2] [--kind trimmed|full]

Each of the N students submits notebook 00's solution: `full` is the whole solution notebook
(model load, bandwidth probe, a short decode), `trimmed` is what a learner who deleted the
ungraded demo cells submits (imports, the two exercises and their tests). Both sides start a
fresh kernel per student, include nbgrader's generate_assignment, and must agree on every score.
Goal on 2 cores: >= 1.8x (2x is the ideal). Writes bench/results/grading.json.

    .venv/bin/python bench/grading.py --scheduler local [--submissions 30] [--workers 2]

instead times `grade --scheduler local` (a LocalCluster of --workers processes, one thread each,
`grader=1` each: autograder/cluster.py) against `grade --workers N` (the process pool) on the same
submissions in one run, both sandboxed; they must agree on every score. Goal: Dask within 10% of
the pool (ratio <= 1.10). Writes bench/results/grading_dask.json (only record it from a quiet machine).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lib")]
NAME = "00_meet_the_model"


def submission(kind: str):
    import nbformat

    nb = nbformat.read(str(ROOT / "solutions" / NAME / f"{NAME}.ipynb"), as_version=4)
    if kind == "trimmed":
        nb.cells = [
            c
            for i, c in enumerate(nb.cells)
            if c.cell_type == "markdown" or i == 1 or c.metadata.get("nbgrader", {}).get("grade_id")
        ]
    return nb


def nbgrader_serial(students: list[str], nb, root: Path) -> tuple[float, dict[str, float]]:
    """nbgrader's own way: generate_assignment, then `autograde` one student after another."""
    import nbformat
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    from autograder.release import ensure_tools_on_path, load_config

    ensure_tools_on_path()
    shutil.copytree(ROOT / "solutions" / NAME, root / "solutions" / NAME)
    for student in students:
        folder = root / "submitted" / student / NAME
        folder.mkdir(parents=True)
        nbformat.write(nb, str(folder / f"{NAME}.ipynb"))
    config = load_config()
    config.CourseDirectory.root = str(root)
    started = time.perf_counter()
    api = NbGraderAPI(CourseDirectory(config=config), config=config)
    assert api.generate_assignment(NAME)["success"]
    for student in students:
        result = api.autograde(NAME, student)
        assert result["success"], result.get("error")
    elapsed = time.perf_counter() - started
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        scores = {s: gb.find_submission_notebook(NAME, NAME, s).score for s in students}
    return elapsed, scores


def ours(
    students: list[str], nb, root: Path, workers: int, sandbox: bool, extra: tuple[str, ...] = ()
) -> tuple[float, dict[str, float], dict]:
    import nbformat

    subs = root / "submissions"
    for student in students:
        folder = subs / student / NAME
        folder.mkdir(parents=True)
        nbformat.write(nb, str(folder / f"{NAME}.ipynb"))
    out = root / "grades.csv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "lib")]), OMP_WAIT_POLICY="PASSIVE")
    cmd = [
        sys.executable,
        "-m",
        "autograder",
        "grade",
        "--assignment",
        NAME,
        "--submissions",
        str(subs),
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--quiet",
        *extra,
    ] + ([] if sandbox else ["--no-sandbox"])
    started = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"autograder grade failed:\n{result.stdout}\n{result.stderr[-3000:]}")
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    statuses = {}
    for row in rows:
        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
    return elapsed, {r["student"]: float(r["score"]) for r in rows}, statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submissions", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kind", choices=("trimmed", "full"), default="trimmed")
    parser.add_argument("--no-sandbox", action="store_true", help="time ours without the sandbox (not as root)")
    parser.add_argument("--scheduler", choices=("local",), help="time a 2-worker LocalCluster against the pool")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.scheduler:
        return against_pool(args)
    args.out = args.out or ROOT / "bench" / "results" / "grading.json"
    sandbox, students, nb = _prepare(args)
    with tempfile.TemporaryDirectory(prefix="decodelab-bench-grading-") as tmp:
        serial_s, serial_scores = nbgrader_serial(students, nb, Path(tmp) / "nbgrader")
        print(
            f"nbgrader autograde, serial:        {serial_s:7.1f} s  ({serial_s / len(students):.1f} s per submission)"
        )
        ours_s, our_scores, statuses = ours(students, nb, Path(tmp) / "ours", args.workers, sandbox)
        print(
            f"autograder grade --workers {args.workers}:      {ours_s:7.1f} s  ({ours_s / len(students):.1f} s per submission, "
            f"{'sandboxed' if sandbox else 'NO sandbox'}), statuses {statuses}"
        )
    assert serial_scores == our_scores, f"the two graders disagree: {serial_scores} vs {our_scores}"
    ratio = serial_s / ours_s
    print(
        f"speed-up: {ratio:.2f}x on {os.cpu_count()} cores (goal >= 1.8x; 2x is the ideal on 2 cores); "
        f"every score agrees ({sorted(set(our_scores.values()))})"
    )
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "submissions": len(students),
        "kind": args.kind,
        "workers": args.workers,
        "sandbox": sandbox,
        "cores": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "machine": platform.platform(),
        "nbgrader_serial_s": round(serial_s, 1),
        "ours_s": round(ours_s, 1),
        "speedup": round(ratio, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


def _prepare(args) -> tuple[bool, list[str], dict]:
    """Quiet warnings, check the sandbox can run, and make the class: (sandbox, students, notebook)."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sandbox = not args.no_sandbox
    if sandbox and (not sys.platform.startswith("linux") or os.geteuid() != 0):
        raise SystemExit("the sandbox needs root: run as root, or pass --no-sandbox")
    students = [f"student{i:03d}" for i in range(args.submissions)]
    return sandbox, students, submission(args.kind)


def against_pool(args) -> int:
    """`grade --scheduler local` against `grade --workers N`, same submissions, same run."""
    sandbox, students, nb = _prepare(args)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="decodelab-bench-grading-") as tmp:
        pool_s, pool_scores, pool_statuses = ours(students, nb, Path(tmp) / "pool", args.workers, sandbox)
        print(f"autograder grade --workers {args.workers}:           {pool_s:7.1f} s, statuses {pool_statuses}")
        dask_s, dask_scores, dask_statuses = ours(
            students, nb, Path(tmp) / "dask", args.workers, sandbox, ("--scheduler", "local")
        )
        print(f"autograder grade --scheduler local ({args.workers} workers): {dask_s:7.1f} s, statuses {dask_statuses}")
    assert pool_scores == dask_scores, f"the pool and Dask disagree: {pool_scores} vs {dask_scores}"
    ratio = dask_s / pool_s
    print(
        f"Dask / pool: {ratio:.2f} (goal <= 1.10) on {os.cpu_count()} cores, load {load_before[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; every score agrees"
    )
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "submissions": len(students),
        "kind": args.kind,
        "workers": args.workers,
        "sandbox": sandbox,
        "cores": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_at_end": os.getloadavg(),
        "machine": platform.platform(),
        "pool_s": round(pool_s, 1),
        "dask_local_s": round(dask_s, 1),
        "ratio": round(ratio, 3),
    }
    out = args.out or ROOT / "bench" / "results" / "grading_dask.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The library's layout holds: the import contracts in pyproject.toml, the inference stack and the
hidden checks importable without any notebook UI, and a top folder that holds only the
package's front door (lib/decodelab/README.md is the map)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lib" / "decodelab"
TOP_LEVEL_MODULES = {"__init__", "__main__", "cli", "config", "params", "paths", "validation"}
SUBPACKAGES = {"model", "decoding", "engine", "serving", "lessons", "course", "training"}


def test_import_contracts_are_kept():
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint_imports, "lint-imports is missing: `make setup` installs import-linter (the dev extra)"
    run = subprocess.run(
        [lint_imports, "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,  # this tree's lib/,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'lib'}"},
    )  # not an installed copy's
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "broken" in run.stdout and " 0 broken" in run.stdout


def test_top_folder_holds_only_the_front_door():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL_MODULES, f"unexpected top-level modules: {sorted(modules - TOP_LEVEL_MODULES)}"
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == SUBPACKAGES


def test_every_subpackage_is_on_the_map():
    text = (PACKAGE / "README.md").read_text()
    for name in SUBPACKAGES:
        assert f"`{name}/`" in text, f"lib/decodelab/README.md does not describe {name}/"
    for path in PACKAGE.glob("*/*.py"):
        if path.name != "__init__.py":
            assert path.stem in text, f"lib/decodelab/README.md does not mention {path.relative_to(PACKAGE)}"
    for path in PACKAGE.glob("*/*/*.py"):  # a package inside a subpackage, decoding/speculative/; widgets go by topic
        if path.name != "__init__.py" and path.parent.name != "widgets":
            assert f"`{path.parent.name}/`" in text and f"`{path.stem}`" in text, (
                f"lib/decodelab/README.md does not describe {path.relative_to(PACKAGE)}"
            )


def test_one_name_per_notebook():
    """A notebook NN_topic's widget module, hidden checks, check tests and kept-bug fixture are
    all named `topic` (the map's last table): no piece goes by another name."""
    topics = {p.name.split("_", 1)[1] for p in (ROOT / "solutions").iterdir() if p.is_dir() and p.name[:2].isdigit()}
    widgets = {p.stem for p in (PACKAGE / "course" / "widgets").glob("*.py")} - {"__init__", "controls"}
    shared = {"__init__", "calling", "answers", "speed"}  # helpers every topic's checks may use
    checks = {p.stem for p in (ROOT / "autograder" / "checks").glob("*.py")} - shared
    fixtures = {p.stem.removeprefix("buggy_") for p in (ROOT / "tests" / "fixtures").glob("buggy_*.py")}
    check_tests = {
        p.stem.removeprefix("test_").removesuffix("_checks") for p in (ROOT / "tests").glob("test_*_checks.py")
    } - {"calling"}
    for kind, names in [
        ("widget module", widgets),
        ("check module", checks),
        ("kept-bug fixture", fixtures),
        ("check test", check_tests),
    ]:
        assert names <= topics, f"{kind}s not named after a notebook topic: {sorted(names - topics)}"
    assert checks == fixtures == check_tests, "every notebook with hidden checks has its fixture and check tests"


_BLOCK_UI = """
import importlib, importlib.abc, pkgutil, sys

class NoUI(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"ipywidgets", "plotly", "IPython"}:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, NoUI())
import decodelab.engine.llm, decodelab.decoding.speculative, decodelab.model.registry
import autograder.checks
for info in pkgutil.iter_modules(autograder.checks.__path__):
    importlib.import_module(f"autograder.checks.{info.name}")
from decodelab import LLM, SamplingParams
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in {"ipywidgets", "plotly", "IPython"}))
"""


def test_engine_and_checks_import_without_ipywidgets_or_plotly():
    run = subprocess.run(
        [sys.executable, "-c", _BLOCK_UI],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'lib'}", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ok []"


@pytest.mark.parametrize(
    "contract_breaker",
    [
        # (file written in a copy of lib/, its source, the start of the contract's name that must break)
        ("decodelab/model/_probe.py", "import decodelab.engine.llm\n", "decodelab's layers"),  # a layer importing up
        ("decodelab/engine/_probe.py", "import plotly\n", "the inference stack"),  # the engine importing a UI package
        ("decodelab/lessons/_probe.py", "import decodelab.training.train_tiny\n", "nothing in decodelab outside"),
        ("../autograder/cells.py", "import autograder.grade\n", "autograder's layers"),  # the grader's bottom, its top
        (
            "../autograder/run.py",
            "import autograder.sandbox\n",
            "what a student's kernel",
        ),  # a kernel reaching the grader
        # the theory importing the chain's adapters (an upward import in decoding/speculative/, no circle)
        (
            "decodelab/decoding/speculative/theory.py",
            "import decodelab.decoding.speculative.proposers\n",
            "speculative decoding's layers",
        ),
        # sampling importing generate, which imports sampling: a circle inside one layer of decodelab's
        ("decodelab/decoding/sampling.py", "import decodelab.decoding.generate\n", "no circle of imports"),
    ],
)
def test_a_broken_contract_fails_the_lint(tmp_path, contract_breaker):
    """The contracts catch what they are for: a copy of the package with one bad import fails, and
    the contract that breaks is the one written for it."""
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    shutil.copytree(PACKAGE, tmp_path / "lib" / "decodelab", ignore=shutil.ignore_patterns("data", "__pycache__"))
    shutil.copytree(ROOT / "autograder", tmp_path / "autograder", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    relative, source, contract = contract_breaker
    (tmp_path / "lib" / relative).write_text(source)
    run = subprocess.run(
        [lint_imports, "--no-cache"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{tmp_path / 'lib'}", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode != 0 and "BROKEN" in run.stdout, run.stdout[-2000:]
    broken = " ".join(run.stdout.partition("Broken contracts")[2].split())  # the broken ones' names and reports
    assert contract in broken, f"expected the contract {contract!r} to break:\n{run.stdout[-2000:]}"

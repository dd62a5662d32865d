"""No dead check: every check a checks module exports (its `__all__`) is called by a hidden test
cell of a solution notebook, as `hidden("<topic>.<check>", ...)`. A check no notebook calls grades
nothing; what it tests belongs with the library's own tests (tests/test_sampling.py's
apply_temperature and probs, tests/test_scheduler_admit.py's admit).

One module is exempt by design: `speed` grades no notebook of its own. Speed credit is an
instructor's choice, added to a hidden cell of their own (autograder/checks/speed.py's docstring);
tests/test_speed_credit.py calls each of its checks on the solutions and on planted slow or wrong code."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPT_IN_MODULES = {"speed"}  # checks an instructor adds to a hidden cell; see the module docstring


def _hidden_cells_text() -> str:
    sources = []
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"])
            if "### BEGIN HIDDEN TESTS" in source:
                sources.append(source)
    return "\n".join(sources)


def test_every_exported_check_is_called_by_a_hidden_cell():
    hidden = _hidden_cells_text()
    uncalled = []
    for path in sorted((ROOT / "autograder" / "checks").glob("*.py")):
        if path.stem in OPT_IN_MODULES:
            continue
        module = importlib.import_module(f"autograder.checks.{path.stem}")
        for name in getattr(module, "__all__", ()):
            if name.startswith("check_") and f'"{path.stem}.{name}"' not in hidden:
                uncalled.append(f"{path.stem}.{name}")
    assert not uncalled, f"checks no solution notebook's hidden cell calls: {uncalled}"


def test_the_opt_in_checks_are_called_by_their_own_tests():
    tests_text = (ROOT / "tests" / "test_speed_credit.py").read_text(encoding="utf-8")
    for topic in OPT_IN_MODULES:
        module = importlib.import_module(f"autograder.checks.{topic}")
        untested = [
            name for name in module.__all__ if name.startswith("check_") and f"{topic}.{name}" not in tests_text
        ]
        assert not untested, f"opt-in checks no test calls: {untested}"

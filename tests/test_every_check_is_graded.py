"""No dead check: every check a checks module exports (its `__all__`) is called by a hidden test
cell of a solution notebook, as `hidden("<topic>.<check>", ...)`. A check no notebook calls grades
nothing; what it tests belongs with the library's own tests (tests/test_sampling.py's
apply_temperature and probs, tests/test_scheduler_admit.py's admit)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
        module = importlib.import_module(f"autograder.checks.{path.stem}")
        for name in getattr(module, "__all__", ()):
            if name.startswith("check_") and f'"{path.stem}.{name}"' not in hidden:
                uncalled.append(f"{path.stem}.{name}")
    assert not uncalled, f"checks no solution notebook's hidden cell calls: {uncalled}"

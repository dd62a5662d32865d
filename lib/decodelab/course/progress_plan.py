"""Which cells `python -m decodelab progress` runs for each exercise: the notebooks of a course
folder, each read into a `Plan` (its set-up, its exercise cells, their visible tests), and the
words of an exercise's status that both processes use.

What runs for exercise X, in a fresh module namespace (the cell-selection rule):

1. the notebook's set-up: its code cells that come before the first exercise cell *and* before
   the first markdown heading ``## N`` with N >= 1 (the imports and section 0, which loads the
   model the exercises may use). Cells with an nbgrader grade id never count as set-up, but for
   a prediction's answer cell (``q_<name>``, a number or None), which a set-up cell may show;
2. every exercise cell before X, in notebook order (what X may build on);
3. X's own cell;
4. the visible part of X's test cell.

Nothing else runs: not the explorers, plots and experiments between the exercises, and not
the hidden tests. The set-up runs again for every exercise, so one exercise's test cannot
change what the next one sees.

An exercise cell whose source still has the checksum nbgrader wrote at the release is
``unchanged`` (nothing runs for it: not started); a duplicated cell or a missing test cell is a
``problem`` that becomes the exercise's status without running anything.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from decodelab.course.exercises import PARTS

NOTEBOOK_DIR = re.compile(r"^\d\d_\w+$")
HIDDEN_BEGIN = "### BEGIN HIDDEN TESTS"
NUMBERED_SECTION = re.compile(r"^##\s+([0-9]+)\b", re.MULTILINE)  # "## 1. Temperature"
PASSING, NOT_STARTED = "passing", "not started"


class ProgressError(ValueError):
    """A bad command line: no such folder, no notebooks in it, not the caller's folder (exit 2)."""


@dataclass
class Plan:
    """What one notebook's check needs: its set-up, its exercise cells, their visible tests."""

    notebook: str
    path: Path
    setup: list[tuple[int, str]] = field(default_factory=list)  # (cell index, source)
    cells: list[tuple[str, int, str]] = field(default_factory=list)  # (exercise, cell index, source), in order
    tests: dict[str, str] = field(default_factory=dict)  # exercise -> visible part of its test cell
    unchanged: set[str] = field(default_factory=set)  # exercise cells still as released
    changed: set[str] = field(default_factory=set)  # exercise cells edited since the release
    problems: dict[str, str] = field(default_factory=dict)  # exercise -> why it cannot run
    error: str | None = None  # the notebook cannot be read at all


# --------------------------------------------------------------------------- finding and reading


def find_notebooks(course_dir, names=None) -> list[Path]:
    """NN_topic/NN_topic.ipynb below course_dir, by name; `names` keeps those whose folder is
    named, or whose NN is given ("02_sampling" or "02")."""
    folder = course_folder(course_dir)
    found = sorted(
        p / f"{p.name}.ipynb"
        for p in folder.iterdir()
        if p.is_dir() and NOTEBOOK_DIR.match(p.name) and (p / f"{p.name}.ipynb").is_file()
    )
    if not found:
        raise ProgressError(f"no course notebooks in {folder}: expected folders like 02_sampling/02_sampling.ipynb")
    if names:
        wanted = {n.strip().rstrip("/") for n in names if n.strip()}
        kept = [p for p in found if p.parent.name in wanted or p.parent.name[:2] in wanted]
        unknown = sorted(n for n in wanted if not any(p.parent.name == n or p.parent.name[:2] == n for p in found))
        if unknown:
            raise ProgressError(
                f"no notebook {', '.join(unknown)} in {folder}; it has {', '.join(p.parent.name for p in found)}"
            )
        found = kept
    return found


def course_folder(course_dir) -> Path:
    folder = Path(course_dir).expanduser()
    if not folder.is_dir():
        raise ProgressError(
            f"{folder} is not a folder: give the folder that holds your notebooks "
            f"(NN_topic/NN_topic.ipynb), e.g. --course ~/course"
        )
    return folder


def _nbgrader(cell) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def release_checksum(cell) -> str:
    """nbgrader's checksum of a solution cell (nbgrader.utils.compute_checksum for a cell that is
    a solution and not graded): generate_assignment stores it in the released cell's metadata."""
    meta = _nbgrader(cell)
    grade, solution = bool(meta.get("grade")), bool(meta.get("solution"))
    locked = False if solution else (True if grade else bool(meta.get("locked")))
    m = hashlib.md5()
    for piece in (
        cell.get("source", ""),
        cell.get("cell_type", ""),
        str(grade),
        str(solution),
        str(locked),
        meta.get("grade_id", ""),
    ):
        m.update(str(piece).encode("utf-8"))
    if grade:
        m.update(str(float(meta.get("points", 0))).encode("utf-8"))
    return m.hexdigest()


def _source(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def plan_notebook(path: Path) -> Plan:
    """Read one notebook and pick its cells (the rule in the module's docstring)."""
    import nbformat

    plan = Plan(notebook=path.parent.name, path=path)
    try:
        _pick_cells(plan, list(nbformat.read(str(path), as_version=4).cells))
    except Exception as exc:  # noqa: BLE001 - any unreadable notebook becomes its rows' status
        plan.error = f"the notebook cannot be read: {first_line(f'{type(exc).__name__}: {exc}')}"
    return plan


def _pick_cells(plan: Plan, cells: list) -> None:
    setup_open = True  # until the first exercise cell or the first "## N" heading with N >= 1
    test_cells = {}
    for index, cell in enumerate(cells):
        grade_id = str(_nbgrader(cell).get("grade_id") or "")
        kind = cell.get("cell_type")
        if kind == "markdown" and any(int(n) >= 1 for n in NUMBERED_SECTION.findall(_source(cell))):
            setup_open = False
        if kind != "code":
            continue
        if grade_id.startswith("ex_"):
            setup_open = False
            name = grade_id[3:]
            plan.cells.append((name, index, _source(cell)))
            checksum = _nbgrader(cell).get("checksum")
            if checksum:
                (plan.unchanged if checksum == release_checksum(cell) else plan.changed).add(name)
        elif grade_id.startswith("test_"):
            test_cells.setdefault(grade_id[5:], []).append(_source(cell))
        elif setup_open and (not grade_id or grade_id.startswith("q_")):  # a prediction: the set-up may show it
            plan.setup.append((index, _source(cell)))
    seen = [name for name, _, _ in plan.cells]
    for name in seen:
        if seen.count(name) > 1:
            plan.problems[name] = f"its exercise cell ex_{name} is in the notebook twice: delete one copy"
        elif len(test_cells.get(name, [])) > 1:
            plan.problems[name] = f"its test cell test_{name} is in the notebook twice: delete one copy"
        elif name in test_cells:
            plan.tests[name] = test_cells[name][0].split(HIDDEN_BEGIN, 1)[0]
        else:
            plan.problems[name] = f"its test cell test_{name} is missing from the notebook"
    exercises = {name for name, _, _ in plan.cells}
    for notebook, name in PARTS:
        if notebook == plan.notebook and name not in exercises:
            plan.problems[name] = f"its exercise cell ex_{name} is missing from the notebook"


def exercise_names(plan: Plan) -> list[str]:
    names = list(dict.fromkeys(name for name, _, _ in plan.cells))
    return names + [name for name in plan.problems if name not in names]


def first_line(text: str, limit: int = 240) -> str:
    line = next((l.strip() for l in str(text).splitlines() if l.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."

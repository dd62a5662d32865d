"""The graded notebooks nbgrader's formgrader shows: <folder>/<student>/<assignment>/<notebook>.ipynb.

formgrader (nbgrader's web page for grading by hand) opens, for each submission in the gradebook,
the notebook at ``{CourseDirectory.root}/autograded/{student}/{assignment}/`` — with `grade`'s default
folder, ``autograded/`` beside grades.csv, a formgrader started with that folder as its course root
and the gradebook beside it shows every submission. Each notebook is written as graded (outputs
included) without its hidden tests; a submission that no longer has a graded notebook (now
missing, unreadable) loses the one an earlier grading wrote, so formgrader never shows stale work.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autograder.cells import strip_hidden_tests
from autograder.grades_csv import write_atomically

if TYPE_CHECKING:
    from autograder.submission import Result, Settings


def autograded_path(folder: Path, student: str, settings: Settings) -> Path:
    return folder / student / settings.assignment / f"{Path(settings.notebook).stem}.ipynb"


def write_autograded(result: Result, settings: Settings, folder: Path) -> Path | None:
    """The graded notebook of one submission into nbgrader's autograded layout; None (and an old
    copy removed) when it was not run."""
    import nbformat

    target = autograded_path(folder, result.student, settings)
    if result.notebook is None:
        target.unlink(missing_ok=True)
        return None
    nb = nbformat.reads(result.notebook, as_version=4)
    strip_hidden_tests(nb)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, lambda f: nbformat.write(nb, f))
    return target

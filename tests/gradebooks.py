"""A small nbgrader gradebook written through nbgrader's own API, for the tests of the late
policy and of the exports (no notebook is run)."""

from __future__ import annotations

import warnings
from pathlib import Path


def make_gradebook(
    path: Path,
    assignment: str = "a1",
    cells: dict[str, float] | None = None,
    scores: dict[str, dict[str, float]] | None = None,
    duedate: str | None = None,
) -> str:
    """A gradebook at path with one notebook `assignment` of these test cells (grade_id -> points)
    and these students' auto scores (student -> grade_id -> points); returns its db_url."""
    from nbgrader.api import Gradebook

    from autograder.release import ensure_tools_on_path

    ensure_tools_on_path()  # a new gradebook runs `alembic`
    cells = cells or {"test_a": 2.0, "test_b": 2.0}
    scores = scores or {}
    url = f"sqlite:///{Path(path).resolve()}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Gradebook(url) as gb:
            gb.add_assignment(assignment, duedate=duedate)
            gb.add_notebook(assignment, assignment)
            for gid, points in cells.items():
                gb.add_grade_cell(gid, assignment, assignment, max_score=points, cell_type="code")
            for student, earned in scores.items():
                gb.add_student(student)
                gb.add_submission(assignment, student)
                notebook = gb.find_submission_notebook(assignment, assignment, student)
                for grade in notebook.grades:
                    grade.auto_score = earned.get(grade.name, 0.0)
                    grade.needs_manual_grade = False
            gb.db.commit()
    return url

"""nbgrader's gradebook for one grading run: the private course it is generated from, the due
date it keeps, and the grades each graded notebook puts into it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from autograder.late import parse_due

if TYPE_CHECKING:
    from autograder.submission import Result, Settings


def prepare_course(assignment: str, source: Path, work: Path, db_path: Path) -> tuple[str, Path]:
    """nbgrader generate_assignment of the source notebook into a private course folder, with the
    gradebook at db_path; returns (db_url, the released notebook)."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    from autograder.release import ensure_tools_on_path, load_config

    ensure_tools_on_path()
    course = work / "course"
    if not (source / assignment / f"{assignment}.ipynb").is_file():
        raise SystemExit(
            f"no source notebook {source / assignment / (assignment + '.ipynb')}: "
            f"--assignment names a folder of {source}"
        )
    shutil.copytree(
        source / assignment,
        course / "solutions" / assignment,
        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"),
    )
    config = load_config()
    config.CourseDirectory.root = str(course)
    db_url = f"sqlite:///{db_path}"
    config.CourseDirectory.db_url = db_url
    api = NbGraderAPI(CourseDirectory(config=config), config=config)
    outcome = api.generate_assignment(assignment, force=True, create=True)
    if not outcome["success"]:
        raise SystemExit(
            f"nbgrader generate_assignment {assignment} failed:\n{outcome.get('error')}\n{outcome.get('log')}"
        )
    os.chmod(db_path, 0o600)
    return db_url, course / "course" / assignment / f"{assignment}.ipynb"


def save_grades(result: Result, settings: Settings) -> tuple[float, float]:
    """The graded notebook into the gradebook (nbgrader SaveAutoGrades); (score, max_score).
    Autograding never overwrites a manual score (formgrader's): the score counts it, and a
    "manual:" note says which cells were scored by hand."""
    import nbformat
    from nbgrader.api import Gradebook
    from nbgrader.preprocessors import SaveAutoGrades

    notebook_id = Path(settings.notebook).stem
    with Gradebook(settings.db_url) as gb:
        gb.update_or_create_student(result.student)
        gb.update_or_create_submission(settings.assignment, result.student)
        sub = gb.find_submission_notebook(notebook_id, settings.assignment, result.student)
        kept = []
        for grade in sub.grades:  # a regrade starts from nothing, but a grade set by hand stays (nbgrader's promise)
            grade.auto_score = 0
            grade.needs_manual_grade = False
            if grade.manual_score is not None:
                kept.append(f"{grade.name} {grade.manual_score:g}")
        sub.late_submission_penalty = None
        gb.db.commit()
    if kept:
        result.notes.append(f"manual: {', '.join(kept)} (scored by hand, kept)")
    if result.notebook is not None:
        nb = nbformat.reads(result.notebook, as_version=4)
        resources = {
            "nbgrader": {
                "notebook": notebook_id,
                "assignment": settings.assignment,
                "student": result.student,
                "db_url": settings.db_url,
            }
        }
        SaveAutoGrades().preprocess(nb, resources)
    with Gradebook(settings.db_url) as gb:
        sub = gb.find_submission_notebook(notebook_id, settings.assignment, result.student)
        waiting = [
            f"{g.name} ({g.max_score:g} points)"
            for g in sorted(sub.grades, key=lambda g: g.name)
            if g.auto_score is None and g.manual_score is None and result.notebook is not None
        ]
        if waiting:
            result.notes.append(f"by hand: {', '.join(waiting)} to grade in formgrader (not in the score yet)")
        return float(sub.score), float(sub.max_score)


def set_due_date(db_url: str, assignment: str, due: str | None, policy):
    """Write `--due` (None: keep the gradebook's, "none": remove it) into nbgrader's gradebook;
    returns the assignment's due date (naive UTC) or None."""
    from nbgrader.api import Gradebook

    with Gradebook(db_url) as gb:
        if due is not None:
            gb.update_or_create_assignment(assignment, duedate=parse_due(due, policy))
        return gb.find_assignment(assignment).duedate

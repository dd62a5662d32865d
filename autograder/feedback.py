"""The student's feedback: nbgrader's feedback HTML (no hidden test code anywhere) in nbgrader's
feedback layout, with the exchange's files beside it so that `nbgrader release_feedback` releases
the folder as it is."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autograder import student_files
from autograder.cells import strip_hidden_tests

if TYPE_CHECKING:
    from autograder.submission import Result, Settings

# What nbgrader's exchange writes into each submission (submit) and `release_feedback` reads beside
# each feedback HTML: the submission time and the secret that names the released file.
EXCHANGE_FILES = ("timestamp.txt", "submission_secret.txt")
EXCHANGE_FILE_MAX_BYTES = 4096  # larger is not the exchange's: not copied


def copy_exchange_files(submitted: Path | None, feedback: Path) -> list[str]:
    """Copy the submission's EXCHANGE_FILES (written by `nbgrader submit`, kept by `collect`) into
    its feedback folder, where `nbgrader release_feedback` reads them; a copy left by an earlier
    grading that the submission no longer has is removed. Only small regular files are copied
    (the submission folder is the student's: a link there is not followed). Returns the names."""
    copied = []
    for name in EXCHANGE_FILES:
        target = feedback / name
        target.unlink(missing_ok=True)
        if submitted is None:
            continue
        try:
            data = student_files.read_bytes(submitted / name, EXCHANGE_FILE_MAX_BYTES)
        except (OSError, ValueError):  # absent, a link, a folder, too large: not copied
            continue
        target.write_bytes(data)
        copied.append(name)
    return copied


def write_feedback(
    result: Result, settings: Settings, folder: Path, score: float, max_score: float, submitted: Path | None = None
) -> Path:
    """HTML for the student, nbgrader's feedback template, no hidden test code anywhere, in
    nbgrader's feedback layout folder/<student>/<assignment>/<notebook>.html; beside it the
    exchange's files from the submission folder `submitted` (copy_exchange_files), so that
    `nbgrader release_feedback` releases the folder as it is."""
    import html

    import nbformat
    from nbconvert.exporters import HTMLExporter
    from nbgrader.preprocessors import ClearHiddenTests, GetGrades, LimitOutput
    from traitlets.config import Config

    target = folder / result.student / settings.assignment / f"{Path(settings.notebook).stem}.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    copy_exchange_files(submitted, target.parent)
    notes = [n for n in result.notes if not n.startswith("integrity:")]
    if result.notebook is None:
        body = (
            f"<html><body><h1>{html.escape(settings.assignment)}: {html.escape(result.status)}</h1>"
            f"<p>Score: {score:g} / {max_score:g}</p><ul>"
            + "".join(f"<li>{html.escape(n)}</li>" for n in notes)
            + "</ul></body></html>"
        )
        target.write_text(body)
        return target
    nb = nbformat.reads(result.notebook, as_version=4)
    resources = {
        "nbgrader": {
            "notebook": Path(settings.notebook).stem,
            "assignment": settings.assignment,
            "student": result.student,
            "db_url": settings.db_url,
        }
    }
    nb, resources = GetGrades().preprocess(nb, resources)
    nb, resources = ClearHiddenTests().preprocess(nb, resources)
    strip_hidden_tests(nb)  # belt and braces, and the tracebacks
    LimitOutput(max_lines=200).preprocess(nb, resources)
    summary = nbformat.v4.new_markdown_cell(
        f"**Grader: {result.status}.** " + html.escape("; ".join(notes) or "no problems")
    )
    nb.cells.insert(0, summary)
    c = Config()
    c.HTMLExporter.template_name = "feedback"
    import nbgrader

    base = Path(nbgrader.__file__).parent / "server_extensions" / "formgrader"
    c.HTMLExporter.extra_template_basedirs = [str(base / "templates")]
    c.HTMLExporter.extra_template_paths = [str(base / "static" / "node_modules" / "bootstrap" / "dist" / "css")]
    body, _ = HTMLExporter(config=c).from_notebook_node(nb, resources)
    target.write_text(body)
    return target

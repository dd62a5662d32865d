"""nbgrader's cell roles and the markers the course puts in cells, read in one place.

A cell's role lives in ``cell.metadata.nbgrader`` (nbgrader's schema 3): ``grade_id`` names it,
``solution`` marks an answer cell, ``grade`` with ``points`` a test cell (a cell that is both is
an answer graded by hand). A test cell of a solution notebook holds its hidden tests between
HIDDEN_BEGIN and HIDDEN_END; nbgrader's release and feedback strip them.
"""

from __future__ import annotations

HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


def meta(cell) -> dict:
    """The cell's nbgrader metadata ({} when it has none)."""
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def grade_id(cell) -> str | None:
    return meta(cell).get("grade_id")


def is_test_cell(cell) -> bool:
    """An autograded test cell: code, graded, not an answer."""
    role = meta(cell)
    return cell.get("cell_type") == "code" and bool(role.get("grade")) and not role.get("solution")


def is_answer_cell(cell) -> bool:
    """A cell the learner writes in (nbgrader's ``solution``), code or markdown."""
    return bool(meta(cell).get("solution"))


def without_hidden_tests(source: str) -> str:
    """The cell source with its HIDDEN_BEGIN ... HIDDEN_END block (and the blank line before it) removed."""
    if HIDDEN_BEGIN not in source:
        return source
    head, _, rest = source.partition(HIDDEN_BEGIN)
    _, _, tail = rest.partition(HIDDEN_END)
    lines = head.split("\n")
    if lines and not lines[-1].strip():
        lines = lines[:-1]
    return ("\n".join(lines) + tail.lstrip("\n")).rstrip("\n") if tail.strip() else "\n".join(lines).rstrip("\n")


def strip_hidden_tests(nb) -> None:
    """In place, for a graded notebook a person will read (feedback, formgrader): each cell without its
    hidden tests, and each error output cut to its one line (a traceback quotes the hidden-test lines)."""
    for cell in nb.cells:
        while HIDDEN_BEGIN in cell.source:
            stripped = without_hidden_tests(cell.source)
            cell.source = stripped if stripped != cell.source else cell.source.split(HIDDEN_BEGIN)[0]
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                output["traceback"] = [f"{output.get('ename', '')}: {output.get('evalue', '')}"]

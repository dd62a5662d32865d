"""The table of claims (tests/claims.py) against the notebooks it describes, without running them: each
claim's words are in its notebook's markdown, its evidence cell exists, prints, and is not graded, and the
checker both passes and fails (tests/test_notebooks.py::test_claims_hold_in_the_run runs it on the executed
solutions)."""

from __future__ import annotations

import re

import nbformat
import pytest
from claims import CLAIMS, Claim, check, markdown, words
from notebooks import READY, grade_id, read, solution_path


def test_every_notebook_has_its_list():
    missing = [name for name in READY if not CLAIMS.get(name)]
    assert not missing, f"tests/claims.py has no claims for {missing}"
    unknown = [name for name in CLAIMS if not solution_path(name).exists()]
    assert not unknown, f"tests/claims.py lists notebooks that do not exist: {unknown}"


@pytest.mark.parametrize("name", READY)
def test_claims_are_in_the_markdown_and_name_a_printing_cell(name):
    nb = read(solution_path(name))
    text, cells = markdown(nb), {c.get("id"): c for c in nb.cells}
    for claim in CLAIMS[name]:
        assert words(claim.text) in text, (
            f"{name}: the claim {claim.text!r} is no longer in the markdown; "
            "update tests/claims.py with the sentence as it now reads"
        )
        cell = cells.get(claim.cell)
        assert cell is not None, f"{name}: no cell {claim.cell!r} (the evidence of {claim.text!r})"
        assert cell.cell_type == "code" and grade_id(cell) is None, (
            f"{name}/{claim.cell}: evidence comes from an ungraded code cell"
        )
        assert any(
            call in cell.source for call in ("print(", "show_beside(", "show_answer(", "show_measured(", ".summary()")
        ), f"{name}/{claim.cell}: the cell prints nothing"
        assert re.compile(claim.pattern).groups >= 1, f"{name}: {claim.pattern!r} captures no number"
        assert claim.means, f"{name}: say in words what {claim.text!r} needs"


def _ran(cell_id: str, text: str):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(...)")
    cell.id = cell_id
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    nb.cells.append(cell)
    return nb


def test_the_checker_passes_and_fails():
    claim = Claim(
        "n preemptions", "c1", r"(\d+) preemptions in a pool of ([\d,]+)", lambda v: v[0] >= 1, "one at least"
    )
    assert check(claim, _ran("c1", "2 preemptions in a pool of 1,024 blocks\n")) is None
    assert "needs one at least" in check(claim, _ran("c1", "0 preemptions in a pool of 9 blocks\n"))
    assert "printed nothing matching" in check(claim, _ran("c1", "no preemption\n"))
    assert "no cell" in check(claim, _ran("other", "2 preemptions in a pool of 9 blocks\n"))
    flags = Claim("same", "c1", r"same: (True|False)", lambda v: all(x == 1 for x in v), "True")
    assert check(flags, _ran("c1", "same: True\nsame: True\n")) is None
    assert check(flags, _ran("c1", "same: True\nsame: False\n")) is not None

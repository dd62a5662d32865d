"""Answer similarity (autograder/similarity.py): the normal form, the learner's part of an answer
cell, and the class-wide notes on small classes built from notebook 02's release (its
`top_p_filter` answer written four independent ways, copied with renamed variables, and copied
from the library)."""

from __future__ import annotations

import inspect
import textwrap

import nbformat
import pytest
from notebooks import read, release_path

from autograder import similarity

NAME = "02_sampling"
GID = "ex_top_p_filter"
REFS = {
    "top_p_filter": "decodelab.decoding.sampling:top_p_filter",
    "top_k_filter": "decodelab.decoding.sampling:top_k_filter",
}
LIBRARY = "the library's decodelab.decoding.sampling.top_p_filter"
HEAD = "def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:\n"

# Four ways to write top-p that share no code (0.35-0.74 against each other and the library).
CUMSUM_SHIFT = (
    HEAD
    + """\
    if p <= 0 or p > 1:
        raise ValueError("p must be in (0, 1]")
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    shifted = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    keep_sorted = shifted < p
    keep = torch.zeros_like(keep_sorted).scatter(-1, sorted_idx, keep_sorted)
    return torch.where(keep, logits, torch.full_like(logits, float("-inf")))
"""
)
# the same, variables renamed, another message, a comment, other line breaks
CUMSUM_SHIFT_RENAMED = (
    HEAD
    + """\
    # my own work!
    if p <= 0 or p > 1:
        raise ValueError("top-p: expected 0 < p <= 1")
    pr = torch.softmax(logits, dim=-1)
    sp, si = pr.sort(dim=-1, descending=True)
    cs = torch.cumsum(sp, dim=-1)
    before = torch.cat([torch.zeros_like(cs[..., :1]),
                        cs[..., :-1]], dim=-1)
    ks = before < p
    mask = torch.zeros_like(ks).scatter(-1, si, ks)
    return torch.where(mask, logits, torch.full_like(logits, float("-inf")))
"""
)
ROW_LOOP = (
    HEAD
    + """\
    if not (0 < p <= 1):
        raise ValueError(f"bad p {p}")
    out = logits.clone()
    flat = out.reshape(-1, out.shape[-1])
    for row in flat:
        probs = row.softmax(-1)
        values, indices = probs.sort(descending=True)
        total = 0.0
        cut = len(values)
        for i, v in enumerate(values.tolist()):
            if total >= p:
                cut = i
                break
            total += v
        row[indices[cut:]] = float("-inf")
    return out
"""
)
SHIFTED_MASK = (
    HEAD
    + """\
    if not 0 < p <= 1:
        raise ValueError("p out of range")
    if p == 1:
        return logits.clone()
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum > p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    mask = drop.scatter(-1, order, drop)
    return logits.masked_fill(mask, -float("inf"))
"""
)


def _library_copy() -> str:
    from decodelab.decoding import sampling

    return textwrap.dedent(inspect.getsource(sampling.top_p_filter))


def _scaffold() -> str:
    return similarity.answer_cells(read(release_path(NAME)))[GID]


def _class(tmp_path, answers: dict[str, str | None]) -> dict:
    """Submissions of notebook 02's release with these top_p_filter answers (None: a broken file)."""
    paths = {}
    for student, source in answers.items():
        path = tmp_path / student / NAME / f"{NAME}.ipynb"
        path.parent.mkdir(parents=True)
        if source is None:
            path.write_text('{"cells": [')
        else:
            nb = read(release_path(NAME))
            cell = next(c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == GID)
            cell.source = source
            nbformat.write(nb, str(path))
        paths[student] = path
    return paths


# --------------------------------------------------------------------------- the normal form


def test_renamed_variables_and_changed_literals_give_the_same_normal_form():
    ours = similarity.normal_form(CUMSUM_SHIFT)
    assert similarity.normal_form(CUMSUM_SHIFT_RENAMED) == ours
    assert "softmax" in ours and "descending=True" in ours and "float(" in ours  # attributes, keywords, builtins kept
    assert "probs" not in ours and "p must" not in ours and "-inf" not in ours  # names and literals gone


def test_formatting_comments_and_docstrings_do_not_count():
    plain = "def f(x, y):\n    total = x + 2 * y\n    return total\n"
    dressed = (
        'def g(a,\n      b):\n    """Adds."""\n    # a comment\n    s = (a +\n         7 * b)  # more\n'
        '    "a bare string"\n    return s\n'
    )
    assert similarity.normal_form(plain) == similarity.normal_form(dressed)


def test_a_different_algorithm_differs():
    forms = {similarity.normal_form(src) for src in (CUMSUM_SHIFT, ROW_LOOP, SHIFTED_MASK, _library_copy())}
    assert len(forms) == 4
    a, b = (similarity.answer_tokens(src, _scaffold()) for src in (CUMSUM_SHIFT, ROW_LOOP))
    import difflib

    assert difflib.SequenceMatcher(None, a, b, autojunk=False).ratio() < 0.5


def test_the_learners_part_leaves_out_the_release():
    scaffold = _scaffold()
    assert similarity.answer_tokens(scaffold, scaffold) == ()  # the stub left as it was: nothing written
    with_imports = "import torch\nfrom math import inf\n" + CUMSUM_SHIFT
    assert similarity.answer_tokens(with_imports, scaffold) == similarity.answer_tokens(CUMSUM_SHIFT, scaffold)
    assert similarity.answer_tokens("def top_p_filter(:\n", scaffold) is None  # does not parse


# --------------------------------------------------------------------------- a class


def test_copies_are_flagged_with_whom(tmp_path):
    near = _library_copy().replace("        return logits\n", "        return logits.clone()\n")
    paths = _class(
        tmp_path,
        {
            "ali": CUMSUM_SHIFT,
            "bo": CUMSUM_SHIFT_RENAMED,
            "cy": _library_copy(),
            "dee": near,
            "eve": ROW_LOOP,
            "broken": None,
        },
    )
    paths["gone"] = tmp_path / "gone" / NAME / f"{NAME}.ipynb"  # never submitted: skipped
    notes = similarity.class_notes(read(release_path(NAME)), paths)
    assert notes == {
        "ali": [f"similarity: {GID} identical to bo's"],
        "bo": [f"similarity: {GID} identical to ali's"],
        "cy": [f"similarity: {GID} identical to {LIBRARY}", f"similarity: {GID} near-identical (0.98) to dee's"],
        "dee": [f"similarity: {GID} near-identical to {LIBRARY} (0.98), cy's (0.98)"],
    }


def test_nobody_copies_no_notes(tmp_path):
    paths = _class(tmp_path, {"ali": CUMSUM_SHIFT, "bo": ROW_LOOP, "cy": SHIFTED_MASK})
    assert similarity.class_notes(read(release_path(NAME)), paths, REFS) == {}


def test_short_answers_are_never_flagged(tmp_path):
    """Three lines are below MIN_TOKENS: everyone writes them alike."""
    short = HEAD + "    if not 0 < p <= 1:\n        raise ValueError('p')\n    return logits\n"
    paths = _class(tmp_path, {"ali": short, "bo": short})
    assert len(similarity.answer_tokens(short, _scaffold())) < similarity.MIN_TOKENS
    assert similarity.class_notes(read(release_path(NAME)), paths, REFS) == {}


def test_many_copies_are_counted_not_all_named(tmp_path):
    paths = _class(tmp_path, {f"s{i}": CUMSUM_SHIFT for i in range(8)})
    notes = similarity.class_notes(read(release_path(NAME)), paths, REFS)
    assert notes["s0"] == [f"similarity: {GID} identical to s1's, s2's, s3's, s4's, s5's and 2 more"]


@pytest.mark.parametrize("threshold", [0.9])
def test_the_threshold_separates_the_course_own_pairs(threshold):
    """What the threshold rests on: the course's solution notebook copies the library's top_p with
    one line changed (0.98); the independent ways above score <= 0.74 against the library."""
    import difflib

    scaffold = _scaffold()
    [(reference, node)] = similarity.cell_references(scaffold, REFS)
    library = similarity.reference_tokens(reference, node)
    for src in (CUMSUM_SHIFT, ROW_LOOP, SHIFTED_MASK):
        ratio = difflib.SequenceMatcher(None, similarity.answer_tokens(src, scaffold), library, autojunk=False).ratio()
        assert ratio < 0.75 < threshold, ratio

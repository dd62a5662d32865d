"""Green Validate means a green grade (issue 28, item 1): every kept bug the hidden checks catch is
caught by the visible test too, unless the notebook's text never states the behaviour it breaks.

The kept bugs are tests/fixtures/buggy_*.py's BUGS (each names the check that must fail on it).
For each exercise of a notebook, each of its kept bugs runs against the visible part of the test
cell (tests/notebooks.py run_visible: the notebook's imports, the other exercises bound to the
library's references) and against the hidden check (autograder.run._run). A bug the hidden check
catches and the visible test passes is a learner who sees a green Validate and then a red grade:
the test fails on it, unless UNSTATED lists it with the reason the text cannot promise that
behaviour. MESSAGES pins what the visible failure must say for the bugs whose old message pointed
at the wrong cause.
"""

from __future__ import annotations

import pytest
from notebooks import READY, exercise_test_ids, graded_cells, hidden_calls, read, run_visible, solution_path
from test_notebooks import _fixture_bugs

# Bug name -> why the notebook's text does not state the behaviour it breaks (so only the hidden
# check, which may vary data and probe edge cases, holds it). Keep it short and true.
UNSTATED: dict[str, str] = {}

# Bug name -> words the visible test's failure message must contain: the behaviour it breaks.
MESSAGES: dict[str, tuple[str, ...]] = {
    "reused_block_keeps_its_name": ("name",),
    "chunked_feeds_cached_tokens": ("cached",),
    "step_draft_fed_pending_only": ("forward pass of the draft", "lacks"),
    "attention_kv_heads_not_repeated": ("KV heads must be repeated to the query heads",),
    "step_draft_truncated_to_length": ("draft cache must be rolled back to min(",),
    "launcher_group_not_padded": ("group must be padded to a power of two",),
}


def _outcomes(name: str):
    """(test cell, bug, visible failure or None, hidden failure message or None) of every kept bug of the
    notebook's exercises."""
    from autograder.run import _run

    nb = read(solution_path(name))
    bugs = _fixture_bugs()
    for gid in sorted(exercise_test_ids(nb)):
        function = gid.removeprefix("test_")
        for check, _ in hidden_calls(graded_cells(nb)[gid].source):
            for bug, fn in bugs.get(check.rpartition(".")[2], []):
                yield gid, bug, run_visible(nb, gid, function, fn), _run(check, fn)


@pytest.mark.parametrize("name", READY)
def test_visible_tests_catch_what_the_hidden_checks_catch(name):
    slipped, listed_but_caught, wrong_message = [], [], []
    seen = set()
    for gid, bug, visible, hidden in _outcomes(name):
        seen.add(bug)
        if visible is None and hidden is not None and bug not in UNSTATED:
            slipped.append(f"{gid}: {bug} (hidden: {hidden[:160]})")
        if visible is not None and bug in UNSTATED:
            listed_but_caught.append(f"{gid}: {bug}")
        words = MESSAGES.get(bug, ())
        if words and not (visible is not None and all(w in str(visible) for w in words)):
            wrong_message.append(f"{gid}: {bug} must fail with a message naming {words}, got {visible!r:.300}")
    assert not slipped, (
        f"{name}: the visible tests pass these kept bugs that the hidden checks catch; sharpen the "
        "visible test (its message naming the behaviour), or list the bug in UNSTATED with the reason "
        "the text does not state it:\n  " + "\n  ".join(slipped)
    )
    assert not listed_but_caught, (
        f"{name}: UNSTATED lists bugs the visible tests now catch; drop them:\n  " + "\n  ".join(listed_but_caught)
    )
    assert not wrong_message, f"{name}:\n  " + "\n  ".join(wrong_message)


def test_the_tables_name_kept_bugs():
    """UNSTATED and MESSAGES name bugs that exist (a renamed bug must not leave a stale excuse behind)."""
    kept = {bug for bugs in _fixture_bugs().values() for bug, _ in bugs}
    assert not set(UNSTATED) - kept, f"UNSTATED names no kept bug: {sorted(set(UNSTATED) - kept)}"
    assert not set(MESSAGES) - kept, f"MESSAGES names no kept bug: {sorted(set(MESSAGES) - kept)}"
    assert all(len(reason) > 20 for reason in UNSTATED.values()), "each UNSTATED entry says why"

"""Notebook 07's hidden checks: they pass on the library's reference implementations (and on an
allocator written another valid way), and catch every kept bug (tests/fixtures/buggy_paged_kv.py)
with a message that names the case; the notebook's visible allocator tests catch the bugs too."""

from __future__ import annotations

import pytest
from oracles import expect_bug_caught, load_fixture

from autograder.checks import paged_kv as checks
from decodelab.engine.block_allocator import BlockAllocator, kv_waste
from decodelab.engine.paged_attention import gather_kv
from decodelab.lessons.paged_kv import paged_decode_attention

buggy = load_fixture("buggy_paged_kv")
CHECK_OF = {
    "kv_waste": "check_kv_waste",
    "gather_kv": "check_gather_kv",
    "paged_decode_attention": "check_paged_decode_attention",
    "BlockAllocator": "check_block_allocator",
}


def test_reference_passes():
    checks.check_kv_waste(kv_waste)
    checks.check_gather_kv(gather_kv)
    checks.check_paged_decode_attention(paged_decode_attention)
    checks.check_block_allocator(BlockAllocator)


def test_an_allocator_written_another_way_passes():
    """Behaviour is graded, not layout: a deque free list, other block ids, other hash values."""
    checks.check_block_allocator(buggy.AllocatorBase)


def test_every_exercise_has_a_bug():
    assert set(CHECK_OF) == set(checks.REFERENCES)
    assert {check for _, check, _ in buggy.BUGS.values()} == set(CHECK_OF.values())


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match=r"kv_waste\(\[17, 5\], block_size=8\): expected 0.3125"):
        checks.check_kv_waste(buggy.kv_waste_floor_blocks)
    with pytest.raises(AssertionError, match=r"expected shape \[H_kv, context_len, D\]"):
        checks.check_gather_kv(buggy.gather_kv_no_transpose)
    with pytest.raises(AssertionError, match="token 4 should come from slot 4"):
        checks.check_gather_kv(buggy.gather_kv_contiguous_from_first_block)
    with pytest.raises(AssertionError, match=r"token 0 should come from slot 20 \(block 5, offset 0\)"):
        checks.check_gather_kv(buggy.gather_kv_adds_offset_to_block_id)
    # A decode batch: the call, the sequence and head, and which sequences differ (here: the padded ones).
    with pytest.raises(
        AssertionError,
        match=r"block_tables=\[\[5, 1\], \[3\], \[0, 4, 2\]\] \(lists\), "
        r"context_lens=\[5, 1, 11\]\): sequence 0 .*Sequences that differ: "
        r"\[0, 1\] of 3; .*\(padded\): \[0, 1\]",
    ):
        checks.check_paged_decode_attention(buggy.decode_attention_padding_unmasked)
    with pytest.raises(AssertionError, match=r"query head 1 \(it reads KV head 1 // 2 = 0\)"):
        checks.check_paged_decode_attention(buggy.decode_attention_heads_modulo)
    # The allocator's messages: the operations so far, then what was expected and what came back.
    with pytest.raises(
        AssertionError,
        match=r"(?s)1\. A = allocate\(\[1, 2, 3, 4, 5, 6, 7, 8, 100, 101, 102\]\).*"
        r"free_sequence\(A's table .*ref_count\(\d+\): expected 1 "
        r"\(block \d+ is held by B\), got 2",
    ):
        checks.check_block_allocator(buggy.FreeForgetsSharedBlocks)
    with pytest.raises(
        AssertionError,
        match=r"A2 must now write the K/V of its token 6 into block \d+ .* which A "
        r"and A3 also hold",
    ):
        checks.check_block_allocator(buggy.CowWritesShared)
    with pytest.raises(
        AssertionError,
        match=r"is_cached\(\d+\), A's entry 2 \(partly filled: 3 of 4 tokens\): "
        r"expected False, got True",
    ):
        checks.check_block_allocator(buggy.PartialBlockCached)
    with pytest.raises(AssertionError, match=r"the number of cached tokens: expected 8 \(2 full blocks"):
        checks.check_block_allocator(buggy.CachesLastToken)
    with pytest.raises(AssertionError, match=r"expected a table of 2 blocks \(8 tokens in blocks of 4"):
        checks.check_block_allocator(buggy.BlocksNeededOffByOne)
    with pytest.raises(AssertionError, match=r"can_allocate\(\[1, 2, .*\]\): expected False, got True"):
        checks.check_block_allocator(buggy.CanAllocateIgnoresCachedFree)
    # A speculative step: reserve for the drafts, shrink back to the accepted ones.
    with pytest.raises(
        AssertionError,
        match=r"reserve\(A's table \[\d+, \d+, \d+\], 5 \+ 10 drafts\): expected "
        r"False, got True\n  \(5 new blocks .* and a copy of its shared last "
        r"block, 5 free\)",
    ):
        checks.check_block_allocator(buggy.ReserveWritesSharedTail)
    with pytest.raises(
        AssertionError,
        match=r"it returned False, so it must change nothing, but A's table went "
        r"from \[\d+, \d+, \d+\] to \[(\d+, ){6}\d+\]",
    ):
        checks.check_block_allocator(buggy.ReserveTakesBeforeChecking)
    with pytest.raises(
        AssertionError,
        match=r"1 of 4 drafts accepted and 30 sampled, 6 computed\): "
        r"is_cached\(\d+\), A's entry 2 \(full: \[5, 6\] after 4 tokens\): "
        r"expected True, got False",
    ):
        checks.check_block_allocator(buggy.ShrinkForgetsNames)


def test_an_unfinished_allocator_says_so():
    class Stub(buggy.AllocatorBase):
        def allocate(self, token_ids):
            raise NotImplementedError("write this function")

    with pytest.raises(AssertionError, match=r"^Stub\.allocate is not written yet"):
        checks.check_block_allocator(Stub)


def _notebook_visible_test():
    from notebooks import graded_cells, read, solution_path, visible_part

    nb = read(solution_path("07_paged_kv"))
    setup = next(c.source for c in nb.cells if c.cell_type == "code")
    return setup, visible_part(graded_cells(nb)["test_BlockAllocator"].source)


@pytest.mark.parametrize(
    "bug", sorted(bug for bug, (_, check, _) in buggy.BUGS.items() if check == "check_block_allocator")
)
def test_the_notebooks_visible_tests_catch_each_allocator_bug(bug):
    """Not only one bug per exercise (tests/test_notebooks.py): every kept allocator bug fails the
    visible tests a learner runs, with an AssertionError (a friendly message, not a crash)."""
    import contextlib
    import io

    setup, visible = _notebook_visible_test()
    for cls, should_fail in ((BlockAllocator, False), (buggy.AllocatorBase, False), (buggy.BUGS[bug][0], True)):
        namespace = {"__name__": "__visible_test__"}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(setup, "<setup cell>", "exec"), namespace)  # noqa: S102 - our own notebook
            namespace["BlockAllocator"] = cls
            try:
                exec(compile(visible, "<test_BlockAllocator>", "exec"), namespace)  # noqa: S102
            except AssertionError:
                assert should_fail, f"the visible tests fail on {cls.__name__}, a right allocator"
                continue
        assert not should_fail, f"the visible tests pass on {bug}"


@pytest.mark.parametrize(
    "bug", sorted(bug for bug, (_, check, _) in buggy.BUGS.items() if check == "check_paged_decode_attention")
)
def test_the_notebooks_visible_tests_catch_each_decode_attention_bug(bug):
    """Every kept bug of paged_decode_attention fails the visible tests with an AssertionError."""
    import contextlib
    import io

    from notebooks import graded_cells, read, solution_path, visible_part

    nb = read(solution_path("07_paged_kv"))
    setup = next(c.source for c in nb.cells if c.cell_type == "code")
    visible = visible_part(graded_cells(nb)["test_paged_decode_attention"].source)
    for fn, should_fail in ((paged_decode_attention, False), (buggy.BUGS[bug][0], True)):
        namespace = {"__name__": "__visible_test__"}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(setup, "<setup cell>", "exec"), namespace)  # noqa: S102 - our own notebook
            namespace["paged_decode_attention"] = fn
            try:
                exec(compile(visible, "<test_paged_decode_attention>", "exec"), namespace)  # noqa: S102
            except AssertionError:
                assert should_fail, "the visible tests fail on the library's paged_decode_attention"
                continue
        assert not should_fail, f"the visible tests pass on {bug}"

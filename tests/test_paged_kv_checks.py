"""Notebook 07's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_paged_kv.py) with a message that names the case."""
from __future__ import annotations

import pytest

from autograder.checks import paged_kv as checks
from decodelab.engine.block_allocator import copy_on_write_last_block, kv_waste, slot_of
from decodelab.engine.paged_attention import gather_kv
from oracles import expect_bug_caught, load_fixture

buggy = load_fixture("buggy_paged_kv")


def test_reference_passes():
    checks.check_slot_of(slot_of)
    checks.check_kv_waste(kv_waste)
    checks.check_gather_kv(gather_kv)
    checks.check_copy_on_write_last_block(copy_on_write_last_block)


def test_every_exercise_has_a_bug():
    assert {check for _, check, _ in buggy.BUGS.values()} == {f"check_{name}" for name in checks.REFERENCES}


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match=r"slot_of\(block_table=\[7, 2, 9\], position=0, block_size=4\): "
                                             r"expected slot 28"):
        checks.check_slot_of(buggy.slot_of_adds_offset_to_block_id)
    with pytest.raises(AssertionError, match=r"kv_waste\(\[17, 5\], block_size=8\): expected 0.3125"):
        checks.check_kv_waste(buggy.kv_waste_floor_blocks)
    with pytest.raises(AssertionError, match=r"expected shape \[H_kv, context_len, D\]"):
        checks.check_gather_kv(buggy.gather_kv_no_transpose)
    with pytest.raises(AssertionError, match="token 4 should come from slot 4"):
        checks.check_gather_kv(buggy.gather_kv_contiguous_from_first_block)
    with pytest.raises(AssertionError, match="block 2 should be held once afterwards"):
        checks.check_copy_on_write_last_block(buggy.cow_keeps_reference)
    with pytest.raises(AssertionError, match="take the free block before you drop the reference"):
        checks.check_copy_on_write_last_block(buggy.cow_releases_before_taking)


def test_allocator_with_swapped_copy_on_write_is_used():
    """The hook the notebook's closing cell uses: a subclass's copy_on_write replaces the library's."""
    from decodelab.engine.block_allocator import BlockAllocator

    calls = []

    class Counting(BlockAllocator):
        def copy_on_write(self, block_table):
            copied = copy_on_write_last_block(self, block_table)
            calls.append(copied)
            return copied

    allocator = Counting(8, 4)
    table, _ = allocator.allocate(list(range(6)))
    other = allocator.fork(table)
    allocator.append_slot(other, list(range(7)))
    assert True in calls and allocator.copy_on_write_log and other[-1] != table[-1]
    allocator.check_invariants([table, other])

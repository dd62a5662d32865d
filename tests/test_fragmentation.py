"""Notebook 07's fragmentation simulation (decodelab.lessons.fragmentation) and its pool pictures'
helpers (decodelab.course.widgets.paged_kv): the shares add up, each layout loses memory the way
its definition says, and a snapshot of the pool refuses an allocator whose counts are wrong."""

from __future__ import annotations

import pytest
from oracles import load_fixture

from decodelab.course.widgets import paged_kv as widgets
from decodelab.engine.block_allocator import BlockAllocator, kv_waste
from decodelab.lessons.fragmentation import simulate

LENGTHS = widgets.uniform_lengths(300, 50, 2047, seed=0)
POOL = 32 * 2048


@pytest.mark.parametrize(
    "layout, kwargs",
    [("preallocate", {"max_len": 2048}), ("exact", {}), ("paged", {"block_size": 16}), ("paged", {"block_size": 32})],
)
def test_shares_add_up(layout, kwargs):
    r = simulate(LENGTHS, layout, POOL, **kwargs)
    assert abs(r.tokens + r.internal + r.external + r.idle - 1) < 1e-9
    assert min(r.tokens, r.internal, r.external, r.idle) >= 0


def test_each_layout_wastes_its_own_way():
    prealloc = simulate(LENGTHS, "preallocate", POOL, max_len=2048)
    exact = simulate(LENGTHS, "exact", POOL)
    paged16 = simulate(LENGTHS, "paged", POOL, block_size=16)
    # Same-size reservations: every hole fits the next one; blocks: any free block serves anyone.
    assert prealloc.external == 0 and paged16.external == 0 and prealloc.mean_running == 32
    assert exact.internal == 0 and exact.external > 0.05 and exact.refusals_with_enough_free > 0
    # Internal fragmentation as kv_waste counts it (every request weighs alike), within sampling noise.
    assert abs(prealloc.internal - kv_waste(LENGTHS, None, 2048)) < 0.03
    assert abs(paged16.internal - kv_waste(LENGTHS, 16)) < 0.002
    assert paged16.mean_running > exact.mean_running > prealloc.mean_running


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        simulate(LENGTHS, "buddy", POOL)
    with pytest.raises(ValueError, match="max_len"):
        simulate(LENGTHS, "preallocate", POOL, max_len=100)
    with pytest.raises(ValueError, match="does not fit an empty pool"):
        simulate([10, 5000], "exact", 4096)


def test_story_and_snapshots_read_any_allocator():
    """The picture reads an allocator through its interface only, so a learner's works."""
    base = load_fixture("buggy_paged_kv").AllocatorBase
    story = [
        ("A", "arrive", "A", list(range(1, 12))),
        ("B", "arrive", "B", [1, 2, 3, 4, 50]),
        ("fork", "fork", "B2", "B"),
        ("grow", "grow", "B2", [60]),
        ("A ends", "finish", "A"),
    ]
    for cls in (BlockAllocator, base):
        snapshots = widgets.play_block_story(cls(8, 4), story)
        held = [sorted(h for holders in s["holders"] for h in holders) for s in snapshots]
        assert held[1] == ["A", "A", "A", "B", "B"] and held[-1] == ["B", "B", "B2", "B2"]
        assert sum(snapshots[-1]["cached"]) == 1  # A's two full blocks: the first is still B's, the second cached
    fig = widgets.block_table_figure(snapshots, "story", used_only=True)
    assert len(fig.data[0].x) == 5  # A's 3 blocks, B's second, B2's copy


def test_snapshot_refuses_wrong_counts():
    leaky = load_fixture("buggy_paged_kv").FreeForgetsSharedBlocks
    story = [("A", "arrive", "A", list(range(1, 10))), ("B", "fork", "B", "A"), ("A ends", "finish", "A")]
    with pytest.raises(AssertionError, match="A ends: block .* has ref_count 2 but 1 tables hold it"):
        widgets.play_block_story(leaky(6, 4), story)


def test_allocator_fallback(capsys):
    """A right allocator is used; one whose counts or copies are wrong gives way to the reference, with a note."""
    fixture = load_fixture("buggy_paged_kv")
    assert widgets.allocator_class_or_reference(fixture.AllocatorBase, BlockAllocator) is fixture.AllocatorBase
    for broken in (fixture.FreeForgetsSharedBlocks, fixture.CowWritesShared):
        assert widgets.allocator_class_or_reference(broken, BlockAllocator) is BlockAllocator
        assert f"note: your {broken.__name__} raised AssertionError" in capsys.readouterr().out
    pick = widgets.allocator_class_or_reference
    assert pick(fixture.AllocatorBase, BlockAllocator, drafts=True) is fixture.AllocatorBase
    for broken in (fixture.ReserveWritesSharedTail, fixture.ShrinkForgetsNames, fixture.ReserveTakesBeforeChecking):
        assert pick(broken, BlockAllocator) is broken  # no speculative step asked for
    assert pick(fixture.ReserveWritesSharedTail, BlockAllocator, drafts=True) is BlockAllocator
    assert "expected a copy of the shared last block" in capsys.readouterr().out

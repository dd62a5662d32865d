"""Checks for notebook 07, paged KV: `slot_of`, `kv_waste`, `gather_kv`, `copy_on_write_last_block`.

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and either
returns None or raises ``AssertionError`` whose message gives the input, the expected and the
actual result.

The expected results never come from ``decodelab.engine.block_allocator``: slots from spelling out every slot
of every block in table order, waste from counting empty slots exactly (fractions), gathered
K/V from a Python loop over tokens. The copy-on-write check drives the library's real
`BlockAllocator` (its free list and reference counts are the state being changed) and checks
the result against the invariant "every block's ref count = the number of tables holding it"
and the exact expected tables, log and ref counts.
"""
from __future__ import annotations

import numbers
import random
from fractions import Fraction

import torch

from autograder.checks.calling import call, expect_raises

REFERENCES = {
    "slot_of": "decodelab.engine.block_allocator:slot_of",
    "kv_waste": "decodelab.engine.block_allocator:kv_waste",
    "gather_kv": "decodelab.engine.paged_attention:gather_kv",
    "copy_on_write_last_block": "decodelab.engine.block_allocator:copy_on_write_last_block",
}

__all__ = ["check_slot_of", "check_kv_waste", "check_gather_kv", "check_copy_on_write_last_block"]


# --------------------------------------------------------------------------- slot_of


def _all_slots(block_table, block_size):
    """Slot of token 0, 1, 2, ...: every slot of every block, blocks in table order."""
    return [block_id * block_size + offset for block_id in block_table for offset in range(block_size)]


def check_slot_of(fn) -> None:
    rng = random.Random(6)
    cases = [([7, 2, 9], 4), ([0], 16), ([3, 0, 5, 1], 1), ([12, 4], 16)]
    for _ in range(20):
        block_size = rng.choice([2, 3, 8, 16, 32])
        cases.append((rng.sample(range(64), rng.randint(1, 6)), block_size))
    for table, block_size in cases:
        expected = _all_slots(table, block_size)
        for position in range(len(table) * block_size):
            what = f"slot_of(block_table={table}, position={position}, block_size={block_size})"
            got = call(what, fn, list(table), position, block_size)
            if isinstance(got, bool) or not isinstance(got, numbers.Integral):
                raise AssertionError(f"{what}: expected the integer {expected[position]}, got "
                                     f"{type(got).__name__} {got!r}")
            if int(got) != expected[position]:
                raise AssertionError(f"{what}: expected slot {expected[position]} (block "
                                     f"{table[position // block_size]}, offset {position % block_size}), got {got}")


# --------------------------------------------------------------------------- kv_waste


def _exact_waste(lengths, block_size, max_len):
    used = sum(lengths)
    if block_size is None:
        reserved = max_len * len(lengths)
    else:
        reserved = 0
        for n in lengths:  # add blocks until the request fits
            blocks = 0
            while blocks * block_size < n:
                blocks += 1
            reserved += blocks * block_size
    return 1 - Fraction(used, reserved)


def _expect_waste(fn, lengths, block_size, max_len=None, label=None):
    expected = float(_exact_waste(lengths, block_size, max_len))
    args = f"block_size={block_size}" + (f", max_len={max_len}" if max_len is not None else "")
    what = f"kv_waste({label or lengths}, {args})"
    got = call(what, fn, list(lengths), block_size, *([max_len] if max_len is not None else []))
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise AssertionError(f"{what}: expected a number (a fraction between 0 and 1), got {type(got).__name__} {got!r}")
    if abs(float(got) - expected) > 1e-9:
        raise AssertionError(f"{what}: expected {expected:.6g} (empty slots / reserved slots), got {float(got):.6g}")


def check_kv_waste(fn) -> None:
    _expect_waste(fn, [16, 32], 16)  # exact multiples: nothing wasted
    _expect_waste(fn, [1], 16)  # one token in a block of 16: 15/16 empty
    _expect_waste(fn, [17, 5], 8)  # 24 + 8 reserved, 22 used
    _expect_waste(fn, [3, 5, 7], 1)
    _expect_waste(fn, [100, 50], None, 200)  # preallocation: 400 reserved
    _expect_waste(fn, [100, 50], 16, 200)  # max_len plays no part with blocks
    _expect_waste(fn, [2048], None, 2048)
    rng = random.Random(2047)
    lengths = [rng.randint(50, 2047) for _ in range(1000)]
    label = "1,000 lengths uniform in 50..2,047"
    for block_size in (16, 32, 100, 256):
        _expect_waste(fn, lengths, block_size, label=label)
    _expect_waste(fn, lengths, None, 2048, label=label)
    expect_raises("kv_waste([10, 20], block_size=None) without max_len", ValueError, "preallocation needs max_len",
                  fn, [10, 20], None)


# --------------------------------------------------------------------------- gather_kv


def _loop_gather(flat, table, context_len, block_size):
    rows = [flat[table[i // block_size] * block_size + i % block_size] for i in range(context_len)]  # [H_kv, D] each
    return torch.stack(rows, dim=1) if rows else flat.new_zeros(flat.shape[1], 0, flat.shape[2])


def check_gather_kv(fn) -> None:
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    cases = [(8, 4, [5, 1, 6], 10, 2, 3), (4, 16, [2], 16, 1, 8), (6, 1, [4, 0, 5, 2], 3, 3, 2),
             (10, 8, [9, 3, 0, 7], 25, 2, 4)]
    for _ in range(8):
        num_blocks, block_size = rng.randint(4, 20), rng.choice([2, 4, 16])
        table = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
        context_len = rng.randint((len(table) - 1) * block_size + 1, len(table) * block_size)
        cases.append((num_blocks, block_size, table, context_len, rng.choice([1, 2, 3]), rng.choice([4, 8])))
    for num_blocks, block_size, table, context_len, heads, dim in cases:
        flat = torch.randn(num_blocks * block_size, heads, dim, generator=gen, dtype=torch.float64)
        before = flat.clone()
        what = (f"gather_kv(flat_cache of shape {list(flat.shape)}, block_table={table}, context_len={context_len}, "
                f"block_size={block_size})")
        got = call(what, fn, flat, list(table), context_len, block_size)
        expected = _loop_gather(before, table, context_len, block_size)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(f"{what}: expected shape [H_kv, context_len, D] = {list(expected.shape)}, "
                                 f"got {list(got.shape)}")
        if not torch.equal(flat, before):
            raise AssertionError(f"{what} changed flat_cache in place; it must only read the pool")
        if not torch.equal(got.double(), expected):
            bad = (got.double() != expected).any(dim=0).any(dim=-1).nonzero()
            token = int(bad[0])
            slot = table[token // block_size] * block_size + token % block_size
            raise AssertionError(f"{what}: token {token} should come from slot {slot} (block "
                                 f"{table[token // block_size]}, offset {token % block_size}); "
                                 f"{len(bad)} of {context_len} tokens differ")
        got[...] = 0  # the result must be a new tensor, not a view into the pool
        if not torch.equal(flat, before):
            raise AssertionError(f"{what}: writing into the result changed the pool; return a new tensor")
    flat = torch.randn(16, 2, 4, generator=gen)
    for table, context_len in (([1, 2], 9), ([], 1)):
        what = f"gather_kv(flat_cache [16, 2, 4], block_table={table}, context_len={context_len}, block_size=4)"
        expect_raises(what, ValueError, f"{len(table)} blocks of 4 hold {4 * len(table)} < {context_len} tokens",
                      fn, flat, table, context_len, 4)


# --------------------------------------------------------------------------- copy_on_write_last_block


def _state(allocator):
    return ([b.ref_count for b in allocator.blocks], list(allocator.free), list(allocator.copy_on_write_log))


def _check_invariants(allocator, tables, what):
    try:
        allocator.check_invariants(tables)
    except AssertionError as exc:
        raise AssertionError(f"{what}: afterwards the pool is inconsistent: {exc} "
                             f"(tables {tables})") from None


def _cow_copied(fn, allocator, table, what):
    got = call(what, fn, allocator, table)
    if not isinstance(got, bool):
        raise AssertionError(f"{what}: expected True or False (did it copy?), got {type(got).__name__} {got!r}")
    return got


def check_copy_on_write_last_block(fn) -> None:
    from decodelab.engine.block_allocator import BlockAllocator, OutOfBlocksError

    # Two sequences share a 20-token prompt in blocks of 8: three blocks, the last one 4/8 full.
    allocator = BlockAllocator(8, 8, enable_prefix_caching=False)
    first, _ = allocator.allocate(list(range(20)))
    second = allocator.fork(first)
    shared_tail = first[-1]
    free_before = list(allocator.free)
    what = (f"copy_on_write_last_block on a table {second} whose last block {shared_tail} is shared by two "
            f"sequences (ref_count 2), free list {free_before}")
    copied = _cow_copied(fn, allocator, second, what)
    if not copied:
        raise AssertionError(f"{what}: expected True (the block is shared, so it must be copied), got False")
    new = free_before[0]
    if len(second) != 3 or second[:2] != first[:2]:
        raise AssertionError(f"{what}: the table should keep its first two blocks {first[:2]} and end with the copy, "
                             f"in place: expected {first[:2] + [new]}, got {second}")
    if second[-1] != new:
        raise AssertionError(f"{what}: expected the new block {new} (the least recently freed, from "
                             f"allocator.take_free_block()) at the end of the table, got table {second}")
    if allocator.copy_on_write_log != [(shared_tail, new)]:
        raise AssertionError(f"{what}: expected copy_on_write_log [({shared_tail}, {new})] (source, destination: "
                             f"the KV store copies the shared block's rows into the new one), got "
                             f"{allocator.copy_on_write_log}")
    if allocator.blocks[shared_tail].ref_count != 1:
        raise AssertionError(f"{what}: block {shared_tail} should be held once afterwards (by the other sequence "
                             f"only), its ref_count is {allocator.blocks[shared_tail].ref_count}")
    _check_invariants(allocator, [first, second], what)

    # Now each last block belongs to one sequence: nothing to copy.
    for table, name in ((second, "the copy"), (first, "the original")):
        before, table_before = _state(allocator), list(table)
        what = f"copy_on_write_last_block on a table {table_before} whose last block ({name}) is no longer shared"
        if _cow_copied(fn, allocator, table, what):
            raise AssertionError(f"{what}: expected False (ref_count 1: write in place), got True")
        if table != table_before or _state(allocator) != before:
            raise AssertionError(f"{what}: nothing should change; table {table_before} -> {table}, "
                                 f"free list {before[1]} -> {list(allocator.free)}, "
                                 f"log {before[2]} -> {allocator.copy_on_write_log}")

    # Three samples of one prompt: one copy leaves the others sharing (ref_count 3 -> 2).
    allocator = BlockAllocator(6, 4, enable_prefix_caching=False)
    base, _ = allocator.allocate(list(range(6)))
    tables = [base, allocator.fork(base), allocator.fork(base)]
    tail = base[-1]
    what = f"copy_on_write_last_block on a table {tables[2]} whose last block {tail} is held by three sequences"
    if not _cow_copied(fn, allocator, tables[2], what):
        raise AssertionError(f"{what}: expected True, got False")
    if allocator.blocks[tail].ref_count != 2:
        raise AssertionError(f"{what}: block {tail} should still be held by the two other sequences "
                             f"(ref_count 2), got ref_count {allocator.blocks[tail].ref_count}")
    _check_invariants(allocator, tables, what)
    what = f"then on {tables[1]}, whose last block {tail} is still shared by two"
    if not _cow_copied(fn, allocator, tables[1], what) or tables[1][-1] == tail:
        raise AssertionError(f"{what}: expected a copy (True) and a new last block, got table {tables[1]}")
    _check_invariants(allocator, tables, what)
    if len(allocator.copy_on_write_log) != 2:
        raise AssertionError(f"{what}: expected two (source, destination) pairs in copy_on_write_log, got "
                             f"{allocator.copy_on_write_log}")

    # A full pool: the copy cannot be made, and the pool must be left as it was.
    allocator = BlockAllocator(2, 4, enable_prefix_caching=False)
    base, _ = allocator.allocate(list(range(7)))
    other = allocator.fork(base)
    before, other_before = _state(allocator), list(other)
    what = (f"copy_on_write_last_block on a shared table {other_before} when no block is free "
            "(allocator.take_free_block() raises OutOfBlocksError)")
    expect_raises(what, OutOfBlocksError, "there is nowhere to copy to: let it pass through", fn, allocator, other)
    if other != other_before or _state(allocator) != before:
        raise AssertionError(f"{what}: the failed copy changed the pool: ref counts {before[0]} -> "
                             f"{[b.ref_count for b in allocator.blocks]}, table {other_before} -> {other} "
                             "(take the free block before you drop the reference)")

"""Checks for notebook 07, paged KV: `kv_waste`, `gather_kv`, `paged_decode_attention` and the
`BlockAllocator` class.

Every ``check_*`` takes the function or class under test (the library's reference in CI, a
kept buggy version in CI's negative tests, the learner's own in a notebook's hidden-test cell)
and either returns None or raises ``AssertionError`` whose message gives the input, the
expected and the actual result.

The expected waste and gathered K/V never come from the library: waste from counting empty
slots exactly (fractions), gathered K/V from a Python loop over tokens, a decode batch's attention
from a float64 loop over sequences, query heads and tokens. The allocator is driven
through scripted stories and random sequences of operations (allocate, append a token, a
speculative step's reserve and shrink, fork, free) side by side with the library's
`BlockAllocator` as the oracle, and judged by behaviour, never layout: block ids and hash
values are the learner's own. What must agree is what the engine sees: can_allocate /
can_append / reserve, the number of cached tokens, the number of free blocks, which sequences
share which blocks, and the number of blocks the prefix cache names.
Two oracle-free invariants hold after every operation: every block's ref_count equals the
number of live block tables holding it, and free + held = all blocks. And a model of the KV
store (each slot remembers the prefix whose K/V the engine wrote there; copy-on-write pairs
are copied as the engine copies them) checks that every sequence reads its own K/V: a cached
block must hold exactly the prompt's prefix, and nobody may write into a block another
sequence still holds.
"""

from __future__ import annotations

import numbers
import random
from fractions import Fraction

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.course.exercises import references

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("07_paged_kv")

__all__ = ["check_kv_waste", "check_gather_kv", "check_paged_decode_attention", "check_block_allocator"]


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
        raise AssertionError(
            f"{what}: expected a number (a fraction between 0 and 1), got {type(got).__name__} {got!r}"
        )
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
    expect_raises(
        "kv_waste([10, 20], block_size=None) without max_len",
        ValueError,
        "preallocation needs max_len",
        fn,
        [10, 20],
        None,
    )


# --------------------------------------------------------------------------- gather_kv


def _loop_gather(flat, table, context_len, block_size):
    rows = [flat[table[i // block_size] * block_size + i % block_size] for i in range(context_len)]  # [H_kv, D] each
    return torch.stack(rows, dim=1) if rows else flat.new_zeros(flat.shape[1], 0, flat.shape[2])


def check_gather_kv(fn) -> None:
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    cases = [
        (8, 4, [5, 1, 6], 10, 2, 3),
        (4, 16, [2], 16, 1, 8),
        (6, 1, [4, 0, 5, 2], 3, 3, 2),
        (10, 8, [9, 3, 0, 7], 25, 2, 4),
    ]
    for _ in range(8):
        num_blocks, block_size = rng.randint(4, 20), rng.choice([2, 4, 16])
        table = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
        context_len = rng.randint((len(table) - 1) * block_size + 1, len(table) * block_size)
        cases.append((num_blocks, block_size, table, context_len, rng.choice([1, 2, 3]), rng.choice([4, 8])))
    for num_blocks, block_size, table, context_len, heads, dim in cases:
        flat = torch.randn(num_blocks * block_size, heads, dim, generator=gen, dtype=torch.float64)
        before = flat.clone()
        what = (
            f"gather_kv(flat_cache of shape {list(flat.shape)}, block_table={table}, context_len={context_len}, "
            f"block_size={block_size})"
        )
        got = call(what, fn, flat, list(table), context_len, block_size)
        expected = _loop_gather(before, table, context_len, block_size)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
        if tuple(got.shape) != tuple(expected.shape):
            raise AssertionError(
                f"{what}: expected shape [H_kv, context_len, D] = {list(expected.shape)}, got {list(got.shape)}"
            )
        if not torch.equal(flat, before):
            raise AssertionError(f"{what} changed flat_cache in place; it must only read the pool")
        if not torch.equal(got.double(), expected):
            bad = (got.double() != expected).any(dim=0).any(dim=-1).nonzero()
            token = int(bad[0])
            slot = table[token // block_size] * block_size + token % block_size
            raise AssertionError(
                f"{what}: token {token} should come from slot {slot} (block "
                f"{table[token // block_size]}, offset {token % block_size}); "
                f"{len(bad)} of {context_len} tokens differ"
            )
        got[...] = 0  # the result must be a new tensor, not a view into the pool
        if not torch.equal(flat, before):
            raise AssertionError(f"{what}: writing into the result changed the pool; return a new tensor")
    flat = torch.randn(16, 2, 4, generator=gen)
    for table, context_len in (([1, 2], 9), ([], 1)):
        what = f"gather_kv(flat_cache [16, 2, 4], block_table={table}, context_len={context_len}, block_size=4)"
        expect_raises(
            what,
            ValueError,
            f"{len(table)} blocks of 4 hold {4 * len(table)} < {context_len} tokens",
            fn,
            flat,
            table,
            context_len,
            4,
        )


# --------------------------------------------------------------------------- paged_decode_attention


def _loop_decode_attention(q, key_cache, value_cache, tables, lengths):
    """[B, H, D] float64: for each sequence, query head and token, the slot read through the table."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, (table, length) in enumerate(zip(tables, lengths)):
        slots = [(table[i // block_size], i % block_size) for i in range(length)]
        for h in range(q.shape[1]):
            keys = torch.stack([key_cache[blk, off, h // group] for blk, off in slots]).double()  # [length, D]
            values = torch.stack([value_cache[blk, off, h // group] for blk, off in slots]).double()
            weights = torch.softmax(keys @ q[b, h].double() / head_dim**0.5, dim=0)
            out[b, h] = weights @ values
    return out


def _decode_case(
    rng: random.Random,
    gen: torch.Generator,
    lengths,
    num_heads,
    num_kv_heads,
    block_size,
    shared_blocks=0,
    extra_block=False,
    head_dim=8,
):
    """A shuffled pool of random (stale) numbers and out-of-order tables, the first shared_blocks
    blocks shared by every sequence long enough, one table holding a block past its context if
    extra_block. -> (q, key_cache, value_cache, tables as lists)."""
    needed = [-(-n // block_size) + (1 if extra_block and b == 0 else 0) for b, n in enumerate(lengths)]
    num_blocks = sum(needed) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(shared_blocks)]
    tables = []
    for n in needed:
        shared = prefix if n > len(prefix) else []
        tables.append(shared + [free.pop() for _ in range(n - len(shared))])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.randn(len(lengths), num_heads, head_dim, generator=gen),
        torch.randn(*shape, generator=gen),
        torch.randn(*shape, generator=gen),
        tables,
    )


def _padded(tables, dtype=torch.long) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=dtype)


def _expect_decode(fn, q, key_cache, value_cache, tables, lengths, as_tensor=False, dtype=None):
    form = "a [B, max_blocks] tensor padded with -1" if as_tensor else "lists"
    what = (
        f"paged_decode_attention(q {list(q.shape)}, key_cache and value_cache {list(key_cache.shape)}, "
        f"block_tables={tables} ({form}), context_lens={lengths})"
    )
    expected = _loop_decode_attention(q, key_cache, value_cache, tables, lengths)
    if dtype is not None:
        q, key_cache, value_cache = q.to(dtype), key_cache.to(dtype), value_cache.to(dtype)
        what = what.replace("paged_decode_attention(q", f"paged_decode_attention({dtype} q")
    block_tables = _padded(tables) if as_tensor else [list(t) for t in tables]
    before = (
        q.clone(),
        key_cache.clone(),
        value_cache.clone(),
        block_tables.clone() if as_tensor else [list(t) for t in block_tables],
    )
    got = call(what, fn, q, key_cache, value_cache, block_tables, torch.tensor(lengths) if as_tensor else list(lengths))
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(q.shape):
        raise AssertionError(f"{what}: expected shape [B, H, D] = {list(q.shape)}, got {list(got.shape)}")
    if got.dtype != q.dtype:
        raise AssertionError(f"{what}: expected q's dtype {q.dtype}, got {got.dtype}")
    unchanged = (
        torch.equal(before[0], q)
        and torch.equal(before[1], key_cache)
        and torch.equal(before[2], value_cache)
        and (torch.equal(before[3], block_tables) if as_tensor else before[3] == block_tables)
    )
    if not unchanged:
        raise AssertionError(
            f"{what} changed its input in place (q, the pool or the block tables); it must only read them"
        )
    tol = 1e-5 if dtype is None else 3e-2
    bad = ~torch.isclose(got.double(), expected, rtol=tol, atol=tol) | torch.isnan(got)
    if bad.any():
        b, h = (int(i) for i in bad.nonzero()[0][:2])
        group = q.shape[1] // key_cache.shape[2]
        wrong = sorted({int(i) for i in bad.nonzero()[:, 0]})
        width = max(len(t) for t in tables)
        padded = [i for i, t in enumerate(tables) if len(t) < width]
        show = lambda t: ", ".join(f"{x:.4f}" for x in t[:4].tolist())  # noqa: E731
        raise AssertionError(
            f"{what}: sequence {b} (context_len {lengths[b]}, table {tables[b]}), query head {h} (it reads KV head "
            f"{h} // {group} = {h // group}): expected [{show(expected[b, h])}, ...], got [{show(got[b, h].double())}, "
            f"...] (tolerance {tol:g}). Sequences that differ: {wrong} of {len(tables)}; the ones whose table is "
            f"shorter than the longest (padded): {padded}"
        )


def check_paged_decode_attention(fn) -> None:
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    # (lengths, H, H_kv, block_size, shared blocks, a table with a block past its context)
    cases = [
        ([5, 1, 11], 4, 2, 4, 0, False),
        ([1, 37, 5, 64, 2], 6, 2, 4, 0, False),
        ([20, 33, 9, 8], 4, 4, 4, 2, False),
        ([30, 16, 3], 9, 3, 16, 0, True),
        ([7, 40, 41], 8, 1, 8, 2, False),
        ([12], 6, 3, 4, 0, False),
        ([16, 4], 2, 1, 4, 0, False),
    ]
    for i, (lengths, heads, kv_heads, block_size, shared, extra) in enumerate(cases):
        q, key_cache, value_cache, tables = _decode_case(rng, gen, lengths, heads, kv_heads, block_size, shared, extra)
        _expect_decode(fn, q, key_cache, value_cache, tables, lengths, as_tensor=i % 2 == 1)
    q, key_cache, value_cache, tables = _decode_case(rng, gen, [50, 3, 21], 6, 2, 8)
    _expect_decode(fn, q, key_cache, value_cache, tables, [50, 3, 21], dtype=torch.bfloat16)
    cache = torch.zeros(3, 4, 2, 8)
    expect_raises(
        "paged_decode_attention(q [2, 4, 8], key_cache [3, 4, 2, 8], block_tables=[[0, 1], [2]], context_lens=[8, 5])",
        ValueError,
        "sequence 1's one block of 4 holds fewer than 5 tokens",
        fn,
        torch.zeros(2, 4, 8),
        cache,
        cache,
        [[0, 1], [2]],
        [8, 5],
    )
    expect_raises(
        "paged_decode_attention(q [1, 3, 8], key_cache [3, 4, 2, 8], block_tables=[[0]], context_lens=[2])",
        ValueError,
        "3 query heads do not split evenly over 2 KV heads",
        fn,
        torch.zeros(1, 3, 8),
        cache,
        cache,
        [[0]],
        [2],
    )


# --------------------------------------------------------------------------- BlockAllocator


def _shown(tokens) -> str:
    tokens = list(tokens)
    if len(tokens) <= 16:
        return str(tokens)
    return f"[{', '.join(map(str, tokens[:12]))}, ... ({len(tokens)} tokens)]"


class _Story:
    """The learner's allocator and the library's side by side, the same operations on both, a
    model of the KV store written through the learner's block tables, and a log of what was done."""

    def __init__(self, cls, num_blocks: int, block_size: int, caching: bool = True):
        from decodelab.engine.block_allocator import BlockAllocator

        name = getattr(cls, "__name__", "BlockAllocator")
        self.header = f"{name}(num_blocks={num_blocks}, block_size={block_size}, enable_prefix_caching={caching})"
        self.mine = call(self.header, cls, num_blocks, block_size, caching)
        self.lib = BlockAllocator(num_blocks, block_size, caching)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.tables: dict[str, list[int]] = {}  # the learner's tables by sequence name
        self.lib_tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.kv: dict[int, dict[int, tuple]] = {}  # learner's block id -> offset -> the prefix written there
        self.log: list[str] = []
        log = call(f"{self.header}.copy_on_write_log", getattr, self.mine, "copy_on_write_log")
        if not isinstance(log, list) or log:
            self.fail("copy_on_write_log of a new allocator", "an empty list", repr(log))

    # ------------------------------------------------------------ messages
    def where(self) -> str:
        if not self.log:
            return f"{self.header}, new"
        shown = self.log if len(self.log) <= 40 else ["..."] + self.log[-40:]
        return f"{self.header}, after\n" + "\n".join(f"    {line}" for line in shown)

    def fail(self, what: str, expected: str, got: str, why: str = "") -> None:
        raise AssertionError(
            f"{self.where()}\n  then {what}: expected {expected}, got {got}" + (f"\n  ({why})" if why else "")
        )

    def broken(self, what: str, problem: str) -> None:
        raise AssertionError(f"{self.where()}\n  then {what}: {problem}")

    def _call(self, what: str, fn, *args):
        return call(f"{self.where()}\n  then {what}", fn, *args)

    def _bool(self, what: str, fn, *args) -> bool:
        got = self._call(what, fn, *args)
        if not isinstance(got, bool):
            self.broken(what, f"expected True or False, got {type(got).__name__} {got!r}")
        return got

    def _int(self, what: str, got) -> int:
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            self.broken(what, f"expected an int, got {type(got).__name__} {got!r}")
        return int(got)

    def num_free(self, what: str = "num_free") -> int:
        return self._int(what, self._call(what, getattr, self.mine, "num_free"))

    # ------------------------------------------------------------ the KV store model
    def _write(self, name: str, positions, op: str) -> None:
        """The engine writes the K/V of tokens `positions` of `name` through its table."""
        table, tokens, size = self.tables[name], self.tokens[name], self.block_size
        for position in positions:
            block = table[position // size]
            others = [other for other, t in self.tables.items() if other != name and block in t]
            if others:
                self.broken(
                    op,
                    f"{name} must now write the K/V of its token {position} into block {block} "
                    f"(entry {position // size} of its table {table}), which {' and '.join(others)} "
                    f"also hold{'s' if len(others) == 1 else ''}: that would change their K/V. Only "
                    "blocks full of tokens already computed may be shared; a shared block a "
                    "sequence writes into must be copied first (copy-on-write)",
                )
            self.kv.setdefault(block, {})[position % size] = tuple(tokens[: position + 1])

    def _check_kv(self, op: str) -> None:
        """Every live sequence's blocks hold the K/V of its own tokens."""
        size = self.block_size
        for name, table in self.tables.items():
            tokens = self.tokens[name]
            for position in range(len(tokens)):
                block = table[position // size]
                held = self.kv.get(block, {}).get(position % size)
                if held != tuple(tokens[: position + 1]):
                    if held is None:
                        what = "holds nothing written there"
                    else:
                        what = (
                            f"holds the K/V of token {len(held) - 1} of the prefix {_shown(held)}"
                            if held[:-1] != tuple(tokens[:position])
                            else f"holds the K/V of token {held[-1]} in that place"
                        )
                    self.broken(
                        op,
                        f"{name}'s token {position} ({tokens[position]}) should be read from block "
                        f"{block} (entry {position // size} of its table {table}) at offset "
                        f"{position % size}, but that slot {what}, not {name}'s own "
                        f"{_shown(tokens[: position + 1])}",
                    )

    def _apply_copies(self, op: str) -> None:
        """What the engine does before its next forward pass: copy each (source, destination)."""
        log = self._call(f"{op}: its copy_on_write_log", getattr, self.mine, "copy_on_write_log")
        if not isinstance(log, list):
            self.broken(op, f"copy_on_write_log should be a list of (source, destination) pairs, got {log!r}")
        for pair in list(log):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                self.broken(op, f"copy_on_write_log holds {pair!r}; expected (source block, destination block)")
            src, dst = (int(b) for b in pair)
            self.kv[dst] = dict(self.kv.get(src, {}))
        log.clear()
        self.lib.copy_on_write_log.clear()

    # ------------------------------------------------------------ comparisons after every operation
    @staticmethod
    def _sharing(tables: dict[str, list[int]]) -> dict[tuple[str, int], tuple]:
        holders: dict[int, list] = {}
        for name, table in tables.items():
            for index, block in enumerate(table):
                holders.setdefault(block, []).append((name, index))
        return {entry: tuple(entries) for entries in holders.values() for entry in entries}

    def compare(self, op: str) -> None:
        size, mine, lib = self.block_size, self.mine, self.lib
        for name, table in self.tables.items():
            if len(table) != len(self.lib_tables[name]):
                needed = -(-len(self.tokens[name]) // size)
                self.fail(
                    f"{op}: the length of {name}'s block table",
                    f"{needed} blocks ({len(self.tokens[name])} tokens in blocks of {size})",
                    f"{len(table)}: {table}",
                )
            bad = [
                b
                for b in table
                if isinstance(b, bool) or not isinstance(b, numbers.Integral) or not 0 <= b < self.num_blocks
            ]
            if bad:
                self.broken(
                    op, f"{name}'s block table {table} holds {bad[0]!r}, not a block id 0..{self.num_blocks - 1}"
                )
        self._check_kv(op)
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                counts[block] += 1
        refs = [
            self._int(f"{op}: ref_count({b})", self._call(f"{op}: ref_count({b})", mine.ref_count, b))
            for b in range(self.num_blocks)
        ]
        for block, (ref, count) in enumerate(zip(refs, counts)):
            if ref != count:
                who = [name for name, table in self.tables.items() if block in table]
                held = f"held by {', '.join(who)}" if who else "held by no live table"
                self.fail(
                    f"{op}: ref_count({block})",
                    f"{count} (block {block} is {held})",
                    str(ref),
                    "a block's reference count is the number of live block tables that hold it",
                )
        free = self.num_free(f"{op}: num_free")
        held = sum(1 for count in counts if count)
        if free + held != self.num_blocks:
            self.fail(
                f"{op}: num_free",
                f"{self.num_blocks - held} ({held} of {self.num_blocks} blocks are held "
                "by live tables; every other block is free)",
                str(free),
                "free + held = all blocks: a block nobody holds must go back to the free list, "
                "and a held block must not be on it",
            )
        if free != lib.num_free:  # cannot differ when the invariants hold and the tables match; kept as a guard
            self.fail(
                f"{op}: num_free", f"{lib.num_free} (the library's allocator after the same operations)", str(free)
            )
        got, expected = self._sharing(self.tables), self._sharing(self.lib_tables)
        for entry in sorted(expected):
            if got[entry] != expected[entry]:
                name, index = entry

                def say(group):
                    others = [f"{n}'s entry {i}" for n, i in group if (n, i) != entry]
                    return f"shared with {', '.join(others)}" if others else "held by it alone"

                self.fail(
                    f"{op}: entry {index} of {name}'s table {self.tables[name]}",
                    say(expected[entry]),
                    say(got[entry]),
                    "which blocks are shared is decided by the prefix cache (full blocks "
                    "with the same prefix), fork, and copy-on-write; everything else is private",
                )
        named = [self._bool(f"{op}: is_cached({b})", mine.is_cached, b) for b in range(self.num_blocks)]
        for name, table in self.tables.items():
            tokens = self.tokens[name]
            for index, (block, lib_block) in enumerate(zip(table, self.lib_tables[name])):
                expected = lib.is_cached(lib_block)
                if named[block] != expected:
                    chunk = tokens[index * size : (index + 1) * size]
                    if len(chunk) < size:
                        kind = f"partly filled: {len(chunk)} of {size} tokens"
                    else:
                        kind = f"full: {_shown(chunk)} after {index * size} tokens"
                    self.fail(
                        f"{op}: is_cached({block}), {name}'s entry {index} ({kind})",
                        str(expected),
                        str(named[block]),
                        _NAMING,
                    )
        if sum(named) != len(lib.cached):
            self.fail(
                f"{op}: the number of blocks the prefix cache names (is_cached True), free ones included",
                f"{len(lib.cached)}",
                str(sum(named)),
                _NAMING + "; free blocks are handed out least "
                "recently freed first, so a prefix freed recently is the last to lose its names",
            )

    # ------------------------------------------------------------ operations
    def arrive(self, name: str, tokens) -> bool:
        """A new sequence: can_allocate, then allocate (or OutOfBlocksError). True if it got its blocks."""
        tokens, size = list(tokens), self.block_size
        op = f"{len(self.log) + 1}. {name} = allocate({_shown(tokens)})"
        expected_ok = self.lib.can_allocate(tokens)
        ok = self._bool(f"can_allocate({_shown(tokens)})", self.mine.can_allocate, list(tokens))
        if ok != expected_ok:
            need = self.lib.blocks_needed(len(tokens))
            hits = self.lib._cached_prefix_blocks(tokens)
            revived = sum(1 for b in hits if self.lib.blocks[b].ref_count == 0)
            self.fail(
                f"can_allocate({_shown(tokens)})",
                str(expected_ok),
                str(ok),
                f"{need} blocks for {len(tokens)} tokens, {len(hits)} of them found in the prefix cache "
                f"({revived} of those on the free list, which takes them off it), "
                f"{self.lib.num_free} free",
            )
        if not ok:
            before = self.num_free()
            expect_raises(
                f"{self.where()}\n  then {op} when can_allocate says False",
                _out_of_blocks(),
                "the pool has too few free blocks",
                self.mine.allocate,
                list(tokens),
            )
            self.log.append(f"{op} -> OutOfBlocksError")
            self.compare(op)
            if self.num_free() != before:
                self.fail(
                    f"{op} (refused)",
                    f"num_free still {before}",
                    str(self.num_free()),
                    "a refused allocation changes nothing",
                )
            return False
        given = list(tokens)
        got = self._call(op, self.mine.allocate, given)
        if not (isinstance(got, tuple) and len(got) == 2):
            self.broken(op, f"expected a pair (block table, number of cached tokens), got {got!r}")
        table, cached = got
        if not isinstance(table, list):
            self.broken(op, f"expected the block table as a list of block ids, got {type(table).__name__} {table!r}")
        cached = self._int(f"{op}: the number of cached tokens", cached)
        lib_table, lib_cached = self.lib.allocate(list(tokens))
        if given != tokens:
            self.broken(op, f"allocate changed the caller's token list to {_shown(given)}")
        self.tables[name], self.lib_tables[name], self.tokens[name] = table, lib_table, tokens
        self.log.append(f"{op} -> table {table}, {cached} tokens cached")
        if len(table) != len(lib_table):
            del self.tables[name], self.lib_tables[name], self.tokens[name]
            self.fail(
                op,
                f"a table of {len(lib_table)} blocks ({len(tokens)} tokens in blocks of {size}: "
                f"ceil({len(tokens)} / {size}))",
                f"{len(table)} blocks: {table}",
            )
        if cached != lib_cached:
            found = lib_cached // size
            self.fail(
                f"{op}: the number of cached tokens",
                f"{lib_cached} ({found} full block{'' if found == 1 else 's'} of this prefix in the prefix cache)",
                str(cached),
                "the prefix cache finds full blocks only, each named by its tokens and the name of the "
                "block before it, and it always leaves the prompt's last token to compute",
            )
        self._write(name, range(cached, len(tokens)), op)
        self.compare(op)
        return True

    def grow(self, name: str, token: int, held: bool = False) -> bool:
        """Append a token: can_append, then append_slot (or OutOfBlocksError). True if it grew.
        held: the table already holds the token's slot (after shrink), so can_append is not asked."""
        table, tokens = self.tables[name], self.tokens[name]
        tokens.append(token)
        op = f"{len(self.log) + 1}. append_slot({name}'s table {list(table)}, its {len(tokens)} tokens, now ending {token})"
        expected_ok = held or self.lib.can_append(self.lib_tables[name], len(tokens) - 1)
        ok = held or self._bool(
            f"can_append({name}'s table {table}, {len(tokens) - 1})", self.mine.can_append, table, len(tokens) - 1
        )
        if ok != expected_ok:
            full = (len(tokens) - 1) % self.block_size == 0
            shared = not full and self.lib.blocks[self.lib_tables[name][-1]].ref_count > 1
            self.fail(
                f"can_append({name}'s table {table}, {len(tokens) - 1})",
                str(expected_ok),
                str(ok),
                f"its last block is {'full: the token needs a new block' if full else 'shared: the token needs a copy' if shared else 'its own and has room'}; "
                f"{self.lib.num_free} free",
            )
        if not ok:
            before = list(table)
            expect_raises(
                f"{self.where()}\n  then {op} when can_append says False",
                _out_of_blocks(),
                "the pool has no free block for it",
                self.mine.append_slot,
                table,
                list(tokens),
            )
            tokens.pop()
            self.log.append(f"{op} -> OutOfBlocksError")
            if table != before:
                self.broken(
                    op,
                    f"the refused append changed {name}'s table {before} to {table}; a refused "
                    "append changes nothing (take the free block before you let go of anything)",
                )
            self.compare(op)
            return False
        self._call(op, self.mine.append_slot, table, list(tokens))
        self.lib.append_slot(self.lib_tables[name], tokens)
        self.log.append(f"{op} -> table {table}")
        self._apply_copies(op)
        if len(table) != len(self.lib_tables[name]):
            self.fail(
                f"{op}: {name}'s table",
                f"{len(self.lib_tables[name])} blocks for {len(tokens)} tokens",
                f"{len(table)}: {table}",
            )
        self._write(name, [len(tokens) - 1], op)
        self.compare(op)
        return True

    def speculate(self, name: str, drafts, accepted: int, token: int) -> bool:
        """A speculative step as the engine runs it: reserve slots for the drafts, write the K/V of
        the pending token and the drafts, keep `accepted` drafts and the target's `token`, shrink
        the table to them, then give `token` its slot (`grow`). False if reserve refuses."""
        table, tokens, lib_table = self.tables[name], self.tokens[name], self.lib_tables[name]
        n, k, size = len(tokens), len(drafts), self.block_size
        op = f"{len(self.log) + 1}. reserve({name}'s table {list(table)}, {n} + {k} drafts)"
        extra = self.lib.blocks_needed(n + k) - len(lib_table)
        copy = self.lib.blocks[lib_table[-1]].ref_count > 1
        before, free_before = list(table), self.lib.num_free
        ok = self._bool(op, self.mine.reserve, table, n + k)
        expected_ok = self.lib.reserve(lib_table, n + k)
        if ok != expected_ok:
            self.fail(
                op,
                str(expected_ok),
                str(ok),
                f"{max(extra, 0)} new block{'' if extra == 1 else 's'} for "
                f"{n + k} tokens in blocks of {size}{' and a copy of its shared last block' if copy else ''}, "
                f"{free_before} free",
            )
        if not ok:
            if table != before or self.num_free() != free_before:
                self.broken(
                    op,
                    f"it returned False, so it must change nothing, but {name}'s table went from "
                    f"{before} to {table} and num_free from {free_before} to {self.num_free()} "
                    "(check the room before taking anything)",
                )
            self.log.append(f"{op} -> False")
            self.compare(op)
            return False
        self.log.append(f"{op} -> table {table}")
        self._apply_copies(op)
        if len(table) != len(lib_table):
            self.fail(f"{op}: {name}'s table", f"{len(lib_table)} blocks for {n + k} tokens", f"{len(table)}: {table}")
        self.tokens[name] = tokens + list(drafts)
        self._write(name, range(n - 1, n + k), op)  # the verify pass: the pending token and the drafts
        self.compare(op)
        kept = tokens + list(drafts[:accepted])
        final = kept + [token]
        op = (
            f"{len(self.log) + 1}. shrink({name}'s table {list(table)}, its {len(final)} tokens after {accepted} "
            f"of {k} drafts accepted and {token} sampled, {len(kept)} computed)"
        )
        self._call(op, self.mine.shrink, table, list(final), len(kept))
        self.lib.shrink(lib_table, final, len(kept))
        self.tokens[name] = kept
        self.log.append(f"{op} -> table {table}")
        if len(table) != len(lib_table):
            self.fail(
                f"{op}: {name}'s table",
                f"{len(lib_table)} blocks ({len(final)} tokens in blocks of {size}: "
                "the slots of the rejected drafts go back)",
                f"{len(table)}: {table}",
            )
        self.compare(op)
        self.grow(name, token, held=len(lib_table) * size >= len(final))  # the next step gives it its slot
        return True

    def fork(self, name: str, parent: str) -> None:
        op = f"{len(self.log) + 1}. {name} = fork({parent}'s table {self.tables[parent]})"
        table = self._call(op, self.mine.fork, self.tables[parent])
        if not isinstance(table, list):
            self.broken(op, f"expected a new list of block ids, got {type(table).__name__} {table!r}")
        if table is self.tables[parent]:
            self.broken(
                op,
                "fork returned the parent's own list: the two sequences' tables must be two lists "
                "(holding the same blocks), or a copy-on-write in one would change the other",
            )
        self.tables[name], self.tokens[name] = table, list(self.tokens[parent])
        self.lib_tables[name] = self.lib.fork(self.lib_tables[parent])
        self.log.append(f"{op} -> {table}")
        self.compare(op)

    def free(self, name: str) -> None:
        table = self.tables[name]
        op = f"{len(self.log) + 1}. free_sequence({name}'s table {list(table)})"
        self._call(op, self.mine.free_sequence, table)
        self.lib.free_sequence(self.lib_tables.pop(name))
        self.log.append(op)
        if table:
            self.broken(op, f"free_sequence should empty the table in place, it still holds {table}")
        del self.tables[name], self.tokens[name]
        self.compare(op)

    def free_all(self) -> None:
        for name in list(self.tables):
            self.free(name)
        if self.num_free() != self.num_blocks:
            self.fail(
                "with every sequence freed: num_free", str(self.num_blocks), str(self.num_free()), "a block leaked"
            )


_NAMING = (
    "every full block is named by its tokens and the name of the block before it; the first block "
    "under a name keeps it; a partly filled block is never named; a block loses its name when it is "
    "handed out again"
)


def _out_of_blocks():
    from decodelab.engine.block_allocator import OutOfBlocksError

    return OutOfBlocksError


def _scripted_stories(cls) -> None:
    """Short stories that each put one rule to the test, with readable messages."""
    system = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4
    # Blocks, free list, sharing a system prompt, freeing.
    story = _Story(cls, 12, 4)
    story.arrive("A", system + [100, 101, 102])
    story.arrive("B", system + [200, 201, 202, 203, 204])  # finds A's two blocks
    story.arrive("C", [9, 9, 9, 9, 9, 9, 9, 9])  # 8 tokens: exactly two blocks
    for token in (103, 104, 105):
        story.grow("A", token)  # fills A's third block, then opens a fourth
    story.free("A")
    story.arrive("D", system + [100, 101, 102, 103, 400])  # A's first three blocks, from the free list
    story.arrive("E", system + [100, 101, 102, 103])  # the last token stays to compute: two blocks cached
    story.free_all()

    # The name of a block stands for its whole prefix (chained), and a partly filled block has none.
    story = _Story(cls, 16, 4)
    story.arrive("A", [1, 2, 3, 4, 50, 51, 52, 53, 60])
    story.arrive("B", [5, 6, 7, 8, 50, 51, 52, 53, 61])  # same second block, other first block
    story.arrive("C", [5, 6, 7, 8, 50, 51, 52, 53, 62])  # B's prefix: two blocks cached, B's, not A's
    story.arrive("D", [1, 2, 3, 4, 50, 51, 52, 53, 60, 70])  # A's 9 tokens + 1: A's third block is partial
    story.arrive("E", [1, 2, 3, 4, 50, 51])
    story.arrive("F", [1, 2, 3, 4, 50, 51, 90])  # E's partial second block must not be found
    story.free_all()

    # n > 1: fork shares every block, copy-on-write parts the last one.
    story = _Story(cls, 10, 4, caching=False)
    story.arrive("A", list(range(10, 16)))  # 6 tokens: the second block half full
    story.fork("A2", "A")
    story.fork("A3", "A")
    story.grow("A2", 20)  # shared last block: copied
    story.grow("A", 21)  # still shared with A3: copied
    story.grow("A3", 22)  # now its own: written in place
    story.grow("A3", 23)  # fills it
    story.grow("A3", 24)  # a new block
    story.free("A")
    story.free_all()

    # A full pool: refusals change nothing.
    story = _Story(cls, 3, 4)
    story.arrive("A", list(range(30, 37)))  # 7 tokens: 2 blocks
    story.arrive("B", list(range(40, 53)))  # 13 tokens need 4 blocks: OutOfBlocksError
    story.fork("A2", "A")
    story.arrive("C", [60, 61, 62])  # the last free block
    story.grow("A2", 70)  # needs a copy, no block free: OutOfBlocksError, nothing changes
    story.grow("C", 63)  # its own block has room
    story.grow("C", 64)  # needs a new block: OutOfBlocksError
    story.free("C")
    story.grow("A2", 70)  # now the copy can be made
    story.free_all()

    # Freed blocks keep their names until handed out again, least recently freed first; the
    # tail of a sequence is freed before its head, so the head is the last to be forgotten.
    story = _Story(cls, 6, 4)
    story.arrive("A", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    story.free("A")
    story.arrive("B", [20, 21, 22, 23, 24, 25, 26, 27, 28])  # the three blocks never used
    story.arrive("C", [30, 31, 32, 33, 34])  # A's third block, then its second
    story.arrive("D", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # A's first block is still there
    story.free_all()

    # A cached block found on the free list must come off it: it costs a free block too.
    story = _Story(cls, 4, 4)
    story.arrive("A", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    story.free("A")
    story.arrive("B", [50, 51, 52])
    story.arrive("C", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])  # 4 blocks, 2 of them cached and free: 4 > 3
    story.arrive("D", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 3 blocks, 2 of them cached and free: 3 <= 3
    story.free_all()

    # Speculative decoding: reserve slots for drafts not known yet (a shared last block copied
    # first, nothing taken when they do not fit), shrink back to the accepted ones, and name the
    # blocks their computed tokens filled, so that a later prompt finds them.
    story = _Story(cls, 8, 2)
    story.arrive("A", [1, 2, 3, 4, 5])  # 3 blocks, the last half full
    story.fork("A2", "A")
    story.speculate("A", list(range(6, 16)), 0, 20)  # 5 new blocks and a copy, 5 free: refused
    story.speculate("A", [6, 7, 8, 9], 1, 30)  # a copy and 2 new blocks; 1 kept: block [5, 6] named, 1 freed
    story.arrive("B", [1, 2, 3, 4, 5, 6, 99])  # finds A's three blocks
    story.speculate("A2", [40, 41, 42], 3, 43)  # every draft accepted
    story.free_all()
    story = _Story(cls, 6, 2)
    story.arrive("C", [1, 2, 3, 4])  # 2 full blocks
    story.fork("C2", "C")
    story.speculate("C", [5, 6], 2, 7)  # the full shared last block is copied too: C writes token 3 again
    story.free_all()


def _random_story(cls, seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4, 4])
    story = _Story(cls, rng.randint(5, 30), block_size, caching=rng.random() < 0.85)
    pieces = [[rng.randint(1, 6) for _ in range(block_size)] for _ in range(4)]  # shared block contents
    past: list[list[int]] = []
    names = iter(f"S{i}" for i in range(1000))
    for _ in range(36):
        live = list(story.tables)
        roll = rng.random()
        if roll < 0.35 or not live:
            if past and rng.random() < 0.4:  # a prefix of an earlier sequence, maybe more
                earlier = rng.choice(past)
                tokens = earlier[: rng.randint(1, len(earlier))] + [rng.randint(1, 6) for _ in range(rng.randint(0, 3))]
            else:
                tokens = [t for _ in range(rng.randint(0, 4)) for t in rng.choice(pieces)]
                tokens += [rng.randint(1, 6) for _ in range(rng.randint(0 if tokens else 1, 2 * block_size))]
            name = next(names)
            if story.arrive(name, tokens):
                past.append(tokens)
        elif roll < 0.55:
            name = rng.choice(live)
            if story.grow(name, rng.randint(1, 6)):
                past.append(list(story.tokens[name]))
        elif roll < 0.7:
            name, k = rng.choice(live), rng.randint(1, 4)
            drafts = [rng.randint(1, 6) for _ in range(k)]
            if story.speculate(name, drafts, rng.randint(0, k), rng.randint(1, 6)):
                past.append(list(story.tokens[name]))
        elif roll < 0.8:
            story.fork(next(names), rng.choice(live))
        else:
            story.free(rng.choice(live))
    story.free_all()


def check_block_allocator(cls) -> None:
    _scripted_stories(cls)
    for seed in range(60):
        _random_story(cls, seed)


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_reservation_mib() -> float:
    """MiB of SmolLM2-135M's K and V for a 2,048-token reservation, float32 (the library's kv_bytes)."""
    from decodelab.lessons import kv_size

    return kv_size.kv_bytes("SmolLM2-135M", 2048, 1, "fp32") / 2**20


def check_q_reservation_mib(value) -> None:
    """Graded q_reservation_mib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_reservation_mib",
        value,
        answer_q_reservation_mib(),
        "SmolLM2's K and V for 2,048 tokens in float32, in MiB (30 layers x 2 x 3 KV heads x 64 x 4 bytes per token)",
    )


def answer_q_waste_pct_blocks_32() -> float:
    """Percent of slots wasted by blocks of 32 on lengths uniform in 50..2,047: the library's kv_waste over
    every length once (the expectation over the uniform draw; a sample of 1,000 lands within 0.1 point)."""
    from decodelab.engine.block_allocator import kv_waste

    return 100 * kv_waste(list(range(50, 2048)), 32)


def check_q_waste_pct_blocks_32(value) -> None:
    """Graded q_waste_pct_blocks_32 (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_waste_pct_blocks_32",
        value,
        answer_q_waste_pct_blocks_32(),
        "percent of reserved slots left empty by blocks of 32, lengths uniform in 50..2,047 (about (32 - "
        "1) / 2 slots per request of 1,048.5 tokens on average)",
    )

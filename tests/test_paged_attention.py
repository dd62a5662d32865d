"""`PagedBatch.attend` against plain causal attention over each sequence's whole context, for
packed batches that mix decode rows (one new token) and prefill rows (several) in any order."""

from __future__ import annotations

import random

import pytest
import torch

from decodelab.config import ModelConfig
from decodelab.engine import paged_decode_kernel
from decodelab.engine.block_allocator import blocks_needed
from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice, group_by_length
from decodelab.model import q4_kernel, thread_team
from decodelab.model.attention import causal_attention

H, H_KV, D, BLOCK = 6, 2, 8, 4


def make_case(new_lengths: list[int], seed: int, sliding_window: int | None = None, batch_class=None):
    """Sequences with random earlier contexts already in a shuffled block pool, and their new
    tokens packed in the given order -> (PagedBatch, q, k, v, the oracle output [1, H, N, D])."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=32,
        hidden_size=H * D,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=H,
        num_key_value_heads=H_KV,
        head_dim=D,
        max_position_embeddings=256,
    )
    store = PagedKVStore(config, num_blocks=64, block_size=BLOCK)
    free = list(range(64))
    rng.shuffle(free)
    slices, slots, expected, qs, ks, vs = [], [], [], [], [], []
    start = 0
    for new in new_lengths:
        old = rng.randint(0, 20)
        total = old + new
        table = [free.pop() for _ in range(blocks_needed(total, BLOCK))]
        k_all, v_all = torch.randn(1, H_KV, total, D), torch.randn(1, H_KV, total, D)
        q_new = torch.randn(1, H, new, D)
        for pos in range(old):  # the context written by earlier steps
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            store.keys[0].view(-1, H_KV, D)[slot] = k_all[0, :, pos]
            store.values[0].view(-1, H_KV, D)[slot] = v_all[0, :, pos]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(old, total)]
        slices.append(SequenceSlice(start, new, total, table))
        expected.append(causal_attention(q_new, k_all, v_all, q_offset=old, sliding_window=sliding_window))
        qs.append(q_new)
        ks.append(k_all[:, :, old:])
        vs.append(v_all[:, :, old:])
        start += new
    batch = (batch_class or PagedBatch)(store, slices, torch.tensor(slots), sliding_window)
    return batch, torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(expected, 2)


ORDERS = [[1, 1, 1], [5, 1, 3, 1, 1], [1, 7, 1], [4, 6], [1, 1, 9]]


class OneGroupPerLength(PagedBatch):
    """Groups cost nothing: decode sequences of different block counts attend apart."""

    DECODE_GROUP_COST = 0


def decode_path(monkeypatch, path: str) -> None:
    """Make decode groups attend through `path`: "c" (engine.paged_decode_kernel; skipped where the C
    kernels cannot load) or "torch" (gathered blocks and SDPA)."""
    if path == "torch":
        monkeypatch.setattr(paged_decode_kernel, "runs_here", lambda q, keys: False)
    elif not q4_kernel.kernel_loads():
        pytest.skip("the C kernels cannot load here")


@pytest.mark.parametrize("new_lengths", ORDERS + [[1] * 9, [1, 1, 6, 1, 1, 1, 2, 1]])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("batch_class", [PagedBatch, OneGroupPerLength])
@pytest.mark.parametrize("path", ["c", "torch"])
def test_packed_attention_equals_per_sequence_attention(new_lengths, sliding_window, batch_class, path, monkeypatch):
    decode_path(monkeypatch, path)
    batch, q, k, v, expected = make_case(
        new_lengths, seed=len(new_lengths), sliding_window=sliding_window, batch_class=batch_class
    )
    assert batch.decode_only == all(n == 1 for n in new_lengths)
    if batch_class is OneGroupPerLength and new_lengths.count(1) >= 5:
        assert len(batch.decode_groups) > 1  # the case this class exists for
    out = batch.attend(0, q, k, v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 12, 64])  # 12: a tail past the 8-float vectors
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_decode_attention_is_sdpa_over_the_gathered_blocks(head_dim, window, threads, monkeypatch):
    """paged_decode_attention against its definition: SDPA of each sequence's one query over the keys it
    gathers from its own (shuffled, padded) table, the last `window` of them with a window; GQA of 4
    query heads per KV head; lengths from one key to a full table; on one thread and on two."""
    if not q4_kernel.kernel_loads():
        pytest.skip("the C kernels cannot load here")
    monkeypatch.setattr(thread_team, "threads_for", lambda work, below: threads)
    torch.manual_seed(head_dim)
    heads, kv_heads, block, max_blocks = 8, 2, 4, 5
    keys, values = torch.randn(2, 40, block, kv_heads, head_dim)  # [num_blocks, block_size, H_kv, D]
    lengths = torch.tensor([1, 7, 20, 13])
    tables = torch.stack([torch.randperm(40)[:max_blocks] for _ in lengths])  # unused entries: padding
    q = torch.randn(len(lengths), heads, head_dim)
    out = paged_decode_kernel.paged_decode_attention(q, keys, values, tables, lengths, window)
    for b, length in enumerate(lengths.tolist()):
        table = tables[b].tolist()
        slots = torch.tensor([table[p // block] * block + p % block for p in range(length)][-(window or length) :])
        k_seq = keys.view(-1, kv_heads, head_dim)[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v_seq = values.view(-1, kv_heads, head_dim)[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        expected = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k_seq, v_seq)[:, 0]
        torch.testing.assert_close(out[b], expected, rtol=1e-5, atol=1e-6)


class DecodeRowsFirst(PagedBatch):
    """A plausible bug kept as a fixture: the batched decode result is written to the first
    rows of the output, as if decode rows always came first in a mixed batch."""

    def attend(self, layer, q, k, v):
        out = super().attend(layer, q, k, v)
        if self.decode_slices and self.prefill_slices:
            group = self.decode_group(self.decode_slices, q.device)
            out[:, :, : len(self.decode_slices)] = self._attend_decode(layer, q[:, :, group.rows], group)
        return out


def test_misplaced_decode_rows_are_caught():
    batch, q, k, v, expected = make_case([5, 1, 3, 1, 1], seed=5)
    buggy = DecodeRowsFirst(batch.store, batch.slices, batch.slot_mapping)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(buggy.attend(0, q, k, v), expected, atol=1e-5, rtol=1e-5)


def partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in partitions(rest):
        yield [[first]] + partition
        for i in range(len(partition)):
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1 :]


@pytest.mark.parametrize("seed", range(12))
def test_group_by_length_finds_the_cheapest_partition(seed):
    """Against every partition of up to 7 sequences (brute force)."""
    rng = random.Random(seed)
    num_blocks = [rng.randint(1, 12) for _ in range(rng.randint(1, 7))]
    block_size, cost_per_group = 4, rng.choice([0, 8, 40, 1000])

    def cost(groups):
        return sum(len(g) * max(num_blocks[i] for i in g) * block_size + cost_per_group for g in groups)

    groups = group_by_length(num_blocks, block_size, cost_per_group)
    assert sorted(i for g in groups for i in g) == list(range(len(num_blocks)))
    assert all(g == sorted(g) for g in groups)
    assert cost(groups) == min(cost(p) for p in partitions(list(range(len(num_blocks)))))


# --------------------------------------------------------------------------- a decode batch through its block tables
# (decodelab.lessons.paged_kv, notebook 07's exercise: the whole batch at once, no loop over sequences)


def decode_batch_case(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    seed: int,
    shared_prefix: int = 0,
    spare_blocks: int = 1,
):
    """Sequences with contiguous K/V [H_kv, length, D] each (the first shared_prefix tokens the same
    K/V and the same blocks in every sequence long enough), written into a shuffled pool full of
    stale numbers. -> (q [B, H, D], key_cache, value_cache, ragged block tables, the oracle [B, H, D]):
    per-sequence SDPA of the one query over its contiguous K/V, the K/V heads repeated per query head."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    shared_blocks = shared_prefix // block_size  # only full blocks can be shared
    needed = [blocks_needed(n, block_size) for n in lengths]
    num_blocks = shared_blocks + sum(n - shared_blocks if n > shared_blocks else n for n in needed) + spare_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix_table = [free.pop() for _ in range(shared_blocks)]
    pool_k, pool_v = (torch.randn(num_blocks * block_size, num_kv_heads, D, generator=gen) for _ in range(2))
    prefix_k, prefix_v = (torch.randn(num_kv_heads, shared_blocks * block_size, D, generator=gen) for _ in range(2))
    q = torch.randn(len(lengths), num_heads, D, generator=gen)
    tables, expected = [], []
    for b, n in enumerate(lengths):
        k, v = (torch.randn(num_kv_heads, n, D, generator=gen) for _ in range(2))
        shares = needed[b] > shared_blocks and shared_blocks > 0
        if shares:
            k[:, : shared_blocks * block_size], v[:, : shared_blocks * block_size] = prefix_k, prefix_v
        table = (prefix_table if shares else []) + [
            free.pop() for _ in range(needed[b] - (shared_blocks if shares else 0))
        ]
        for position in range(n):
            slot = table[position // block_size] * block_size + position % block_size
            pool_k[slot], pool_v[slot] = k[:, position], v[:, position]
        group = num_heads // num_kv_heads
        expected.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[b][:, None], k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            )[:, 0]
        )
        tables.append(table)
    shape = (num_blocks, block_size, num_kv_heads, D)
    return q, pool_k.view(shape), pool_v.view(shape), tables, torch.stack(expected)


def padded_with(tables: list[list[int]], fill: int) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [fill] * (width - len(t)) for t in tables])


DECODE_CASES = [  # (context lengths, H, H_kv, block size, shared prefix tokens)
    ([1, 37, 5, 64, 2], 6, 2, 4, 0),  # very different lengths, GQA
    ([130, 3, 17, 16, 1, 90], 9, 3, 16, 0),  # SmolLM2's heads
    ([20, 33, 12, 8], 4, 4, 4, 8),  # a shared 8-token prefix (two blocks); the 8-token one is all prefix
    ([7, 40, 41], 8, 1, 8, 16),  # MQA, a shared prefix
    ([5], 2, 1, 2, 0),
]


@pytest.mark.parametrize("lengths, num_heads, num_kv_heads, block_size, shared", DECODE_CASES)
def test_paged_decode_attention_equals_per_sequence_sdpa(lengths, num_heads, num_kv_heads, block_size, shared):
    from decodelab.lessons.paged_kv import paged_decode_attention, per_sequence_decode_attention

    q, key_cache, value_cache, tables, expected = decode_batch_case(
        lengths, num_heads, num_kv_heads, block_size, seed=len(lengths), shared_prefix=shared
    )
    assert any(sorted(t) != t for t in tables), "the case should hold a table out of order"
    if shared:
        held = [b for t in tables for b in t]
        assert len(set(held)) < len(held), "the case should share a block"
    before = [list(t) for t in tables], key_cache.clone(), value_cache.clone()
    for block_tables, context_lens in ((tables, lengths), (padded_with(tables, -1), torch.tensor(lengths))):
        got = paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        per_sequence_decode_attention(q, key_cache, value_cache, tables, lengths), expected, atol=1e-5, rtol=1e-5
    )
    assert before[0] == tables and torch.equal(before[1], key_cache) and torch.equal(before[2], value_cache)


def test_paged_decode_attention_keeps_q_dtype_and_softmaxes_in_float32():
    from decodelab.lessons.paged_kv import paged_decode_attention

    q, key_cache, value_cache, tables, expected = decode_batch_case([50, 3, 21], 6, 2, 8, seed=3)
    got = paged_decode_attention(q.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16(), tables, [50, 3, 21])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "tables, lengths, message",
    [
        ([[0, 1], [2]], [9, 4], r"context_lens \[9, 4\] must each lie in 1 \.\. .* \[8, 4\]"),
        ([[0, 1], [2]], [8, 0], "must each lie in 1"),
        ([[0, 1]], [8, 4], "q holds 2 sequences; got 1 block tables and 2 context lengths"),
    ],
)
def test_paged_decode_attention_names_bad_input(tables, lengths, message):
    from decodelab.lessons.paged_kv import paged_decode_attention

    cache = torch.zeros(3, 4, 1, D)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(torch.zeros(2, 2, D), cache, cache, tables, lengths)
    with pytest.raises(ValueError, match="the 3 query heads must be a multiple of the 2 KV heads"):
        paged_decode_attention(torch.zeros(1, 3, D), torch.zeros(3, 4, 2, D), torch.zeros(3, 4, 2, D), [[0]], [1])

"""`PagedBatch.attend` against plain causal attention over each sequence's whole context, for
packed batches that mix decode rows (one new token) and prefill rows (several) in any order."""
from __future__ import annotations

import random

import pytest
import torch

from decodelab.model.attention import causal_attention
from decodelab.config import ModelConfig
from decodelab.engine.block_allocator import blocks_needed
from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice, group_by_length

H, H_KV, D, BLOCK = 6, 2, 8, 4


def make_case(new_lengths: list[int], seed: int, sliding_window: int | None = None, batch_class=None):
    """Sequences with random earlier contexts already in a shuffled block pool, and their new
    tokens packed in the given order -> (PagedBatch, q, k, v, the oracle output [1, H, N, D])."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=32, hidden_size=H * D, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=H, num_key_value_heads=H_KV, head_dim=D, max_position_embeddings=256)
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


@pytest.mark.parametrize("new_lengths", ORDERS + [[1] * 9, [1, 1, 6, 1, 1, 1, 2, 1]])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("batch_class", [PagedBatch, OneGroupPerLength])
def test_packed_attention_equals_per_sequence_attention(new_lengths, sliding_window, batch_class):
    batch, q, k, v, expected = make_case(new_lengths, seed=len(new_lengths), sliding_window=sliding_window,
                                         batch_class=batch_class)
    assert batch.decode_only == all(n == 1 for n in new_lengths)
    if batch_class is OneGroupPerLength and new_lengths.count(1) >= 5:
        assert len(batch.decode_groups) > 1  # the case this class exists for
    out = batch.attend(0, q, k, v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


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
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1:]


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

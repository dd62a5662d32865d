"""`PagedBatch.attend` against plain causal attention over each sequence's whole context, for
packed batches that mix decode rows (one new token) and prefill rows (several) in any order."""
from __future__ import annotations

import random

import pytest
import torch

from decodelab.attention import causal_attention
from decodelab.config import ModelConfig
from decodelab.paged_attention import PagedBatch, PagedKVStore, SequenceSlice

H, H_KV, D, BLOCK = 6, 2, 8, 4


def make_case(new_lengths: list[int], seed: int, sliding_window: int | None = None):
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
        table = [free.pop() for _ in range(-(-total // BLOCK))]
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
    batch = PagedBatch(store, slices, torch.tensor(slots), sliding_window)
    return batch, torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(expected, 2)


ORDERS = [[1, 1, 1], [5, 1, 3, 1, 1], [1, 7, 1], [4, 6], [1, 1, 9]]


@pytest.mark.parametrize("new_lengths", ORDERS)
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_packed_attention_equals_per_sequence_attention(new_lengths, sliding_window):
    batch, q, k, v, expected = make_case(new_lengths, seed=len(new_lengths), sliding_window=sliding_window)
    assert batch.decode_only == all(n == 1 for n in new_lengths)
    out = batch.attend(0, q, k, v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


class DecodeRowsFirst(PagedBatch):
    """A plausible bug kept as a fixture: the batched decode result is written to the first
    rows of the output, as if decode rows always came first in a mixed batch."""

    def attend(self, layer, q, k, v):
        out = super().attend(layer, q, k, v)
        if self.decode_slices and self.prefill_slices:
            out[:, :, : len(self.decode_slices)] = self._attend_decode(layer, q[:, :, self.decode_rows])
        return out


def test_misplaced_decode_rows_are_caught():
    batch, q, k, v, expected = make_case([5, 1, 3, 1, 1], seed=5)
    buggy = DecodeRowsFirst(batch.store, batch.slices, batch.slot_mapping)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(buggy.attend(0, q, k, v), expected, atol=1e-5, rtol=1e-5)

"""Attention that reads keys and values through block tables (PagedAttention by gather).

`PagedKVStore` holds every layer's K and V for the whole block pool:
    keys, values: [num_layers, num_blocks, block_size, H_kv, D]
A forward pass over a *packed* batch — all new tokens of all scheduled sequences laid
end to end, input_ids [1, N] — gets a `PagedBatch` as its `kv_cache`. In each layer it
writes the new K/V rows into their slots, then lets every sequence's queries attend over
the blocks in its table: gathered into a contiguous [H_kv, context, D] view, so the
attention itself is the ordinary causal one. Decode sequences (one new token each) attend
in groups of similar context length (`group_by_length`), each group as one batch padded to
its longest member: in a long-tailed workload, one padded batch of 32 made the attention read
about three times the keys that exist, and the grouping raised throughput by ~20%
(`bench/serving.py`). On a CPU in float32 a group attends in one C call instead
(`paged_decode_kernel`), reading K/V through the tables where they lie: no gathered copy, no mask.

An attention function written for a contiguous cache, ``attention(cache, layer_index, q, k, v)``
that stores K/V with ``cache.append(layer_index, k, v)`` (notebook 01's, the engine's
`EngineHooks.attention`), runs here too: `PagedBatch(attention_fn=...)` calls it once per
sequence with a `PagedSequenceCache`, whose ``append`` writes into that sequence's slots and
returns its whole context gathered from its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodelab.config import ModelConfig
from decodelab.engine import paged_decode_kernel
from decodelab.engine.block_allocator import blocks_needed, slot_of
from decodelab.model.attention import ATTENTION_ONE_THREAD_BELOW, causal_attention
from decodelab.model.thread_team import one_thread_if_small


class PagedKVStore:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device=None, dtype=torch.float32):
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_blocks * block_size, H_kv, D] views: one row per slot."""
        return (
            self.keys[layer].view(-1, self.num_kv_heads, self.head_dim),
            self.values[layer].view(-1, self.num_kv_heads, self.head_dim),
        )

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: duplicate a shared block's K/V in every layer."""
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype=torch.float32) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


def gather_kv(flat_cache: torch.Tensor, block_table: list[int], context_len: int, block_size: int) -> torch.Tensor:
    """One sequence's keys (or values) read through its block table, in token order.

    flat_cache [num_blocks * block_size, H_kv, D] (one row per slot) -> a new tensor
    [H_kv, context_len, D] whose token i comes from slot
    block_table[i // block_size] * block_size + i % block_size. Raises ValueError when the
    table's blocks hold fewer than context_len slots.
    """
    if context_len > len(block_table) * block_size:
        raise ValueError(
            f"context_len {context_len} needs {blocks_needed(context_len, block_size)} blocks of "
            f"{block_size}, the block table has {len(block_table)}"
        )
    positions = torch.arange(context_len, device=flat_cache.device)
    table = torch.as_tensor(block_table, dtype=torch.long, device=flat_cache.device)
    slots = slot_of(table, positions, block_size)  # [context_len] (slot_of works on tensors too)
    return flat_cache[slots].transpose(0, 1)  # [H_kv, context_len, D]


@dataclass
class SequenceSlice:
    """One sequence's part of a packed batch: its new tokens are rows q_start .. q_start + q_len."""

    q_start: int
    q_len: int
    context_len: int  # tokens attended to, new ones included
    block_table: list[int]


@dataclass
class DecodeGroup:
    """Decode sequences that attend together, padded to the longest of them.

    rows [b]: their rows among the packed tokens; blocks [b, max_blocks]: block ids, padded
    with block 0; lengths [b]: each one's context length (int64); mask [b, 1, 1, max_blocks *
    block_size]: 0 where a key position is attended to, -inf elsewhere (SDPA is ~15% faster on CPU
    with an additive mask than a boolean one; the C path reads lengths instead)."""

    rows: torch.Tensor
    blocks: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor


def group_by_length(num_blocks: list[int], block_size: int, cost_per_group: int) -> list[list[int]]:
    """Split sequences into groups, each padded to its longest member, at the least cost.

    num_blocks[i]: the blocks sequence i attends over. Minimizes, over all partitions, the key
    positions attended (each group: its size x its longest member's blocks x block_size) plus
    cost_per_group per group (a group costs a few more calls per layer). An optimal partition
    splits the sequences sorted by length into runs, so a dynamic program over the distinct
    lengths finds it. Returns lists of indices into num_blocks, shortest group first.
    """
    lengths = sorted(set(num_blocks))
    members = {n: [i for i, m in enumerate(num_blocks) if m == n] for n in lengths}
    best = [0.0] + [float("inf")] * len(lengths)  # best[j]: cost of grouping the j shortest lengths
    cut = [0] * (len(lengths) + 1)
    for j in range(1, len(lengths) + 1):
        count = 0
        for i in range(j, 0, -1):  # the last group holds lengths i-1 .. j-1
            count += len(members[lengths[i - 1]])
            cost = best[i - 1] + count * lengths[j - 1] * block_size + cost_per_group
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    groups, j = [], len(lengths)
    while j > 0:
        groups.append(sorted(i for n in lengths[cut[j] : j] for i in members[n]))
        j = cut[j]
    return groups[::-1]


class PagedBatch:
    """The `kv_cache` handed to the model for one packed forward pass.

    slot_mapping [N]: the slot each new token's K/V is written to.
    Sequences with one new token (decode steps) attend in groups of similar context length,
    each group at once, reading whole blocks through a [b, max_blocks] table padded to its
    longest member (`group_by_length`: one padded batch would make a 40-token sequence read
    as many keys as a 400-token one); sequences with several (prefills) attend one by one
    through `gather_kv`. A batch may mix both (a prefill joining running decodes).
    """

    # What a decode group costs beyond its keys, in key positions: about the calls of one
    # group and layer (~75 us) over the time per attended key position (~90 ns) on a 2-core CPU.
    DECODE_GROUP_COST = 1024

    def __init__(
        self,
        store: PagedKVStore,
        slices: list[SequenceSlice],
        slot_mapping: torch.Tensor,
        sliding_window: int | None = None,
        attention_fn=None,
    ):
        self.store, self.slices, self.slot_mapping = store, slices, slot_mapping
        self.sliding_window = sliding_window
        if attention_fn is not None and sliding_window is not None:
            raise ValueError(
                f"an attention hook attends over every held token; this model has a sliding window of {sliding_window}"
            )
        self.attention_fn = attention_fn  # None: the library's attention below
        self.decode_slices = [s for s in slices if s.q_len == 1]
        self.prefill_slices = [s for s in slices if s.q_len > 1]
        self.decode_only = not self.prefill_slices
        self._decode_groups: list[DecodeGroup] | None = None  # decode_groups, built on first ask
        self._decode_tables = None  # decode_tables(), likewise

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        """The decode sequences in groups of similar context length (`group_by_length`), built on the
        first attention call: a step that `model.q4_stack` runs in one C call never needs them."""
        if self._decode_groups is None:
            block_size = self.store.block_size
            needed = [blocks_needed(s.context_len, block_size) for s in self.decode_slices]
            members = group_by_length(needed, block_size, self.DECODE_GROUP_COST) if needed else []
            device = self.slot_mapping.device
            self._decode_groups = [self.decode_group([self.decode_slices[i] for i in m], device) for m in members]
        return self._decode_groups

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a step of decodes only with the library's attention: (tables [B, max_blocks] of block
        ids, padded with 0; lengths [B], each sequence's context with its new token; slots [B], where
        its new K/V go), int64, sequences in row order; None otherwise (a prefill in the batch, an
        attention hook). What `model.q4_stack.Q4Backbone` needs to run the whole step in one C call;
        built once per batch."""
        if not self.decode_only or self.attention_fn is not None or not self.decode_slices:
            return None
        if self._decode_tables is None:
            block_size = self.store.block_size
            slices = sorted(self.decode_slices, key=lambda s: s.q_start)
            if [s.q_start for s in slices] != list(range(len(slices))):
                return None
            used = [s.block_table[: blocks_needed(s.context_len, block_size)] for s in slices]
            tables = torch.zeros(len(slices), max(len(blocks) for blocks in used), dtype=torch.int64)
            for row, blocks in enumerate(used):
                tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
            lengths = torch.tensor([s.context_len for s in slices], dtype=torch.int64)
            self._decode_tables = (tables, lengths, self.slot_mapping.to(torch.int64).contiguous())
        return self._decode_tables

    def decode_group(self, slices: list[SequenceSlice], device) -> DecodeGroup:
        """The DecodeGroup of these decode slices (tables, mask and rows built once per step)."""
        block_size = self.store.block_size
        max_blocks = max(blocks_needed(s.context_len, block_size) for s in slices)
        tables = torch.zeros(len(slices), max_blocks, dtype=torch.long)
        for i, s in enumerate(slices):
            used = s.block_table[: blocks_needed(s.context_len, block_size)]
            tables[i, : len(used)] = torch.tensor(used, dtype=torch.long)
        lengths = torch.tensor([s.context_len for s in slices])
        key_pos = torch.arange(max_blocks * block_size)
        valid = key_pos[None, :] < lengths[:, None]  # [b, S]
        if self.sliding_window is not None:
            valid &= key_pos[None, :] >= (lengths[:, None] - self.sliding_window)
        additive = torch.zeros(valid.shape, dtype=self.store.keys.dtype).masked_fill_(~valid, float("-inf"))
        return DecodeGroup(
            rows=torch.tensor([s.q_start for s in slices], device=device),
            blocks=tables.to(device),
            lengths=lengths.to(device),
            mask=additive[:, None, None, :].to(device),
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, H, N, D], k/v [1, H_kv, N, D] for the N packed new tokens -> [1, H, N, D]."""
        if self.attention_fn is not None:
            return self._attend_through_hook(layer, q, k, v)
        flat_k, flat_v = self.store.flat(layer)
        flat_k[self.slot_mapping] = k[0].transpose(0, 1)  # [N, H_kv, D] into their slots
        flat_v[self.slot_mapping] = v[0].transpose(0, 1)
        if self.decode_only and len(self.decode_groups) == 1:  # rows 0 .. B-1 in order
            return self._attend_decode(layer, q, self.decode_groups[0])
        out = torch.empty_like(q)
        for group in self.decode_groups:
            out[:, :, group.rows] = self._attend_decode(layer, q[:, :, group.rows], group)
        for s in self.prefill_slices:
            k_ctx = gather_kv(flat_k, s.block_table, s.context_len, self.store.block_size)[
                None
            ]  # [1, H_kv, context, D]
            v_ctx = gather_kv(flat_v, s.block_table, s.context_len, self.store.block_size)[None]
            q_seq = q[:, :, s.q_start : s.q_start + s.q_len]
            out[:, :, s.q_start : s.q_start + s.q_len] = causal_attention(
                q_seq, k_ctx, v_ctx, q_offset=s.context_len - s.q_len, sliding_window=self.sliding_window
            )
        return out

    def _attend_decode(self, layer: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """q [1, H, b, D]: the one new token of each sequence in `group` -> [1, H, b, D].

        Float32 on a CPU whose C kernels load: one call of `paged_decode_kernel`, which reads the
        keys and values through the block tables where they lie. Otherwise whole blocks are gathered
        ([b * max_blocks, block_size, H_kv, D]: one index per block, not per token, so the copy moves
        long contiguous rows). The query heads sharing a KV
        head are folded into the query-length axis, q [b, H_kv, group size, D], so each KV head
        is read once, not copied per query head (no repeat_kv), and the padding mask broadcasts."""
        batch, num_heads, head_dim = q.shape[2], q.shape[1], q.shape[3]
        keys, values = self.store.keys[layer], self.store.values[layer]  # [num_blocks, block_size, H_kv, D]
        if paged_decode_kernel.runs_here(q, keys):  # one C call, straight through the tables
            out = paged_decode_kernel.paged_decode_attention(
                q[0].transpose(0, 1), keys, values, group.blocks, group.lengths, self.sliding_window
            )  # [b, H, D]
            return out.transpose(0, 1)[None]  # [1, H, b, D]
        num_kv_heads = self.store.num_kv_heads
        context = group.blocks.shape[1] * self.store.block_size
        blocks = group.blocks.view(-1)  # index_select: ~2-3x faster than keys[table] on CPU
        k_ctx = keys.index_select(0, blocks)  # [b * max_blocks, block_size, H_kv, D]
        v_ctx = values.index_select(0, blocks)
        k_ctx = k_ctx.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)  # [b, H_kv, S, D]
        v_ctx = v_ctx.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
        q_b = q[0].transpose(0, 1).reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        with one_thread_if_small(batch * num_heads * context * head_dim, ATTENTION_ONE_THREAD_BELOW, q.device):
            out = F.scaled_dot_product_attention(q_b, k_ctx, v_ctx, attn_mask=group.mask)
        return out.reshape(batch, num_heads, head_dim).transpose(0, 1)[None]  # [1, H, b, D]

    def _attend_through_hook(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention hook, one sequence at a time: q [1, H, N, D], k/v [1, H_kv, N, D] -> [1, H, N, D]."""
        out = torch.empty_like(q)
        for s in self.slices:
            rows = slice(s.q_start, s.q_start + s.q_len)
            cache = PagedSequenceCache(self, s)
            out[:, :, rows] = self.attention_fn(cache, layer, q[:, :, rows], k[:, :, rows], v[:, :, rows])
        return out


class PagedSequenceCache:
    """One sequence of a `PagedBatch`, seen as a cache with `KVCache.append`'s interface, for an
    attention hook written against a contiguous cache."""

    def __init__(self, batch: PagedBatch, seq: SequenceSlice):
        self.batch, self.seq = batch, seq
        self.seq_len = seq.context_len - seq.q_len  # tokens held before this step's

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the sequence's new k, v [1, H_kv, q_len, D] in its slots; return everything it holds
        in this layer, [1, H_kv, context_len, D] each, in token order."""
        s, store = self.seq, self.batch.store
        if k.shape[0] != 1 or k.shape[2] != s.q_len:
            raise ValueError(
                f"append got k of shape {list(k.shape)}; this sequence has {s.q_len} new tokens "
                f"(expected [1, H_kv, {s.q_len}, D])"
            )
        flat_k, flat_v = store.flat(layer)
        slots = self.batch.slot_mapping[s.q_start : s.q_start + s.q_len]
        flat_k[slots] = k[0].transpose(0, 1)  # [q_len, H_kv, D] into their slots
        flat_v[slots] = v[0].transpose(0, 1)
        return (
            gather_kv(flat_k, s.block_table, s.context_len, store.block_size)[None],
            gather_kv(flat_v, s.block_table, s.context_len, store.block_size)[None],
        )

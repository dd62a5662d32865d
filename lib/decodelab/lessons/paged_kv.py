"""A decode batch's attention, read straight through its block tables (notebook 07).

In a decode step every running sequence brings one new token, and that token's queries attend
over everything the sequence holds in the pool. `paged_decode_attention` does it for the whole
batch in a handful of tensor operations: the block tables padded into one [B, max_blocks]
tensor, the blocks of every sequence gathered by one indexing operation, the positions past
each context length masked, the query heads grouped under the KV head they share (no copy of
K or V per query head), and the softmax in float32. `per_sequence_decode_attention` gives the
same result one sequence at a time (`gather_kv`, then the causal attention): the loop that the
batched version replaces. The engine's decode step (`PagedBatch._attend_decode`) does the
batched work with SDPA instead of explicit products: SDPA reads the gathered keys where they lie,
while the products here first copy them into head-major order, so on a CPU the engine's way is
about as fast on short contexts and faster the longer they get.

Layouts:
    q             [B, H, D]                           one new token per sequence
    key_cache     [num_blocks, block_size, H_kv, D]   one layer of the pool (PagedKVStore.keys[layer])
    value_cache   [num_blocks, block_size, H_kv, D]
    block_tables  B lists of block ids, or a [B, max_blocks] integer tensor padded with -1
    context_lens  [B], a list or a tensor: the tokens sequence b attends over
Query head h reads KV head h // (H / H_kv), the library's grouping (`model.attention`).
"""

from __future__ import annotations

import math
import time

import torch

from decodelab.engine.block_allocator import blocks_needed
from decodelab.engine.paged_attention import gather_kv
from decodelab.lessons.measure import median
from decodelab.model.attention import causal_attention


def paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables, context_lens
) -> torch.Tensor:
    """Decode attention of a batch, one new token per sequence, read through the block tables.

    q [B, H, D]: each sequence's newest token (its K/V already written to the pool).
    key_cache, value_cache [num_blocks, block_size, H_kv, D]: one layer of the pool.
    block_tables: B lists of block ids, or a [B, max_blocks] integer tensor padded with -1.
    context_lens [B] (list or tensor): sequence b attends over its tokens 0 .. context_lens[b] - 1.
    Returns [B, H, D] in q's dtype; query head h reads KV head h // (H / H_kv); scores and
    softmax in float32. Raises ValueError when H is not a multiple of H_kv, when the tables or
    lengths do not match the batch, when a block id is not in the pool, or when a context
    length is below 1 or beyond its blocks.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"the {num_heads} query heads must be a multiple of the {num_kv_heads} KV heads")
    if isinstance(block_tables, torch.Tensor):
        tables = block_tables.to(device=q.device, dtype=torch.long)
    else:  # ragged lists: pad each with -1 to the longest
        width = max(len(table) for table in block_tables)
        tables = torch.tensor(
            [list(table) + [-1] * (width - len(table)) for table in block_tables], dtype=torch.long, device=q.device
        )
    lengths = torch.as_tensor(context_lens, dtype=torch.long, device=q.device)  # [B]
    if tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(
            f"q holds {batch} sequences; got {tables.shape[0]} block tables and {lengths.numel()} context lengths"
        )
    if tables.numel() and (tables.min() < -1 or tables.max() >= num_blocks):
        raise ValueError(f"block ids must lie in 0 .. {num_blocks - 1} (-1: padding), got {tables.tolist()}")
    held = (tables >= 0).sum(dim=1) * block_size  # [B]: the slots of each table's blocks
    if (lengths < 1).any() or (lengths > held).any():
        raise ValueError(
            f"context_lens {lengths.tolist()} must each lie in 1 .. the slots of their table's blocks, {held.tolist()}"
        )
    context = tables.shape[1] * block_size  # S: every sequence padded to the longest table
    blocks = tables.clamp(min=0).reshape(-1)  # padding reads block 0; the mask drops it
    keys = key_cache.index_select(0, blocks).view(batch, context, num_kv_heads, head_dim)  # one gather for all
    values = value_cache.index_select(0, blocks).view(batch, context, num_kv_heads, head_dim)
    keys, values = (t.transpose(1, 2).float() for t in (keys, values))  # [B, H_kv, S, D]
    q_grouped = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, H_kv, G, D]
    scores = q_grouped @ keys.transpose(-1, -2) / math.sqrt(head_dim)  # [B, H_kv, G, S]
    valid = torch.arange(context, device=q.device) < lengths[:, None]  # [B, S]
    weights = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
    return (weights @ values).reshape(batch, num_heads, head_dim).to(q.dtype)  # [B, H, D]


def per_sequence_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables, context_lens, gather=gather_kv
) -> torch.Tensor:
    """The same result as `paged_decode_attention`, one sequence at a time: its keys and values
    gathered in token order (`gather`, with `gather_kv`'s signature), then the causal attention of
    its one query. The same arguments (tables as lists or a padded tensor); returns [B, H, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)  # one row per slot
    flat_v = value_cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    tables = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else block_tables
    lengths = context_lens.tolist() if isinstance(context_lens, torch.Tensor) else context_lens
    out = torch.empty_like(q)
    for b, (table, length) in enumerate(zip(tables, lengths)):
        used = table[: blocks_needed(length, block_size)]  # padding, if any, lies past the context
        k = gather(flat_k, used, length, block_size)[None]  # [1, H_kv, length, D]
        v = gather(flat_v, used, length, block_size)[None]
        out[b] = causal_attention(q[b, :, None][None], k, v, q_offset=length - 1)[0, :, 0]
    return out


def random_paged_batch(
    context_lens: list[int],
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    spare_blocks: int = 3,
    seed: int = 0,
    device="cpu",
    dtype=torch.float32,
) -> dict[str, torch.Tensor]:
    """A decode batch over a shuffled KV pool: the keyword arguments of `paged_decode_attention`
    (and of notebook 12's `gpu_kernel.paged_attention`).

    Every slot of the pool holds random numbers (stale data included, as in a real pool), each
    sequence's blocks are distinct physical blocks in a random order, and block_tables is padded
    with the ids of other blocks of the pool, other sequences' or free ones (the attention must stop
    at the context length). spare_blocks: blocks nobody owns. Returns q [B, H, D], key_cache and
    value_cache [num_blocks, block_size, H_kv, D], block_tables [B, max_blocks] int32, context_lens [B] int32.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [blocks_needed(n, block_size) for n in context_lens]
    num_blocks, max_blocks = sum(needed) + spare_blocks, max(needed)
    order = torch.randperm(num_blocks, generator=gen)
    tables, start = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32), 0
    for b, n in enumerate(needed):
        tables[b] = order[torch.arange(start, start + max_blocks) % num_blocks].to(torch.int32)
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return {
        "q": torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(device, dtype),
        "key_cache": torch.randn(*shape, generator=gen).to(device, dtype),
        "value_cache": torch.randn(*shape, generator=gen).to(device, dtype),
        "block_tables": tables.to(device),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
    }


def time_side_by_side(attentions: dict, batch: dict, rounds: int = 21) -> dict[str, float]:
    """Median seconds per call of each attention (name -> fn(**batch)) on the same batch, CPU.
    The calls alternate round by round, so that a busy machine slows them all alike."""
    for fn in attentions.values():  # warm up: first calls allocate
        fn(**batch)
    times: dict[str, list[float]] = {name: [] for name in attentions}
    for _ in range(rounds):
        for name, fn in attentions.items():
            start = time.perf_counter()
            fn(**batch)
            times[name].append(time.perf_counter() - start)
    return {name: median(values) for name, values in times.items()}


__all__ = ["paged_decode_attention", "per_sequence_decode_attention", "random_paged_batch", "time_side_by_side"]

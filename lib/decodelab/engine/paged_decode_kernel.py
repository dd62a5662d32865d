"""The engine's decode attention in one C call per layer: `csrc/paged_decode.c`, read straight
through the block tables (no gathered copy of the blocks, no padding mask).

`PagedBatch` (`engine.paged_attention`) calls `paged_decode_attention` for a decode group when
`runs_here` says the C library holds it: float32 on a CPU whose kernels load (`model.q4_kernel`,
the same library as the GGUF products), and not while torch.compile traces. Elsewhere its torch path
(gather the blocks, SDPA with a mask) runs. Both give the same numbers to float32 rounding
(tests/test_paged_attention.py); `python bench/decode_layers.py` times them side by side.
"""

from __future__ import annotations

import torch

from decodelab.model import q4_kernel, thread_team
from decodelab.model.attention import ATTENTION_ONE_THREAD_BELOW  # SDPA's one-thread threshold, reused here


def runs_here(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Can `paged_decode_attention` take queries `q` over the pool `keys`? Float32 on the CPU, no
    autograd, not inside torch.compile, and the C kernels load here."""
    if q.dtype != torch.float32 or keys.dtype != torch.float32 or not q.is_cpu or not keys.is_cpu:
        return False
    if torch.compiler.is_compiling() or (q.requires_grad and torch.is_grad_enabled()):
        return False
    return q4_kernel.kernel_loads()


def paged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Each sequence's one new query over its paged keys and values, as SDPA would give it.

    q [B, H, D] float32; keys, values [num_blocks, block_size, H_kv, D] float32 (one layer's pool,
    contiguous); tables [B, max_blocks] int64 (block ids, padding ignored); lengths [B] int64 (the
    keys each sequence attends to, the new one included, 1 <= length <= max_blocks * block_size);
    window: a sliding window's size, or None. Returns out [B, H, D]. `runs_here` must hold.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = keys.shape
    max_blocks = tables.shape[1]
    q = q.contiguous()
    tables, lengths = tables.contiguous(), lengths.contiguous()
    work = batch * num_heads * max_blocks * block_size * head_dim  # the padded context bounds the longest
    # one thread below SDPA's threshold while OpenMP's team sleeps (bench/attention_threads.py measured it)
    threads = thread_team.threads_for(work, ATTENTION_ONE_THREAD_BELOW)
    out = torch.empty_like(q)
    scratch = torch.empty(threads, max_blocks * block_size, dtype=torch.float32)
    pointers = [tensor.data_ptr() for tensor in (q, keys, values, tables, lengths, out)]
    q4_kernel.kernel().paged_decode_attention(
        *pointers,
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_blocks,
        window or 0,
        head_dim**-0.5,
        scratch.data_ptr(),
        threads,
    )
    return out

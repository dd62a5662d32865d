"""Paged decode attention as a Triton kernel: one program reads its KV blocks in place.

The engine's decode attention (`decodelab.engine.paged_attention`) first *gathers* each
sequence's blocks into a contiguous copy, then runs SDPA on the copy: every key and value is
read, written and read again. A paged attention kernel (vLLM's, 2023) reads the blocks where
they lie, through the block table, and never builds the copy. Here it is in Triton, with
FlashAttention's online softmax (notebook 11) over the blocks:

* one **program** per (sequence, KV head): grid (B, H_kv);
* it loads the G = H / H_kv query heads that share its KV head (grouped-query attention by
  indexing: heads kv * G .. kv * G + G - 1) as one [G, D] tile, padded to a power of two;
* for each logical block j of its sequence it looks up the physical block block_tables[b, j],
  loads that block's keys and values [BLOCK_SIZE, D], masks the slots past the context length
  (the last block is partly empty), and folds the scores into the running max, sum and output.

Layouts (all contiguous, as the launchers require):
    q            [B, H, D]                            one new token per sequence
    key_cache    [num_blocks, BLOCK_SIZE, H_kv, D]    one layer of the engine's KV pool
    value_cache  [num_blocks, BLOCK_SIZE, H_kv, D]
    block_tables [B, max_blocks] int32                physical block of each logical block
    context_lens [B] int32                            tokens each sequence attends over (>= 1)
    out          [B, H, D]

Element (block, slot, head, d) of a cache lives at ((block * BLOCK_SIZE + slot) * H_kv + head)
* D + d. On a machine without CUDA the kernels run under Triton's interpreter
(TRITON_INTERPRET=1, set by `use_interpreter_without_gpu` before triton is imported): the same
kernel source, executed by NumPy one program at a time: right answers, no speed.
Importing this module without triton installed works; launching a kernel then raises ImportError.
"""

from __future__ import annotations  # "tl.constexpr" stays a string: the kernels can be defined without triton

import math
import os

import torch
import torch.nn.functional as F

from decodelab.lessons.paged_kv import (  # the latter re-exported (__all__)
    per_sequence_decode_attention,
    random_paged_batch,
)


def use_interpreter_without_gpu() -> str:
    """Run Triton kernels under its interpreter when no CUDA device is present; returns the mode.

    Sets TRITON_INTERPRET=1 (Triton reads it when a kernel is defined) unless CUDA is available
    or the variable is already set. Returns "compiled" or "interpreter". Call it before the
    first @triton.jit: kernels defined earlier keep the mode they were defined in.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return "interpreter" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "compiled"


MODE = use_interpreter_without_gpu()

try:
    import triton
    import triton.language as tl
except ImportError:  # a platform without triton wheels: the module imports, launching says why
    triton = tl = None

jit = triton.jit if triton is not None else (lambda fn: fn)


def _let_the_interpreter_index_with_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with int() of a one-element array,
    which NumPy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by the same squeeze):
    `for j in range(tl.cdiv(n, BLOCK))` would fail on CPU. Patch that one attribute, nothing else."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1))
        return  # NumPy < 2.4: nothing to fix
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor
    if getattr(original, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if triton is not None and MODE == "interpreter":
    _let_the_interpreter_index_with_numpy_2_4()


def require_triton() -> None:
    """Raise ImportError with the fix when triton is not installed."""
    if triton is None:
        raise ImportError(
            "triton is not installed: `pip install triton==3.6.0` (Linux), or "
            "`pip install -e '.[course]'`; the GPU kernel notebook needs it"
        )


# --------------------------------------------------------------------------- the kernels


@jit
def gather_kv_kernel(
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    num_kv_heads,
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Program (b, h) copies KV head h of sequence b, block by block, into out[b, h] in token order.

    cache [num_blocks, BLOCK_SIZE, H_kv, D]; block_tables [B, max_blocks]; context_lens [B];
    out [B, H_kv, max_blocks * BLOCK_SIZE, D], zeros on entry: rows at or past context_lens[b]
    must stay zero (the last block's tail holds stale slots: load and store it masked).
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    slots = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    dims = tl.arange(0, HEAD_DIM)  # [D]
    out_row = (seq * num_kv_heads + head) * max_blocks * BLOCK_SIZE  # out[seq, head, 0, 0] / D
    for j in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + j)  # the physical block of logical block j
        positions = j * BLOCK_SIZE + slots  # token positions in the sequence
        valid = positions < context_len
        src = ((block * BLOCK_SIZE + slots)[:, None] * num_kv_heads + head) * HEAD_DIM + dims[None, :]
        rows = tl.load(cache_ptr + src, mask=valid[:, None], other=0.0)  # [BLOCK_SIZE, D]
        dst = (out_row + positions)[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + dst, rows, mask=valid[:, None])


@jit
def paged_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    num_kv_heads,
    max_blocks,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
):
    """Program (b, kv) attends the GROUP query heads of KV head kv of sequence b over its blocks.

    q, out [B, H, D] with H = num_kv_heads * GROUP; caches [num_blocks, BLOCK_SIZE, H_kv, D];
    block_tables [B, max_blocks]; context_lens [B] (>= 1); scale: 1 / sqrt(D) usually.
    GROUP_PAD: GROUP rounded up to a power of two (tl.arange needs one); the padding heads are
    masked. Online softmax in float32: running max m [G], sum l [G], output acc [G, D].
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = tl.arange(0, GROUP_PAD)  # [G]
    heads = kv_head * GROUP + group  # the query heads that read this KV head
    head_ok = group < GROUP
    dims = tl.arange(0, HEAD_DIM)  # [D]
    slots = tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    q_offsets = (seq * num_kv_heads * GROUP + heads)[:, None] * HEAD_DIM + dims[None, :]  # [G, D]
    q = tl.load(q_ptr + q_offsets, mask=head_ok[:, None], other=0.0).to(tl.float32)
    context_len = tl.load(context_lens_ptr + seq)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741 - the paper's name
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + j)
        valid = j * BLOCK_SIZE + slots < context_len  # [BLOCK_SIZE]: the last block may be partly empty
        kv_offsets = ((block * BLOCK_SIZE + slots)[:, None] * num_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_SIZE, D]
        v = tl.load(value_cache_ptr + kv_offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK_SIZE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: every block read holds a valid slot
        rescale = tl.exp(m - m_new)  # exp(old max - new max), 0 on the first block
        p = tl.exp(scores - m_new[:, None])  # [G, BLOCK_SIZE]
        l = l * rescale + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


# --------------------------------------------------------------------------- launching


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), with the errors a learner can act on: a function without
    @triton.jit is named; under the interpreter an exception raised inside the kernel comes out as
    itself (Triton wraps it in an InterpreterError); compiled, a kernel whose body still raises
    NotImplementedError (an unwritten stub, which Triton cannot compile) raises NotImplementedError."""
    require_triton()
    if not hasattr(kernel, "__getitem__"):
        raise TypeError(
            f"{getattr(kernel, '__name__', kernel)} is not a Triton kernel: put @triton.jit on the line above its def"
        )
    if interpreter_active() and type(tl.cdiv).__name__ == "JITFunction":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its own functions (tl.cdiv) "
            "are compiled ones the interpreter cannot call: restart the kernel and import "
            "decodelab.lessons.gpu_kernel (or run the set-up cell) before anything imports triton"
        )
    try:
        kernel[grid](*args, **kwargs)
    except Exception as exc:
        cause = exc.__cause__
        if type(exc).__name__ == "InterpreterError" and isinstance(cause, Exception):
            raise cause from None
        from triton.compiler.errors import CompilationError

        if isinstance(exc, CompilationError) and "raise NotImplementedError" in getattr(kernel, "src", ""):
            raise NotImplementedError(
                f"{kernel.__name__} is not written yet: its body still raises NotImplementedError"
            ) from None
        raise


def check_paged_inputs(
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    value_cache: torch.Tensor | None = None,
) -> None:
    """ValueError naming the problem unless the shapes and values fit the layouts above."""
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, H_kv, D], got shape {list(key_cache.shape)}")
    if value_cache is not None and value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {list(value_cache.shape)} must have key_cache's shape {list(key_cache.shape)}")
    num_blocks, block_size, _, head_dim = key_cache.shape
    for name, size in (("block_size", block_size), ("head dimension D", head_dim)):
        if size & (size - 1):
            raise ValueError(f"{name} must be a power of two (tl.arange needs one), got {size}")
    if block_tables.dim() != 2 or context_lens.shape != (block_tables.shape[0],):
        raise ValueError(
            f"block_tables must be [B, max_blocks] and context_lens [B], got "
            f"{list(block_tables.shape)} and {list(context_lens.shape)}"
        )
    if block_tables.is_floating_point() or context_lens.is_floating_point():
        raise ValueError("block_tables and context_lens must hold integers")
    capacity = block_tables.shape[1] * block_size
    if len(context_lens) and (int(context_lens.min()) < 1 or int(context_lens.max()) > capacity):
        raise ValueError(
            f"context_lens must lie in 1 .. {capacity} (max_blocks x block_size), got {context_lens.tolist()}"
        )
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks):
        raise ValueError(f"block_tables must hold block ids in 0 .. {num_blocks - 1}")


def gather_kv_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, kernel=None
) -> torch.Tensor:
    """One layer's keys (or values) of every sequence, in token order, by a Triton kernel.

    cache [num_blocks, block_size, H_kv, D], block_tables [B, max_blocks], context_lens [B] ->
    [B, H_kv, max_blocks * block_size, D]: row i of out[b, h] is token i's vector for i below
    context_lens[b], zero after. kernel: a kernel with `gather_kv_kernel`'s signature (None: it).
    """
    require_triton()
    check_paged_inputs(cache, block_tables, context_lens)
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    batch, max_blocks = block_tables.shape
    out = torch.zeros(batch, num_kv_heads, max_blocks * block_size, head_dim, dtype=cache.dtype, device=cache.device)
    launch(
        kernel or gather_kv_kernel,
        (batch, num_kv_heads),
        cache.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
        out,
        num_kv_heads,
        max_blocks,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )
    return out


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kernel=None,
) -> torch.Tensor:
    """Decode attention of q [B, H, D] over each sequence's cached keys and values, read in place
    through its block table by one Triton program per (sequence, KV head); returns [B, H, D].

    key_cache, value_cache [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks];
    context_lens [B], each in 1 .. max_blocks * block_size. H must be a multiple of H_kv; D
    and block_size powers of two. kernel: one with `paged_attention_kernel`'s signature (None: it).
    Raises ValueError on shapes that do not fit.
    """
    check_paged_inputs(key_cache, block_tables, context_lens, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    require_triton()
    if q.dim() != 3 or q.shape[0] != block_tables.shape[0] or q.shape[2] != head_dim:
        raise ValueError(f"q must be [B, H, D] = [{block_tables.shape[0]}, H, {head_dim}], got {list(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"the {q.shape[1]} query heads must be a multiple of the {num_kv_heads} KV heads")
    batch, group = q.shape[0], q.shape[1] // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    launch(
        kernel or paged_attention_kernel,
        (batch, num_kv_heads),
        q,
        key_cache.contiguous(),
        value_cache.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
        out,
        1.0 / math.sqrt(head_dim),
        num_kv_heads,
        block_tables.shape[1],
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
    )
    return out


# --------------------------------------------------------------------------- the oracles: gather, then SDPA


def sdpa_by_gather(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """The engine's way, one sequence at a time: `gather_kv` through the block table, then SDPA
    (`causal_attention` with grouped heads). Same arguments and result as `paged_attention`."""
    check_paged_inputs(key_cache, block_tables, context_lens, value_cache)
    return per_sequence_decode_attention(q, key_cache, value_cache, block_tables, context_lens)


def batched_sdpa_by_gather(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Gather + SDPA for the whole batch at once, as the engine's decode step does it
    (`PagedBatch._attend_decode`): whole blocks copied into a [B, H_kv, max_blocks * block_size, D]
    batch, the padding masked, the query heads of a KV head folded into SDPA's query axis. The
    baseline the Triton kernel is timed against. Same arguments and result as `paged_attention`."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    max_blocks = block_tables.shape[1]
    context = max_blocks * block_size
    blocks = block_tables.reshape(-1).long()
    k = (
        key_cache.index_select(0, blocks).view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    )  # [B, H_kv, S, D]
    v = value_cache.index_select(0, blocks).view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(context, device=q.device)[None, :] < context_lens.to(q.device)[:, None]  # [B, S]
    mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, float("-inf"))
    q_grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, H_kv, G, D]
    out = F.scaled_dot_product_attention(q_grouped, k, v, attn_mask=mask[:, None, None, :])
    return out.reshape(batch, num_heads, head_dim)


# --------------------------------------------------------------------------- inputs and measurement


def kv_bytes_read(context_lens, num_kv_heads: int, head_dim: int, bytes_per_value: float) -> float:
    """Bytes of keys and values one decode attention must read at least: 2 x tokens x H_kv x D x bytes."""
    return 2 * float(sum(int(n) for n in context_lens)) * num_kv_heads * head_dim * bytes_per_value


def time_against_gather(
    attentions: dict,
    context_lengths: list[int],
    batch_size: int = 32,
    device="cuda",
    dtype=torch.bfloat16,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    repeats: int = 20,
) -> dict[str, list[dict]]:
    """Median time of each attention (name -> fn(**batch), e.g. `paged_attention` and
    `batched_sdpa_by_gather`) on a decode batch of batch_size sequences of each context length;
    returns name -> [{"context": n, "ms": ..., "bytes_per_s": KV bytes read / time}] in order.
    SmolLM2's heads by default; every function sees the same batch."""
    from decodelab.lessons.measure import median, time_call

    results: dict[str, list[dict]] = {name: [] for name in attentions}
    for n in context_lengths:
        batch = random_paged_batch(
            [n] * batch_size, num_heads, num_kv_heads, head_dim, block_size, device=device, dtype=dtype
        )
        kv_bytes = kv_bytes_read(batch["context_lens"].tolist(), num_kv_heads, head_dim, batch["q"].element_size())
        for name, fn in attentions.items():
            seconds = median(time_call(lambda: fn(**batch), device=device, repeats=repeats, warmup=3))
            results[name].append({"context": n, "ms": seconds * 1e3, "bytes_per_s": kv_bytes / seconds})
    return results


def interpreter_active() -> bool:
    """True when the kernels of this module were defined under Triton's interpreter."""
    return triton is not None and type(paged_attention_kernel).__name__ == "InterpretedFunction"


__all__ = [
    "use_interpreter_without_gpu",
    "MODE",
    "require_triton",
    "gather_kv_kernel",
    "paged_attention_kernel",
    "launch",
    "check_paged_inputs",
    "gather_kv_blocks",
    "paged_attention",
    "sdpa_by_gather",
    "batched_sdpa_by_gather",
    "random_paged_batch",
    "kv_bytes_read",
    "time_against_gather",
    "interpreter_active",
]

"""Checks for the bonus notebook 12, your first GPU kernel: `gather_kv_kernel`,
`paged_attention_kernel` (Triton kernels) and `paged_attention` (their launcher).

Every ``check_*`` takes the object under test and either returns None or raises
``AssertionError`` whose message gives the case, the expected and the actual result. A kernel is
launched here as the notebook documents it, ``kernel[(B, H_kv)](...)`` with its arguments in
order; on a machine without CUDA it runs under Triton's interpreter (TRITON_INTERPRET=1), which
wraps what a kernel raises in an InterpreterError: the check unwraps it, so an unfinished stub
reads "<kernel> is not written yet".

The expected results never come from `decodelab`: they follow from the definitions, in float64,
reading the pool with Python indexing: token i of sequence b lives in slot i % block_size of block
block_tables[b, i // block_size]; query head h reads KV head h // (H / H_kv); decode attention is
softmax(q.k / sqrt(D)) @ V over the context_lens[b] tokens. The pools hold random numbers in every
slot (stale data included) and the block tables are shuffled, so reading the wrong block or the
tail of the last block shows.
"""

from __future__ import annotations

import math

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, failure
from decodelab.course.exercises import references

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("12_gpu_kernel")

__all__ = ["check_gather_kv_kernel", "check_paged_attention_kernel", "check_paged_attention"]


def _batch(context_lens, num_heads, num_kv_heads, head_dim, block_size, seed, grow=False, dtype=torch.float32):
    """A decode batch over a shuffled pool of random numbers; grow=True moves the keys of logical
    block j by 6j along the query of their KV head's first query head, so each block brings a
    larger max score than the last."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks, max_blocks = sum(needed) + 2, max(needed)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:  # own blocks first, then other sequences' blocks as padding (never read)
        tables.append([order[(start + j) % num_blocks] for j in range(max_blocks)])
        start += n
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen)
    keys = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    group = num_heads // num_kv_heads
    if grow:
        for b, (table, n) in enumerate(zip(tables, needed)):
            for j in range(n):
                for h in range(num_kv_heads):
                    keys[table[j], :, h] += 6 * j * q[b, h * group] / q[b, h * group].norm()
    return {
        "q": q.to(dtype),
        "key_cache": keys.to(dtype),
        "value_cache": torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype),
        "block_tables": torch.tensor(tables, dtype=torch.int32),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32),
    }


def _tokens(cache, table, length, block_size) -> torch.Tensor:
    """[length, H_kv, D]: a sequence's cached vectors in token order, from the definition."""
    return torch.stack([cache[table[i // block_size], i % block_size] for i in range(length)])


def _expected_attention(batch, lengths=None, tables=None) -> torch.Tensor:
    """[B, H, D] float64 decode attention from the definition (lengths / tables: to name a bug)."""
    q, kc, vc = batch["q"].double(), batch["key_cache"].double(), batch["value_cache"].double()
    lengths = lengths or batch["context_lens"].tolist()
    tables = tables or batch["block_tables"].tolist()
    block_size, group = kc.shape[1], q.shape[1] // kc.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, (table, n) in enumerate(zip(tables, lengths)):
        k, v = _tokens(kc, table, n, block_size), _tokens(vc, table, n, block_size)  # [n, H_kv, D]
        for h in range(q.shape[1]):
            weights = torch.softmax(k[:, h // group] @ q[b, h] / math.sqrt(q.shape[2]), dim=0)  # [n]
            out[b, h] = weights @ v[:, h // group]
    return out


def _describe(batch) -> str:
    b, h, d = batch["q"].shape
    num_blocks, block_size, h_kv, _ = batch["key_cache"].shape
    return (
        f"B={b} sequences with context_lens {batch['context_lens'].tolist()}, {h} query heads over {h_kv} KV "
        f"heads, D={d}, block_size={block_size}, a pool of {num_blocks} blocks, block_tables "
        f"{batch['block_tables'].tolist()}"
    )


def _launch(what: str, kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](...), whatever it raises reported as the learner's (the interpreter's wrapper removed)."""
    if not hasattr(kernel, "__getitem__"):
        raise AssertionError(
            f"{what}: {getattr(kernel, '__name__', kernel)!s} is not a Triton kernel (kernel[grid] "
            f"fails): put @triton.jit on the line above its def"
        )
    try:
        kernel[grid](*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any exception of the code under test fails the check
        cause = exc.__cause__ if type(exc).__name__ == "InterpreterError" else None
        raise failure(what, cause if isinstance(cause, Exception) else exc) from None


def _first_bad(got: torch.Tensor, want: torch.Tensor, tol: float):
    err = (got.double() - want).abs().nan_to_num(nan=math.inf)
    if err.numel() == 0 or err.max() <= tol:
        return None
    return tuple(int(i) for i in (err == err.max()).nonzero()[0])


def _hint(got: torch.Tensor, batch, tol: float) -> str:
    """Name a known bug when the result matches what it computes."""
    block_size = batch["key_cache"].shape[1]
    lengths = batch["context_lens"].tolist()
    whole = [-(-n // block_size) * block_size for n in lengths]
    if whole != lengths and _first_bad(got, _expected_attention(batch, lengths=whole), tol) is None:
        return (
            " (this is attention over whole blocks: the slots of the last block past the context length "
            "were attended to; mask them, in tl.load and in the scores)"
        )
    logical = [list(range(len(t))) for t in batch["block_tables"].tolist()]
    if _first_bad(got, _expected_attention(batch, tables=logical), tol) is None:
        return " (this reads logical block j itself; the physical block is block_tables[b, j])"
    return ""


# --------------------------------------------------------------------------- gather_kv_kernel


def check_gather_kv_kernel(kernel) -> None:
    """Launched on grid (B, H_kv): out[b, h, i] must be token i's vector (read through the block
    table) for i < context_lens[b], exactly, and zero after; partly filled last blocks, a block
    table in random order, one token, MQA."""
    cases = [  # (context_lens, H_kv, D, block_size, what)
        ([5], 1, 8, 4, "one sequence, its last block holds 1 of 4 slots"),
        ([16, 7, 1], 2, 16, 8, "full blocks, a partly filled one, a single token"),
        ([33, 12], 3, 4, 16, "SmolLM2's 3 KV heads, the last block of 33 tokens holds one slot"),
    ]
    for seed, (lengths, h_kv, d, block_size, what) in enumerate(cases):
        batch = _batch(lengths, h_kv, h_kv, d, block_size, seed=30 + seed)
        cache, tables, lens = batch["key_cache"], batch["block_tables"], batch["context_lens"]
        max_blocks = tables.shape[1]
        out = torch.zeros(len(lengths), h_kv, max_blocks * block_size, d)
        desc = f"gather_kv_kernel[(B, H_kv)] on {_describe(batch)} ({what})"
        _launch(
            desc,
            kernel,
            (len(lengths), h_kv),
            cache,
            tables,
            lens,
            out,
            h_kv,
            max_blocks,
            BLOCK_SIZE=block_size,
            HEAD_DIM=d,
        )
        for b, n in enumerate(lengths):
            want = _tokens(cache, tables[b].tolist(), n, block_size).transpose(0, 1)  # [H_kv, n, D]
            for h in range(h_kv):
                for i in range(n):
                    if not torch.equal(out[b, h, i], want[h, i]):
                        logical = tables[b, i // block_size].item() != i // block_size
                        hint = (
                            f" (token {i} lives in block block_tables[{b}, {i // block_size}] = "
                            f"{tables[b, i // block_size].item()}, slot {i % block_size})"
                            if logical
                            else ""
                        )
                        raise AssertionError(
                            f"{desc}: out[{b}, {h}, {i}] should be token {i}'s vector of KV head "
                            f"{h}, {want[h, i][:4].tolist()}..., got {out[b, h, i][:4].tolist()}..."
                            f"{hint}"
                        )
            tail = out[b, :, n:]
            if tail.numel() and tail.abs().max() > 0:
                i = n + int((tail.abs().amax(dim=(0, 2)) > 0).nonzero()[0])
                raise AssertionError(
                    f"{desc}: out[{b}, :, {i}] should stay zero (sequence {b} has only {n} tokens), "
                    f"got {out[b, :, i, :4].tolist()}: the last block's slots past the context "
                    f"length are stale; load and store them with a mask"
                )


# --------------------------------------------------------------------------- paged_attention_kernel


_ATTENTION_CASES = [  # (context_lens, H, H_kv, D, block_size, grow, what)
    ([3], 2, 2, 8, 4, False, "one block, partly filled"),
    ([1, 4], 4, 1, 16, 4, False, "one token; one full block; MQA (4 query heads share one KV head)"),
    (
        [48, 25],
        2,
        2,
        8,
        8,
        True,
        "each block's keys larger than the last: the running max grows block by "
        "block, so the sum and output so far must be rescaled by exp(old max - new max)",
    ),
    ([19, 32, 9], 4, 2, 16, 8, False, "several blocks, the last one partly filled; GQA 4 over 2"),
    ([40, 17], 9, 3, 16, 8, False, "SmolLM2's 9 query heads over 3 KV heads (groups of 3, padded to 4)"),
]


def _attention_kernel_args(batch):
    q, kc = batch["q"], batch["key_cache"]
    num_kv_heads, head_dim, group = kc.shape[2], kc.shape[3], q.shape[1] // kc.shape[2]
    out = torch.full_like(q, float("nan"))
    args = (
        q,
        kc,
        batch["value_cache"],
        batch["block_tables"],
        batch["context_lens"],
        out,
        1.0 / math.sqrt(head_dim),
        num_kv_heads,
        batch["block_tables"].shape[1],
    )
    constants = {
        "BLOCK_SIZE": kc.shape[1],
        "HEAD_DIM": head_dim,
        "GROUP": group,
        "GROUP_PAD": 1 << (group - 1).bit_length(),
    }
    return out, args, constants


def _compare_attention(desc: str, got, batch, what: str, tol: float = 1e-5) -> None:
    want = _expected_attention(batch)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"{desc}: expected a tensor of shape {list(want.shape)} ([B, H, D]), got {shape}")
    bad = _first_bad(got, want, tol)
    if bad is not None:
        hint = _hint(got, batch, tol)
        if not hint and "rescaled" in what:
            hint = " (the earlier blocks' sum and output must be multiplied by exp(old max - new max))"
        raise AssertionError(
            f"{desc}: out[b, h, d] at {list(bad)} should be {want[bad].item():.6g}, got "
            f"{got[bad].item():.6g} (max difference {(got.double() - want).abs().nan_to_num(nan=math.inf).max().item():.3g}; "
            f"tolerance {tol:g}){hint}"
        )


def check_paged_attention_kernel(kernel) -> None:
    """Launched on grid (B, H_kv) with scale 1/sqrt(D) and GROUP_PAD = GROUP rounded up to a power
    of two: matches float64 attention from the definition to 1e-5 on partly filled last blocks,
    shuffled block tables, MHA, GQA (3 heads per group), MQA and a running max that grows."""
    for seed, (lengths, h, h_kv, d, block_size, grow, what) in enumerate(_ATTENTION_CASES):
        batch = _batch(lengths, h, h_kv, d, block_size, seed=40 + seed, grow=grow)
        out, args, constants = _attention_kernel_args(batch)
        desc = f"paged_attention_kernel[(B, H_kv)] on {_describe(batch)} ({what})"
        _launch(desc, kernel, (len(lengths), h_kv), *args, **constants)
        _compare_attention(desc, out, batch, what)


# --------------------------------------------------------------------------- paged_attention (the launcher)


def check_paged_attention(fn) -> None:
    """The launcher, run with the library's kernel (so only the launcher is graded): [B, H, D] in
    q's dtype, matching float64 attention; GQA groups of 3 (GROUP_PAD 4), int64 block tables and
    lengths, a q that is a non-contiguous view, float16."""
    from decodelab.lessons.gpu_kernel import paged_attention_kernel

    cases = [  # (context_lens, H, H_kv, D, block_size, what)
        ([7, 20], 4, 4, 16, 8, "4 heads, no grouping"),
        ([30, 5, 16], 9, 3, 16, 8, "SmolLM2's 9 query heads over 3 KV heads"),
        ([12], 6, 2, 8, 4, "GQA 6 over 2, block_tables and context_lens given as int64"),
    ]
    for seed, (lengths, h, h_kv, d, block_size, what) in enumerate(cases):
        batch = _batch(lengths, h, h_kv, d, block_size, seed=50 + seed)
        if "int64" in what:
            batch["block_tables"], batch["context_lens"] = batch["block_tables"].long(), batch["context_lens"].long()
        desc = f"paged_attention(q, key_cache, value_cache, block_tables, context_lens) on {_describe(batch)} ({what})"
        got = call(desc, fn, **batch, kernel=paged_attention_kernel)
        _compare_attention(desc, got, batch, what)
    batch = _batch([10, 3], 4, 2, 8, 4, seed=60)
    wide = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(61))  # q = wide.transpose(0, 1): strided
    batch["q"] = wide.transpose(0, 1)
    desc = (
        f"paged_attention on {_describe(batch)}, with q a transposed (non-contiguous) view of shape [2, 4, 8]: "
        f"the kernel computes addresses of a contiguous [B, H, D], so the launcher must pass a contiguous q"
    )
    _compare_attention(desc, call(desc, fn, **batch, kernel=paged_attention_kernel), batch, "")
    batch = _batch([9, 17], 4, 2, 16, 8, seed=62, dtype=torch.float16)
    desc = f"paged_attention on float16 inputs, {_describe(batch)}"
    got = call(desc, fn, **batch, kernel=paged_attention_kernel)
    if isinstance(got, torch.Tensor) and got.dtype != torch.float16:
        raise AssertionError(f"{desc}: expected float16 out (q's dtype), got {got.dtype}")
    _compare_attention(desc, got, batch, "", tol=5e-3)


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_programs_batch32() -> float:
    """Programs the paged attention grid (B, H_kv) launches: 32 sequences, SmolLM2's 3 KV heads."""
    from decodelab.lessons.gpu_kernel import random_paged_batch

    batch = random_paged_batch([1] * 32)  # SmolLM2's heads: 9 query heads over 3 KV heads
    return batch["q"].shape[0] * batch["key_cache"].shape[2]


def check_q_programs_batch32(value) -> None:
    """Graded q_programs_batch32 (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_programs_batch32",
        value,
        answer_q_programs_batch32(),
        "programs on the grid (sequences, KV heads) for 32 sequences with 3 KV heads",
    )


def answer_q_min_read_mib() -> float:
    """MiB of K and V one decode attention call must read: 32 x 2,048 tokens, 3 KV heads of 64, bf16."""
    from decodelab.lessons.gpu_kernel import kv_bytes_read

    return kv_bytes_read([2048] * 32, 3, 64, 2) / 2**20


def check_q_min_read_mib(value) -> None:
    """Graded q_min_read_mib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_min_read_mib",
        value,
        answer_q_min_read_mib(),
        "the least MiB of keys and values read for 32 sequences of 2,048 tokens, 3 KV heads of 64, bf16 "
        "(2 x tokens x H_kv x D x 2 bytes)",
    )

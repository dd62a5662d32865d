"""Checks for notebook 05, grouped-query attention: `broadcast_gqa_attention`, `pool_kv_heads`.

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and either
returns None or raises ``AssertionError`` whose message gives the input, the expected and the
actual result.

The expected results never come from `decodelab`'s attention or pooling: they are written out
here head by head and query by query in float64 (``_ref_*``), from the definitions:

* query head h reads KV head h // (H / H_kv) (consecutive query heads share one KV head, as in
  Llama and `transformers`: tests/test_gqa_checks.py holds the loop oracle against
  `transformers`' own ``repeat_kv`` and eager attention; the check does not import transformers,
  which would cost a learner seconds per run);
* query t of T sits at position q_offset + t and sees keys 0 .. q_offset + t, softmax(q.k / sqrt(D));
* pooled head i is the mean of old heads i*g .. i*g + g - 1, g = H_kv / H_new.

What broadcasting saves is measured with `decodelab.lessons.tiled_attention.measure_tensor_memory`
(it sees every tensor an operation makes, the copy inside a broadcasting ``@`` included): on a
long decode step the function must not hold as much as half of one K repeated to all H heads.
"""

from __future__ import annotations

import math

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.course.exercises import references
from decodelab.lessons import kv_size
from decodelab.lessons.tiled_attention import measure_tensor_memory
from decodelab.model.attention import repeat_kv

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("05_gqa")

__all__ = ["check_broadcast_gqa_attention", "check_pool_kv_heads", "check_gqa_decode_step"]

MiB = 2**20


def _expect_tensor(desc: str, got, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{desc}: expected a torch.Tensor of shape {list(shape)}, got {type(got).__name__}")
    if tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{desc}: expected shape {list(shape)}, got shape {list(got.shape)}")
    if dtype is not None and got.dtype != dtype:
        raise AssertionError(f"{desc}: expected dtype {dtype} (the input's), got {got.dtype}")


def _where(index: tuple, names: str) -> str:
    return ", ".join(f"{n}={i}" for n, i in zip(names.split(), index))


# --------------------------------------------------------------------------- broadcast_gqa_attention


def _ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    round_robin: bool = False,
    mask_offset: int | None = None,
) -> torch.Tensor:
    """Loops over batch, head and query in float64: the definition, nothing vectorized that could
    hide a slip. round_robin / mask_offset build two classic wrong answers, to name a mistake."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    group = h // h_kv
    mask_offset = q_offset if mask_offset is None else mask_offset
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for i in range(b):
        for head in range(h):
            kv = head % h_kv if round_robin else head // group
            for j in range(t):
                visible = mask_offset + j + 1  # keys 0 .. q_offset + j
                scores = k[i, kv, :visible] @ q[i, head, j] / math.sqrt(d)  # [visible]
                out[i, head, j] = torch.softmax(scores, dim=0) @ v[i, kv, :visible]
    return out


def _diagnose(got: torch.Tensor, q, k, v, q_offset: int) -> str:
    """Which known mistake got matches, as a hint; '' if none."""
    h, h_kv = q.shape[1], k.shape[1]
    if h_kv not in (1, h) and torch.allclose(
        got.double(), _ref_attention(q, k, v, q_offset, round_robin=True), atol=1e-5
    ):
        return (
            f" (this is what query head h reading KV head h % {h_kv} gives: consecutive query heads must "
            f"share a KV head, h // {h // h_kv})"
        )
    if q_offset > 0 and torch.allclose(got.double(), _ref_attention(q, k, v, q_offset, mask_offset=0), atol=1e-5):
        return (
            " (this is what a causal mask that ignores q_offset gives: query t sits at position "
            "q_offset + t and sees keys 0 .. q_offset + t)"
        )
    b, t, d = q.shape[0], q.shape[2], q.shape[3]
    if h_kv not in (1, h):
        swapped = _ref_attention(q, k, v, q_offset).view(b, h_kv, h // h_kv, t, d).transpose(1, 2).reshape(b, h, t, d)
        if torch.allclose(got.double(), swapped, atol=1e-5):
            return (
                f" (these are the right heads in the wrong order: head g*{h_kv} + j where j*{h // h_kv} + g "
                f"belongs; put [B, H_kv, G, T, D] back to [B, H, T, D] without swapping H_kv and G)"
            )
    return ""


def _case(b: int, h: int, h_kv: int, t: int, offset: int, d: int, dtype=torch.float32):
    q = torch.randn(b, h, t, d).to(dtype)
    k, v = torch.randn(b, h_kv, offset + t, d).to(dtype), torch.randn(b, h_kv, offset + t, d).to(dtype)
    return q, k, v


def _describe(name: str, q, k, offset: int, what: str = "") -> str:
    dtype = "" if q.dtype == torch.float32 else f"{str(q.dtype).removeprefix('torch.')} "
    return f"{name} with {dtype}q {list(q.shape)}, k and v {list(k.shape)}, q_offset={offset}" + (
        f" ({what})" if what else ""
    )


def _check_float32_cases(fn, name: str = "broadcast_gqa_attention") -> None:
    """The values, in float32, on GQA, MHA and MQA; prompts, decode steps and chunks."""
    torch.manual_seed(11)
    cases = [  # (batch, heads, kv_heads, queries T, q_offset, head_dim, what)
        (1, 8, 2, 5, 0, 16, "GQA, a 5-token prompt"),
        (1, 8, 2, 1, 9, 16, "GQA, one decode step after 9 cached tokens"),
        (2, 8, 4, 3, 6, 8, "GQA, a 3-token chunk after 6 cached tokens, batch of two"),
        (1, 6, 6, 4, 3, 8, "MHA (H_kv = H)"),
        (2, 4, 1, 4, 5, 8, "MQA (H_kv = 1)"),
        (2, 4, 1, 1, 7, 8, "MQA, one decode step"),
        (1, 9, 3, 2, 7, 64, "SmolLM2's shape: 9 query heads over 3 KV heads, head_dim 64"),
    ]
    for b, h, h_kv, t, offset, d, what in cases:
        q, k, v = _case(b, h, h_kv, t, offset, d)
        desc = _describe(name, q, k, offset, what)
        got = call(desc, fn, q, k, v, offset)
        _expect_tensor(desc, got, (b, h, t, d), q.dtype)
        want = _ref_attention(q, k, v, offset)
        err = (got.double() - want).abs()
        if not err.max() <= 1e-5:  # NaN fails too
            index = (
                tuple(int(i) for i in (err == err.max()).nonzero()[0])
                if not err.isnan().any()
                else tuple(int(i) for i in err.isnan().nonzero()[0])
            )
            hint = _diagnose(got, q, k, v, offset)
            raise AssertionError(
                f"{desc}: at {_where(index, 'batch head query dim')} expected "
                f"{want[index].item():.6g}, got {got[index].item():.6g} "
                f"(max difference {err.max().item():.3g}){hint}"
            )


def _check_bfloat16(fn) -> None:
    """bfloat16 in, bfloat16 out, and no more error than rounding the exact result to bfloat16 once:
    scores and softmax in float32. bfloat16 keeps 8 bits of mantissa, so one rounding moves a value by
    at most 2**-8 of itself; a softmax computed in bfloat16 is off by far more."""
    torch.manual_seed(13)
    q, k, v = _case(2, 9, 3, 3, 29, 64, torch.bfloat16)
    q = q * 2  # sharper softmax rows, where half precision shows
    desc = _describe("broadcast_gqa_attention", q, k, 29, "SmolLM2's heads, a 3-token chunk")
    got = call(desc, fn, q, k, v, 29)
    _expect_tensor(desc, got, tuple(q.shape), torch.bfloat16)
    want = _ref_attention(q, k, v, 29)
    excess = (got.double() - want).abs() - 2**-8 * want.abs()
    if not excess.max() <= 1e-4:
        index = (
            tuple(int(i) for i in (excess == excess.max()).nonzero()[0])
            if not excess.isnan().any()
            else tuple(int(i) for i in excess.isnan().nonzero()[0])
        )
        raise AssertionError(
            f"{desc}: at {_where(index, 'batch head query dim')} expected {want[index].item():.6g} "
            f"(within bfloat16 rounding, {2**-8 * abs(want[index].item()):.2g}), got "
            f"{got[index].item():.6g}: compute the scores and the softmax in float32 "
            f"(q.float(), k.float(), v.float()) and convert only the result back to q's dtype"
        )


def _check_no_copy(fn) -> None:
    """Long decode steps and a chunk: the tensors the call holds at once stay under half of one
    [B, H, S, D] float32 tensor (K repeated to every query head), as broadcasting needs only the
    [B, H, T, S] scores and weights."""
    torch.manual_seed(14)
    for b, h, h_kv, t, offset, d, what in [
        (1, 8, 2, 1, 2047, 64, "GQA, a decode step over a 2,048-token cache"),
        (1, 8, 1, 4, 1020, 64, "MQA, a 4-token chunk over 1,020 cached tokens"),
    ]:
        q, k, v = _case(b, h, h_kv, t, offset, d)
        desc = _describe("broadcast_gqa_attention", q, k, offset, what)
        got, seen = call(desc, measure_tensor_memory, fn, q, k, v, offset)
        _expect_tensor(desc, got, (b, h, t, d), q.dtype)
        s = offset + t
        repeated, scores = b * h * s * d * 4, b * h * t * s * 4
        if seen.peak_bytes > repeated // 2:
            raise AssertionError(
                f"{desc}: the tensors it created took {seen.peak_bytes / MiB:.2f} MiB at once (largest "
                f"{list(seen.largest_shape)}); expected at most {repeated / 2 / MiB:.2f} MiB, half of one K repeated "
                f"to all {h} query heads ([{b}, {h}, {s}, {d}] float32 = {repeated / MiB:.2f} MiB), while broadcasting "
                f"needs a few [{b}, {h}, {t}, {s}] score blocks of {scores / MiB:.3f} MiB. K or V was copied to every "
                f"query head: repeat_kv, repeat_interleave, expand + reshape, or @ on a broadcast (size-1) head "
                f"axis, which torch.matmul expands and copies before multiplying; fold the G heads of a group "
                f"into the query rows, [B, H_kv, G*T, D] @ [B, H_kv, D, S], instead"
            )


def _check_errors(fn) -> None:
    for h, h_kv, t, s, offset, why in [
        (8, 3, 2, 2, 0, "3 KV heads cannot split 8 query heads into equal groups"),
        (8, 2, 2, 5, 1, "S must be q_offset + T = 3 keys"),
        (4, 2, 1, 4, 4, "S must be q_offset + T = 5 keys"),
    ]:
        q, k, v = torch.randn(1, h, t, 4), torch.randn(1, h_kv, s, 4), torch.randn(1, h_kv, s, 4)
        expect_raises(_describe("broadcast_gqa_attention", q, k, offset), ValueError, why, fn, q, k, v, offset)


def check_broadcast_gqa_attention(fn) -> None:
    """Causal GQA over a cache without copying K/V: values against the float64 loop above (float32
    and bfloat16), the memory a long decode step holds, and ValueError for shapes that do not fit."""
    _check_float32_cases(fn)
    _check_bfloat16(fn)
    _check_no_copy(fn)
    _check_errors(fn)


# --------------------------------------------------------------------------- pool_kv_heads


def _ref_pool(weight: torch.Tensor, new: int, head_dim: int) -> torch.Tensor:
    old = weight.shape[0] // head_dim
    group = old // new
    w = weight.double()
    heads = [w[i * head_dim : (i + 1) * head_dim] for i in range(old)]
    pooled = [sum(heads[i * group + j] for j in range(group)) / group for i in range(new)]
    return torch.cat(pooled)


def check_pool_kv_heads(fn) -> None:
    """Mean of consecutive groups of heads, for weights [H_kv * D, E] and biases [H_kv * D]; ValueError
    for a head count that does not divide the KV heads and for rows that are not whole heads."""
    torch.manual_seed(12)
    head_dim, hidden = 4, 6
    for old, new in [(4, 2), (8, 2), (6, 3), (3, 1), (4, 4)]:
        base = torch.randn(new * head_dim, hidden)
        group = old // new
        copies = (
            base.view(new, 1, head_dim, hidden).expand(new, group, head_dim, hidden).reshape(old * head_dim, hidden)
        )
        desc = (
            f"pool_kv_heads on a weight of {old} KV heads (head_dim {head_dim}, hidden {hidden}) down to {new}, "
            f"where old heads {group}i .. {group}i+{group - 1} are all copies of head i"
        )
        got = call(desc, fn, copies, new, head_dim)
        _expect_tensor(desc, got, (new * head_dim, hidden), copies.dtype)
        err = (got.double() - base.double()).abs().max().item()
        if err > 1e-6:
            raise AssertionError(f"{desc}: should give the {new} originals back, differs by {err:.3g}")
    for old, new, rest in [(4, 2, (hidden,)), (6, 2, (hidden,)), (6, 3, ()), (9, 3, ())]:
        rows = old * head_dim
        weight = torch.randn(rows, *rest) + torch.arange(rows, dtype=torch.float32).view(rows, *[1] * len(rest))
        kind = f"weight [{rows}, {rest[0]}]" if rest else f"bias [{rows}]"
        desc = f"pool_kv_heads on a {kind} ({old} KV heads of head_dim {head_dim}) down to {new}"
        got = call(desc, fn, weight, new, head_dim)
        _expect_tensor(desc, got, (new * head_dim, *rest), weight.dtype)
        want = _ref_pool(weight, new, head_dim)
        err = (got.double() - want).abs()
        if err.max() > 1e-4:
            index = tuple(int(i) for i in (err == err.max()).nonzero()[0])
            head, group = index[0] // head_dim, old // new
            raise AssertionError(
                f"{desc}: new head {head} should be the mean of old heads {head * group} .. "
                f"{head * group + group - 1}; at index {index[0] if len(index) == 1 else index} "
                f"expected {want[index].item():.6g}, got {got[index].item():.6g}"
            )
    for rows, new, why in [
        (6 * head_dim, 4, "4 does not divide the 6 KV heads"),
        (4 * head_dim, 8, "a weight of 4 KV heads cannot be pooled up to 8"),
        (4 * head_dim, 0, "at least one KV head must remain"),
        (4 * head_dim + 2, 2, f"{4 * head_dim + 2} rows are not whole heads of {head_dim}"),
    ]:
        weight = torch.randn(rows, hidden)
        expect_raises(
            f"pool_kv_heads(weight [{rows}, {hidden}], num_kv_heads_new={new}, head_dim={head_dim})",
            ValueError,
            why,
            fn,
            weight,
            new,
            head_dim,
        )
    weight = torch.randn(4 * head_dim, hidden, dtype=torch.bfloat16)
    desc = "pool_kv_heads on a bfloat16 weight of 4 KV heads down to 2"
    got = call(desc, fn, weight, 2, head_dim)
    _expect_tensor(desc, got, (2 * head_dim, hidden), torch.bfloat16)
    err = (got.double() - _ref_pool(weight, 2, head_dim)).abs().max().item()
    if err > 2e-2:
        raise AssertionError(f"{desc}: differs from the float64 mean by {err:.3g} (more than bfloat16 rounding)")


# --------------------------------------------------------------------------- gqa_decode_step


def check_gqa_decode_step(fn) -> None:
    """One decode step over a preallocated cache: the new row written at `length` (and nowhere else),
    the output against the float64 loop over positions 0 .. length, bytes_read = 2 B H_kv (length + 1)
    D x element size, no copy of K/V to the H query heads, ValueError for a full cache or bad heads."""
    g = torch.Generator().manual_seed(21)
    for b, h, h_kv, length, s_max, d, dtype in [
        (1, 4, 4, 3, 8, 8, torch.float32),
        (2, 8, 2, 5, 9, 16, torch.float32),
        (1, 6, 1, 0, 4, 8, torch.float32),
        (1, 8, 2, 6, 7, 4, torch.float64),
    ]:
        q = torch.randn(b, h, 1, d, generator=g, dtype=dtype)
        k_new, v_new = (torch.randn(b, h_kv, 1, d, generator=g, dtype=dtype) for _ in range(2))
        k_cache, v_cache = (torch.randn(b, h_kv, s_max, d, generator=g, dtype=dtype) for _ in range(2))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        desc = (
            f"gqa_decode_step(q [{b}, {h}, 1, {d}], k_new, v_new [{b}, {h_kv}, 1, {d}], caches [{b}, {h_kv}, "
            f"{s_max}, {d}] {str(dtype).removeprefix('torch.')}, length={length})"
        )
        got = call(desc, fn, q, k_new, v_new, k_cache, v_cache, length)
        if not isinstance(got, tuple) or len(got) != 2:
            raise AssertionError(f"{desc}: expected a pair (out, bytes_read), got {type(got).__name__}")
        out, bytes_read = got
        for name, cache, before, new in (("k_cache", k_cache, k_before, k_new), ("v_cache", v_cache, v_before, v_new)):
            want = before.clone()
            want[:, :, length] = new[:, :, 0]
            if not torch.equal(cache, want):
                rows = sorted({int(i) for i in (cache != want).any(dim=-1).nonzero()[:, 2]})
                raise AssertionError(
                    f"{desc}: {name} differs from the cache with the new row written at position "
                    f"{length} (only there) at positions {rows}"
                )
        _expect_tensor(desc, out, (b, h, 1, d), dtype)
        expected = _ref_attention(q, k_cache[:, :, : length + 1], v_cache[:, :, : length + 1], length)
        err = (out.double() - expected).abs().max().item()
        if not err <= 1e-5:
            raise AssertionError(
                f"{desc}: output differs from attention over positions 0..{length} (the {length} "
                f"cached tokens and the new one, query head h reading KV head h // {h // h_kv}) "
                f"by {err:.3g}"
            )
        want_bytes = 2 * b * h_kv * (length + 1) * d * k_cache.element_size()
        if isinstance(bytes_read, bool) or not isinstance(bytes_read, int) or bytes_read != want_bytes:
            raise AssertionError(
                f"{desc}: bytes_read expected {want_bytes:,} (2 for K and V x B {b} x H_kv {h_kv} x "
                f"{length + 1} positions x D {d} x {k_cache.element_size()} bytes), got "
                f"{bytes_read!r}"
            )
    q, k_new, v_new = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    k_cache, v_cache = torch.randn(1, 2, 2048, 64), torch.randn(1, 2, 2048, 64)
    desc = "gqa_decode_step(q [1, 8, 1, 64], caches [1, 2, 2048, 64] float32, length=2047)"
    _, seen = call(desc, measure_tensor_memory, fn, q, k_new, v_new, k_cache, v_cache, 2047)
    repeated = 8 * 2048 * 64 * 4
    if seen.peak_bytes > repeated // 2:
        raise AssertionError(
            f"{desc}: the tensors it created took {seen.peak_bytes / MiB:.2f} MiB at once (largest "
            f"{list(seen.largest_shape)}); expected at most {repeated / 2 / MiB:.2f} MiB, half of one "
            f"K repeated to all 8 query heads: read each KV head in place for its group (fold the g "
            f"heads into the rows), never repeat_kv"
        )
    for q, cache, length, why in [
        (torch.randn(1, 4, 1, 4), torch.zeros(1, 2, 3, 4), 3, "the cache of 3 is full"),
        (torch.randn(1, 8, 1, 4), torch.zeros(1, 3, 5, 4), 1, "3 KV heads cannot split 8 query heads"),
        (torch.randn(1, 4, 2, 4), torch.zeros(1, 2, 5, 4), 1, "a decode step has T = 1"),
    ]:
        h_kv = cache.shape[1]
        expect_raises(
            f"gqa_decode_step(q {list(q.shape)}, caches {list(cache.shape)}, length={length})",
            ValueError,
            why,
            fn,
            q,
            torch.zeros(1, h_kv, 1, 4),
            torch.zeros(1, h_kv, 1, 4),
            cache,
            cache.clone(),
            length,
        )


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_mha_kv_mib() -> float:
    """MiB of K and V for one 4,096-token sequence of Llama-3.1-8B in fp16, were it MHA (32 KV heads)."""
    mha = dict(kv_size.PRESETS["Llama-3.1-8B"], num_key_value_heads=32)
    return kv_size.kv_bytes(mha, 4096, 1, "fp16") / MiB


def check_q_mha_kv_mib(value) -> None:
    """Graded q_mha_kv_mib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_mha_kv_mib",
        value,
        answer_q_mha_kv_mib(),
        "Llama-3.1-8B with 32 KV heads instead of 8, one sequence of 4,096 tokens in fp16, in MiB (2 x 32 "
        "layers x 32 KV heads x 128 x 2 bytes per token)",
    )


def answer_q_repeat_kv_mib() -> float:
    """MiB of the tensor repeat_kv(K, 4) creates from one layer's K [1, 2, 4096, 128] in float32."""
    return repeat_kv(torch.zeros(1, 2, 4096, 128), 4).nbytes / MiB


def check_q_repeat_kv_mib(value) -> None:
    """Graded q_repeat_kv_mib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_repeat_kv_mib",
        value,
        answer_q_repeat_kv_mib(),
        "the new tensor of repeat_kv(K [1, 2 KV heads, 4,096, 128] float32, 4), in MiB (8 heads x 4,096 x "
        "128 x 4 bytes)",
    )

"""Checks for notebook 13, calibrated quantization: LLM.int8()'s float/int8 decomposition (`decompose`),
AWQ's per-input-channel scale search (`search_scales`) and GPTQ on one linear from its inputs
(`gptq_quantize_layer`).

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy version in
CI's negative tests, the learner's own in the notebook's hidden-test cells) and either returns None or
raises ``AssertionError`` naming the input, the expected and the actual result.

Oracles, not snapshots:
* decompose: the outlier dims (|x| > threshold in some token, strictly), the float columns of w and the
  per-row absmax int8 levels of the others, all by formula here, and the decomposed product against the
  float product within the int8 bound;
* search_scales: the loss of every alpha of the grid recomputed here (scales mean|x|^alpha normalised by
  sqrt(max * min), the weight's columns times s, the input divided by s, round-to-nearest on the
  asymmetric group grid written out here), the chosen alpha its argmin, and the float product unchanged
  by the scaling before rounding;
* gptq_quantize_layer: a slow, direct GPTQ (`lessons.calibrated_quantization.direct_gptq`: one column
  at a time, the inverse of the remaining columns' dampened Hessian recomputed from scratch) within
  1e-4, over block sizes that divide and that are multiples of the group size, at 3 and 4 bits, with
  fewer tokens than inputs (a singular H only dampening saves); and its layer objective
  ||X W^T - X Ŵ^T||^2 never above round-to-nearest's on the calibration inputs.

The predictions' answers (``check_q_*``) come from the library's own byte counts.
"""

from __future__ import annotations

import math

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call
from decodelab.course.exercises import references
from decodelab.lessons.calibrated_quantization import direct_gptq

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("13_calibrated_quantization")

__all__ = ["check_decompose", "check_search_scales", "check_gptq_quantize_layer"]


def _activations(tokens: int, inputs: int, seed: int, outliers: dict[int, float]) -> torch.Tensor:
    """x [tokens, inputs] ~ N(0, 1) (|x| < 6 here), with dim d set to +-value in every third token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inputs, generator=g).clamp(-4, 4)
    for dim, value in outliers.items():
        x[::3, dim] = value * torch.where(torch.rand(x[::3].shape[0], generator=g) < 0.5, -1.0, 1.0)
    return x


# --------------------------------------------------------------------------- decompose (LLM.int8())


def _expect_split(fn, w, x, threshold, want_dims, what):
    got = call(f"decompose({what}, threshold={threshold})", fn, w, x, threshold)
    dims = sorted(int(d) for d in got.float_dims)
    assert dims == want_dims, (
        f"decompose({what}, threshold={threshold}): float_dims {dims}; expected {want_dims}, the input dims whose "
        f"|x| exceeds {threshold} (strictly) in at least one token"
    )
    rest = sorted(int(d) for d in got.int8_dims)
    want_rest = [d for d in range(w.shape[1]) if d not in want_dims]
    assert rest == want_rest, f"decompose({what}): int8_dims {rest}; expected every other input dim {want_rest}"
    assert tuple(got.float_weight.shape) == (w.shape[0], len(dims)), (
        f"decompose({what}): float_weight has shape {tuple(got.float_weight.shape)}; expected [out, k] = "
        f"{[w.shape[0], len(dims)]}: the weight's COLUMNS (input dims) kept in float"
    )
    assert torch.equal(got.float_weight.float(), w[:, got.float_dims].float()), (
        f"decompose({what}): float_weight is not w[:, float_dims] (the float columns, unrounded)"
    )
    if rest:
        part = w[:, got.int8_dims].float()
        scale = part.abs().amax(dim=1, keepdim=True) / 127  # [out, 1]: absmax per output row
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        levels = torch.round(part / scale).clamp(-127, 127)
        assert got.weight_q.dtype == torch.int8, f"decompose({what}): weight_q is {got.weight_q.dtype}, not int8"
        assert torch.allclose(got.weight_scale.float().reshape(-1, 1), scale, rtol=1e-6), (
            f"decompose({what}): weight_scale {got.weight_scale.flatten()[:4].tolist()}...; expected one absmax scale "
            f"per output row of the int8 columns, max|w[r, int8_dims]| / 127: {scale.flatten()[:4].tolist()}..."
        )
        assert torch.equal(got.weight_q.float(), levels), (
            f"decompose({what}): weight_q differs from round(w[:, int8_dims] / scale) clamped to [-127, 127]"
        )
    return got


def check_decompose(fn) -> None:
    w = torch.randn(10, 16, generator=torch.Generator().manual_seed(3))
    x = _activations(24, 16, 4, {2: 40.0, 11: 9.0})
    x[5, 7] = 6.0  # exactly at the threshold: not above it, so dim 7 stays int8
    x[7, 13] = -6.5  # once, negative: above the threshold in |x|
    what = "w [10, 16], x [24, 16] with |x| up to 40 in dims 2 and 11 (every third token), -6.5 once in dim 13"
    got = _expect_split(fn, w, x, 6.0, [2, 11, 13], what)
    out = got.forward(x)  # [24, 10]
    exact = x.double() @ w.double().T
    float_only = x[:, [2, 11, 13]].double() @ w[:, [2, 11, 13]].double().T
    rest = [d for d in range(16) if d not in (2, 11, 13)]
    # int8 x int8: each product off by at most (s_x / 2)|w| + (s_w / 2)|x| + s_x s_w / 4, summed over the int8 dims
    s_x = x[:, rest].abs().amax(dim=1, keepdim=True).double() / 127  # [24, 1]
    s_w = w[:, rest].abs().amax(dim=1).double() / 127  # [10]
    bound = s_x / 2 * w[:, rest].abs().double().sum(1) + s_w / 2 * x[:, rest].abs().double().sum(1, keepdim=True)
    bound = bound + len(rest) * s_x * s_w / 4 + 1e-4
    assert ((out.double() - exact).abs() <= bound).all(), (
        f"decompose({what}).forward(x): off the float product by {float((out.double() - exact).abs().max()):.3g}, "
        "more than the int8 rounding allows"
    )
    assert (out.double() - float_only).abs().max() > 1e-3, "the int8 part must contribute to the product"
    _expect_split(fn, w, x, math.inf, [], "the same w and x")
    _expect_split(fn, w, x, 0.0, list(range(16)), "the same w and x")
    w2 = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    x2 = _activations(9, 8, 6, {0: -7.0})
    _expect_split(fn, w2, x2, 6.0, [0], "w [6, 8], x [9, 8] with |x| = 7 in dim 0 (every third token)")


# --------------------------------------------------------------------------- search_scales (AWQ)


def _rtn(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Asymmetric min/max round-to-nearest per group of columns, read back: w [out, in] -> [out, in]."""
    out, inputs = w.shape
    groups = w.double().reshape(out, inputs // group_size, group_size)
    lo, hi = groups.amin(-1, keepdim=True).clamp(max=0), groups.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / (2**bits - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    levels = torch.clamp(torch.round(groups / scale) + zero, 0, 2**bits - 1)
    return ((levels - zero) * scale).reshape(out, inputs)


def _awq_losses(w, x, bits, group_size, alphas):
    magnitude = x.double().abs().mean(0).clamp(min=1e-4)  # [in]
    reference = x.double() @ w.double().T
    losses, scales = {}, {}
    for alpha in alphas:
        s = magnitude**alpha
        s = s / (s.max() * s.min()).sqrt()
        w_hat = _rtn(w.double() * s, bits, group_size)
        losses[alpha] = float((reference - (x.double() / s) @ w_hat.T).pow(2).mean())
        scales[alpha] = s
    return losses, scales


def _expect_search(fn, w, x, bits, group_size, alphas, what):
    args = (w, x, bits, group_size) if alphas is None else (w, x, bits, group_size, alphas)
    grid = alphas if alphas is not None else tuple(i / 20 for i in range(21))
    got = call(f"search_scales({what})", fn, *args)
    want, scales = _awq_losses(w, x, bits, group_size, grid)
    keys = sorted(float(a) for a in got.losses)
    assert keys == sorted(grid), f"search_scales({what}): losses for alphas {keys}; expected every alpha of {grid}"
    for alpha in grid:
        value = got.losses[alpha]
        assert math.isclose(value, want[alpha], rel_tol=1e-3, abs_tol=1e-9), (
            f"search_scales({what}): loss at alpha {alpha} is {value:.6g}; expected {want[alpha]:.6g}, the mean of "
            "(x W^T - (x / s) Q(W * s)^T)^2 with s = mean|x|^alpha / sqrt(max * min), W's column i times s_i, "
            "x's input i divided by s_i, Q the group-wise round-to-nearest"
        )
    best = min(want, key=want.get)
    close = [a for a in grid if want[a] <= want[best] * (1 + 1e-4)]
    assert got.alpha in close, (
        f"search_scales({what}): chose alpha {got.alpha} (loss {want.get(got.alpha, float('nan')):.6g}); the least "
        f"loss on the grid is at alpha {best} ({want[best]:.6g})"
    )
    s = got.scales.double()
    assert tuple(s.shape) == (w.shape[1],) and (s > 0).all(), (
        f"search_scales({what}): scales must be [in] = [{w.shape[1]}], all > 0, got shape {tuple(s.shape)}"
    )
    assert torch.allclose(s, scales[got.alpha], rtol=1e-4), (
        f"search_scales({what}): scales {s[:4].tolist()}... are not mean|x|^{got.alpha} / sqrt(max * min): "
        f"{scales[got.alpha][:4].tolist()}..."
    )
    product = (x.double() / s) @ (w.double() * s).T
    assert torch.allclose(product, x.double() @ w.double().T, rtol=1e-9, atol=1e-9), (
        f"search_scales({what}): (x / s) (W * s)^T differs from x W^T: the scaling must leave the float product unchanged"
    )
    return got


def check_search_scales(fn) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(16, 64, generator=g) * 0.1
    x = torch.randn(48, 64, generator=g) * torch.logspace(-1, 1, 64)[torch.randperm(64, generator=g)]
    what = "w [16, 64], x [48, 64] with inputs of magnitude 0.1 to 10, int4, groups of 32"
    got = _expect_search(fn, w, x, 4, 32, None, what)
    assert got.alpha > 0, f"search_scales({what}): alpha {got.alpha}: here scaling beats plain rounding"
    _expect_search(fn, w, x, 3, 32, (0.0, 0.5, 1.0), "the same w and x, int3, groups of 32, alphas (0, 0.5, 1)")
    x_flat = torch.randn(32, 64, generator=g)
    _expect_search(fn, w, x_flat, 4, 64, (0.0, 0.25, 1.0), "w [16, 64], x [32, 64] of even magnitude, int4, g64")


# --------------------------------------------------------------------------- gptq_quantize_layer


def _layer(out: int, inputs: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] and correlated inputs x [tokens, in] (a random mix of a few sources, as a layer's are)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inputs, generator=g) * 0.2
    mix = torch.randn(inputs // 2, inputs, generator=g)
    x = torch.randn(tokens, inputs // 2, generator=g) @ mix + 0.1 * torch.randn(tokens, inputs, generator=g)
    return w, x


def _objective(w, w_hat, x) -> float:
    return float((x.double() @ (w.double() - w_hat.double()).T).pow(2).sum())


def _expect_gptq(fn, w, x, bits, group_size, block_size, what):
    got = call(f"gptq_quantize_layer({what})", fn, w, x, bits, group_size, block_size, 0.01)
    w_hat = got.dequantize().double()
    want = direct_gptq(w, x, bits, group_size, 0.01)
    diff = float((w_hat - want).abs().max())
    assert diff <= 1e-4, (
        f"gptq_quantize_layer({what}): differs from a direct GPTQ (column by column, H = 2 X^T X / N from the "
        f"INPUTS, dampened by 0.01 x mean(diag H), the remaining columns' inverse recomputed each step, only the "
        f"columns not yet quantized updated) by up to {diff:.3g}; allowed 1e-4"
    )
    rtn = _rtn(w, bits, group_size)
    ours, rounded = _objective(w, w_hat, x), _objective(w, rtn, x)
    assert ours <= rounded * (1 + 1e-6), (
        f"gptq_quantize_layer({what}): layer error ||X W^T - X Ŵ^T||^2 = {ours:.6g}, above round-to-nearest's "
        f"{rounded:.6g} on the same inputs"
    )


def check_gptq_quantize_layer(fn) -> None:
    w, x = _layer(12, 64, 160, 11)
    _expect_gptq(fn, w, x, 4, 32, 16, "w [12, 64], x [160, 64], int4, groups of 32, blocks of 16")
    _expect_gptq(fn, w, x, 3, 32, 64, "the same w and x, int3, groups of 32, blocks of 64")
    w2, x2 = _layer(6, 64, 24, 12)  # 24 tokens, 64 inputs: H is singular, only the dampening makes it invertible
    _expect_gptq(
        fn, w2, x2, 4, 32, 32, "w [6, 64], x [24, 64] (fewer tokens than inputs), int4, groups and blocks of 32"
    )


# --------------------------------------------------------------------------- predictions


def answer_q_outlier_extra_bytes() -> float:
    from decodelab.model.outliers import Decomposition

    w = torch.zeros(576, 576)
    return float(Decomposition.split(w, torch.tensor([64, 247, 455])).extra_bytes())


def check_q_outlier_extra_bytes(value) -> None:
    expect_answer(
        "q_outlier_extra_bytes",
        value,
        answer_q_outlier_extra_bytes(),
        "3 float32 columns of 576 weights instead of int8: 3 x 576 x (4 - 1) bytes",
    )


def answer_q_int3_bits_per_weight() -> float:
    from decodelab.model.groupwise import packed_bytes

    out, inputs, groups = 1, 1536, 1536 // 128
    return 8 * (packed_bytes(out, inputs, 3) + groups * (4 + 1)) / inputs


def check_q_int3_bits_per_weight(value) -> None:
    expect_answer(
        "q_int3_bits_per_weight",
        value,
        answer_q_int3_bits_per_weight(),
        "a row of 1,536 int3 levels packs 10 to an int32 word (154 words, 616 bytes), plus 12 groups' float32 "
        "scale and uint8 zero point (60 bytes): 676 bytes for 1,536 weights",
    )

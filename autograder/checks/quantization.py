"""Checks for notebook 06, `decodelab.model.quantization`: absmax int8 (per tensor, per channel), group-wise
int4 packed two levels per byte, the int8 linear layer that dequantizes inside the matmul (`Int8Linear`), and
the swap of a model's linear layers (`replace_linears`), the group-wise int4 layer that unpacks and
scales one group of inputs at a time (`Int4Linear`), and the KV cache in int8 with one scale per token and
KV head (`Int8KVCache`).

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in the notebook's hidden-test cells) and
either returns None or raises ``AssertionError`` whose message gives the input, the expected
and the actual result.

Expected values of the quantizers come from plain-torch formulas written here (in float64 where it
matters), never from `decodelab.model.quantization`. The nibble layout is checked byte by byte on all 225
pairs of levels -7..7 that quantize_int4_groupwise packs. The int8 layer is checked against the float
layer within its bound (formulas here) and, as the task asks, against the library's `QuantizedLinear`
(the same levels and scales) and its int8 `quantize_model` / `LLM(quantization="int8")`.

Error bound, derived: round-to-nearest puts x / s within 1/2 of its level q, so |x - q s| <= s / 2
in exact arithmetic. In float32, x / s and q * s each add a relative rounding error of at most
eps / 2 (eps = 2^-23), so the checks allow s / 2 + 2 eps max|x|.

The int8 layer's bound, derived the same way: output o is sum_i x_i W_oi in float and
sum_i x_i q_oi s_o from the levels, so |y_o - y_float_o| = |sum_i x_i (W_oi - q_oi s_o)|
<= s_o / 2 * sum_i |x_i|, with s_o = max_i |W_oi| / 127 taken from the float weight (not from the
layer under test). Float32 sums of n products add at most n eps sum_i |x_i W_oi| (the worst case of
recursive summation), which the check allows on top. Memory is measured with
`decodelab.lessons.tiled_attention.measure_module_memory` (`measure_tensor_memory`, the layer's own
buffers counted as already there): the int8 forward may not hold half a float32 copy of the weight. The int4
forward is bounded by what its method needs, in units of one group's levels [out, g] in float32: six of them,
two alive at once (the group it multiplies and the previous one, until the loop rebinds the name: a correct
answer) and room to unpack and convert a group (int8, int16 or int32 steps, a dequantized copy), plus four
[N, out] float32 results; measured on a weight of 64 groups a row, where an int8 copy of the whole weight alone
is 16 such groups.

The answers of the notebook's predictions (``check_q_*``) are the library's quantizers applied to the
question's numbers: there the library is the measuring instrument, not the thing under test.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.course.exercises import references

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("06_quantization")

__all__ = [
    "check_quantize_int8_per_tensor",
    "check_quantize_int8_per_channel",
    "check_quantize_int4_groupwise",
    "check_int8_linear",
    "check_int4_linear",
    "check_replace_linears",
    "check_int8_kv_cache",
]

EPS = torch.finfo(torch.float32).eps


def _weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitude (1e-3 .. 10), with a few large entries of either sign."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * torch.logspace(-3, 1, out_features)[:, None]
    w[-1, 3] = 1.5 * float(w.abs().max())  # the largest |w| is positive: 127 (or 7) must not wrap around
    w[0, 1] = -2.0 * float(w[0].abs().max())  # a row whose extreme is negative
    return w


def _ref_bytes_from_levels(levels: torch.Tensor) -> torch.Tensor:
    """Documented layout, encoded here: column 2j in bits 0-3 of byte j, 2j + 1 in bits 4-7."""
    nibbles = levels.long() % 16  # 4-bit two's complement: -1 -> 15
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)


def _ref_levels_from_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Documented layout, decoded here: byte j holds column 2j in bits 0-3 and 2j + 1 in bits 4-7."""
    nibbles = torch.stack([packed.long() & 0xF, packed.long() >> 4], dim=-1).flatten(-2)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def _pair(result, name: str):
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        raise AssertionError(f"{name}: expected a tuple of two tensors (q, scale), got {type(result).__name__}")
    return result


def _check_absmax(
    name: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, expected_scale: torch.Tensor, qmax: int
) -> None:
    """Levels in range, scale = absmax / qmax, every value within scale / 2 of q * scale."""
    back = q.double() * scale.double()
    err = (x.double() - back).abs()
    bound = (scale.double() / 2 + 2 * EPS * x.double().abs().max()).expand_as(err)
    if (err > bound).any():
        i = int((err > bound).flatten().nonzero()[0, 0])
        w_i, q_i = float(x.flatten()[i]), int(q.flatten()[i])
        if w_i * q_i < 0:
            hint = " (w and its level have opposite signs: a level past the range wrapped around)"
        elif abs(q_i) == qmax:
            hint = f" (clipped at level {q_i}: the scale must be max|w| of its block, absolute values, / {qmax})"
        else:
            hint = " (round to the nearest level: torch.round, not a cast that truncates toward zero)"
        raise AssertionError(
            f"{name}: w = {w_i:.5g} at flat index {i} came back as {float(back.flatten()[i]):.5g} "
            f"(q = {q_i}); the error must be <= scale / 2 = {float(bound.flatten()[i]):.4g}{hint}"
        )
    assert torch.allclose(scale.double(), expected_scale, rtol=1e-6, atol=0), (
        f"{name}: scale should be max|w| / {qmax}; expected {expected_scale.flatten()[:4].tolist()}..., "
        f"got {scale.double().flatten()[:4].tolist()}..."
    )
    assert int(q.min()) >= -qmax and int(q.max()) <= qmax, (
        f"{name}: levels must lie in [-{qmax}, {qmax}], got [{int(q.min())}, {int(q.max())}]"
    )


# --------------------------------------------------------------------------- int8


def check_quantize_int8_per_tensor(fn) -> None:
    w = _weights(8, 48, seed=0)
    cases = {
        "w [8, 48]": w,
        "-w (extreme negative)": -w,
        "w 1-D [37]": w.flatten()[:37],
        "w [2, 4, 48]": w.reshape(2, 4, 48),
        "w [1, 1] = [[-3.0]]": torch.tensor([[-3.0]]),
    }
    for name, x in cases.items():
        what = f"quantize_int8_per_tensor({name})"
        q, scale = _pair(call(what, fn, x.clone()), what)
        assert q.dtype == torch.int8 and tuple(q.shape) == tuple(x.shape), (
            f"{name}: expected q int8 of shape {tuple(x.shape)}, got {q.dtype} {tuple(q.shape)}"
        )
        assert scale.dtype == torch.float32 and scale.dim() == 0, (
            f"{name}: expected a float32 scalar scale (shape []), got {scale.dtype} of shape {tuple(scale.shape)}"
        )
        _check_absmax(name, x, q, scale, x.double().abs().max() / 127, 127)
    what = "quantize_int8_per_tensor(zeros [3, 5])"
    q, scale = _pair(call(what, fn, torch.zeros(3, 5)), what)
    assert torch.isfinite(scale) and float(scale) == 1.0, (
        f"all-zero w [3, 5]: the scale must be 1.0 (not 0: 0 / 0 is nan), got {float(scale)}"
    )
    assert torch.equal(q, torch.zeros(3, 5, dtype=torch.int8)), f"all-zero w: every level must be 0, got {q.tolist()}"


def check_quantize_int8_per_channel(fn) -> None:
    w = _weights(16, 96, seed=1)
    for name, x in {"w [16, 96], rows from 1e-3 to 10": w, "-w": -w, "w [1, 5]": w[-1:, :5]}.items():
        what = f"quantize_int8_per_channel({name})"
        q, scale = _pair(call(what, fn, x.clone()), what)
        assert q.dtype == torch.int8 and tuple(q.shape) == tuple(x.shape), (
            f"{name}: expected q int8 of shape {tuple(x.shape)}, got {q.dtype} {tuple(q.shape)}"
        )
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (x.shape[0], 1), (
            f"{name}: scale has shape {tuple(scale.shape)}, expected {(x.shape[0], 1)}: one scale per output row, "
            f"kept as a column so that q * scale broadcasts"
        )
        _check_absmax(name, x, q, scale, x.double().abs().amax(dim=1, keepdim=True) / 127, 127)
    small_row = w[0]
    q, scale = call("quantize_int8_per_channel(w [16, 96])", fn, w.clone())
    err = (small_row - q[0].float() * scale[0]).abs().max()
    assert float(err) <= float(small_row.abs().max()) / 254 * (1 + 1e-5), (
        f"row 0 of w (max|w| = {float(small_row.abs().max()):.3g}) must keep its own precision, max|w| / 254 = "
        f"{float(small_row.abs().max()) / 254:.3g}; its error is {float(err):.3g}"
    )
    rows = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25]])
    q, scale = call("quantize_int8_per_channel(w [[0, 0, 0], [1, -0.5, 0.25]])", fn, rows)
    assert torch.isfinite(scale).all() and float(scale[0, 0]) == 1.0 and not q[0].any(), (
        f"w [[0, 0, 0], [1, -0.5, 0.25]]: an all-zero row gets scale 1.0 and levels 0; got scale "
        f"{scale.flatten().tolist()}, q {q.tolist()}"
    )
    expect_raises(
        "quantize_int8_per_channel on a 3-D tensor [2, 3, 4]",
        ValueError,
        "a weight matrix is 2-D",
        fn,
        torch.zeros(2, 3, 4),
    )


# --------------------------------------------------------------------------- int4 groups


# Every pair of levels -7..7 (225 pairs), 15 to a group of 32 values behind a pair (7, -7) that fixes the
# group's scale at 0.7 / 7: w = levels / 10, one row of 15 groups. Its packed bytes are known exactly.
_PAIRS = torch.cartesian_prod(torch.arange(-7, 8), torch.arange(-7, 8)).reshape(15, 15, 2)  # [group, pair, 2]
PACKING_LEVELS = torch.cat([torch.tensor([7, -7]).expand(15, 1, 2), _PAIRS], dim=1).reshape(1, 480).to(torch.int8)


def _check_packing(fn) -> None:
    """The bytes of w = PACKING_LEVELS / 10, group_size 32: the layout, pair by pair."""
    what = "quantize_int4_groupwise(w [1, 480] = every pair of levels -7..7 / 10, group_size=32)"
    packed, _ = _pair(call(what, fn, PACKING_LEVELS.float() / 10, 32), what)
    assert isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8 and tuple(packed.shape) == (1, 240), (
        f"{what}: expected packed uint8 [1, 240] (two levels per byte), got "
        f"{getattr(packed, 'dtype', type(packed).__name__)} {tuple(getattr(packed, 'shape', ()))}"
    )
    expected = _ref_bytes_from_levels(PACKING_LEVELS)
    bad = (packed != expected).flatten().nonzero().flatten()
    if bad.numel():
        j = int(bad[0])
        a, b = PACKING_LEVELS[0, 2 * j].item(), PACKING_LEVELS[0, 2 * j + 1].item()
        raise AssertionError(
            f"{what}: the levels ({a}, {b}) of columns {2 * j} and {2 * j + 1} packed to {hex(int(packed[0, j]))}, "
            f"expected {hex(int(expected[0, j]))}: the even column goes in the low nibble (bits 0-3), the odd one in "
            f"the high nibble, each as its 4-bit two's complement (mask with & 0xF: -1 -> 0xF, -7 -> 0x9)"
        )


def check_quantize_int4_groupwise(fn) -> None:
    _check_packing(fn)
    w = _weights(6, 256, seed=2)
    for group_size in (32, 64, 128):
        for sign in (1, -1):
            x = sign * w
            name = f"{'-' if sign < 0 else ''}w [6, 256], group_size={group_size}"
            what = f"quantize_int4_groupwise({name})"
            packed, scale = _pair(call(what, fn, x.clone(), group_size), what)
            assert packed.dtype == torch.uint8 and tuple(packed.shape) == (6, 128), (
                f"{name}: expected packed uint8 [6, 128] (two values per byte), "
                f"got {packed.dtype} {tuple(packed.shape)}"
            )
            assert scale.dtype == torch.float32 and tuple(scale.shape) == (6, 256 // group_size), (
                f"{name}: expected scale float32 {(6, 256 // group_size)}, got {scale.dtype} {tuple(scale.shape)}"
            )
            groups = x.reshape(6, -1, group_size)  # [out, G, g]
            levels = _ref_levels_from_bytes(packed).reshape(6, -1, group_size)
            _check_absmax(name, groups, levels, scale[..., None], groups.double().abs().amax(-1, keepdim=True) / 7, 7)
    packed, scale = call("quantize_int4_groupwise(zeros [2, 64], group_size=32)", fn, torch.zeros(2, 64), 32)
    assert torch.isfinite(scale).all() and bool((scale == 1.0).all()) and not _ref_levels_from_bytes(packed).any(), (
        f"all-zero w [2, 64], group_size=32: expected levels 0 and every scale 1.0, got scale {scale.tolist()}"
    )
    expect_raises(
        "quantize_int4_groupwise(w [4, 96], group_size=64)",
        ValueError,
        "64 does not divide 96",
        fn,
        torch.zeros(4, 96),
        64,
    )


# --------------------------------------------------------------------------- the int8 linear layer

MiB = 2**20
# The greedy runs on `tiny` through the engine: prompts whose greedy path keeps a top-2 logit margin of
# more than 0.01 at every step (float32 rounding between correct layers is ~1e-5 there).
ENGINE_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef "]
ENGINE_TOKENS = 8


def _linear(in_features: int, out_features: int, seed: int, bias: bool = True) -> nn.Linear:
    """An nn.Linear with rows of very different magnitude (`_weights`) and a bias of order 1."""
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(_weights(out_features, in_features, seed))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=torch.Generator().manual_seed(seed + 1)))
    return linear.requires_grad_(False)


def _own_tensors(layer) -> list[torch.Tensor]:
    return [t for t in (*layer.parameters(), *layer.buffers(), *vars(layer).values()) if isinstance(t, torch.Tensor)]


def _expect_buffers(what: str, layer, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias) -> None:
    """The layer keeps weight_q, weight_scale and bias (unless None) as buffers holding the tensors
    given, and bias None when none was given (an Int8Linear's or an Int4Linear's constructor)."""
    buffers = dict(layer.named_buffers()) if isinstance(layer, nn.Module) else {}
    missing = [
        n
        for n, t in (("weight_q", weight_q), ("weight_scale", weight_scale), ("bias", bias))
        if t is not None and not (n in buffers and torch.equal(buffers[n], t))
    ]
    assert not missing, (
        f"{what}: {missing} should be the layer's buffers, holding the tensors given "
        f"(self.register_buffer(name, tensor)); its buffers are {sorted(buffers)}"
    )
    assert getattr(layer, "bias", "missing") is None or bias is not None, f"{what}: expected bias None"


def _check_init(cls, name: str) -> None:
    """cls(weight_q, weight_scale, bias) keeps the three tensors as buffers (so that model.to(device) moves
    them) and the shape as out_features, in_features."""
    g = torch.Generator().manual_seed(12)
    q = torch.randint(-127, 128, (8, 16), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(8, 1, generator=g) + 0.01, torch.randn(8, generator=g)
    for b in (bias, None):
        what = f"{name}(weight_q int8 [8, 16], weight_scale [8, 1], bias {'[8]' if b is not None else 'None'})"
        layer = call(what, cls, q, scale, b)
        _expect_buffers(what, layer, q, scale, b)
        assert (getattr(layer, "out_features", None), getattr(layer, "in_features", None)) == (8, 16), (
            f"{what}: expected out_features 8 and in_features 16 (weight_q's shape), got "
            f"{getattr(layer, 'out_features', None)} and {getattr(layer, 'in_features', None)}"
        )


def _check_stored(cls, linear: nn.Linear, name: str):
    """from_linear: int8 levels [out, in] and float32 scales [out, 1] on the absmax grid of each output row,
    the bias as it was, and nothing else of the float weight kept. Returns the layer."""
    out_features, in_features = linear.weight.shape
    layer = call(f"{name}.from_linear(nn.Linear({in_features}, {out_features}))", lambda: cls.from_linear(linear))
    for attr in ("weight_q", "weight_scale", "bias"):
        assert hasattr(layer, attr), f"{name}.from_linear(...) returned a layer without .{attr}: store it in __init__"
    q, scale = layer.weight_q, layer.weight_scale
    assert isinstance(q, torch.Tensor) and q.dtype == torch.int8 and tuple(q.shape) == (out_features, in_features), (
        f"{name}.weight_q: expected int8 levels [{out_features}, {in_features}] (one per weight), got "
        f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}"
    )
    assert (
        isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and tuple(scale.shape) == (out_features, 1)
    ), (
        f"{name}.weight_scale has shape {tuple(getattr(scale, 'shape', ()))} and dtype "
        f"{getattr(scale, 'dtype', None)}, expected float32 {(out_features, 1)}: one scale per output row, "
        f"max|W[o]| / 127 (a scale per input column cannot be applied to the output after the sum)"
    )
    w = linear.weight.detach()
    _check_absmax(
        f"{name}.from_linear on W [{out_features}, {in_features}]",
        w,
        q,
        scale,
        w.double().abs().amax(dim=1, keepdim=True) / 127,
        127,
    )
    if linear.bias is None:
        assert layer.bias is None, f"{name}.from_linear(a linear without bias): expected bias None, got {layer.bias}"
    else:
        assert isinstance(layer.bias, torch.Tensor) and torch.equal(layer.bias.float(), linear.bias.float()), (
            f"{name}.bias: expected the linear's bias, unchanged, got {layer.bias if layer.bias is None else 'other values'}"
        )
        assert layer.bias.data_ptr() != linear.bias.data_ptr(), (
            f"{name}.bias shares memory with the float layer's bias: store a copy (.detach().clone())"
        )
    held = sum(t.nbytes for t in {t.data_ptr(): t for t in _own_tensors(layer)}.values())
    want = out_features * in_features + 4 * out_features + (0 if linear.bias is None else linear.bias.nbytes)
    assert held <= want, (
        f"{name}.from_linear(nn.Linear({in_features}, {out_features})): the layer holds {held:,} bytes of tensors, "
        f"expected {want:,}: int8 levels, {out_features * in_features:,} bytes (a quarter of float32's "
        f"{4 * out_features * in_features:,}, half of float16's), plus 4 bytes of scale per row and the bias. "
        f"Keep no float copy of the weight (nor the nn.Linear itself)"
    )
    assert getattr(layer, "nbytes", None) == out_features * in_features + 4 * out_features, (
        f"{name}.nbytes: expected {out_features * in_features + 4 * out_features:,} (levels + scales), "
        f"got {getattr(layer, 'nbytes', None)!r}"
    )
    return layer


def _check_forward(layer, linear: nn.Linear, name: str) -> None:
    """Against the float layer within the int8 bound, and against the library's QuantizedLinear."""
    from decodelab.model.quantization import QuantizedLinear

    out_features, in_features = linear.weight.shape
    x = torch.randn(2, 3, in_features, generator=torch.Generator().manual_seed(7))
    what = f"{name}(x [2, 3, {in_features}]), float32"
    with torch.no_grad():
        got = call(what, layer, x.clone())
        want = QuantizedLinear.from_linear(linear, 8)(x)
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == (2, 3, out_features) and got.dtype == torch.float32, (
        f"{what}: expected float32 [2, 3, {out_features}], got {getattr(got, 'dtype', type(got).__name__)} "
        f"{tuple(getattr(got, 'shape', ()))}"
    )
    w, b = linear.weight.double(), (0 if linear.bias is None else linear.bias.double())
    exact = x.double() @ w.T + b  # the float layer, in float64
    scale = w.abs().amax(dim=1) / 127  # [out]: from the float weight, not from the layer under test
    bound = x.double().abs() @ (scale / 2)[None, :].expand(in_features, -1).contiguous() + in_features * EPS * (
        x.double().abs() @ w.abs().T
    )  # [2, 3, out]
    err = (got.double() - exact).abs()
    if (err > bound).any():
        i = tuple(int(j) for j in (err > bound).nonzero()[0])
        o = i[-1]
        if linear.bias is not None and torch.allclose(got + linear.bias, want, rtol=1e-4, atol=1e-4):
            hint = " The output misses exactly the bias: add it after the scaled sum."
        elif torch.allclose(got.double(), (want.double() - b) * scale + b, rtol=1e-3, atol=1e-6):
            hint = " Each output was multiplied by its row's scale twice: once dequantizing the levels, once after."
        else:
            hint = " y[o] = (x @ weight_q[o]) * weight_scale[o] + bias[o]."
        raise AssertionError(
            f"{what}: output {o} at {i[:-1]} is {got[i].item():.6g}, the float layer gives {exact[i].item():.6g}; "
            f"int8 weights move it by at most scale[o] / 2 * sum_i |x_i| = {bound[i].item():.4g}, it moved "
            f"{err[i].item():.4g}.{hint}"
        )
    tol = 1e-5 * want.abs().max()
    assert (got - want).abs().max() <= tol, (
        f"{what}: differs from the library's QuantizedLinear (the same levels and scales, dequantized) by "
        f"{(got - want).abs().max().item():.3g}, more than float32 rounding ({tol.item():.3g})"
    )


def _forward_memory(layer, what: str, in_features: int, seed: int):
    """One forward of x [4, in_features] through the layer, its memory measured -> (output, what the
    forward's new tensors took: `measure_module_memory`'s record)."""
    from decodelab.lessons.tiled_attention import measure_module_memory

    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(seed))
    return call(what, measure_module_memory, layer, x)


def _expect_peak(what: str, seen, limit: int, allowance: str, advice: str) -> None:
    """The forward's new tensors held at most `limit` bytes at once (`allowance` says what that is), else
    AssertionError with the measurement, the limit itself and `advice`."""
    if seen.peak_bytes > limit:
        raise AssertionError(
            f"{what}: the tensors the forward created took {seen.peak_bytes:,} bytes at once (largest "
            f"{list(seen.largest_shape)}); the forward may hold at most {limit:,} bytes, {allowance}. {advice}"
        )


def _check_memory(layer, name: str) -> None:
    out_features, in_features = layer.weight_q.shape
    what = f"{name}(x [4, {in_features}]) with weights [{out_features}, {in_features}]"
    _, seen = _forward_memory(layer, what, in_features, seed=8)
    weight = 4 * out_features * in_features
    _expect_peak(
        what,
        seen,
        weight // 2,
        f"half of a float32 copy of the weight ({weight:,} bytes)",
        f"Convert the levels to x's dtype one block of {getattr(layer, 'block_rows', 128)} output rows at a "
        "time (weight_q[start:end].to(x.dtype)) and scale the output, instead of dequantizing (or converting) "
        "the whole weight_q",
    )


def _check_bfloat16(layer, linear: nn.Linear, name: str) -> None:
    from decodelab.model.quantization import QuantizedLinear

    in_features = linear.in_features
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(9)).bfloat16()
    what = f"{name}(x [5, {in_features}] in bfloat16)"
    with torch.no_grad():
        got = call(what, layer, x)
        reference = QuantizedLinear.from_linear(linear, 8)
        want = reference(x.float()).double()
        magnitude = x.double().abs() @ reference.dequantized_weight().double().abs().T  # [5, out]
        if linear.bias is not None:
            magnitude = magnitude + linear.bias.double().abs()
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16, (
        f"{what}: expected a bfloat16 result (x's dtype: the engine may run the model in bfloat16), got "
        f"{getattr(got, 'dtype', type(got).__name__)}"
    )
    bound = 2**-7 * (magnitude + want.abs())  # a few bfloat16 roundings (2^-9 each) of the sum, scale and bias
    err = (got.double() - want).abs()
    if (err > bound).any():
        i = tuple(int(j) for j in (err > bound).nonzero()[0])
        raise AssertionError(
            f"{what}: output {i} is {got[i].item():.6g}, expected {want[i].item():.6g} within "
            f"bfloat16 rounding ({bound[i].item():.3g})"
        )


@functools.lru_cache(maxsize=None)
def _tiny_float():
    from decodelab.model.registry import load

    return load("tiny", device="cpu", dtype="float32")


def _check_models(cls, name: str) -> None:
    """A random toy model and `tiny` through the engine: the learner's layers give the tokens of the
    library's int8 quantization (quantize_model, LLM(quantization="int8"))."""
    from decodelab.engine.llm import LLM, EngineHooks
    from decodelab.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=ENGINE_TOKENS, ignore_eos=True)
    _check_toy_like_library(
        name, seed=21, bits=8, group_size=None, linear=cls.from_linear, linear_text=f"{name}.from_linear"
    )

    float_model, tokenizer = _tiny_float()
    prompts = [tokenizer.encode(p) for p in ENGINE_PROMPTS]
    outputs = {}
    for label, hooks in (("library", None), (name, EngineHooks(linear=lambda linear: cls.from_linear(linear)))):
        engine_what = f"LLM(model=tiny, quantization='int8', hooks=EngineHooks(linear={name}.from_linear))"
        llm = call(
            engine_what if hooks else "LLM(model=tiny, quantization='int8')",
            LLM,
            model=(copy.deepcopy(float_model), tokenizer),
            quantization="int8",
            hooks=hooks,
            kv_cache_memory=4 * MiB,
        )
        results = (
            call(f"{engine_what}.generate", llm.generate, prompts, params, use_tqdm=False)
            if hooks
            else llm.generate(prompts, params, use_tqdm=False)
        )
        outputs[label] = [r.outputs[0].token_ids for r in results]
    assert outputs[name] == outputs["library"], (
        f"the engine on tiny with your {name} layers wrote the greedy tokens {outputs[name]}, "
        f"LLM(quantization='int8') writes {outputs['library']} (prompts {ENGINE_PROMPTS})"
    )


def check_int8_linear(cls) -> None:
    """Int8Linear: what __init__ keeps (buffers) and from_linear stores (int8 levels, a scale per output row, the bias; a quarter of
    float32's bytes), the forward within the int8 bound of the float layer and equal to the library's
    QuantizedLinear, without a float copy of the weight, in x's dtype; and whole models with it."""
    name = getattr(cls, "__name__", "Int8Linear")
    _check_init(cls, name)
    for bias in (True, False):
        linear = _linear(256, 1024, seed=11 + bias, bias=bias)
        layer = _check_stored(cls, linear, name)
        _check_forward(layer, linear, name)
        _check_bfloat16(layer, linear, name)
    _check_memory(layer, name)
    _check_models(cls, name)


# --------------------------------------------------------------------------- the int4 linear layer
# Oracles here: the levels of a byte come from `_ref_levels_from_bytes` (the documented layout, decoded in
# plain torch), the expected bytes and scales from the formulas of `_ref_bytes_from_levels` and max|group| / 7
# in float64, the expected output from x @ (levels * scale)^T in float64. Bound: group k of row o moves output
# o by at most s_ok / 2 * sum_(i in k) |x_i| (half a step per weight), plus float32 summation (n eps sum |x W|).


def _int4_grid(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels int [out, in], scale float64 [out, in / g]) of symmetric int4 in groups, by the formula."""
    out_features, in_features = w.shape
    groups = w.double().reshape(out_features, in_features // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / 7
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = torch.round(groups / scale[..., None]).clamp(-7, 7).reshape(out_features, in_features)
    return levels.long(), scale


def _check_int4_init(cls, name: str) -> None:
    g = torch.Generator().manual_seed(14)
    packed = torch.randint(0, 256, (8, 32), generator=g).to(torch.uint8)  # 64 inputs
    scale, bias = torch.rand(8, 2, generator=g) + 0.01, torch.randn(8, generator=g)
    for b in (bias, None):
        what = f"{name}(weight_q uint8 [8, 32], weight_scale [8, 2], bias {'[8]' if b is not None else 'None'})"
        layer = call(what, cls, packed, scale, b)
        _expect_buffers(what, layer, packed, scale, b)
        got = tuple(getattr(layer, a, None) for a in ("out_features", "in_features", "group_size"))
        assert got == (8, 64, 32), (
            f"{what}: expected (out_features, in_features, group_size) = (8, 64, 32): "
            f"two inputs per byte, 64 / 2 scales per row; got {got}"
        )
        want = _ref_levels_from_bytes(packed)  # [8, 64]
        for k in range(2):
            levels = call(f"{what}.unpack_group({k})", layer.unpack_group, k)
            ok = isinstance(levels, torch.Tensor) and tuple(levels.shape) == (8, 32)
            assert ok and torch.equal(levels.long(), want[:, 32 * k : 32 * (k + 1)]), (
                f"{what}.unpack_group({k}): expected the levels [8, 32] of inputs {32 * k}..{32 * k + 31}, e.g. row 0 "
                f"starts {want[0, 32 * k : 32 * k + 4].tolist()} from the bytes {[hex(v) for v in packed[0, 16 * k : 16 * k + 2].tolist()]} "
                f"(even column in the low nibble, two's complement: 0x8..0xF are -8..-1); got "
                f"{levels[0, :4].tolist() if ok else tuple(getattr(levels, 'shape', ()))}"
            )


def _check_int4_stored(cls, linear: nn.Linear, group_size: int, name: str):
    out_features, in_features = linear.weight.shape
    what = f"{name}.from_linear(nn.Linear({in_features}, {out_features}), group_size={group_size})"
    layer = call(what, lambda: cls.from_linear(linear, group_size))
    for attr in ("weight_q", "weight_scale", "bias"):
        assert hasattr(layer, attr), f"{what} returned a layer without .{attr}: store it in __init__"
    levels, scale = _int4_grid(linear.weight.detach(), group_size)
    q, s = layer.weight_q, layer.weight_scale
    assert (
        isinstance(q, torch.Tensor) and q.dtype == torch.uint8 and tuple(q.shape) == (out_features, in_features // 2)
    ), (
        f"{what}.weight_q: expected packed uint8 [{out_features}, {in_features // 2}], got "
        f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}"
    )
    assert isinstance(s, torch.Tensor) and tuple(s.shape) == tuple(scale.shape) and s.dtype == torch.float32, (
        f"{what}.weight_scale: expected float32 {tuple(scale.shape)} (one scale per group of {group_size} inputs of a "
        f"row), got {getattr(s, 'dtype', None)} {tuple(getattr(s, 'shape', ()))}"
    )
    assert torch.allclose(s.double(), scale, rtol=1e-6, atol=0), (
        f"{what}.weight_scale: expected max|group| / 7, e.g. {scale[0, :3].tolist()}, got {s[0, :3].tolist()}"
    )
    assert torch.equal(q, _ref_bytes_from_levels(levels)), (
        f"{what}.weight_q: the bytes differ from the levels round(w / scale) packed two per byte (even column low)"
    )
    if linear.bias is None:
        assert layer.bias is None, f"{what}: a linear without bias gives bias None, got {layer.bias}"
    else:
        assert isinstance(layer.bias, torch.Tensor) and torch.equal(layer.bias.float(), linear.bias.float()), (
            f"{what}.bias: expected the linear's bias, unchanged"
        )
    held = sum(t.nbytes for t in {t.data_ptr(): t for t in _own_tensors(layer)}.values())
    want = in_features * out_features // 2 + s.nbytes + (0 if linear.bias is None else linear.bias.nbytes)
    assert held <= want, (
        f"{what}: the layer holds {held:,} bytes of tensors, expected {want:,} (packed levels, "
        f"scales, bias): keep no float copy of the weight (nor the nn.Linear itself)"
    )
    assert getattr(layer, "nbytes", None) == in_features * out_features // 2 + s.nbytes, (
        f"{what}.nbytes: expected {in_features * out_features // 2 + s.nbytes:,}, got {getattr(layer, 'nbytes', None)!r}"
    )
    return layer


def _check_int4_forward(layer, linear: nn.Linear, group_size: int, name: str) -> None:
    out_features, in_features = linear.weight.shape
    levels, scale = _int4_grid(linear.weight.detach(), group_size)
    b = 0 if linear.bias is None else linear.bias.double()
    groups = in_features // group_size
    x = torch.randn(2, 3, in_features, generator=torch.Generator().manual_seed(17))
    what = f"{name}(x [2, 3, {in_features}]) in groups of {group_size}, float32"
    with torch.no_grad():
        got = call(what, layer, x.clone())
    assert isinstance(got, torch.Tensor) and tuple(got.shape) == (2, 3, out_features) and got.dtype == torch.float32, (
        f"{what}: expected float32 [2, 3, {out_features}], got {getattr(got, 'dtype', type(got).__name__)} "
        f"{tuple(getattr(got, 'shape', ()))}"
    )
    w = linear.weight.double()
    grid_weight = (levels.double().reshape(out_features, groups, group_size) * scale[..., None]).reshape_as(w)
    want = x.double() @ grid_weight.T + b  # the dequantized layer, in float64
    exact = x.double() @ w.T + b  # the float layer
    rounding = in_features * EPS * (x.double().abs() @ w.abs().T)
    bound = x.double().abs().reshape(2, 3, groups, group_size).sum(-1) @ (scale / 2).T + rounding
    err = (got.double() - exact).abs()
    one_scale = x.double() @ (levels.double() * scale[:, :1]).T + b
    if linear.bias is not None and torch.allclose(got.double() + b, want, rtol=1e-4, atol=1e-4):
        hint = " The output misses exactly the bias."
    elif torch.allclose(got.double(), one_scale, rtol=1e-4, atol=1e-4):
        hint = " Every group was scaled by group 0's scale: group k's partial sum takes weight_scale[:, k]."
    else:
        hint = (
            " y[o] = sum_k weight_scale[o, k] * (x[group k] @ levels[o, group k]) + bias[o], the levels "
            "unpacked as signed nibbles, even column from the low nibble."
        )
    if (err > bound).any():
        i = tuple(int(j) for j in (err > bound).nonzero()[0])
        raise AssertionError(
            f"{what}: output {i[-1]} at {i[:-1]} is {got[i].item():.6g}, the float layer gives {exact[i].item():.6g}; "
            f"int4 weights move it by at most sum_k scale[o, k] / 2 * sum_(i in k) |x_i| = {bound[i].item():.4g}, it "
            f"moved {err[i].item():.4g}.{hint}"
        )
    tol = 1e-5 * want.abs().max() + rounding.max()
    assert (got.double() - want).abs().max() <= tol, (
        f"{what}: differs from x @ (levels * scale)^T + bias (the same levels and scales, in float64) by "
        f"{(got.double() - want).abs().max().item():.3g}, more than float32 rounding ({tol.item():.3g}).{hint}"
    )


INT4_MEMORY_GROUPS = 6  # groups of levels [out, g] in float32 an int4 forward may hold at once (module docstring)


def _int4_forward_allowance(out_features: int, group_size: int, rows: int) -> int:
    """Bytes of new tensors a forward that unpacks and converts one group of inputs at a time may hold at once,
    x of `rows` rows: six groups of levels [out, g] in float32 (two alive at once, the one it multiplies and the
    previous one until the loop rebinds its name, and room to unpack and convert a group), and four [rows, out]
    float32 results."""
    return INT4_MEMORY_GROUPS * out_features * group_size * 4 + 4 * rows * out_features * 4


def _check_int4_memory(cls, name: str) -> None:
    """A forward through a layer of 64 groups of 32 a row holds at most `_int4_forward_allowance`."""
    out_features, in_features, group_size = 1024, 2048, 32
    made = f"{name}.from_linear(nn.Linear({in_features}, {out_features}), {group_size})"
    layer = call(made, cls.from_linear, _linear(in_features, out_features, seed=35), group_size)
    what = f"{name}(x [4, {in_features}]) with weights [{out_features}, {in_features}] in groups of {group_size}"
    _, seen = _forward_memory(layer, what, in_features, seed=18)
    _expect_peak(
        what,
        seen,
        _int4_forward_allowance(out_features, group_size, 4),
        f"what unpacking one group of {group_size} inputs at a time needs: {INT4_MEMORY_GROUPS} groups of "
        f"levels [{out_features}, {group_size}] in float32 (two alive at once, the one it multiplies and the "
        f"previous one until the loop rebinds its name: that is fine; and room to unpack and convert a group) "
        f"and four [4, {out_features}] float32 results; an int8 copy of the whole weight is "
        f"{out_features * in_features:,} bytes, a float32 one {4 * out_features * in_features:,}",
        "Unpack and convert one group of inputs at a time (unpack_group(k)), instead of unpacking or "
        "dequantizing the whole weight_q",
    )


def _check_int4_bfloat16(layer, linear: nn.Linear, group_size: int, name: str) -> None:
    in_features = linear.in_features
    levels, scale = _int4_grid(linear.weight.detach(), group_size)
    grid_weight = (levels.double().reshape(linear.out_features, -1, group_size) * scale[..., None]).reshape(
        linear.out_features, in_features
    )
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(19)).bfloat16()
    what = f"{name}(x [5, {in_features}] in bfloat16)"
    with torch.no_grad():
        got = call(what, layer, x)
    b = 0 if linear.bias is None else linear.bias.double()
    want = x.double() @ grid_weight.T + b
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16, (
        f"{what}: expected a bfloat16 result (x's dtype), got {getattr(got, 'dtype', type(got).__name__)}"
    )
    magnitude = x.double().abs() @ grid_weight.abs().T + (b.abs() if linear.bias is not None else 0)
    bound = 2**-7 * (magnitude + want.abs())  # a few bfloat16 roundings of each group's sum and of the output
    err = (got.double() - want).abs()
    if (err > bound).any():
        i = tuple(int(j) for j in (err > bound).nonzero()[0])
        raise AssertionError(
            f"{what}: output {i} is {got[i].item():.6g}, expected {want[i].item():.6g} within "
            f"bfloat16 rounding ({bound[i].item():.3g}); keep the running sum in float32"
        )


def _check_int4_models(cls, name: str) -> None:
    """A toy model quantized with the learner's layers (groups of 32) gives the logits and greedy tokens of
    the library's int4 model: the same levels and scales."""
    _check_toy_like_library(
        name,
        seed=22,
        bits=4,
        group_size=32,
        linear=lambda linear: cls.from_linear(linear, 32),
        linear_text=f"lambda linear: {name}.from_linear(linear, 32)",
    )


def _check_toy_like_library(name: str, seed: int, bits: int, group_size: int | None, linear, linear_text: str) -> None:
    """A random toy model quantized with the learner's layers (`linear`, the factory quantize_model
    calls) gives the logits (within 1e-4 of their size) and greedy tokens of the library's model at
    `bits` (and `group_size`)."""
    from decodelab.decoding.generate import stream_token_ids
    from decodelab.model.quantization import quantize_model
    from decodelab.model.toy import random_llama
    from decodelab.params import SamplingParams

    toy = random_llama(seed, weight_scale=2.0)
    grouping = {} if group_size is None else {"group_size": group_size}
    library, learner = quantize_model(copy.deepcopy(toy), bits=bits, **grouping), copy.deepcopy(toy)
    what = f"quantize_model(toy model, bits={bits}, linear={linear_text})"
    call(what, lambda: quantize_model(learner, bits=bits, linear=linear))
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        want, got = library(ids), call(f"the toy model with {name} layers, on 8 tokens", learner, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (
        f"{what}: its logits differ from the library's int{bits} model by {(got - want).abs().max().item():.3g} "
        f"(logits up to {want.abs().max().item():.3g})"
    )
    params = SamplingParams(temperature=0, max_tokens=ENGINE_TOKENS, ignore_eos=True)
    want_tokens = list(stream_token_ids(library, [1, 2, 3], params))
    got_tokens = call(f"greedy decoding with {name} layers", lambda: list(stream_token_ids(learner, [1, 2, 3], params)))
    assert got_tokens == want_tokens, (
        f"{what}: greedy tokens from [1, 2, 3] are {got_tokens}, the library's int{bits} model gives {want_tokens}"
    )


def check_int4_linear(cls) -> None:
    """Int4Linear: what __init__ keeps (buffers, group_size) and unpack_group reads (one group's signed nibbles),
    what from_linear stores (packed levels, a scale per group, the bias), the forward within the int4 bound of the
    float layer and equal to the dequantized product, without a float copy of the weight, in x's dtype; and a
    whole model with it."""
    name = getattr(cls, "__name__", "Int4Linear")
    _check_int4_init(cls, name)
    for bias, group_size in ((True, 64), (False, 32)):
        linear = _linear(512, 1024, seed=31 + bias, bias=bias)
        layer = _check_int4_stored(cls, linear, group_size, name)
        _check_int4_forward(layer, linear, group_size, name)
        _check_int4_bfloat16(layer, linear, group_size, name)
    _check_int4_memory(cls, name)
    _check_int4_models(cls, name)


# --------------------------------------------------------------------------- replace_linears


class _Marked(nn.Module):
    """What the check's factory returns: remembers the linear it replaced and computes as it."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.original = linear

    def forward(self, x):
        return self.original(x)


def check_replace_linears(fn) -> None:
    """Every nn.Linear inside model.model.layers goes through make_linear once and its result takes
    the linear's place; the embedding and lm_head (tied or not) stay; the model is returned."""
    from decodelab.model.quantization import Int8Linear, quantize_model
    from decodelab.model.toy import random_llama

    for tied in (True, False):
        model = random_llama(5, tie_word_embeddings=tied)
        case = (
            f"replace_linears(toy model with {model.config.num_hidden_layers} layers, "
            f"{'tied' if tied else 'untied'} lm_head, make_linear)"
        )
        before = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        inside = {name: m for name, m in before.items() if name.startswith("model.layers.")}
        embedding, lm_head = model.model.embed_tokens, model.lm_head
        ids = torch.tensor([[1, 5, 9, 2]])
        with torch.no_grad():
            want = model(ids)
        seen = []

        def make_linear(linear):
            seen.append(linear)
            return _Marked(linear)

        result = call(case, fn, model, make_linear)
        assert result is model, f"{case}: should return the model it changed in place, got {type(result).__name__}"
        assert model.lm_head is lm_head and isinstance(lm_head, nn.Linear) and not any(m is lm_head for m in seen), (
            f"{case}: the lm_head was replaced too; only the linears inside model.model.layers are quantized "
            f"(the lm_head{' shares its matrix with the embedding and' if tied else ''} sets every logit, so it stays "
            f"float, as quant.quantize_model keeps it)"
        )
        assert model.model.embed_tokens is embedding, f"{case}: the embedding was replaced; it must stay"
        if tied:
            assert model.lm_head.weight is model.model.embed_tokens.weight, f"{case}: the lm_head is no longer tied"
        assert len(seen) == len({id(m) for m in seen}) == len(inside), (
            f"{case}: make_linear was called {len(seen)} times on {len({id(m) for m in seen})} different layers; "
            f"expected once for each of the {len(inside)} linears inside the layers"
        )
        for name, linear in inside.items():
            now = model.get_submodule(name)
            assert isinstance(now, _Marked) and now.original is linear, (
                f"{case}: at {name} expected make_linear(the linear that was there), got "
                f"{type(now).__name__}{' of another linear' if isinstance(now, _Marked) else ''}; "
                f"setattr the result on the linear's parent module, under the same attribute name"
            )
        with torch.no_grad():
            got = call(f"the model after {case}", model, ids)
        assert torch.equal(got, want), f"{case}: with factories that compute as the linears do, the logits changed"
    model = random_llama(6, tie_word_embeddings=True)
    library = quantize_model(copy.deepcopy(model), bits=8, linear=Int8Linear.from_linear)
    call("replace_linears(toy model, Int8Linear.from_linear)", fn, model, Int8Linear.from_linear)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        assert torch.equal(model(ids), library(ids)), (
            "replace_linears(toy model, Int8Linear.from_linear): its logits differ from quant.quantize_model's"
        )


# --------------------------------------------------------------------------- the int8 KV cache
# Oracles, computed here in float64 from what was appended: each row (one sequence, KV head and position,
# D values) has the scale s = max|row| / 127 (1.0 for an all-zero row) and comes back as round(x / s) * s.
# The analytic bound is |x - round(x / s) s| <= s / 2; float32 adds at most eps / 2 relative in x / s and in
# q * s, so the check allows s / 2 + 2 eps max|row|. Bytes per token, typed in: 2 (K and V) * layers *
# sequences * KV heads * (D one-byte levels + one 4-byte float32 scale).

_KV_LAYERS, _KV_BATCH, _KV_HEADS, _KV_DIM, _KV_MAX_LEN = 3, 2, 2, 8, 8
_KV_TOKEN_BYTES = 2 * _KV_LAYERS * _KV_BATCH * _KV_HEADS * (_KV_DIM + 4)


def _kv_config():
    from decodelab.model.toy import toy_config

    return toy_config(
        num_hidden_layers=_KV_LAYERS,
        num_key_value_heads=_KV_HEADS,
        num_attention_heads=4,
        head_dim=_KV_DIM,
        max_position_embeddings=16,
    )


def _kv_rows(tokens: int, seed: int) -> torch.Tensor:
    """k or v [B, H_kv, tokens, D] float32: each row of its own magnitude (1e-3 .. 10, shuffled), and in
    every other row the extreme is negative (max(x) is then not max|x|)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(_KV_BATCH, _KV_HEADS, tokens, _KV_DIM, generator=g)
    rows = _KV_BATCH * _KV_HEADS * tokens
    magnitude = torch.logspace(-3, 1, rows)[torch.randperm(rows, generator=g)].reshape(_KV_BATCH, _KV_HEADS, tokens, 1)
    x = x / x.abs().amax(-1, keepdim=True) * magnitude
    x[..., ::2, 1] = -1.5 * magnitude[..., ::2, 0]  # a negative extreme, 1.5 times the rest of the row
    return x


def _kv_grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(round(x / s) * s, s) in float64, s = max|row| / 127 over the last dimension ([..., 1])."""
    absmax = x.double().abs().amax(-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    return torch.round(x.double() / scale) * scale, scale


def _expect_kv_rows(got, x: torch.Tensor, what: str) -> None:
    """got: what the cache handed back for the float rows x [B, H_kv, S, D]: their int8 levels times their
    row's scale, in x's dtype, within half a step of x."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(x.shape):
        shown = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(f"{what}: expected a tensor [B, H_kv, S, D] = {list(x.shape)}, got {shown}")
    if got.dtype != x.dtype:
        raise AssertionError(f"{what}: expected {x.dtype} (the dtype of the k, v appended), got {got.dtype}")
    want, scale = _kv_grid(x)
    err = (got.double() - x.double()).abs()
    bound = scale / 2 + 2 * EPS * scale * 127
    if not bool((err <= bound).all()):
        excess = (err - bound) / scale  # in steps of each row's own scale
        b, h, t, d = [int(i) for i in (excess == excess.max()).nonzero()[0]]
        row = x[b, h, t].double()
        raise AssertionError(
            f"{what}: sequence {b}, KV head {h}, position {t}, value {d} is {x[b, h, t, d].item():.6g} and came "
            f"back as {got[b, h, t, d].item():.6g}, off by {err[b, h, t, d].item():.3g}; with a scale per (token, KV "
            f"head), s = max|row| / 127 = {row.abs().max().item():.4g} / 127 = {scale[b, h, t, 0].item():.4g}, every "
            f"value of that row comes back within s / 2 = {scale[b, h, t, 0].item() / 2:.3g} (the row's smallest and "
            f"largest values are {row.min().item():.4g} and {row.max().item():.4g}; the scale of position {t} must "
            f"be the one written with its own row)"
        )
    off_grid = (got.double() - want).abs() > 1e-3 * scale + 2 * EPS * scale * 127
    if bool(off_grid.any()):
        b, h, t, d = [int(i) for i in off_grid.nonzero()[0]]
        same = (
            " (the float input itself: store int8 levels and hand back levels * scale)" if torch.equal(got, x) else ""
        )
        raise AssertionError(
            f"{what}: sequence {b}, KV head {h}, position {t}, value {d} came back as {got[b, h, t, d].item():.6g}"
            f"{same}; int8 levels give round(x / s) * s = {want[b, h, t, d].item():.6g} for x = "
            f"{x[b, h, t, d].item():.6g}, s = max|row| / 127 = {scale[b, h, t, 0].item():.4g}"
        )


def _kv_storage(cache, what: str) -> None:
    """The tensors the cache keeps take no more than int8 levels and float32 scales for max_seq_len tokens."""
    found = []
    for value in vars(cache).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in items if isinstance(t, torch.Tensor)]
    held, allowed = sum(t.nbytes for t in found), _KV_TOKEN_BYTES * _KV_MAX_LEN
    if held > allowed:
        kinds = sorted({f"{t.dtype} {list(t.shape)}" for t in found})
        raise AssertionError(
            f"{what} keeps {held:,} bytes of tensors ({', '.join(kinds)}); int8 levels and one "
            f"float32 scale per (layer, sequence, KV head, position) for max_seq_len="
            f"{_KV_MAX_LEN} tokens take {allowed:,}: store K and V as int8"
        )


def _kv_pair(got, what: str):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise AssertionError(f"{what}: expected a pair (keys, values), got {type(got).__name__}")
    return got


def _check_kv_appends(cls, name: str) -> None:
    made = (
        f"{name}(config with {_KV_LAYERS} layers, {_KV_HEADS} KV heads of dim {_KV_DIM}, "
        f"batch_size={_KV_BATCH}, max_seq_len={_KV_MAX_LEN})"
    )
    cache = call(made, cls, _kv_config(), _KV_BATCH, _KV_MAX_LEN)
    _kv_storage(cache, made)
    held = [None] * _KV_LAYERS
    for step, tokens in enumerate((5, 2)):
        for layer in range(_KV_LAYERS):
            k, v = _kv_rows(tokens, 10 * step + 2 * layer), _kv_rows(tokens, 10 * step + 2 * layer + 1)
            before = 0 if held[layer] is None else held[layer][0].shape[2]
            what = f"append(layer={layer}, k, v [{_KV_BATCH}, {_KV_HEADS}, {tokens}, {_KV_DIM}]) with {before} held"
            got = _kv_pair(call(f"{made}.{what}", cache.append, layer, k, v), what)
            held[layer] = (
                (k, v) if held[layer] is None else tuple(torch.cat([h, x], 2) for h, x in zip(held[layer], (k, v)))
            )
            _expect_kv_rows(got[0], held[layer][0], f"the keys {what} returned (all {before + tokens} held)")
            _expect_kv_rows(got[1], held[layer][1], f"the values {what} returned (all {before + tokens} held)")
        seq_len = 5 + 2 * step
        nbytes = call(f"nbytes() with {seq_len} tokens held", cache.nbytes)
        assert nbytes == seq_len * _KV_TOKEN_BYTES, (
            f"{made}.nbytes() with {seq_len} tokens held: expected {seq_len} * 2 (K, V) * {_KV_LAYERS} layers * "
            f"{_KV_BATCH} sequences * {_KV_HEADS} heads * ({_KV_DIM} levels + 4 scale bytes) = "
            f"{seq_len * _KV_TOKEN_BYTES:,}, got {nbytes!r}"
        )
    for layer in range(_KV_LAYERS):
        got = _kv_pair(call(f"view(layer={layer}) with 7 held", cache.view, layer), f"view(layer={layer})")
        _expect_kv_rows(got[0].float(), held[layer][0], f"the keys of view(layer={layer}) with 7 held")
    _kv_storage(cache, f"{made}, after 7 tokens,")
    call("truncate(3) with 7 held", cache.truncate, 3)
    for layer in range(_KV_LAYERS):
        k, v = _kv_rows(1, 50 + layer), _kv_rows(1, 60 + layer)
        what = f"append(layer={layer}, one token) after truncate(3)"
        got = _kv_pair(call(what, cache.append, layer, k, v), what)
        _expect_kv_rows(got[0], torch.cat([held[layer][0][:, :, :3], k], 2), f"the keys {what} returned")
    expect_raises(
        f"append(layer=1, k [1, {_KV_HEADS}, 1, {_KV_DIM}]) to a cache of batch_size={_KV_BATCH}",
        ValueError,
        "k must have the cache's batch size (a slice assignment would broadcast it silently)",
        cache.append,
        1,
        _kv_rows(1, 72)[:1],
        _kv_rows(1, 73)[:1],
    )
    expect_raises(
        f"append(layer=0, 5 tokens) with 4 held and max_seq_len={_KV_MAX_LEN}",
        ValueError,
        f"4 + 5 tokens exceed max_seq_len={_KV_MAX_LEN}",
        cache.append,
        0,
        _kv_rows(5, 70),
        _kv_rows(5, 71),
    )
    cache = call(made, cls, _kv_config(), _KV_BATCH, _KV_MAX_LEN)
    k = _kv_rows(2, 80).bfloat16()
    what = "append(layer=0, k, v in bfloat16)"
    got = _kv_pair(call(what, cache.append, 0, k, k), what)[0]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16, (
        f"{what}: expected bfloat16 keys back (the dtype the model runs in), got "
        f"{got.dtype if isinstance(got, torch.Tensor) else type(got).__name__}"
    )
    want, scale = _kv_grid(k)
    assert bool(((got.double() - want).abs() <= scale / 2 + 2**-8 * want.abs()).all()), (
        f"{what}: the keys returned are not the int8 levels times their scales (within bfloat16's rounding)"
    )


@torch.no_grad()
def _greedy_through(model, ids: torch.Tensor, cache, tokens: int, what: str) -> tuple[list, torch.Tensor]:
    """Greedy decoding of `tokens` tokens after ids [B, T] through the cache -> (tokens, logits [B, tokens, V])."""
    x, chosen, logits = ids, [], []
    for i in range(tokens):
        step = call(f"{what}, step {i}", model, x, kv_cache=cache, last_only=True)[:, -1].float()  # [B, V]
        logits.append(step)
        x = step.argmax(-1, keepdim=True)  # [B, 1]
        chosen.append(x)
    return torch.cat(chosen, 1).tolist(), torch.stack(logits, 1)


def _check_kv_in_model(cls, name: str) -> None:
    """Greedy decoding of a random toy model (batch of 2) through the learner's cache and the library's."""
    from decodelab.decoding.generate import stream_token_ids
    from decodelab.model.quantization import Int8KVCache
    from decodelab.model.toy import random_llama
    from decodelab.params import SamplingParams

    model = random_llama(31, weight_scale=2.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(31))
    what = f"greedy decoding of 10 tokens (toy model, 2 prompts of 6 tokens) with model(x, kv_cache={name}(...))"
    cache = call(f"{name}(toy config, 2, 16)", cls, model.config, 2, 16)
    got_tokens, got_logits = _greedy_through(model, ids, cache, 10, what)
    want_tokens, want_logits = _greedy_through(model, ids, Int8KVCache(model.config, 2, 16), 10, "library")
    diff = (got_logits - want_logits).abs().max().item()
    assert diff <= 1e-4 * want_logits.abs().max().item(), (
        f"{what}: the logits differ from the library's Int8KVCache by {diff:.3g} (same levels and scales "
        f"should give the same logits up to float rounding)"
    )
    assert got_tokens == want_tokens, f"{what}: tokens {got_tokens}, the library's Int8KVCache gives {want_tokens}"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = ids[0].tolist()
    what = f"stream_token_ids(toy model, {prompt}, greedy, 12 tokens, cache_class={name})"
    got = call(what, lambda: list(stream_token_ids(model, prompt, params, cache_class=cls)))
    want = list(stream_token_ids(model, prompt, params, cache_class=Int8KVCache))
    assert got == want, f"{what}: tokens {got}, with the library's Int8KVCache {want}"


def check_int8_kv_cache(cls) -> None:
    """Int8KVCache: every value handed back is its int8 level times its (token, KV head) scale, within half a
    step of what was appended, after a prefill, a second append and a truncate; view, nbytes (D + 4 bytes a
    row), the full-cache error, x's dtype kept, no more tensor bytes than int8 levels and float32 scales; and
    greedy decoding of a toy model through it gives the library's Int8KVCache logits and tokens."""
    name = getattr(cls, "__name__", "Int8KVCache")
    _check_kv_appends(cls, name)
    _check_kv_in_model(cls, name)


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_int8_max_error() -> float:
    """The largest rounding error of absmax int8 with one scale, for a tensor whose max|w| is 0.508."""
    from decodelab.model import quantization as _quant

    _, scale = _quant.quantize_int8_per_tensor(torch.tensor([0.508, -0.2]))
    return scale.item() / 2


def check_q_int8_max_error(value) -> None:
    """Graded q_int8_max_error (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_int8_max_error",
        value,
        answer_q_int8_max_error(),
        "the largest |w - q * scale| for max|w| = 0.508 (half a step, scale = 0.508 / 127)",
    )


def answer_q_int4_group_bytes() -> float:
    """Bytes of one int4 group of 64 weights: packed levels plus its float32 scale."""
    from decodelab.model import quantization as _quant

    packed, scale = _quant.quantize_int4_groupwise(torch.ones(1, 64), 64)
    return packed.nbytes + scale.nbytes


def check_q_int4_group_bytes(value) -> None:
    """Graded q_int4_group_bytes (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_int4_group_bytes",
        value,
        answer_q_int4_group_bytes(),
        "one group of 64 int4 weights, two levels a byte, plus one float32 scale",
    )

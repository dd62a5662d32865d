"""Checks for notebook 06, `decodelab.model.quantization`: absmax int8 (per tensor, per channel), int4 nibble
packing, group-wise int4.

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in the notebook's hidden-test cells) and
either returns None or raises ``AssertionError`` whose message gives the input, the expected
and the actual result.

Expected values come from plain-torch formulas written here (in float64 where it matters),
never from `decodelab.model.quantization`. Nibble layouts are checked byte by byte against all 256 pairs of
4-bit values.

Error bound, derived: round-to-nearest puts x / s within 1/2 of its level q, so |x - q s| <= s / 2
in exact arithmetic. In float32, x / s and q * s each add a relative rounding error of at most
eps / 2 (eps = 2^-23), so the checks allow s / 2 + 2 eps max|x|.
"""
from __future__ import annotations

import torch

from autograder.checks.calling import call, expect_raises

# exercise function -> the library's reference it is graded against (tests/notebooks.py reads this)
REFERENCES = {
    "quantize_int8_per_tensor": "decodelab.model.quantization:quantize_int8_per_tensor",
    "quantize_int8_per_channel": "decodelab.model.quantization:quantize_int8_per_channel",
    "pack_int4": "decodelab.model.quantization:pack_int4",
    "unpack_int4": "decodelab.model.quantization:unpack_int4",
    "quantize_int4_groupwise": "decodelab.model.quantization:quantize_int4_groupwise",
}

__all__ = [
    "check_quantize_int8_per_tensor",
    "check_quantize_int8_per_channel",
    "check_pack_int4",
    "check_unpack_int4",
    "check_quantize_int4_groupwise",
]

EPS = torch.finfo(torch.float32).eps

# All 256 pairs (even column, odd column) of 4-bit values and their documented byte:
# the even column in bits 0-3, the odd column in bits 4-7, each as 4-bit two's complement.
ALL_PAIRS = torch.cartesian_prod(torch.arange(-8, 8), torch.arange(-8, 8)).to(torch.int8)  # [256, 2]
ALL_PAIR_BYTES = torch.tensor([[(a % 16) | ((b % 16) << 4)] for a, b in ALL_PAIRS.tolist()], dtype=torch.uint8)


def _weights(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitude (1e-3 .. 10), with a few large entries of either sign."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * torch.logspace(-3, 1, out_features)[:, None]
    w[-1, 3] = 1.5 * float(w.abs().max())  # the largest |w| is positive: 127 (or 7) must not wrap around
    w[0, 1] = -2.0 * float(w[0].abs().max())  # a row whose extreme is negative
    return w


def _ref_levels_from_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Documented layout, decoded here: byte j holds column 2j in bits 0-3 and 2j + 1 in bits 4-7."""
    nibbles = torch.stack([packed.long() & 0xF, packed.long() >> 4], dim=-1).flatten(-2)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def _pair(result, name: str):
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        raise AssertionError(f"{name}: expected a tuple of two tensors (q, scale), got {type(result).__name__}")
    return result


def _check_absmax(name: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, expected_scale: torch.Tensor,
                  qmax: int) -> None:
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
        raise AssertionError(f"{name}: w = {w_i:.5g} at flat index {i} came back as {float(back.flatten()[i]):.5g} "
                             f"(q = {q_i}); the error must be <= scale / 2 = {float(bound.flatten()[i]):.4g}{hint}")
    assert torch.allclose(scale.double(), expected_scale, rtol=1e-6, atol=0), (
        f"{name}: scale should be max|w| / {qmax}; expected {expected_scale.flatten()[:4].tolist()}..., "
        f"got {scale.double().flatten()[:4].tolist()}...")
    assert int(q.min()) >= -qmax and int(q.max()) <= qmax, \
        f"{name}: levels must lie in [-{qmax}, {qmax}], got [{int(q.min())}, {int(q.max())}]"


# --------------------------------------------------------------------------- int8


def check_quantize_int8_per_tensor(fn) -> None:
    w = _weights(8, 48, seed=0)
    cases = {"w [8, 48]": w, "-w (extreme negative)": -w, "w 1-D [37]": w.flatten()[:37],
             "w [2, 4, 48]": w.reshape(2, 4, 48), "w [1, 1] = [[-3.0]]": torch.tensor([[-3.0]])}
    for name, x in cases.items():
        what = f"quantize_int8_per_tensor({name})"
        q, scale = _pair(call(what, fn, x.clone()), what)
        assert q.dtype == torch.int8 and tuple(q.shape) == tuple(x.shape), \
            f"{name}: expected q int8 of shape {tuple(x.shape)}, got {q.dtype} {tuple(q.shape)}"
        assert scale.dtype == torch.float32 and scale.dim() == 0, \
            f"{name}: expected a float32 scalar scale (shape []), got {scale.dtype} of shape {tuple(scale.shape)}"
        _check_absmax(name, x, q, scale, x.double().abs().max() / 127, 127)
    what = "quantize_int8_per_tensor(zeros [3, 5])"
    q, scale = _pair(call(what, fn, torch.zeros(3, 5)), what)
    assert torch.isfinite(scale) and float(scale) == 1.0, \
        f"all-zero w [3, 5]: the scale must be 1.0 (not 0: 0 / 0 is nan), got {float(scale)}"
    assert torch.equal(q, torch.zeros(3, 5, dtype=torch.int8)), f"all-zero w: every level must be 0, got {q.tolist()}"


def check_quantize_int8_per_channel(fn) -> None:
    w = _weights(16, 96, seed=1)
    for name, x in {"w [16, 96], rows from 1e-3 to 10": w, "-w": -w, "w [1, 5]": w[-1:, :5]}.items():
        what = f"quantize_int8_per_channel({name})"
        q, scale = _pair(call(what, fn, x.clone()), what)
        assert q.dtype == torch.int8 and tuple(q.shape) == tuple(x.shape), \
            f"{name}: expected q int8 of shape {tuple(x.shape)}, got {q.dtype} {tuple(q.shape)}"
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (x.shape[0], 1), (
            f"{name}: scale has shape {tuple(scale.shape)}, expected {(x.shape[0], 1)}: one scale per output row, "
            f"kept as a column so that q * scale broadcasts")
        _check_absmax(name, x, q, scale, x.double().abs().amax(dim=1, keepdim=True) / 127, 127)
    small_row = w[0]
    q, scale = call("quantize_int8_per_channel(w [16, 96])", fn, w.clone())
    err = (small_row - q[0].float() * scale[0]).abs().max()
    assert float(err) <= float(small_row.abs().max()) / 254 * (1 + 1e-5), (
        f"row 0 of w (max|w| = {float(small_row.abs().max()):.3g}) must keep its own precision, max|w| / 254 = "
        f"{float(small_row.abs().max()) / 254:.3g}; its error is {float(err):.3g}")
    rows = torch.tensor([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25]])
    q, scale = call("quantize_int8_per_channel(w [[0, 0, 0], [1, -0.5, 0.25]])", fn, rows)
    assert torch.isfinite(scale).all() and float(scale[0, 0]) == 1.0 and not q[0].any(), \
        f"w [[0, 0, 0], [1, -0.5, 0.25]]: an all-zero row gets scale 1.0 and levels 0; got scale " \
        f"{scale.flatten().tolist()}, q {q.tolist()}"
    expect_raises("quantize_int8_per_channel on a 3-D tensor [2, 3, 4]", ValueError, "a weight matrix is 2-D", fn,
                  torch.zeros(2, 3, 4))


# --------------------------------------------------------------------------- int4 packing


def check_pack_int4(fn) -> None:
    example = torch.tensor([[-1, 7, -8, 0]], dtype=torch.int8)
    got = call("pack_int4([[-1, 7, -8, 0]])", fn, example.clone())
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8, \
        f"pack_int4 must return uint8 bytes, got {getattr(got, 'dtype', type(got).__name__)}"
    expected = torch.tensor([[0x7F, 0x08]], dtype=torch.uint8)
    assert torch.equal(got, expected), (
        f"pack_int4([[-1, 7, -8, 0]]) should give bytes [0x7f, 0x08] (even column in the low nibble, -1 as 0xF), "
        f"got {[hex(b) for b in got.flatten().tolist()]}")
    got = call("pack_int4 of all 256 pairs of 4-bit values, int8 [256, 2]", fn, ALL_PAIRS.clone())
    assert tuple(got.shape) == (256, 1), f"pack_int4 of int8 [256, 2] should be uint8 [256, 1], got {tuple(got.shape)}"
    bad = (got != ALL_PAIR_BYTES).flatten().nonzero().flatten()
    assert bad.numel() == 0, (f"pack_int4 of the pair {ALL_PAIRS[bad[0]].tolist()} gave {hex(int(got[bad[0]]))}, "
                              f"expected {hex(int(ALL_PAIR_BYTES[bad[0]]))}")
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (2, 3, 10), generator=g, dtype=torch.int8)
    got = call("pack_int4 of int8 [2, 3, 10]", fn, q.clone())
    assert tuple(got.shape) == (2, 3, 5) and torch.equal(_ref_levels_from_bytes(got), q.long()), \
        f"pack_int4 of int8 [2, 3, 10] should pack along the last dimension into uint8 [2, 3, 5]; " \
        f"got {tuple(got.shape)}"
    expect_raises("pack_int4 on 3 columns (odd)", ValueError, "two columns share a byte", fn,
                  torch.zeros(2, 3, dtype=torch.int8))


def check_unpack_int4(fn) -> None:
    got = call("unpack_int4 of all 256 bytes, uint8 [256, 1]", fn, ALL_PAIR_BYTES.clone())
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int8 and tuple(got.shape) == (256, 2), \
        f"unpack_int4 of uint8 [256, 1] should be int8 [256, 2], got {getattr(got, 'dtype', None)} " \
        f"{tuple(getattr(got, 'shape', ()))}"
    bad = (got != ALL_PAIRS).any(dim=1).nonzero().flatten()
    assert bad.numel() == 0, (
        f"unpack_int4 of the byte {hex(int(ALL_PAIR_BYTES[bad[0]]))} gave {got[bad[0]].tolist()}, expected "
        f"{ALL_PAIRS[bad[0]].tolist()} (low nibble first; a nibble >= 8 is negative: 0xF is -1)")
    packed = torch.tensor([[0x7F, 0x08, 0x80]], dtype=torch.uint8)
    got = call("unpack_int4(bytes [[0x7f, 0x08, 0x80]])", fn, packed)
    assert got.tolist() == [[-1, 7, -8, 0, 0, -8]], \
        f"unpack_int4(bytes [[0x7f, 0x08, 0x80]]) should be [[-1, 7, -8, 0, 0, -8]], got {got.tolist()}"
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (3, 2, 7), generator=g).to(torch.uint8)
    got = call("unpack_int4 of uint8 [3, 2, 7]", fn, packed)
    assert tuple(got.shape) == (3, 2, 14) and torch.equal(got.long(), _ref_levels_from_bytes(packed)), \
        f"unpack_int4 of uint8 [3, 2, 7] should unpack the last dimension into int8 [3, 2, 14], got {tuple(got.shape)}"


# --------------------------------------------------------------------------- int4 groups


def check_quantize_int4_groupwise(fn) -> None:
    w = _weights(6, 256, seed=2)
    for group_size in (32, 64, 128):
        for sign in (1, -1):
            x = sign * w
            name = f"{'-' if sign < 0 else ''}w [6, 256], group_size={group_size}"
            what = f"quantize_int4_groupwise({name})"
            packed, scale = _pair(call(what, fn, x.clone(), group_size), what)
            assert packed.dtype == torch.uint8 and tuple(packed.shape) == (6, 128), \
                f"{name}: expected packed uint8 [6, 128] (two values per byte), " \
                f"got {packed.dtype} {tuple(packed.shape)}"
            assert scale.dtype == torch.float32 and tuple(scale.shape) == (6, 256 // group_size), \
                f"{name}: expected scale float32 {(6, 256 // group_size)}, got {scale.dtype} {tuple(scale.shape)}"
            groups = x.reshape(6, -1, group_size)  # [out, G, g]
            levels = _ref_levels_from_bytes(packed).reshape(6, -1, group_size)
            _check_absmax(name, groups, levels, scale[..., None], groups.double().abs().amax(-1, keepdim=True) / 7, 7)
    packed, scale = call("quantize_int4_groupwise(zeros [2, 64], group_size=32)", fn, torch.zeros(2, 64), 32)
    assert torch.isfinite(scale).all() and bool((scale == 1.0).all()) and not _ref_levels_from_bytes(packed).any(), \
        f"all-zero w [2, 64], group_size=32: expected levels 0 and every scale 1.0, got scale {scale.tolist()}"
    expect_raises("quantize_int4_groupwise(w [4, 96], group_size=64)", ValueError, "64 does not divide 96", fn,
                  torch.zeros(4, 96), 64)

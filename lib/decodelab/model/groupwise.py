"""Group-wise integer round-to-nearest (RTN) at 3, 4 or 8 bits: the grid the calibrated methods share.

`decodelab.model.quantization` rounds symmetrically (absmax, no zero point) at 8 and 4 bits. The
calibrated methods (`awq`, `gptq`) use the grid their papers and checkpoints use instead:
**asymmetric**, min/max with an integer zero point, by default. Each group of `group_size`
consecutive input columns of a row of a weight [out, in] gets

    lo = min(min w, 0), hi = max(max w, 0)      (the range always holds 0, as GPTQ's quantizer does)
    scale = (hi - lo) / (2^b - 1),  zero = round(-lo / scale)   an integer level in [0, 2^b - 1]
    level = clamp(round(w / scale) + zero, 0, 2^b - 1),  read back as (level - zero) * scale

so every weight comes back within scale / 2 (rounding), and 0 exactly. `symmetric=True` is the
absmax grid of `quantization` written the same way: scale = max|w| / (2^(b-1) - 1), zero =
2^(b-1), levels 1 .. 2^b - 1 (one level unused; at 3 bits that is 7 levels of 8).

Levels are stored packed: `pack_levels` puts 32 // b levels in each int32 word (8 at 4 bits, 10 at
3 bits, 4 at 8 bits); `packed_bytes` counts them. The group-size rules (`GROUP_SIZES`, the
fall-back for a row the size does not divide) are `quantization`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodelab.model.quantization import GROUP_SIZES, _check_finite, absmax_scale, check_group_size

BITS = (3, 4, 8)


def check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")


def group_params(w: torch.Tensor, bits: int, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, g] (one group's columns) -> (scale float32 [out, 1], zero float32 [out, 1]; zero a whole level).

    See the module docstring for the grid. A row that is all zero gets scale 1.0 (`absmax_scale`).
    """
    check_bits(bits)
    w = w if w.dtype == torch.float64 else w.float()
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = absmax_scale(w.abs().amax(dim=1, keepdim=True), qmax)  # [out, 1]
        return scale, torch.full_like(scale, 2 ** (bits - 1))
    lo = w.amin(dim=1, keepdim=True).clamp(max=0)  # [out, 1]
    hi = w.amax(dim=1, keepdim=True).clamp(min=0)
    scale = absmax_scale(hi - lo, 2**bits - 1)  # (hi - lo) / (2^b - 1); 1.0 for an all-zero row
    return scale, torch.round(-lo / scale)


def to_levels(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """w [out, c] (float32 or float64: kept, so that GPTQ's float64 columns round as they are), scale and
    zero broadcastable to it -> integer levels in [0, 2^b - 1], in w's dtype."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """w [out, c] -> its nearest grid values (level - zero) * scale [out, c]."""
    return (to_levels(w, scale, zero, bits) - zero) * scale


@dataclass
class GroupwiseWeight:
    """A weight [out, in] on a group-wise grid: levels uint8 [out, in], scale and zero float32
    [out, in / group_size] (zero holds whole numbers in [0, 2^b - 1])."""

    levels: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]: (level - zero) * scale, each group with its own scale and zero."""
        out, inputs = self.levels.shape
        levels = self.levels.float().reshape(out, inputs // self.group_size, self.group_size)  # [out, G, g]
        return ((levels - self.zero[..., None]) * self.scale[..., None]).reshape(out, inputs)


def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int = 128, symmetric: bool = False) -> GroupwiseWeight:
    """w [out, in] -> GroupwiseWeight: round-to-nearest on the group-wise grid (module docstring).

    ValueError unless w is 2-D and finite, bits is one of BITS, and group_size is one of
    GROUP_SIZES dividing in (`quantization.fallback_group_size` picks one that does).
    """
    if w.dim() != 2:
        raise ValueError(f"group-wise quantization needs a weight [out, in], got shape {tuple(w.shape)}")
    check_bits(bits)
    check_group_size(w.shape[1], group_size)
    _check_finite(w)
    out, inputs = w.shape
    groups = w.float().reshape(out * (inputs // group_size), group_size)  # each row one group
    scale, zero = group_params(groups, bits, symmetric)  # [out * G, 1]
    levels = to_levels(groups, scale, zero, bits).to(torch.uint8).reshape(out, inputs)
    return GroupwiseWeight(levels, scale.reshape(out, -1), zero.reshape(out, -1), bits, group_size)


def rtn(w: torch.Tensor, bits: int, group_size: int = 128, symmetric: bool = False) -> torch.Tensor:
    """Round-to-nearest, read back: w [out, in] -> float32 [out, in] on the grid."""
    return quantize_groupwise(w, bits, group_size, symmetric).dequantize()


def levels_per_word(bits: int) -> int:
    check_bits(bits)
    return 32 // bits


def pack_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """levels [out, in] in [0, 2^b - 1] -> int32 [out, ceil(in / n)], n = 32 // bits levels a word.

    Level j of a word sits in bits j*b .. j*b + b - 1 (the first column lowest); the last word of a
    row is padded with zeros. (At 3 bits two bits of each word are unused: 3.2 bits a weight.)
    """
    n = levels_per_word(bits)
    out, inputs = levels.shape
    words = -(-inputs // n)
    padded = torch.zeros(out, words * n, dtype=torch.int64)
    padded[:, :inputs] = levels.to(torch.int64)
    shifts = torch.arange(n, dtype=torch.int64) * bits  # [n]
    packed = (padded.reshape(out, words, n) << shifts).sum(-1)  # [out, words], < 2^32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same 32 bits, signed


def unpack_levels(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The inverse of `pack_levels`: int32 [out, words] -> uint8 [out, in_features]."""
    n = levels_per_word(bits)
    shifts = torch.arange(n, dtype=torch.int64, device=packed.device) * bits
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [out, words], unsigned
    levels = (words[..., None] >> shifts) & (2**bits - 1)  # [out, words, n]
    return levels.reshape(packed.shape[0], -1)[:, :in_features].to(torch.uint8)


def packed_bytes(out_features: int, in_features: int, bits: int) -> int:
    """Bytes of `pack_levels`'s words for a weight [out, in]."""
    return 4 * out_features * -(-in_features // levels_per_word(bits))


__all__ = [
    "BITS",
    "GROUP_SIZES",
    "GroupwiseWeight",
    "check_bits",
    "group_params",
    "to_levels",
    "round_to_grid",
    "quantize_groupwise",
    "rtn",
    "pack_levels",
    "unpack_levels",
    "packed_bytes",
    "levels_per_word",
]

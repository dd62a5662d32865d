"""Quantization: store weights and the KV cache in fewer bits, multiply in float.

Batch-1 decode reads every weight byte once per token, so fewer bytes per weight mean
less memory and, on a GPU with a fused kernel, faster tokens. Everything here is
symmetric absmax, round-to-nearest: a block of values x gets one float32 scale
s = max|x| / qmax, is stored as q = round(x / s) clamped to [-qmax, qmax], and read back
as q * s. Rounding to the nearest level bounds the error of every value by s / 2.

* int8 per tensor: one scale for the whole tensor (qmax 127).
* int8 per channel: one scale per output row of a weight [out, in] -> scale [out, 1].
* int4 groupwise: one scale per `group_size` consecutive inputs of a row (levels -7..7),
  two values packed per byte -> packed [out, in / 2] uint8, scale [out, in / group_size].
* KV cache: one scale per (layer, batch, head, position) over the head_dim values.

A block that is all zero gets scale 1.0 (not 0), so q = 0 and no division by zero.
`QuantizedLinear` dequantizes its whole weight on every call and then runs F.linear: simple
and exact, but on a CPU slower than float32 (the bytes saved are spent again as a float
copy). Real engines fuse dequantization into the matmul kernel instead. `Int8Linear` (notebook
06's exercise) is the library's one int8 layer and goes that way: it applies each output row's
scale to the output, after the sum, and converts the levels to float a block of rows at a time,
so that no float copy of the whole weight is ever held; under `torch.compile` it writes the
product as a plain sum that inductor fuses into one loop over the int8 bytes
(`decodelab.model.fused_int8.quantize_for_decode` puts it on every linear, lm_head too, for the
compiled decode step). `QuantizedLinear(bits=8)` stores the same levels and scales; it stays as
the dequantize-then-multiply baseline the notebook measures `Int8Linear` against.

`quantize_model` swaps the decoder layers' nn.Linear for quantized layers through
`replace_linears(model, make_linear)`; `make_linear` may be any factory (the engine's
`EngineHooks(linear=...)` passes one in), the library's default builds `QuantizedLinear`s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.config import ModelConfig
from decodelab.model.kv_cache import KVCache

INT8_MAX = 127
INT4_MAX = 7  # levels -7..7: symmetric like int8; -8 fits in a nibble but the quantizer never uses it
GROUP_SIZES = (32, 64, 128)
KV_DTYPES = ("int8", "fp8", "fp16")


def _check_finite(w: torch.Tensor) -> None:
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a tensor holding inf or nan")


def absmax_scale(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """absmax / qmax in float32, with 1.0 where that is 0 (an all-zero block: q = 0, no 0/0)."""
    scale = absmax.float() / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# --------------------------------------------------------------------------- int8


def quantize_int8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [...] (any shape) -> (q int8 [...], scale float32 scalar tensor []).

    scale = max|w| / 127, q = round(w / scale) clamped to [-127, 127], so that
    |w - q * scale| <= scale / 2 everywhere. An all-zero w gets scale 1.0.
    """
    _check_finite(w)
    scale = absmax_scale(w.abs().max(), INT8_MAX)  # []
    q = torch.round(w.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int8 [out, in], scale float32 [out, 1]): one scale per output row.

    A row of small weights no longer shares its scale with the largest row of the matrix,
    so |w[i] - q[i] * scale[i]| <= scale[i] / 2 = max|w[i]| / 254 for every row i.
    Raises ValueError unless w is 2-D.
    """
    if w.dim() != 2:
        raise ValueError(f"per-channel quantization needs a weight [out, in], got shape {tuple(w.shape)}")
    _check_finite(w)
    scale = absmax_scale(w.abs().amax(dim=1, keepdim=True), INT8_MAX)  # [out, 1]
    q = torch.round(w.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q int8 [...] times scale ([] per tensor, or [out, 1] per channel) -> float32 [...]."""
    return q * scale.float()  # int8 * float32 promotes to float32 in one pass


# --------------------------------------------------------------------------- int4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [..., n] with values in [-8, 7], n even -> uint8 [..., n / 2], two per byte.

    Each value is stored as its 4-bit two's complement (-1 -> 0b1111). Column 2j (even)
    goes in the low nibble (bits 0-3) of byte j, column 2j + 1 (odd) in the high nibble.
    Raises ValueError for an odd n.
    """
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.shape[-1]}")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values must lie in [-8, 7], got [{int(q.min())}, {int(q.max())}]")
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)  # [..., n], two's complement in 4 bits
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> int8 [..., n] in [-8, 7]; the inverse of `pack_int4`.

    A nibble's top bit is its sign bit (0b1111 is -1, not 15). Reading the byte as int8
    and shifting right is an arithmetic shift, which copies that sign bit downwards:
    high = byte >> 4; low = (byte << 4) >> 4 moves the low nibble up, then back down.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed int4 data must be uint8, got {packed.dtype}")
    signed = packed.view(torch.int8)
    low, high = (signed << 4) >> 4, signed >> 4  # [..., n / 2] each, in [-8, 7]
    return torch.stack([low, high], dim=-1).flatten(-2)  # [..., n]: even column first


def check_group_size(in_features: int | None, group_size: int) -> None:
    """ValueError unless group_size is allowed and divides in_features (None: skip that test)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if in_features is not None and in_features % group_size:
        raise ValueError(f"in_features {in_features} is not divisible by group_size {group_size}")


def quantize_int4_groupwise(w: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (packed uint8 [out, in / 2], scale float32 [out, in / group_size]).

    Symmetric, no zero-point: each run of `group_size` inputs in a row gets
    scale = max|w_group| / 7 and levels q = round(w / scale) in [-7, 7], so
    |w - q * scale| <= scale / 2. Packing as in `pack_int4` (even column in the low nibble).
    Raises ValueError unless group_size is one of GROUP_SIZES (32, 64, 128) and divides in.
    """
    if w.dim() != 2:
        raise ValueError(f"int4 quantization needs a weight [out, in], got shape {tuple(w.shape)}")
    out_features, in_features = w.shape
    check_group_size(in_features, group_size)
    _check_finite(w)
    groups = w.float().reshape(out_features, in_features // group_size, group_size)  # [out, G, g]
    scale = absmax_scale(groups.abs().amax(dim=-1), INT4_MAX)  # [out, G]
    q = torch.round(groups / scale[..., None]).clamp(-INT4_MAX, INT4_MAX).to(torch.int8)
    return pack_int4(q.reshape(out_features, in_features)), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """packed uint8 [out, in / 2], scale [out, in / group_size] -> float32 [out, in]."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    check_group_size(in_features, group_size)
    if tuple(scale.shape) != (out_features, in_features // group_size):
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}, expected {(out_features, in_features // group_size)} "
            f"for {in_features} inputs in groups of {group_size}"
        )
    q = unpack_int4(packed).float().reshape(out_features, -1, group_size)  # [out, G, g]
    return (q * scale.float()[..., None]).reshape(out_features, in_features)


# --------------------------------------------------------------------------- layers


class QuantizedLinear(nn.Module):
    """A drop-in nn.Linear whose weight is stored quantized (buffers, not parameters).

    bits=8: weight_q int8 [out, in], weight_scale [out, 1] (per channel).
    bits=4: weight_q uint8 [out, in / 2], weight_scale [out, in / group_size].
    forward(x [..., in]) == F.linear(x, dequantized_weight(), bias) -> [..., out].
    """

    def __init__(
        self,
        weight_q: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        bits: int,
        group_size: int | None = None,
    ):
        super().__init__()
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        self.bits, self.group_size = bits, group_size if bits == 4 else None
        self.out_features = weight_q.shape[0]
        self.in_features = weight_q.shape[1] * (2 if bits == 4 else 1)
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 8, group_size: int = 64) -> "QuantizedLinear":
        """Quantize an nn.Linear's weight: int8 per channel, or int4 in groups (group_size
        is used by bits=4 only). The bias, if any, stays in float."""
        weight = linear.weight.detach()
        if bits == 8:
            q, scale = quantize_int8_per_channel(weight)
        elif bits == 4:
            q, scale = quantize_int4_groupwise(weight, group_size)
        else:
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias, bits, group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] that this layer multiplies by."""
        if self.bits == 8:
            return dequantize_int8(self.weight_q, self.weight_scale)
        return dequantize_int4(self.weight_q, self.weight_scale, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight plus its scales (the bias is not counted)."""
        return self.weight_q.nbytes + self.weight_scale.nbytes

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}{group}"


class Int8Linear(nn.Module):
    """An int8 nn.Linear that dequantizes inside the matmul: the weight never exists in float.

    weight_q int8 [out, in] and weight_scale float32 [out, 1] (one scale per output row, as
    `quantize_int8_per_channel` returns them) and the bias (float [out] or None): buffers.
    forward(x [..., in]) -> [..., out] in x's dtype:

        y[..., o] = (sum_i x[..., i] * weight_q[o, i]) * weight_scale[o] + bias[o]

    Legal because row o's scale is the same for every input i: sum_i x_i (q_oi s_o) =
    s_o sum_i x_i q_oi, so the scale multiplies the output (one multiply per output instead of
    one per weight). Eagerly the levels are converted to x's dtype `block_rows` output rows at a
    time, so the largest float weight the forward holds is [block_rows, in], not [out, in] (a GPU
    kernel does the same per tile, in registers). Under `torch.compile` the product is written as
    a plain sum over the inputs, which inductor's C++ backend turns into one vectorized loop that
    reads the int8 bytes themselves (convert, multiply, add): a batch-1 decode step then reads a
    quarter of the float32 bytes. Both forms give the same numbers up to float rounding order.
    The rounding error of the weights moves output o by at most weight_scale[o] / 2 * sum_i |x_i|.
    """

    block_rows = 128  # output rows whose levels are in float at one time (eager form)

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
            raise ValueError(f"weight_q must be an int8 matrix [out, in], got {weight_q.dtype} {tuple(weight_q.shape)}")
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize an nn.Linear's weight per output row (`quantize_int8_per_channel`); the
        bias, if any, stays float (a copy)."""
        q, scale = quantize_int8_per_channel(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {tuple(x.shape)}")
        if torch.compiler.is_compiling():
            return self._fused_forward(x)
        rows = x.reshape(-1, self.in_features)  # [N, in]
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)  # [N, out]
        scale = self.weight_scale.to(x.dtype).T  # [1, out]
        for start in range(0, self.out_features, self.block_rows):
            block = slice(start, start + self.block_rows)
            levels = self.weight_q[block].to(x.dtype)  # [b, in]: the only float weights held
            out[:, block] = (rows @ levels.T) * scale[:, block]  # [N, b], scaled per output row
        if self.bias is not None:
            out += self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The traced form: x [..., in] -> [..., out] (`fused_int8_product`)."""
        return fused_int8_product(x, self.weight_q, self.weight_scale, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer stands for (for measurements, never in forward)."""
        return dequantize_int8(self.weight_q, self.weight_scale)

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 weight plus its scales (the bias is not counted): what a call reads."""
        return self.weight_q.nbytes + self.weight_scale.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, scale on the output"


def fused_int8_product(
    x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`Int8Linear`'s product as a plain sum, the form to trace: x [..., in], weight_q int8 [out, in],
    weight_scale [out, 1], bias [out] or None -> [..., out] in x's dtype. Under `torch.compile` the
    conversion of the levels happens inside the compiled loop, so no float weight is ever stored."""
    out = (x[..., None, :] * weight_q.to(x.dtype)).sum(-1)  # [..., out]: one pass over the int8 bytes
    out = out * weight_scale.reshape(-1).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


class Int4Linear(nn.Module):
    """A group-wise int4 nn.Linear that dequantizes inside the matmul, one group of inputs at a time.

    weight_q uint8 [out, in / 2] (two levels per byte, as `quantize_int4_groupwise` packs them),
    weight_scale float32 [out, in / group_size] (one scale per group of a row), bias float [out]
    or None: buffers; group_size = in / weight_scale.shape[1].
    forward(x [..., in]) -> [..., out] in x's dtype:

        y[..., o] = sum_k weight_scale[o, k] * (sum_{i in group k} x[..., i] * level[o, i]) + bias[o]

    A group's scale is constant over that group's inputs only, so it leaves the group's partial
    sum, not the whole sum: one partial product per group, each scaled and added. The forward
    unpacks and converts the levels of one group ([out, group_size]) at a time, so no float copy
    of the whole weight is ever held. The rounding moves output o by at most
    sum_k weight_scale[o, k] / 2 * sum_{i in group k} |x_i|.
    """

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_q.shape[0], 2 * weight_q.shape[1]
        self.group_size = self.in_features // weight_scale.shape[1]
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64) -> "Int4Linear":
        """Quantize an nn.Linear's weight with `quantize_int4_groupwise` in groups of group_size
        (or the largest smaller allowed size that divides its inputs, `fallback_group_size`); the
        bias, if any, stays float (a copy)."""
        size = fallback_group_size(linear.in_features, group_size)
        q, scale = quantize_int4_groupwise(linear.weight.detach(), size)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias)

    def unpack_group(self, k: int) -> torch.Tensor:
        """The int8 levels [out, group_size] in [-8, 7] of group k (inputs k * g ... (k + 1) * g - 1)."""
        half = self.group_size // 2  # bytes per group of a row
        signed = self.weight_q[:, k * half : (k + 1) * half].view(torch.int8)  # [out, g / 2]: the same bits, signed
        return torch.stack([(signed << 4) >> 4, signed >> 4], dim=-1).flatten(-2)  # [out, g]: low nibble first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        out = torch.zeros(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)  # [N, out]
        for k in range(self.weight_scale.shape[1]):
            inputs = rows[:, k * self.group_size : (k + 1) * self.group_size]  # [N, g]
            partial = inputs @ self.unpack_group(k).to(x.dtype).T  # [N, out]: one group's levels in float at a time
            out += partial.float() * self.weight_scale[:, k].float()  # this group's scale, after its sum
        if self.bias is not None:
            out += self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer stands for (for measurements, never in forward)."""
        return dequantize_int4(self.weight_q, self.weight_scale, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed levels plus their scales (the bias is not counted)."""
        return self.weight_q.nbytes + self.weight_scale.nbytes

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4, "
            f"group_size={self.group_size}, scale on each group's sum"
        )


def replace_linears(model, make_linear):
    """Replace every nn.Linear inside the decoder layers (model.model.layers) by
    make_linear(that linear), in place; returns the model.

    Only the layers: the embedding and the lm_head (in SmolLM2 and `tiny` one tied matrix) stay
    as they are, as `quantize_model` keeps them. Every linear is passed to make_linear once, and
    its result goes where the linear was (`layers[0].self_attn.q_proj` stays at that name).
    """
    for layer in model.model.layers:
        for name, module in list(layer.named_modules()):  # a list: the loop changes the modules
            if isinstance(module, nn.Linear):
                parent_name, _, attr = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, attr, make_linear(module))
    return model


def _skipped(name: str, skip) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def fallback_group_size(in_features: int, group_size: int) -> int:
    """group_size if it divides in_features, else the largest smaller allowed size that does
    (llama.cpp likewise falls back for rows its block size does not divide)."""
    check_group_size(None, group_size)
    for size in sorted((g for g in GROUP_SIZES if g <= group_size), reverse=True):
        if in_features % size == 0:
            return size
    raise ValueError(f"in_features {in_features} is divisible by none of the group sizes {GROUP_SIZES}")


def quantize_model(model, bits: int = 8, group_size: int = 64, skip=("lm_head",), linear=None):
    """Replace every nn.Linear inside the decoder layers by a QuantizedLinear, in place.

    skip: names that stay float; an entry matches a layer's attribute name ("down_proj")
    or the end of its dotted name ("mlp.down_proj"). For bits=4, a layer whose in_features
    `group_size` does not divide uses `fallback_group_size` (SmolLM2's 576 inputs with 128).
    linear: None, or a factory linear(nn.Linear) -> layer that builds each quantized layer
    instead of `QuantizedLinear.from_linear` (the engine's `EngineHooks(linear=...)`, e.g. a
    learner's `Int8Linear.from_linear`); bits and group_size then only pick the default.
    The swap itself is `replace_linears`.

    The embedding and the lm_head stay float: in SmolLM2 and `tiny` they are one tied
    matrix (a fifth of SmolLM2's parameters) used both as a lookup table and as the last
    matmul; quantizing it would untie it or push every lookup through dequantization, and
    it sets every logit directly, so small models are most sensitive there.
    Returns the model, which keeps working with `decodelab.decoding.generate.stream_token_ids`.
    """
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if bits == 4:
        check_group_size(None, group_size)

    def library_layer(module: nn.Linear) -> QuantizedLinear:
        size = fallback_group_size(module.in_features, group_size) if bits == 4 else None
        return QuantizedLinear.from_linear(module, bits, size)

    make = linear or library_layer
    kept = {
        id(module)
        for i, layer in enumerate(model.model.layers)
        for name, module in layer.named_modules()
        if _skipped(f"model.layers.{i}.{name}", skip)
    }
    return replace_linears(model, lambda module: module if id(module) in kept else make(module))


# --------------------------------------------------------------------------- KV cache


class QuantizedKVCache(KVCache):
    """A KVCache that stores K and V in 8 bits (or fp16) and hands back float views.

    kv_dtype="int8": int8 levels with one float32 absmax scale per (layer, batch, head,
    position), i.e. scales [num_layers, B, H_kv, max_seq_len, 1] for keys and for values.
    kv_dtype="fp8": torch.float8_e4m3fn values scaled so that each head-position's absmax
    maps to 448 (the format's largest), same scale layout. kv_dtype="fp16": float16, no scales.
    `append` quantizes the new rows and returns everything held, dequantized to k's dtype,
    so `attend` (inherited) and `model(ids, kv_cache=cache)` work unchanged.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int = 1,
        max_seq_len: int | None = None,
        device=None,
        dtype=None,
        kv_dtype: str = "int8",
    ):
        """`dtype` is accepted so that this drops in wherever a KVCache is built; it is unused:
        `append` returns values in the dtype of the k, v it was given."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if kv_dtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise RuntimeError(
                f"kv_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                "lacks (it appeared in torch 2.1); use kv_dtype='int8'"
            )
        storage = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None), "fp16": torch.float16}
        super().__init__(config, batch_size, max_seq_len, device=device, dtype=storage[kv_dtype])
        self.kv_dtype = kv_dtype
        self.qmax = {"int8": INT8_MAX, "fp8": 448.0, "fp16": None}[kv_dtype]
        scale_shape = self.keys.shape[:-1] + (1,)  # [L, B, H_kv, S_max, 1]
        has_scales = self.qmax is not None
        self.key_scales = torch.ones(scale_shape, device=device) if has_scales else None
        self.value_scales = torch.ones(scale_shape, device=device) if has_scales else None

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, H_kv, T, D] -> (payload [B, H_kv, T, D] in storage dtype, scale [B, H_kv, T, 1] or None)."""
        if self.qmax is None:
            return x.to(self.keys.dtype), None
        scale = absmax_scale(x.abs().amax(dim=-1, keepdim=True), self.qmax)  # [B, H_kv, T, 1]
        scaled = (x.float() / scale).clamp(-self.qmax, self.qmax)
        if self.kv_dtype == "int8":
            scaled = torch.round(scaled)
        return scaled.to(self.keys.dtype), scale

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H_kv, T, D] quantized; return all held, dequantized [B, H_kv, S + T, D] in k's dtype.
        ValueError if k or v is not [B, H_kv, T, D] of this cache, or S + T would exceed max_seq_len."""
        _, batch, heads, _, head_dim = self.keys.shape
        if k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (batch, heads, head_dim):
            raise ValueError(
                f"k and v must both be [B={batch}, H_kv={heads}, T, D={head_dim}], "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"KV cache is full: {start} + {k.shape[2]} tokens exceed max_seq_len={self.max_seq_len}")
        for store, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
            payload, scale = self.quantize(x)
            store[layer, :, :, start:end] = payload
            if scales is not None:
                scales[layer, :, :, start:end] = scale
        self.lengths[layer] = end
        keys, values = self.view(layer)
        return keys.to(k.dtype), values.to(v.dtype)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What this layer holds, dequantized (a new tensor, not a view): float32 [B, H_kv, held, D] each."""
        held = self.lengths[layer]
        if self.key_scales is None:
            return self.keys[layer, :, :, :held].float(), self.values[layer, :, :, :held].float()
        return (
            self.keys[layer, :, :, :held].float() * self.key_scales[layer, :, :, :held],
            self.values[layer, :, :, :held].float() * self.value_scales[layer, :, :, :held],
        )

    def nbytes(self) -> int:
        """Bytes of K and V currently held: payload plus scales."""
        per_position = self.keys[:, :, :, :1].nbytes
        if self.key_scales is not None:
            per_position += self.key_scales[:, :, :, :1].nbytes
        return 2 * per_position * self.seq_len


class Int8KVCache(QuantizedKVCache):
    """The int8 KV cache alone (notebook 06's exercise): `QuantizedKVCache` with kv_dtype="int8".

    keys, values int8 [L, B, H_kv, max_seq_len, D]; key_scales, value_scales float32
    [L, B, H_kv, max_seq_len, 1], one absmax scale per (layer, sequence, KV head, position): the
    cache grows a token at a time, and a scale per token is fixed once written, where one scale
    for the whole cache would have to grow with a larger new value and re-quantize every row held.
    Each token costs 2 * L * B * H_kv * (D + 4) bytes; every value comes back within half its
    row's step, max|row| / 127 / 2.
    """

    def __init__(
        self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None, device=None, dtype=None
    ):
        super().__init__(config, batch_size, max_seq_len, device=device, dtype=dtype, kv_dtype="int8")


__all__ = [
    "quantize_int8_per_tensor",
    "quantize_int8_per_channel",
    "dequantize_int8",
    "pack_int4",
    "unpack_int4",
    "quantize_int4_groupwise",
    "dequantize_int4",
    "QuantizedLinear",
    "Int8Linear",
    "fused_int8_product",
    "Int4Linear",
    "replace_linears",
    "quantize_model",
    "QuantizedKVCache",
    "Int8KVCache",
    "GROUP_SIZES",
    "KV_DTYPES",
]

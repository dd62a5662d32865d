"""Int8 weights read once per token: a matrix-vector product that dequantizes as it reads.

Batch-1 decode on a CPU is bound by memory: every weight byte crosses the memory bus once
per token. An int8 weight is a quarter of a float32 one, but only if the multiply reads the
int8 bytes themselves. `QuantizedLinear` and `Int8Linear` (decodelab.model.quantization)
turn the levels into float before `F.linear`, so the float bytes are written and read again.
`FusedInt8Linear` writes the product of one row as a plain sum,

    y[..., o] = (sum_i x[..., i] * float(weight_q[o, i])) * weight_scale[o] + bias[o],

which `torch.compile` (inductor's C++ backend) turns into one vectorized loop over the int8
bytes: convert, multiply, add, with no float copy of the weight anywhere. Eager code (the
prefill, which runs once per request) takes the simple way, `F.linear` over a float copy.
Both ways give the same numbers up to float rounding order.

`quantize_for_decode(model)` swaps every linear layer, the lm_head included, for one: the
lm_head is a fifth of SmolLM2's bytes, so it is quantized as well (its tied embedding stays
float, as a lookup table it reads one row per token).

Shapes: x [..., in_features] -> [..., out_features].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.model.quantization import quantize_int8_per_channel


class FusedInt8Linear(nn.Module):
    """An inference-only int8 nn.Linear: weight_q int8 [out, in], weight_scale float32 [out]
    (one per output row), bias float [out] or None, all buffers."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
            raise ValueError(f"weight_q must be an int8 matrix [out, in], got {weight_q.dtype} {tuple(weight_q.shape)}")
        if tuple(weight_scale.shape) != (weight_q.shape[0],):
            raise ValueError(f"weight_scale must be [{weight_q.shape[0]}], one per output row, "
                             f"got {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FusedInt8Linear":
        """Quantize an nn.Linear's weight per output row (`quantize_int8_per_channel`); the
        bias, if any, stays float (a copy)."""
        q, scale = quantize_int8_per_channel(linear.weight.detach())  # [out, in], [out, 1]
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale[:, 0], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {tuple(x.shape)}")
        levels = self.weight_q.to(x.dtype)  # compiled: converted inside the loop, never stored
        if torch.compiler.is_compiling():
            out = (x[..., None, :] * levels).sum(-1)  # [..., out]: one pass over the int8 bytes
        else:
            out = F.linear(x, levels)  # eager: a float copy of the levels, then BLAS
        out = out * self.weight_scale.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer stands for (for checks, never in forward)."""
        return self.weight_q.float() * self.weight_scale[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes read per call: the int8 weight plus its scales (the bias is not counted)."""
        return self.weight_q.nbytes + self.weight_scale.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, fused dequantization"


def quantize_for_decode(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in `model` (decoder layers and lm_head) by a `FusedInt8Linear`,
    in place; returns the model. A tied embedding keeps its float weight for the lookup."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, linear in targets:
        setattr(parent, name, FusedInt8Linear.from_linear(linear))
    return model


"""`CalibratedLinear`: the engine's layer for a weight quantized by RTN, AWQ or GPTQ on the group-wise grid.

weight_packed int32 [out, ceil(in / (32 // bits))] (`groupwise.pack_levels`), weight_scale float32
[out, G], weight_zero uint8 [out, G] (whole levels), input_scale float32 [in] or None (AWQ's s: the
input is divided by it), bias float [out] or None: buffers.

    forward(x [..., in]) = F.linear(x / input_scale, (levels - zero) * scale, bias) -> [..., out]

It dequantizes the whole weight on each call and then multiplies, like `quantization.QuantizedLinear`
(simple and exact; the bytes are what it saves, not time).

In the engine: calibration needs the model itself (GPTQ runs it layer by layer), so the layers are
made first (`calibration.calibrate_model`) and the engine takes that model with a factory that hands
each decoder linear its calibrated layer:

    layers = calibrate_model(model, ids, method)          # {name: CalibratedLinear}, model unchanged
    llm = LLM(model=(model, tokenizer), quantization="int4", hooks=EngineHooks(linear=by_identity(model, layers)))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.model.groupwise import GroupwiseWeight, check_bits, pack_levels, unpack_levels


class CalibratedLinear(nn.Module):
    """A linear layer stored on the group-wise grid, with AWQ's input scale if it has one."""

    def __init__(
        self,
        weight: GroupwiseWeight,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        method: str = "rtn",
    ):
        super().__init__()
        check_bits(weight.bits)
        self.out_features, self.in_features = weight.levels.shape
        if input_scale is not None and tuple(input_scale.shape) != (self.in_features,):
            raise ValueError(f"input_scale must be [{self.in_features}], got {tuple(input_scale.shape)}")
        self.bits, self.group_size, self.method = weight.bits, weight.group_size, method
        self.register_buffer("weight_packed", pack_levels(weight.levels, weight.bits))
        self.register_buffer("weight_scale", weight.scale.float().clone())
        self.register_buffer("weight_zero", weight.zero.to(torch.uint8))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def grid_weight(self) -> GroupwiseWeight:
        levels = unpack_levels(self.weight_packed, self.bits, self.in_features)
        return GroupwiseWeight(levels, self.weight_scale, self.weight_zero.float(), self.bits, self.group_size)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer multiplies x / input_scale by."""
        return self.grid_weight().dequantize()

    def effective_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] it stands for: dequantized / input_scale (x W_eff^T = forward)."""
        w = self.dequantized_weight()
        return w if self.input_scale is None else w / self.input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {tuple(x.shape)}")
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    @property
    def nbytes(self) -> int:
        """Packed levels + scales + zero points + AWQ's input scale (the bias is not counted)."""
        extra = 0 if self.input_scale is None else self.input_scale.nbytes
        return self.weight_packed.nbytes + self.weight_scale.nbytes + self.weight_zero.nbytes + extra

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.method}, "
            f"int{self.bits}, group_size={self.group_size}"
        )


def by_identity(model: nn.Module, layers: dict[str, nn.Module]):
    """A factory for `EngineHooks(linear=...)`: linear -> the layer `layers` holds for it, found by the
    linear's name in `model` (as `model.named_modules()` names it). KeyError names a linear not in it."""
    names = {id(module): name for name, module in model.named_modules()}

    def make(linear: nn.Linear) -> nn.Module:
        name = names.get(id(linear))
        if name not in layers:
            raise KeyError(
                f"no calibrated layer for {name or 'a linear outside this model'}: calibrate this model "
                "(calibration.calibrate_model) and pass the same model to the engine"
            )
        return layers[name]

    return make


__all__ = ["CalibratedLinear", "by_identity"]

"""Int8 weights for the compiled decode step: every linear layer, the lm_head included.

Batch-1 decode on a CPU is bound by memory: every weight byte crosses the memory bus once
per token. An int8 weight is a quarter of a float32 one, but only if the multiply reads the
int8 bytes themselves. `Int8Linear` (decodelab.model.quantization) does when it runs under
`torch.compile`: it writes the product of a row as a plain sum,

    y[..., o] = (sum_i x[..., i] * float(weight_q[o, i])) * weight_scale[o] + bias[o],

which inductor's C++ backend turns into one vectorized loop over the int8 bytes: convert,
multiply, add, with no float copy of the weight anywhere. Eager code (the prefill, which runs
once per request) takes its block-of-rows form. Both give the same numbers up to float
rounding order.

`quantize_for_decode(model)` differs from `quantize_model` (decoder layers only, as the course's
engine does) in that it swaps the lm_head too: the lm_head is a fifth of SmolLM2's bytes, so it
is quantized as well (its tied embedding stays float, as a lookup table it reads one row per
token).

The serving engine cannot run `CompiledDecoder`'s whole step (its KV cache is paged, its batches
change every step), so `RowCompiledInt8Linear` compiles the one part where int8 pays: an
`Int8Linear`'s product for one row (each linear of a batch-1 decode step), `fused_int8_product`
under `torch.compile` with dynamic shapes, one graph for every layer shape. Other inputs (a prefill,
a batched decode step) take `Int8Linear`'s eager form. `LLM(quantization="int8")` builds its layers
this way when it compiles (`compile_decode`, on by default where it pays: `compile_by_default`).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from decodelab.model.quantization import Int8Linear, fused_int8_product

COMPILE_ENV = "DECODELAB_COMPILE"  # "0": nothing compiles unless asked by name (the test suite sets it)


def compile_by_default() -> bool:
    """Should a path that compiles where it pays do so? False when DECODELAB_COMPILE=0 (the tests:
    a compile costs tens of seconds on a small CPU), else True."""
    return os.environ.get(COMPILE_ENV, "1").strip() != "0"


def quantize_for_decode(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in `model` (decoder layers and lm_head) by an `Int8Linear`,
    in place; returns the model. A tied embedding keeps its float weight for the lookup."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, linear in targets:
        setattr(parent, name, Int8Linear.from_linear(linear))
    return model


@functools.cache
def compiled_int8_product():
    """`fused_int8_product` under torch.compile, dynamic shapes: one graph serves every layer shape
    (the rows dimension is specialized to 1, the case it is called for). Compiled on first call;
    inductor keeps the code in its on-disk cache for the next process."""
    return torch.compile(fused_int8_product, fullgraph=True, dynamic=True)


class RowCompiledInt8Linear(nn.Module):
    """An `Int8Linear` whose one-row products run compiled: x [..., in] holding one row -> the compiled
    sum over the int8 bytes (`compiled_int8_product`); any other x -> the layer's own eager forward.
    Same numbers as the layer up to float rounding order. `layer` keeps the weights (weight_q int8
    [out, in], weight_scale [out, 1], bias)."""

    def __init__(self, layer: Int8Linear):
        super().__init__()
        self.layer = layer
        self.in_features, self.out_features = layer.in_features, layer.out_features

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "RowCompiledInt8Linear":
        """Quantize an nn.Linear as `Int8Linear.from_linear` does (per output row)."""
        return cls(Int8Linear.from_linear(linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features or x.numel() != self.in_features:
            return self.layer(x)
        layer = self.layer
        out = compiled_int8_product()(x.reshape(1, self.in_features), layer.weight_q, layer.weight_scale, layer.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes

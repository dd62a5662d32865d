"""Prepacked linear weights for CPU inference (oneDNN), as IPEX and vLLM's CPU backend do.

On a CPU, `torch.nn.functional.linear` in bfloat16 hands the weight to oneDNN in its plain
row-major layout, and oneDNN rearranges it into the blocked layout its matrix kernels
(AMX tiles, AVX-512 BF16) read, on every call. A decode step reads every weight once, so
that rearrangement is a second pass over all the weights per step. Packing each weight once,
up front (`torch.ops.mkldnn._reorder_linear_weight`), removes it. On this project's 2-core
CPU, with bit-identical results: the 210 matrix products of one SmolLM2 layer stack, timed
alone, took 25-35% less time at 1 to 32 rows; a whole engine decode step, 15% less at 1 to 8
sequences and 2% at 32 (paired, interleaved steps: the wider the batch, the more a step
spends outside the weights). `bench/serving.py --unpacked` measures the engine both ways.

`prepack_linear_layers(model)` swaps every `nn.Linear` in a model (lm_head included) for a
`PackedLinear`; the serving engine does it by default on a CPU in bfloat16
(`LLM(prepack_weights=...)`). Only for inference: a packed weight is an opaque oneDNN tensor
(no autograd, no `state_dict`, no `.weight` to read), and on other devices or dtypes
nothing changes.

Shapes: x [..., in_features] -> [..., out_features].
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

PACKING_BATCH_HINT = 32  # rows the packed layout is tuned for (any row count works)


def can_prepack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True where packing helps and works: a CPU with oneDNN whose bfloat16 kernels run here,
    bfloat16 weights. (In float32 this CPU's default path is already faster at one row than a
    packed weight.)"""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and _cpu_packs_bfloat16()


@functools.cache
def _cpu_packs_bfloat16() -> bool:
    """Whether this CPU and torch build pack and multiply a bfloat16 weight with oneDNN.

    oneDNN's bfloat16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU
    the reorder raises, so a tiny weight is packed and used once, and the answer is kept."""
    if not (
        torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    try:
        weight = torch.ones(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.all(out == 16))


def check_packable(weight: torch.Tensor) -> None:
    """ValueError naming the problem unless `can_prepack` holds for this weight."""
    if not can_prepack(weight.device, weight.dtype):
        raise ValueError(
            f"cannot prepack a {weight.dtype} weight on {weight.device}: packing needs bfloat16 "
            f"on a CPU with oneDNN (see decodelab.model.packed_linear.can_prepack)"
        )


class PackedLinear(nn.Module):
    """An inference-only `nn.Linear` whose weight is stored in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """weight [out_features, in_features], bias [out_features] or None (an nn.Linear's)."""
        super().__init__()
        weight = weight.detach()
        check_packable(weight)
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().clone()
        self.dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in the weight's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features).to(self.dtype).contiguous()  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def prepack_linear_layers(model: nn.Module) -> int:
    """Replace every `nn.Linear` inside `model` by a `PackedLinear`, in place; returns how many.

    Raises ValueError (and changes nothing) if the weights are not packable (`can_prepack`).
    Quantized layers (`decodelab.model.quantization`) are not `nn.Linear` and stay as they are."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for _, _, linear in targets:
        check_packable(linear.weight)
    for parent, name, linear in targets:
        setattr(parent, name, PackedLinear(linear.weight, linear.bias))
    return len(targets)


def prepacked_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with packed linear layers that shares every other tensor with it
    (embeddings, norms, buffers); `model` itself is left as it was."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    clone = copy.deepcopy(model, memo=shared)
    prepack_linear_layers(clone)
    return clone

"""The decoder's SwiGLU MLP on Q4_1 blocks in one C call: `Q4SwiGLU`.

`llama.MLP` computes down(silu(gate(x)) * up(x)): three products and two elementwise operations,
five calls from Python for every layer and token. When its three linears are `Q4Linear`s
(`use_gguf_q4_weights`), `Q4SwiGLU` does the same in one call of `q4_kernel.q4_1_swiglu` for up to
`SWIGLU_MAX_ROWS` rows of x: one parallel region, each thread first a range of the hidden units
(gate, up, silu · up), then past a spin barrier a range of the outputs (whole rows of down), so a
sleeping OpenMP team (OMP_WAIT_POLICY=PASSIVE) wakes once for the MLP instead of once per product.
The result equals the three `Q4Linear`s' up to rounding (silu through C's expf, which can move a
hidden value by one 16-bit step where down reads it);
more rows, another device or dtype, or a forward hook on one of the three take those three layers.
"""

from __future__ import annotations

import torch
from torch import nn

from decodelab.model.block_linear import BlockLinear
from decodelab.model.llama import MLP
from decodelab.model.q4_kernel import SWIGLU_MAX_ROWS, q4_1_swiglu


def is_q4(layer: nn.Module) -> bool:
    """A Q4_1 block layer without bias (what the fused Q4 kernels take)."""
    return isinstance(layer, BlockLinear) and layer.FORMAT == "Q4_1" and layer.bias is None


class Q4SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the three `Q4Linear` [F, E], [F, E], [E, F] kept
    under `llama.MLP`'s names (hooks and state dicts see the same modules)."""

    def __init__(self, gate_proj: BlockLinear, up_proj: BlockLinear, down_proj: BlockLinear):
        super().__init__()
        if not all(is_q4(layer) for layer in (gate_proj, up_proj, down_proj)):
            raise TypeError("Q4SwiGLU takes three Q4Linear layers without bias")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def fused(self, x: torch.Tensor) -> bool:
        """Will forward(x) run the one C call? Up to SWIGLU_MAX_ROWS rows the kernel takes, and no
        forward hook on the three layers (or a global one) that expects them to run."""
        rows = x.numel() // self.gate_proj.in_features
        return rows <= SWIGLU_MAX_ROWS and self.gate_proj.uses_kernel(x) and not self._hooked()

    def _hooked(self) -> bool:
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        layers = (self.gate_proj, self.up_proj, self.down_proj)
        return any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., E] -> [..., E]."""
        if not self.fused(x):
            return MLP.forward(self, x)  # the three layers under llama.MLP's names, as llama.MLP runs them
        hidden = self.gate_proj.in_features
        blocks = (self.gate_proj.blocks(), self.up_proj.blocks(), self.down_proj.blocks())
        return q4_1_swiglu(x.reshape(-1, hidden), *blocks).view(x.shape)


def use_q4_swiglu(model: nn.Module) -> int:
    """Replace, in place, every `llama.MLP` of `model` whose three linears are Q4Linear by a
    `Q4SwiGLU` holding them; returns how many were replaced."""
    swaps = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, MLP)
        and all(is_q4(layer) for layer in (module.gate_proj, module.up_proj, module.down_proj))
    ]
    for name, module in swaps:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, Q4SwiGLU(module.gate_proj, module.up_proj, module.down_proj))
    return len(swaps)


__all__ = ["Q4SwiGLU", "use_q4_swiglu"]

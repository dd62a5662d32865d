"""A decoder layer whose weights are all Q4_1 blocks, in two C calls around its attention: `Q4DecoderLayer`.

`llama.DecoderLayer` on `Q4Linear`s (`use_gguf_q4_weights`) still runs some forty small torch
operations per token besides its products: two RMSNorms, the views and RoPE of q and k, two residual
adds, each a trip through Python and the dispatcher. On a CPU they took about as long as the
products themselves. `Q4DecoderLayer` keeps the same modules under the same names (state dicts and
the engine's forward hook see nothing new) and, for float32 CPU inputs of up to `SWIGLU_MAX_ROWS`
rows, runs

    q, k, v = q4_1_attention_inputs(x)     RMSNorm, the q/k/v products, RoPE on q and k  (one C call)
    out = attention over the cache          the same `Attention.attend` as the module's
    x = q4_1_attention_output_and_mlp(...)  o_proj, residual, RMSNorm, the SwiGLU MLP, residual  (one C call)

The result equals the modules' to rounding (the norms' and products' sums run in another order, so
a value read as a 16-bit integer by the next product can land one step away; RoPE is the same
operations). Anything else (more rows, another device or dtype, autograd,
torch.compile, a forward hook on the layer or one of its modules) runs `DecoderLayer.forward` itself.
"""

from __future__ import annotations

import torch
from torch import nn

from decodelab.model import q4_kernel, weight_moves
from decodelab.model.llama import DecoderLayer
from decodelab.model.q4_kernel import SWIGLU_MAX_ROWS
from decodelab.model.q4_swiglu import Q4SwiGLU, is_q4


class Q4DecoderLayer(DecoderLayer):
    """A `DecoderLayer` (input_layernorm, self_attn, post_attention_layernorm, mlp: a `Q4SwiGLU`)
    whose four attention linears are Q4Linear; built from one by `from_layer`."""

    @classmethod
    def from_layer(cls, layer: DecoderLayer) -> "Q4DecoderLayer":
        """The same modules (not copies) under a `Q4DecoderLayer`; TypeError unless they are Q4."""
        attention = layer.self_attn
        projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        if not all(is_q4(linear) for linear in projections) or not isinstance(layer.mlp, Q4SwiGLU):
            raise TypeError("Q4DecoderLayer needs Q4Linear q/k/v/o projections without bias and a Q4SwiGLU MLP")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.input_layernorm, fused.self_attn = layer.input_layernorm, attention
        fused.post_attention_layernorm, fused.mlp = layer.post_attention_layernorm, layer.mlp
        object.__setattr__(fused, "_watched", tuple(fused.modules()))  # not a submodule: the hooks' places
        return fused

    def fused(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Will forward run the two C calls? `takes(x, cos)`, and no forward hook expects the modules."""
        return self.takes(x, cos) and not self._hooked()

    @staticmethod
    def takes(x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Would the C calls take these inputs? Float32 CPU x [B, T, E] of up to SWIGLU_MAX_ROWS rows,
        cos [T, D], no autograd, not compiling, the kernel loaded."""
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() != 3 or cos.dim() != 2 or cos.dtype != torch.float32:
            return False
        if x.shape[0] * x.shape[1] > SWIGLU_MAX_ROWS or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        return q4_kernel.kernel_loads()

    def c_weights(self) -> tuple[torch.Tensor, ...]:
        """The 23 tensors `q4_kernel.q4_1_decode_layers` reads for this layer, in its order:
        input_layernorm's weight, q/k/v/o_proj's (nibbles, d, m), post_attention_layernorm's weight,
        gate/up/down_proj's (nibbles, d, m). Read through the modules' own dicts (no `nn.Module`
        attribute lookups: a decode step asks every layer, every token)."""
        modules = self._modules
        attention, mlp = modules["self_attn"]._modules, modules["mlp"]._modules
        tensors = [modules["input_layernorm"]._parameters["weight"]]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += attention[name].blocks()
        tensors.append(modules["post_attention_layernorm"]._parameters["weight"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            tensors += mlp[name].blocks()
        return tuple(tensors)

    def hook_dicts(self) -> tuple[dict, ...]:
        """The forward hook and pre-hook dicts of this layer and of each of its modules, now: a hook
        registered later lands in one of them (torch adds to the dict, never replaces it)."""
        return tuple(hooks for module in self.modules() for hooks in (module._forward_hooks, module._forward_pre_hooks))

    def _hooked(self) -> bool:
        """Does a forward hook (global, or on this layer or one of its modules) expect the modules to run?"""
        if global_forward_hooks():
            return True
        return any(module._forward_hooks or module._forward_pre_hooks for module in self._watched)

    def _apply(self, fn, *args, **kwargs):
        """nn.Module's (`.to()`, `.half()`, ...), counted by `weight_moves`: the norms' weights may be
        new tensors after it, which no registration hook announces."""
        weight_moves.moved()
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """x [B, T, E] -> [B, T, E], as `DecoderLayer.forward`."""
        if not self.fused(x, cos):
            return DecoderLayer.forward(self, x, cos, sin, kv_cache)
        b, t, e = x.shape
        attention, mlp = self.self_attn, self.mlp
        heads, kv_heads, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
        rows = x.reshape(b * t, e)
        norm = self.input_layernorm
        q, k, v = q4_kernel.q4_1_attention_inputs(
            rows,
            norm.weight,
            norm.eps,
            (attention.q_proj.blocks(), attention.k_proj.blocks(), attention.v_proj.blocks()),
            cos.contiguous(),
            sin.contiguous(),
            d,
        )
        out = attention.attend(
            q.view(b, t, heads, d).transpose(1, 2),  # [B, H, T, D]
            k.view(b, t, kv_heads, d).transpose(1, 2),  # [B, H_kv, T, D]
            v.view(b, t, kv_heads, d).transpose(1, 2),
            kv_cache,
        )
        norm = self.post_attention_layernorm
        y = q4_kernel.q4_1_attention_output_and_mlp(
            rows,
            out.transpose(1, 2).reshape(b * t, heads * d),
            attention.o_proj.blocks(),
            norm.weight,
            norm.eps,
            (mlp.gate_proj.blocks(), mlp.up_proj.blocks(), mlp.down_proj.blocks()),
        )
        return y.view(b, t, e)


def global_forward_hooks() -> bool:
    """Is a forward hook or pre-hook registered for every module (`nn.modules.module`'s global ones)?"""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def use_q4_layers(model: nn.Module) -> int:
    """Replace, in place, every `DecoderLayer` of `model` whose linears are all Q4 (a `Q4SwiGLU` MLP:
    call `use_q4_swiglu` first) by a `Q4DecoderLayer` holding its modules; returns how many."""
    swaps = []
    for name, module in model.named_modules():
        if type(module) is DecoderLayer:
            try:
                swaps.append((name, Q4DecoderLayer.from_layer(module)))
            except TypeError:
                continue
    for name, fused in swaps:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child_name, fused)
    return len(swaps)


__all__ = ["Q4DecoderLayer", "use_q4_layers"]

"""A decode step through every Q4 decoder layer in one C call: `Q4Backbone`.

Each `Q4DecoderLayer` runs as two C calls around its attention, but between them a token still
crossed Python for each layer: the two wrappers' scratch and pointers, the views of q, k and v, the
cache's append, SDPA, the module calls. That was ~100 µs a layer, some 3 ms of a SmolLM2 token,
once the products had become fast. For the commonest call of all, a decode step (one new token per
sequence over a `KVCache`), `Q4Backbone.run_layers` hands the whole stack to
`q4_kernel.q4_1_decode_layers`: for each layer the operations of its two halves, and between them
the cache write and the attention over the cache (`csrc/paged_decode.c`), all in C, in one parallel
region (a sleeping OpenMP team wakes once a token). The
engine's decode step (`LLM`, the server) goes the same way over its paged store
(`q4_1_decode_layers_paged`) when its `PagedBatch` holds decodes only and
the library's attention: the cache offers `decode_tables()`, the block tables, context lengths and
slots of its sequences in row order (the model package names no engine class).

The result is the layers' own to rounding: the same C halves, and an attention that sums in another
order than SDPA. Anything else runs `Backbone.run_layers` (each layer in turn): a prefill or several
tokens, another cache (the sliding ring, an engine step with a prefill or an attention hook), a full
cache (whose error the modules raise), another device or dtype, autograd, torch.compile, a forward
hook anywhere in a layer, or a layer that is not a `Q4DecoderLayer`.
"""

from __future__ import annotations

import torch
from torch import nn

from decodelab.model import q4_kernel, weight_moves
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import Backbone
from decodelab.model.q4_kernel import SWIGLU_MAX_ROWS
from decodelab.model.q4_layer import Q4DecoderLayer, global_forward_hooks


class Q4Backbone(Backbone):
    """A `Backbone` (embed_tokens, layers, norm: the same modules) whose layers are `Q4DecoderLayer`s
    and whose decode steps run in one C call; built from one by `from_backbone`."""

    @classmethod
    def from_backbone(cls, backbone: Backbone) -> "Q4Backbone":
        """The same modules (not copies) under a `Q4Backbone`; TypeError unless every layer is a
        `Q4DecoderLayer` whose attention reads the cache layer of its own index, all of one shape."""
        layers = list(backbone.layers)
        if not layers or not all(isinstance(layer, Q4DecoderLayer) for layer in layers):
            raise TypeError("Q4Backbone needs every layer to be a Q4DecoderLayer")
        shapes = {
            (
                layer.self_attn.num_heads,
                layer.self_attn.num_kv_heads,
                layer.self_attn.head_dim,
                layer.mlp.gate_proj.out_features,
                layer.input_layernorm.eps,
                layer.post_attention_layernorm.eps,
            )
            for layer in layers
        }
        if len(shapes) > 1 or any(layer.self_attn.layer_idx != index for index, layer in enumerate(layers)):
            raise TypeError("Q4Backbone needs layers of one shape, each reading the cache layer of its own index")
        stack = cls.__new__(cls)
        nn.Module.__init__(stack)
        stack.embed_tokens, stack.layers, stack.norm = backbone.embed_tokens, backbone.layers, backbone.norm
        stack._layout = None
        return stack

    def decodes_in_one_call(self, x: torch.Tensor, cos: torch.Tensor, kv_cache) -> bool:
        """Will run_layers make the one C call over a KVCache? x [B, 1, E] of up to SWIGLU_MAX_ROWS
        sequences, a `KVCache` (exactly) of float32 CPU tensors with room for one more position in
        every layer, and every layer would fuse x (`fusable`)."""
        if type(kv_cache) is not KVCache or x.dim() != 3 or x.shape[1] != 1 or x.shape[0] > SWIGLU_MAX_ROWS:
            return False
        keys, values = kv_cache.keys, kv_cache.values
        if keys.shape[:2] != (len(self.layers), x.shape[0]) or not _float32_cpu(keys, values):
            return False
        return max(kv_cache.lengths) < kv_cache.max_seq_len and self.fusable(x, cos)

    def paged_decode_tables(self, x: torch.Tensor, cos: torch.Tensor, kv_cache) -> tuple | None:
        """The engine's step in one C call: for a packed batch x [1, B, E] of B <= SWIGLU_MAX_ROWS
        decoding sequences whose cache offers `decode_tables()` (`engine.paged_attention.PagedBatch`:
        decodes only, the library's attention) over a float32 CPU store, with one cos row per
        sequence and every layer fusing x: (tables, lengths, slots) as it gives them; else None."""
        tables_of = getattr(kv_cache, "decode_tables", None)
        if tables_of is None or x.dim() != 3 or x.shape[0] != 1 or x.shape[1] > SWIGLU_MAX_ROWS:
            return None
        store = kv_cache.store
        if cos.dim() != 2 or cos.shape[0] != x.shape[1] or store.keys.shape[0] != len(self.layers):
            return None
        if not _float32_cpu(store.keys, store.values) or not self.fusable(x, cos):
            return None
        tables = tables_of()
        return tables if tables is not None and tables[0].shape[0] == x.shape[1] else None

    def fusable(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        """Would every layer fuse x (`Q4DecoderLayer.fused`: dtype, device, autograd, compile, the
        kernel, no forward hook on the layer or one of its modules, all layers Q4DecoderLayers)?"""
        layout = self.layout()
        if layout is None or not Q4DecoderLayer.takes(x, cos) or global_forward_hooks():
            return False
        return not any(layout.hook_dicts)

    def layout(self) -> "_Layout | None":
        """What the one-call step reads of the layers, kept while `weight_moves.moves()` stands still
        (nothing registered or assigned a module, parameter or buffer, no `.to()`): their weight
        tensors, the table of addresses of these, and their forward hook dicts. Walking 30 layers'
        modules for them cost ~1 ms a token, most of it cache misses: the step streams ~100 MB of
        weights past the module objects. None while a layer is not a `Q4DecoderLayer`."""
        layout = self._layout
        if layout is not None and layout.moves == weight_moves.moves():
            return layout
        moves, layers = weight_moves.moves(), list(self.layers)
        if not all(isinstance(layer, Q4DecoderLayer) for layer in layers):
            return None
        tensors = tuple(tensor for layer in layers for tensor in layer.c_weights())
        hook_dicts = tuple(hooks for layer in layers for hooks in layer.hook_dicts())
        self._layout = _Layout(moves, len(layers), tensors, hook_dicts)
        return self._layout

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """x [B, T, E] -> [B, T, E], as `Backbone.run_layers`."""
        contiguous = self.decodes_in_one_call(x, cos, kv_cache)
        paged = None if contiguous else self.paged_decode_tables(x, cos, kv_cache)
        if not contiguous and paged is None:
            return super().run_layers(x, cos, sin, kv_cache)
        first = self.layers[0]
        rows = x.reshape(-1, x.shape[-1]).clone()  # updated in place, layer by layer
        shared = (rows, self._layout.addresses(), first.input_layernorm.eps, cos.contiguous(), sin.contiguous())
        heads, hidden = first.self_attn.num_heads, first.mlp.gate_proj.out_features
        if contiguous:
            cache = (kv_cache.keys, kv_cache.values, kv_cache.lengths, kv_cache.sliding_window)
            q4_kernel.q4_1_decode_layers(*shared, *cache, heads, hidden)
            kv_cache.lengths = [length + 1 for length in kv_cache.lengths]
        else:
            store = kv_cache.store
            cache = (store.keys, store.values, *paged, kv_cache.sliding_window)
            q4_kernel.q4_1_decode_layers_paged(*shared, *cache, heads, hidden)
        return rows.view(x.shape)


class _Layout:
    """A `Q4Backbone`'s layers as the one-call step reads them (`Q4Backbone.layout`), at the count
    `moves` of `weight_moves`: the L layers' weight tensors in `Q4DecoderLayer.c_weights`' order, and
    their forward hook dicts (a hook registered since lands in one of them)."""

    def __init__(self, moves: int, layers: int, tensors: tuple[torch.Tensor, ...], hook_dicts: tuple[dict, ...]):
        self.moves, self.layers, self.tensors, self.hook_dicts = moves, layers, tensors, hook_dicts
        self.pointers: list[int] = []
        self.table = torch.empty(0, dtype=torch.int64)

    def addresses(self) -> torch.Tensor:
        """int64 [L, 23], the tensors' addresses, read again every call: `tensor.data = other` or
        `set_()` moves a tensor's storage without registering anything."""
        pointers = [tensor.data_ptr() for tensor in self.tensors]
        if pointers != self.pointers:
            self.pointers, self.table = pointers, torch.tensor(pointers, dtype=torch.int64).view(self.layers, -1)
        return self.table


def _float32_cpu(keys: torch.Tensor, values: torch.Tensor) -> bool:
    return (
        keys.dtype == values.dtype == torch.float32
        and keys.is_cpu
        and values.is_cpu
        and keys.is_contiguous()
        and values.is_contiguous()
    )


def use_q4_backbone(model: nn.Module) -> bool:
    """Replace, in place, `model.model` (a `Backbone`) by a `Q4Backbone` holding its modules when
    every layer is a `Q4DecoderLayer` (call `use_q4_layers` first); returns whether it did."""
    backbone = getattr(model, "model", None)
    if type(backbone) is not Backbone:
        return False
    try:
        model.model = Q4Backbone.from_backbone(backbone)
    except TypeError:
        return False
    return True


__all__ = ["Q4Backbone", "use_q4_backbone"]

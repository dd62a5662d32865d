"""The Llama forward pass as plain functions over a state dict: notebook 01's exercises.

`decodelab.model.llama` is the same model written as nn.Modules. Here every step is a function
of tensors and of the weights by their Hugging Face names (``model.state_dict()``:
``"model.layers.3.self_attn.q_proj.weight"``, ...), so that each can be written and checked on
its own against the library:

    rms_norm       x / sqrt(mean(x^2) + eps) * weight, computed in float32
    rope           rotate the channel pairs (i, i + D/2) of q or k by position * theta^(-2i/D)
    attention      store the new K/V in a cache, then causal attention with grouped K/V heads
    mlp            SwiGLU: down(silu(gate(x)) * up(x))
    decoder_layer  x + attention(norm(x)), then + mlp(norm(x))
    forward        token embedding -> decoder layers -> final norm -> lm_head

**One attention interface.** A decoder layer never touches a cache. It hands the new tokens'
queries, keys and values to one callable,

    attend(layer_index, q, k, v) -> out    q [B, H, T, D]; k, v [B, H_kv, T, D]; out [B, H, T, D]

which stores k and v wherever this layer's keys and values live and attends q over everything
held (the T new tokens sit after the ones already held, and each sees only itself and what came
before). In notebook 01 that is ``functools.partial(attention, cache)`` over a contiguous
`decodelab.model.kv_cache.KVCache` (whose own ``cache.attend`` is the library's version of the
same callable). The engine's `decodelab.engine.paged_attention.PagedBatch.attend` is another: it
writes K/V into paged blocks and gathers them back, so `decoder_layer` and `forward` run over
paged blocks unchanged. The positions of the new tokens come in separately (``positions``),
since only the caller knows where they sit.

Rotary embeddings here are plain RoPE (``config.rope_scaling`` None, as in SmolLM2, Llama 2 and
Qwen2); Llama 3.1's scaled frequencies are `decodelab.model.rope.inverse_frequencies`, which
`forward` does not take: it refuses a scaled config rather than compute other logits.

Shapes: B batch, T new tokens, S tokens attended to (held before + new), H query heads, H_kv KV
heads, D head_dim, E hidden_size, F intermediate_size, V vocab_size.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from decodelab.lessons.gqa import group_query_attention
from decodelab.model.kv_cache import KVCache
from decodelab.model.rope import apply_rope, plain_inverse_frequencies


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight.

    x [..., E], weight [E] -> [..., E] in x's dtype. The mean of squares is taken in float32
    (in float16 the squares of values above 256 overflow), then cast back before the weight
    multiplies it, exactly as `decodelab.model.llama.RMSNorm` and `transformers` do.
    """
    x32 = x.float()
    mean_square = x32.pow(2).mean(dim=-1, keepdim=True)  # [..., 1]
    normed = x32 * torch.rsqrt(mean_square + eps)
    return weight * normed.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, rope_theta: float) -> torch.Tensor:
    """Rotary position embedding of x [B, heads, T, D] at integer positions [T]; returns x's shape and dtype.

    Channel i and channel i + D/2 form a pair, turned by the angle position * theta^(-2i/D)
    (i = 0 .. D/2 - 1). Inverse frequencies, angles, cos and sin are computed in float32 (as
    `decodelab.model.rope.rope_tables` does) and cast to x's dtype only for the rotation.
    """
    inv_freq = plain_inverse_frequencies(x.shape[-1], rope_theta).to(x.device)  # [D/2]
    angles = torch.outer(positions.to(torch.float32), inv_freq)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, D]: channel i and i + D/2 share an angle
    return apply_rope(x, angles.cos().to(x.dtype), angles.sin().to(x.dtype))


def attention(cache: KVCache, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over a KV cache: store this layer's new k, v, then attend q over all held tokens.

    q [B, H, T, D], k and v [B, H_kv, T, D] for the T new tokens; returns [B, H, T, D] in q's
    dtype. ``cache.append(layer_index, k, v)`` returns everything the layer holds, [B, H_kv, S, D]
    with S = held before + T; the new queries sit at positions S - T .. S - 1, each sees the keys
    at its own position and before (the causal mask, shifted by S - T), and query head h reads
    KV head h // (H / H_kv). ``functools.partial(attention, cache)`` is an ``attend`` callable.
    No sliding window (SmolLM2 has none).
    """
    num_new = k.shape[2]
    k_all, v_all = cache.append(layer_index, k, v)  # [B, H_kv, S, D]
    return group_query_attention(q, k_all, v_all, q_offset=k_all.shape[2] - num_new)


def mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), silu(z) = z * sigmoid(z).

    x [..., E]; gate_weight and up_weight [F, E], down_weight [E, F] (nn.Linear's [out, in]
    layout, as in the state dict) -> [..., E].
    """
    gate = F.linear(x, gate_weight)  # [..., F]
    up = F.linear(x, up_weight)  # [..., F]
    return F.linear(F.silu(gate) * up, down_weight)  # [..., E]


def _check_supported(config) -> None:
    if config.rope_scaling is not None:
        raise ValueError(
            f"this forward pass implements plain RoPE; the config has rope_scaling="
            f"{config.rope_scaling!r} (use decodelab.model.llama.LlamaForCausalLM)"
        )
    if config.sliding_window is not None:
        raise ValueError(
            f"this forward pass has no sliding window; the config has sliding_window="
            f"{config.sliding_window} (use decodelab.model.llama.LlamaForCausalLM)"
        )


def _split_heads(h: torch.Tensor, weights: dict, name: str, num_heads: int, head_dim: int) -> torch.Tensor:
    """The projection `name` (its weight, and its bias if the state dict has one) of h [B, T, E],
    split into heads: [B, num_heads, T, D]."""
    out = F.linear(h, weights[name + ".weight"], weights.get(name + ".bias"))  # [B, T, heads * D]
    return out.view(h.shape[0], h.shape[1], num_heads, head_dim).transpose(1, 2)


def decoder_layer(
    weights: dict, config, layer_index: int, x: torch.Tensor, positions: torch.Tensor, attend
) -> torch.Tensor:
    """One pre-norm decoder layer: x [B, T, E] -> [B, T, E].

    x = x + o_proj(attend(layer_index, rope(q), rope(k), v)) with q, k, v the projections of
    rms_norm(x) split into heads ([B, H, T, D] and [B, H_kv, T, D]); then
    x = x + mlp(rms_norm(x)). Weights by their HF names under ``model.layers.{layer_index}.``
    (q/k/v biases used when the state dict has them, as Qwen2's does). positions [T]: the new
    tokens' positions, for RoPE.
    """
    prefix = f"model.layers.{layer_index}."
    batch, num_new, _ = x.shape
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    h = rms_norm(x, weights[prefix + "input_layernorm.weight"], config.rms_norm_eps)
    q = _split_heads(h, weights, prefix + "self_attn.q_proj", heads, head_dim)  # [B, H, T, D]
    k = _split_heads(h, weights, prefix + "self_attn.k_proj", kv_heads, head_dim)  # [B, H_kv, T, D]
    v = _split_heads(h, weights, prefix + "self_attn.v_proj", kv_heads, head_dim)  # [B, H_kv, T, D]
    q, k = rope(q, positions, config.rope_theta), rope(k, positions, config.rope_theta)
    out = attend(layer_index, q, k, v)  # [B, H, T, D]
    out = out.transpose(1, 2).reshape(batch, num_new, heads * head_dim)  # [B, T, H * D]
    x = x + F.linear(out, weights[prefix + "self_attn.o_proj.weight"])
    h = rms_norm(x, weights[prefix + "post_attention_layernorm.weight"], config.rms_norm_eps)
    return x + mlp(
        h,
        weights[prefix + "mlp.gate_proj.weight"],
        weights[prefix + "mlp.up_proj.weight"],
        weights[prefix + "mlp.down_proj.weight"],
    )


def forward(
    weights: dict, config, input_ids: torch.Tensor, attend, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The whole model: input_ids [B, T] -> logits [B, T, V], float32.

    Token embedding (``model.embed_tokens.weight`` [V, E]), the config's decoder layers in order
    (each attends through ``attend(layer_index, q, k, v)``), the final RMSNorm
    (``model.norm.weight``) and the lm_head (``lm_head.weight`` [V, E]; a tied model's is the
    embedding table). positions [T]: where the new tokens sit; by default 0 .. T-1 (an empty
    cache); after S cached tokens, S .. S+T-1. Raises ValueError for rope_scaling or a sliding
    window, which this version does not implement.
    """
    _check_supported(config)
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    x = F.embedding(input_ids, weights["model.embed_tokens.weight"])  # [B, T, E]
    for layer_index in range(config.num_hidden_layers):
        x = decoder_layer(weights, config, layer_index, x, positions, attend)
    x = rms_norm(x, weights["model.norm.weight"], config.rms_norm_eps)
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return F.linear(x, lm_head).float()  # [B, T, V]


def cache_attend(cache: KVCache, attention_fn=attention):
    """The ``attend(layer_index, q, k, v)`` callable of `attention_fn` over `cache`."""
    return functools.partial(attention_fn, cache)


@torch.inference_mode()
def greedy_generate(
    weights: dict,
    config,
    prompt_ids: list[int],
    max_new_tokens: int,
    forward_fn=forward,
    attention_fn=attention,
    device=None,
    dtype=torch.float32,
) -> list[int]:
    """Greedy generation with `forward_fn` over a `KVCache` read through `attention_fn`: the new
    ids (always max_new_tokens of them; no stop token). Prefill feeds the prompt at positions
    0 .. P-1, each later step one token at the next position."""
    cache = KVCache(config, 1, len(prompt_ids) + max_new_tokens, device=device, dtype=dtype)
    attend = cache_attend(cache, attention_fn)
    inputs, held, new_ids = torch.tensor([list(prompt_ids)], device=device), 0, []
    for _ in range(max_new_tokens):
        positions = torch.arange(held, held + inputs.shape[1], device=device)
        logits = forward_fn(weights, config, inputs, attend, positions)  # [1, T, V]
        held += inputs.shape[1]
        new_ids.append(int(logits[0, -1].argmax()))
        inputs = torch.tensor([[new_ids[-1]]], device=device)
    return new_ids

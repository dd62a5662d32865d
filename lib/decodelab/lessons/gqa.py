"""Grouped-query attention (GQA) written out by hand, and mean-pooling KV heads.

H query heads share H_kv key/value heads: KV head j serves the H / H_kv consecutive query
heads j*n .. j*n + n - 1 (n = H / H_kv). The two extremes are the same code:

    MHA  H_kv = H   every query head has its own K and V   (GPT-3, our tiny model)
    GQA  1 < H_kv < H                                       (Llama 3: 32 / 8, SmolLM2: 9 / 3)
    MQA  H_kv = 1   all query heads share one K and V       (PaLM, Falcon-7B)

The KV cache stores only the H_kv heads, so it shrinks by H / H_kv; the queries, and the
model's width, stay as they were.

Converting an MHA checkpoint to GQA (Ainslie et al. 2023, "GQA: Training Generalized
Multi-Query Transformer Models from Multi-Head Checkpoints"): the K and V projections of
each group of consecutive heads are replaced by their mean, then the model is trained a
little more ("uptraining"). `pool_model_kv_heads` does the first step; without uptraining
quality drops, which the course measures as perplexity.

Shapes: B batch, H query heads, H_kv KV heads, T new tokens (queries), S keys
(S = q_offset + T), D head_dim, E hidden_size.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn

from decodelab.model.attention import causal_mask, repeat_kv
from decodelab.validation import is_int


def attention_kind(num_heads: int, num_kv_heads: int) -> str:
    """'MHA' (H_kv = H), 'MQA' (H_kv = 1) or 'GQA' (anything in between that divides H)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide num_heads ({num_heads}), got {num_kv_heads}")
    if num_kv_heads == num_heads:
        return "MHA"
    return "MQA" if num_kv_heads == 1 else "GQA"


def kv_head_for_query_head(query_head: int, num_heads: int, num_kv_heads: int) -> int:
    """Which KV head query head h reads: h // (H / H_kv), i.e. consecutive query heads share one."""
    attention_kind(num_heads, num_kv_heads)  # validates the pair
    if not 0 <= query_head < num_heads:
        raise ValueError(f"query_head must be in [0, {num_heads}), got {query_head}")
    return query_head // (num_heads // num_kv_heads)


def _attention_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> tuple[int, ...]:
    """(B, H, H_kv, T, S, D) of q [B, H, T, D] and k, v [B, H_kv, S, D]; ValueError if they do not fit."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"expected q [B, H, T, D] and k, v [B, H_kv, S, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    batch, num_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"the number of KV heads ({num_kv_heads}) must divide the number of query heads ({num_heads})")
    if q_offset < 0 or num_keys != q_offset + num_queries:
        raise ValueError(
            f"got {num_keys} keys for {num_queries} queries at q_offset={q_offset}; "
            f"expected q_offset + T = {q_offset + num_queries} keys"
        )
    return batch, num_heads, num_kv_heads, num_queries, num_keys, head_dim


def group_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
    """Causal attention of q [B, H, T, D] over k, v [B, H_kv, S, D]; returns [B, H, T, D] in q's dtype.

    The readable reference for `decodelab.model.attention.causal_attention` (which calls SDPA):
    the T queries sit at positions q_offset .. q_offset + T - 1 and each may look at every
    key at its own position or before (S = q_offset + T). Scores and softmax in float32.
    K and V are first copied to all H heads with `repeat_kv` ([B, H, S, D] each): the simple
    way, and the one `broadcast_gqa_attention` avoids.
    """
    _, num_heads, num_kv_heads, num_queries, num_keys, head_dim = _attention_shapes(q, k, v, q_offset)
    group_size = num_heads // num_kv_heads
    k = repeat_kv(k, group_size).float()  # [B, H, S, D]: query head h reads KV head h // group_size
    v = repeat_kv(v, group_size).float()  # [B, H, S, D]
    scores = q.float() @ k.transpose(-2, -1) / math.sqrt(head_dim)  # [B, H, T, S]
    allowed = causal_mask(num_queries, num_keys, q_offset, q.device)  # [T, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [B, H, T, S], each row sums to 1
    return (weights @ v).to(q.dtype)  # [B, H, T, D]


def broadcast_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0) -> torch.Tensor:
    """Causal grouped-query attention that never copies K or V: q [B, H, T, D] over k, v [B, H_kv, S, D]
    (S = q_offset + T); returns [B, H, T, D] in q's dtype, the same numbers as `group_query_attention`.

    Query head h = j*g + i (g = H / H_kv) reads KV head j = h // g, so q viewed as [B, H_kv, g, T, D]
    puts the g heads of group j next to their one K and V, which broadcast over the g axis as
    k.unsqueeze(2) [B, H_kv, 1, S, D]. The products fold g into the query rows, [B, H_kv, g*T, D]
    @ [B, H_kv, D, S], so every row of group j reads the same K in place. (`q5 @ k.unsqueeze(2)
    .transpose(-2, -1)` gives the same numbers, but torch.matmul expands and copies the broadcast
    K to [B, H_kv, g, D, S] before multiplying: the copy of `repeat_kv` again.) The query at
    position q_offset + t sees keys 0 .. q_offset + t; scores and softmax in float32. Tensors
    created: scores and weights [B, H, T, S] and the output, nothing of size [B, H, S, D].
    ValueError if H_kv does not divide H or S != q_offset + T.
    """
    batch, num_heads, num_kv_heads, num_queries, num_keys, head_dim = _attention_shapes(q, k, v, q_offset)
    group = num_heads // num_kv_heads
    rows = q.float().reshape(batch, num_kv_heads, group * num_queries, head_dim)  # [B, H_kv, g*T, D]
    scores = rows @ k.float().transpose(-2, -1) / math.sqrt(head_dim)  # [B, H_kv, g*T, S]: K read in place
    scores = scores.view(batch, num_kv_heads, group, num_queries, num_keys)  # [B, H_kv, g, T, S]
    allowed = causal_mask(num_queries, num_keys, q_offset, q.device)  # [T, S], broadcast over B, H_kv, g
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # over the keys
    out = weights.view(batch, num_kv_heads, group * num_queries, num_keys) @ v.float()  # [B, H_kv, g*T, D]
    return out.view(batch, num_heads, num_queries, head_dim).to(q.dtype)  # head j*g + i, as q had them


def gqa_decode_step(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int
) -> tuple[torch.Tensor, int]:
    """One decode step of grouped-query attention over a preallocated KV cache, and the bytes it reads.

    q [B, H, 1, D]: the new token's queries; k_new, v_new [B, H_kv, 1, D]: its key and value;
    k_cache, v_cache [B, H_kv, S_max, D]: the layer's cache, holding `length` positions. Writes
    k_new, v_new at position `length` (in place), then attends the query over positions
    0 .. length (the new token is the last, so nothing is masked) reading each KV head in place
    for its g = H / H_kv query heads, as `broadcast_gqa_attention` does; scores in float32.
    Returns (out [B, H, 1, D] in q's dtype, bytes_read), bytes_read = the bytes of the K and V
    rows the step reads, 2 * B * H_kv * (length + 1) * D * element size: H_kv, not H, sets it.
    ValueError if T != 1, H_kv does not divide H, or the cache is full (length >= S_max).
    """
    batch, num_heads, num_queries, head_dim = q.shape
    num_kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    if num_queries != 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"a decode step takes q [B, H, 1, D] with H a multiple of H_kv = {num_kv_heads}, got q {tuple(q.shape)}"
        )
    if not 0 <= length < max_len:
        raise ValueError(f"the cache holds {max_len} positions and {length} are taken: no room for one more")
    k_cache[:, :, length] = k_new[:, :, 0]  # the new token's row, in place
    v_cache[:, :, length] = v_new[:, :, 0]
    keys, values = k_cache[:, :, : length + 1], v_cache[:, :, : length + 1]  # views [B, H_kv, length + 1, D]
    group = num_heads // num_kv_heads
    rows = q.float().reshape(batch, num_kv_heads, group, head_dim)  # [B, H_kv, g, D]: the g heads of a group
    scores = rows @ keys.float().transpose(-2, -1) / math.sqrt(head_dim)  # [B, H_kv, g, length + 1]
    out = torch.softmax(scores, dim=-1) @ values.float()  # [B, H_kv, g, D]
    bytes_read = 2 * batch * num_kv_heads * (length + 1) * head_dim * k_cache.element_size()  # K and V rows
    return out.reshape(batch, num_heads, 1, head_dim).to(q.dtype), bytes_read


def pool_kv_heads(k_proj_weight: torch.Tensor, num_kv_heads_new: int, head_dim: int) -> torch.Tensor:
    """Mean-pool consecutive groups of KV heads in a k_proj (or v_proj) weight or bias.

    k_proj_weight [H_kv * D, E] (or a bias [H_kv * D]) -> [H_new * D, E] (or [H_new * D]),
    where new head i is the mean of old heads i*g .. i*g + g - 1, g = H_kv / H_new.
    Consecutive groups keep every query head attached to the mean of the KV heads it used
    to read (see `kv_head_for_query_head`). The mean is taken in float32 and returned in the
    input's dtype. ValueError if the rows are not whole heads of head_dim, or if num_kv_heads_new
    is not a divisor (>= 1) of the current number of KV heads.
    """
    rows = k_proj_weight.shape[0]
    if head_dim < 1 or rows % head_dim:
        raise ValueError(f"weight has {rows} rows, not a multiple of head_dim={head_dim}")
    num_kv_heads = rows // head_dim
    if (
        not isinstance(num_kv_heads_new, int)
        or not 1 <= num_kv_heads_new <= num_kv_heads
        or num_kv_heads % num_kv_heads_new
    ):
        raise ValueError(f"num_kv_heads_new must divide the current {num_kv_heads} KV heads, got {num_kv_heads_new!r}")
    group = num_kv_heads // num_kv_heads_new
    rest = k_proj_weight.shape[1:]  # (E,) for a weight, () for a bias
    heads = k_proj_weight.reshape(num_kv_heads_new, group, head_dim, *rest)  # [H_new, g, D, E]
    pooled = heads.float().mean(dim=1)  # [H_new, D, E]
    return pooled.reshape(num_kv_heads_new * head_dim, *rest).to(k_proj_weight.dtype)


def _pooled_linear(linear: nn.Linear, num_kv_heads: int, head_dim: int, pool=pool_kv_heads) -> nn.Linear:
    weight = linear.weight.detach()
    pooled = nn.Linear(
        weight.shape[1], num_kv_heads * head_dim, bias=linear.bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        pooled.weight.copy_(pool(weight, num_kv_heads, head_dim))
        if linear.bias is not None:
            pooled.bias.copy_(pool(linear.bias.detach(), num_kv_heads, head_dim))
    return pooled.requires_grad_(linear.weight.requires_grad)


def pool_model_kv_heads(model, num_kv_heads: int, pool=pool_kv_heads):
    """A copy of `model` with every layer's K/V heads mean-pooled down to num_kv_heads.

    The query and output projections are unchanged; k_proj and v_proj (and their biases)
    are pooled, and config.num_key_value_heads is updated, so the new model runs in the
    same engine and its KV cache is H_kv_old / num_kv_heads times smaller. The original
    model is left untouched. `pool` pools one weight or bias (the signature of
    `pool_kv_heads`; notebook 05 passes the learner's own).
    """
    config = model.config
    old = config.num_key_value_heads
    divisors = [n for n in range(1, old + 1) if old % n == 0]
    if not is_int(num_kv_heads) or num_kv_heads not in divisors:
        raise ValueError(
            f"num_kv_heads must divide the model's {old} KV heads (one of {divisors}), got {num_kv_heads!r}"
        )
    pooled = copy.deepcopy(model)  # keeps tied embeddings tied
    pooled.config = dataclasses.replace(config, num_key_value_heads=num_kv_heads, extra=dict(config.extra))
    for layer in pooled.model.layers:
        attn = layer.self_attn
        attn.k_proj = _pooled_linear(attn.k_proj, num_kv_heads, attn.head_dim, pool)
        attn.v_proj = _pooled_linear(attn.v_proj, num_kv_heads, attn.head_dim, pool)
        attn.num_kv_heads = num_kv_heads
    return pooled


__all__ = [
    "attention_kind",
    "kv_head_for_query_head",
    "group_query_attention",
    "broadcast_gqa_attention",
    "gqa_decode_step",
    "pool_kv_heads",
    "pool_model_kv_heads",
    "repeat_kv",
]

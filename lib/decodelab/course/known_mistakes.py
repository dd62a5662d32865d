"""The forward pass's known mistakes, for `decodelab.course.diagnosis`: at each point a model computes,
what commonly goes wrong, each mistake simulated from the library's own inputs to that point (so
"your values are exactly what this mistake gives" is a measured statement), and the patterns in a
difference that point at one (position 0 agrees but later ones differ: RoPE; a token's vector the right
way but the wrong length: the norm's statistic; only the last position agrees: the causal mask).

Points and shapes as in `decodelab.course.diagnosis`: B batch, T new tokens, S tokens held after
them, E hidden, H query heads, H_kv KV heads, D head size, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodelab.lessons import forward_pass as fp
from decodelab.model.attention import causal_mask
from decodelab.model.rope import plain_inverse_frequencies

LABELS = {
    "embedding": "the token embedding",
    "input_norm": "the input RMSNorm",
    "q": "the q projection",
    "k": "the k projection",
    "v": "the v projection",
    "q_rope": "RoPE applied to q",
    "k_rope": "RoPE applied to k",
    "attention": "attention (what attend returns)",
    "attn_residual": "o_proj and the residual add after attention",
    "post_norm": "the post-attention RMSNorm",
    "mlp": "the SwiGLU MLP",
    "layer_output": "the residual add after the MLP",
    "final_norm": "the final RMSNorm",
    "logits": "the lm_head (the logits)",
    "rope": "RoPE",
    "rms_norm": "an rms_norm call",
    "layer": "decoder_layer",
    "forward": "your forward",
}
_NORM = (
    "Common causes: eps left out or outside the square root, the mean taken over another dimension than the "
    "last, the weight not applied, the squares taken in float16."
)
_PROJECTION = (
    "Common causes: x @ W instead of x @ W.T (a weight is stored [out, in]); heads split with "
    ".view(B, H, T, D) instead of .view(B, T, H, D).transpose(1, 2); another projection's weight."
)
_ROPE = (
    "Common cause: rotating interleaved pairs (x0, x1), (x2, x3) instead of the two halves (x[:D/2], "
    "x[D/2:]) as Llama and Hugging Face do; also angles other than position * theta^(-2i/D)."
)
COMMON = {  # what to suspect at each point when no single known mistake gives your values
    "embedding": "Common cause: the embedding is a row lookup, weights['model.embed_tokens.weight'][input_ids].",
    "input_norm": _NORM,
    "post_norm": _NORM,
    "final_norm": _NORM,
    "rms_norm": _NORM,
    "q": _PROJECTION,
    "k": _PROJECTION,
    "v": _PROJECTION,
    "q_rope": _ROPE,
    "k_rope": _ROPE,
    "rope": _ROPE,
    "attention": (
        "Common causes: no causal mask, or one not shifted by the tokens already held; scores not divided "
        "by sqrt(D); KV head j serves query heads j*G .. j*G + G - 1 (repeat_interleave, not repeat)."
    ),
    "attn_residual": (
        "Common causes: a missing residual (x = x + o_proj(out)); out's heads merged without "
        ".transpose(1, 2) before the reshape to [B, T, H*D]."
    ),
    "mlp": "Common causes: SiLU on the up branch or on the product instead of on the gate alone; no SiLU.",
    "layer_output": "Common cause: a missing residual: x = x + mlp(rms_norm(x)), not x = mlp(...).",
    "logits": "Common causes: the final RMSNorm left out; another matrix than lm_head.weight [V, E] (x @ W.T).",
    "layer": "Common cause: shapes: x is [B, T, E], q [B, H, T, D], k and v [B, H_kv, T, D].",
    "forward": (
        "Common causes: a shape (x is [B, T, E], q [B, H, T, D], k and v [B, H_kv, T, D]), a weight's name, "
        "forward not returning the logits [B, T, V]."
    ),
}
NOT_REPEATED = (
    "Common cause: K/V heads not repeated for grouped-query attention: [B, H_kv, S, D] must become "
    "[B, H, S, D], each KV head serving H / H_kv consecutive query heads (repeat_interleave(H // H_kv, dim=1))."
)


@dataclass
class Inputs:
    """What the library computed in one pass (point key -> tensor, as `diagnosis` records it, plus "i.k_all"
    and "i.v_all", the keys and values layer i held), the weights, the config, that pass's input_ids
    [B, T] and positions [T], and the layer in question."""

    lib: dict
    weights: dict
    config: object
    ids: torch.Tensor
    positions: torch.Tensor
    layer: int

    def w(self, name: str) -> torch.Tensor:
        return self.weights[f"model.layers.{self.layer}.{name}.weight"]

    @property
    def stream(self) -> torch.Tensor:
        """The residual stream entering this layer, [B, T, E]."""
        return self.lib["embedding"] if self.layer == 0 else self.lib[f"{self.layer - 1}.layer_output"]


def _norm(point: str, c: Inputs) -> list:
    last = c.config.num_hidden_layers - 1
    x, weight = {
        "input_norm": lambda: (c.stream, c.w("input_layernorm")),
        "post_norm": lambda: (c.lib[f"{c.layer}.attn_residual"], c.w("post_attention_layernorm")),
        "final_norm": lambda: (c.lib[f"{last}.layer_output"], c.weights["model.norm.weight"]),
    }[point]()
    eps, x32 = c.config.rms_norm_eps, x.float()
    square_mean, centred = x32.pow(2).mean(-1, keepdim=True), x32 - x32.mean(-1, keepdim=True)
    return [
        (
            "eps left out: x / sqrt(mean(x^2)), which matters wherever a token's vector is small",
            lambda: weight * x32 * torch.rsqrt(square_mean),
        ),
        (
            "eps added outside the square root: x / (sqrt(mean(x^2)) + eps)",
            lambda: weight * x32 / (square_mean.sqrt() + eps),
        ),
        (
            "the mean of x, not of its squares (a negative mean has no square root: NaN)",
            lambda: weight * x32 * torch.rsqrt(x32.mean(-1, keepdim=True) + eps),
        ),
        (
            "the norm's weight not applied: multiply the normalized vector by weight",
            lambda: x32 * torch.rsqrt(square_mean + eps),
        ),
        (
            "dividing by the standard deviation (the mean subtracted): RMSNorm divides by the root mean square",
            lambda: weight * x32 * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps),
        ),
        (
            "LayerNorm's centring: RMSNorm subtracts no mean",
            lambda: weight * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps),
        ),
        (
            "the mean of squares over the first dimension, not the last (one number per token)",
            lambda: weight * x32 * torch.rsqrt(x32.pow(2).mean(0, keepdim=True) + eps),
        ),
        (
            "the squares taken in x's own dtype: above 256 they overflow float16; square in float32",
            lambda: weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)),
        ),
    ]


def _projection(point: str, c: Inputs) -> list:
    h = c.lib[f"{c.layer}.input_norm"]  # [B, T, E]
    heads = c.config.num_attention_heads if point == "q" else c.config.num_key_value_heads
    split = lambda y: y.view(y.shape[0], y.shape[1], heads, -1).transpose(1, 2)  # noqa: E731 [B, T, heads*D] -> [B, heads, T, D]
    proj = c.w(f"self_attn.{point}_proj")
    found = [
        ("x @ W instead of x @ W.T: a weight is stored [out, in]", lambda: split(h @ proj)),
        (
            "heads split with .view(B, H, T, D): view as [B, T, H, D], then .transpose(1, 2)",
            lambda: (h @ proj.T).reshape(h.shape[0], heads, h.shape[1], -1),
        ),
        (
            "the stream x projected, not rms_norm(x): each block reads a normalized copy",
            lambda: split(c.stream @ proj.T),
        ),
    ]
    found += [
        (
            f"{other}_proj's weight used for {point}",
            functools.partial(lambda o: split(h @ c.w(f"self_attn.{o}_proj").T), other),
        )
        for other in "qkv"
        if other != point
    ]
    if point == "v":
        found.append(
            (
                "RoPE applied to v: only q and k are rotated",
                lambda: fp.rope(split(h @ proj.T), c.positions, c.config.rope_theta),
            )
        )
    return found


def _rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    angles = torch.outer(positions.float(), plain_inverse_frequencies(x.shape[-1], theta).to(x.device))  # [T, D/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack(
        [even * angles.cos() - odd * angles.sin(), even * angles.sin() + odd * angles.cos()], -1
    ).flatten(-2)


def _rope(point: str, c: Inputs) -> list:
    x, theta = c.lib[f"{c.layer}.{point[0]}"], c.config.rope_theta  # the projection, [B, heads, T, D]
    return [
        (
            "rotating interleaved pairs (x0, x1), (x2, x3) instead of the two halves (x[:D/2], x[D/2:]) as Llama and "
            "Hugging Face do",
            lambda: _rope_interleaved(x, c.positions, theta),
        ),
        (
            "turning the new tokens by 0 .. T-1 instead of by `positions` (after S cached tokens they sit at S, S+1, ...)",
            lambda: fp.rope(x, torch.arange(x.shape[2], device=x.device), theta),
        ),
        ("rotating the wrong way: the rotated half is cat(-x[D/2:], x[:D/2])", lambda: fp.rope(x, -c.positions, theta)),
        ("RoPE not applied", lambda: x),
    ]


def _attention_as(q, k, v, allowed, tile: bool = False, scale: bool = True) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, H_kv, S, D] where allowed [T, S] (None: everywhere);
    tile: KV heads repeated [0, 1, 0, 1, ...]; scale: divide the scores by sqrt(D)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat(1, group, 1, 1) if tile else t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.double().transpose(-2, -1) / (math.sqrt(q.shape[-1]) if scale else 1.0)  # [B, H, T, S]
    scores = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v.double()


def _attention(point: str, c: Inputs) -> list:
    q, k_all, v_all = c.lib[f"{c.layer}.q_rope"], c.lib[f"{c.layer}.k_all"], c.lib[f"{c.layer}.v_all"]
    new, held = q.shape[2], k_all.shape[2] - q.shape[2]
    mask = lambda offset: causal_mask(new, k_all.shape[2], offset, q.device)  # noqa: E731
    return [
        (
            "no causal mask: each query also saw the tokens after it (the last position, which may see them all, agrees)",
            lambda: _attention_as(q, k_all, v_all, None),
        ),
        ("the scores not divided by sqrt(D)", lambda: _attention_as(q, k_all, v_all, mask(held), scale=False)),
        (
            "KV heads repeated [0, 1, 0, 1, ...] (repeat) instead of [0, 0, 1, 1, ...] (repeat_interleave): query head h "
            "reads KV head h // (H / H_kv)",
            lambda: _attention_as(q, k_all, v_all, mask(held), tile=True),
        ),
        (
            "the causal mask not shifted by the tokens already held: new query t sits at position held + t",
            lambda: _attention_as(q, k_all, v_all, mask(0)),
        ),
        (
            "attending over the new tokens only, not the ones held in the cache",
            lambda: _attention_as(q, k_all[:, :, held:], v_all[:, :, held:], causal_mask(new, new, 0, q.device)),
        ),
    ]


def _blocks(point: str, c: Inputs) -> list:
    i, lib = c.layer, c.lib
    if point == "attn_residual":
        out, o_proj = lib[f"{i}.attention"], c.w("self_attn.o_proj")
        merged = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # [B, T, H*D]
        return [
            ("the residual is missing: x = x + o_proj(out), not x = o_proj(out)", lambda: merged @ o_proj.T),
            ("the attention block's output never added: x left as it was", lambda: c.stream),
            ("the residual added to rms_norm(x) instead of x", lambda: lib[f"{i}.input_norm"] + merged @ o_proj.T),
            (
                "out's heads merged without .transpose(1, 2): [B, H, T, D] -> [B, T, H, D] before the reshape",
                lambda: c.stream + out.reshape(merged.shape) @ o_proj.T,
            ),
            ("o_proj applied as x @ W instead of x @ W.T", lambda: c.stream + merged @ o_proj),
        ]
    if point == "mlp":
        h, gate_w, up_w, down_w = lib[f"{i}.post_norm"], c.w("mlp.gate_proj"), c.w("mlp.up_proj"), c.w("mlp.down_proj")
        gate, up = h @ gate_w.T, h @ up_w.T  # [B, T, F]
        return [
            ("SiLU on the up branch instead of the gate", lambda: (gate * F.silu(up)) @ down_w.T),
            ("SiLU on the product of both branches instead of on the gate alone", lambda: F.silu(gate * up) @ down_w.T),
            ("no SiLU: the gate multiplies up as it is", lambda: (gate * up) @ down_w.T),
            (
                "the MLP read the stream x, not rms_norm(x)",
                lambda: fp.mlp(lib[f"{i}.attn_residual"], gate_w, up_w, down_w),
            ),
        ]
    if point == "layer_output":
        return [
            ("the residual is missing: x = x + mlp(rms_norm(x)), not x = mlp(...)", lambda: lib[f"{i}.mlp"]),
            ("the MLP's output never added: x left as it was", lambda: lib[f"{i}.attn_residual"]),
            ("the residual added to rms_norm(x) instead of x", lambda: lib[f"{i}.post_norm"] + lib[f"{i}.mlp"]),
        ]
    table = c.weights["model.embed_tokens.weight"]
    if point == "logits":
        head, last = c.weights.get("lm_head.weight", table), c.config.num_hidden_layers - 1
        return [
            (
                "the final RMSNorm is missing: the lm_head reads model.norm(x), not x",
                lambda: lib[f"{last}.layer_output"] @ head.T,
            ),
            (
                "the embedding table used as the lm_head: this model's lm_head.weight is a matrix of its own "
                "(tie_word_embeddings is False)",
                lambda: lib["final_norm"] @ table.T,
            ),
        ]
    return [
        ("the lm_head's rows looked up instead of the embedding table's", lambda: c.weights["lm_head.weight"][c.ids])
    ]


_KINDS = {
    "input_norm": _norm,
    "post_norm": _norm,
    "final_norm": _norm,
    "q": _projection,
    "k": _projection,
    "v": _projection,
    "q_rope": _rope,
    "k_rope": _rope,
    "attention": _attention,
}


def mistakes(point: str, inputs: Inputs) -> list[tuple[str, object]]:
    """(the mistake, a function that gives the values it would produce at `point`) for the known mistakes
    there; a function may raise (a mistake that cannot happen with these shapes): skip it."""
    return _KINDS.get(point, _blocks)(point, inputs)


def symptom(
    point: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    tol: float,
    position_agrees: list[bool],
    first_position: int,
    head_agrees: list[bool] | None,
) -> str:
    """A sentence about the pattern of a difference that points at its cause, or ''. position_agrees [T]:
    whether each new token's values agree (the first at first_position); head_agrees [H] for [B, H, T, D] points."""
    if torch.isnan(got).any() and not torch.isnan(expected).any():
        return (
            "Your values hold NaN: a square root of a negative number (the mean must be of the squares)."
            if point.endswith("norm")
            else "Your values hold NaN from here on."
        )
    if torch.isinf(got).any() and not torch.isinf(expected).any():
        return "Your values hold inf: something overflowed (in float16, squares above 65,504 do): square in float32."
    if point.endswith("norm"):
        g, e = got.double(), expected.double()
        scale = (g * e).sum(-1, keepdim=True) / (e * e).sum(-1, keepdim=True).clamp_min(1e-300)  # one number per token
        if (g - scale * e).abs().max() <= tol:
            return (
                "Every token's vector points the right way but has the wrong length: what you divide by (the "
                "mean of squares, eps, the square root) is off."
            )
    if point in ("q_rope", "k_rope") and first_position == 0 and position_agrees[0] and not all(position_agrees):
        return (
            "Position 0 agrees and later ones do not: RoPE turns position 0 by nothing, so the rotation itself is off."
        )
    if point == "attention" and len(position_agrees) > 1 and position_agrees[-1] and not any(position_agrees[:-1]):
        return (
            "Only the last position agrees: it is the one query allowed to see every key, so look at the causal mask."
        )
    if point == "attention" and head_agrees and any(head_agrees) and not all(head_agrees):
        agree = [h for h, ok in enumerate(head_agrees) if ok]
        return f"Query heads {agree} agree and the others do not: look at which KV head each query head reads."
    return ""

"""Scaled dot-product attention for a decoder: causal, with grouped-query K/V heads.

Queries may start part-way through the sequence (``q_offset``): with a KV cache the new
tokens sit at positions q_offset .. q_offset + T - 1 and may look at every cached key
before them. Grouped-query attention: H query heads share H_kv key/value heads, each KV
head serving H / H_kv consecutive query heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decodelab.model.thread_team import one_thread_if_small

# Since torch 2.5 SDPA reads grouped K/V heads itself (enable_gqa); expanding them with
# repeat_kv first would copy the whole cache to H heads at every decode step.
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

# Multiply-adds of q·k (B * H * T * S * D) below which SDPA runs on one thread while OpenMP's team
# sleeps (`thread_team`): one decode token's attention over a short context takes less alone
# than waking the team costs. Measured by bench/attention_threads.py.
ATTENTION_ONE_THREAD_BELOW = 1 << 19


def repeat_kv(x: torch.Tensor, num_queries_per_kv: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * num_queries_per_kv, S, D]: KV head j serves query heads
    j*n .. j*n + n - 1, as in Llama and `transformers`."""
    if num_queries_per_kv == 1:
        return x
    b, h_kv, s, d = x.shape
    return x[:, :, None].expand(b, h_kv, num_queries_per_kv, s, d).reshape(b, h_kv * num_queries_per_kv, s, d)


def causal_mask(
    num_queries: int, num_keys: int, q_offset: int, device=None, sliding_window: int | None = None
) -> torch.Tensor:
    """Boolean [T, S]: True where query t (at position q_offset + t) may attend to key s."""
    q_pos = torch.arange(q_offset, q_offset + num_queries, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0, sliding_window: int | None = None
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, H_kv, S, D] (S = q_offset + T); returns [B, H, T, D].

    The softmax runs in float32 inside SDPA for fp32 inputs; half-precision inputs use the
    backend's own accumulation, as `transformers` does.
    """
    num_queries, num_keys = q.shape[2], k.shape[2]
    if num_keys != q_offset + num_queries:
        raise ValueError(f"attention got {num_keys} keys for {num_queries} queries at offset {q_offset}")
    if sliding_window is None and num_queries == 1:
        return masked_attention(q, k, v)  # one new token sees everything before it
    if sliding_window is None and q_offset == 0:
        return masked_attention(q, k, v, is_causal=True)
    return masked_attention(q, k, v, causal_mask(num_queries, num_keys, q_offset, q.device, sliding_window))


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False
) -> torch.Tensor:
    """SDPA of q [B, H, T, D] over k, v [B, H_kv, S, D] with grouped KV heads; mask: boolean
    [T, S], or [B, 1, T, S] for a mask per sequence (True: may attend), or None for no mask
    (is_causal: SDPA's own causal mask). A query row with no allowed key comes out as zeros
    since PyTorch 2.5, as NaN before it."""
    group = q.shape[1] // k.shape[1]
    grouped = {}
    if group > 1 and SDPA_HAS_GQA:
        grouped = {"enable_gqa": True}
    elif group > 1:
        k, v = repeat_kv(k, group), repeat_kv(v, group)
    work = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    with one_thread_if_small(work, ATTENTION_ONE_THREAD_BELOW, q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **grouped)


class MaskedPass:
    """One forward pass without a KV cache whose attention follows a given mask: pass it as the
    model's `kv_cache`, `model(ids [B, T], positions, kv_cache=MaskedPass(mask))`. mask: boolean
    [T, T], or [B, 1, T, T] for a mask per sequence (a padded batch); True: query t may attend
    to key s. Give every row at least one True (an empty row is NaN before PyTorch 2.5)."""

    seq_len = 0  # nothing held before the pass: default positions start at 0

    def __init__(self, mask: torch.Tensor):
        if mask.dtype != torch.bool or mask.dim() not in (2, 4) or mask.shape[-1] != mask.shape[-2]:
            raise ValueError(
                f"MaskedPass needs a boolean [T, T] or [B, 1, T, T] mask, got {mask.dtype} {list(mask.shape)}"
            )
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D] of this pass -> [B, H, T, D]."""
        return masked_attention(q, k, v, self.mask)

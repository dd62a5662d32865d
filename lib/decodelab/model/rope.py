"""Rotary position embeddings (RoPE), with the Llama-3 and linear frequency scalings.

Pairs of channels (i, i + D/2) of every query and key are rotated by an angle that grows
with the token's position: position p turns pair i by p * theta^(-2i/D). Attention
scores then depend only on the distance between two tokens.
"""

from __future__ import annotations

import math

import torch

from decodelab.config import ModelConfig


def plain_inverse_frequencies(head_dim: int, rope_theta: float) -> torch.Tensor:
    """theta^(-2i/D) for the channel pairs i = 0 .. D/2 - 1, without any rope_scaling.
    Shape [head_dim / 2], float32."""
    # float32 throughout, exactly as `transformers` computes it: float64 here differs in the
    # last bit for some channels, which moves logits by ~1e-4 after a few hundred positions.
    return 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotation speed of each channel pair, after rope_scaling. Shape [head_dim / 2], float32."""
    inv_freq = plain_inverse_frequencies(config.head_dim, config.rope_theta)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: slow channels (long wavelengths) are stretched by `factor`, fast ones kept,
        # and the band in between is interpolated smoothly.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        smooth = (old_context / wavelength - low) / (high - low)
        scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
        in_band = (wavelength <= old_context / low) & (wavelength >= old_context / high)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(in_band, blended, scaled)
    return inv_freq.float()


def rope_tables(config: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position: two float32 tensors [max_position_embeddings, head_dim]."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(positions, inverse_frequencies(config))  # [S, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, D]: channel i and i + D/2 share an angle
    return angles.cos().to(device), angles.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, 1, T, D] (or [T, D]); returns x's shape and dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)

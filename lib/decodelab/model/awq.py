"""AWQ (Lin et al., 2023): activation-aware scaling of the input channels before group-wise rounding.

A weight column that meets large activations matters more: its rounding error is multiplied by
them. AWQ protects those columns without keeping any in float. For a per-input-channel scale
s [in] (all > 0),

    x W^T = (x / s) (W * s)^T      (W * s scales column i by s_i; x / s divides input i by s_i)

holds exactly in real arithmetic, so the float product is unchanged; but W * s is what gets
rounded, so a column scaled up by s_i > 1 is rounded on a relatively finer grid (its group's step
grows by less than the column does), and its error, divided by s_i again, shrinks. The scales
come from the calibration inputs X [N, in]:

    s = mean_over_tokens(|X|) ^ alpha,  normalised by sqrt(max(s) * min(s)) (as the reference code)

and alpha is searched on a grid (`ALPHAS`, 0 ... 1): the one whose quantized layer has the least
output error on the calibration inputs,

    loss(alpha) = mean over tokens and outputs of (X W^T - (X / s) Q(W * s)^T)^2,

with Q the group-wise round-to-nearest of `groupwise`. alpha = 0 is s = 1, plain RTN, so the chosen
scales are never worse than RTN on the calibration inputs. The layer then stores Q(W * s) and
divides its input by s (`calibrated_linear.CalibratedLinear`'s `input_scale`); the reference
implementation folds 1 / s into the previous RMSNorm or linear instead, which costs nothing at run
time. One s per linear here (the reference searches one for q/k/v together, as they share a norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodelab.model.groupwise import rtn

ALPHAS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1: the reference's grid


def input_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Calibration inputs x [N, in] (or [..., in]) -> mean |x| over tokens, float32 [in]."""
    return x.reshape(-1, x.shape[-1]).float().abs().mean(dim=0)


def awq_scales(magnitude: torch.Tensor, alpha: float) -> torch.Tensor:
    """mean |x| [in] -> s [in] = magnitude^alpha / sqrt(max * min) (all > 0; alpha 0 gives ones)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    s = magnitude.float().clamp(min=1e-4) ** alpha  # an input never active still gets a positive scale
    return s / (s.max() * s.min()).sqrt()


def scale_pair(w: torch.Tensor, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W * s, x / s): w [out, in] with column i times s_i, x [..., in] with input i divided by s_i."""
    return w * s[None, :], x / s


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor, s: torch.Tensor | None = None) -> float:
    """Mean of (x W^T - (x / s) Ŵ^T)^2 over tokens and outputs; Ŵ is the (scaled) weight the layer
    stores, w the float one [out, in], x [N, in]; s None: no scaling."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scaled = rows if s is None else rows / s
    return float((rows @ w.float().T - scaled @ w_hat.float().T).pow(2).mean())


@dataclass
class AwqSearch:
    """The search's outcome: alpha, its scales s [in], and the loss of every alpha tried."""

    alpha: float
    scales: torch.Tensor
    losses: dict[float, float]


def search_scales(
    w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int = 128, alphas=ALPHAS, symmetric: bool = False
) -> AwqSearch:
    """w [out, in], calibration inputs x [N, in] -> the alpha of `alphas` with the least `output_error`
    of the scaled, rounded weight (ties: the first, so the smallest alpha)."""
    if not alphas:
        raise ValueError("alphas must hold at least one value")
    rows = x.reshape(-1, x.shape[-1]).float()  # [N, in]
    magnitude = input_magnitude(rows)
    reference = rows @ w.float().T  # [N, out]: the float product, computed once
    losses = {}
    for alpha in alphas:
        s = awq_scales(magnitude, alpha)
        scaled_w, scaled_x = scale_pair(w.float(), rows, s)
        w_hat = rtn(scaled_w, bits, group_size, symmetric)
        losses[alpha] = float((reference - scaled_x @ w_hat.T).pow(2).mean())  # = output_error(w, w_hat, x, s)
    best = min(losses, key=losses.get)
    return AwqSearch(best, awq_scales(magnitude, best), losses)


__all__ = ["ALPHAS", "AwqSearch", "input_magnitude", "awq_scales", "scale_pair", "output_error", "search_scales"]

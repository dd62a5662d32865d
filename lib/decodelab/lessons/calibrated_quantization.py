"""Notebook 13's oracle: GPTQ written the slow, direct way, which the fast version must equal.

`direct_gptq` quantizes one column at a time and recomputes, at every column j, the full inverse of
the dampened Hessian restricted to the columns not yet quantized (F = j, j+1, ...):

    e = w[:, j] - q(w[:, j]),      w[:, F] -= e / [H_F^-1]_00 * [H_F^-1]_0,:

no Cholesky factor, no blocks, no lazy updates: O(in^4) work, fine for a layer of a few dozen
inputs. `model.gptq.gptq_quantize` gets the same numbers from one Cholesky factor of H^-1 (its rows
are the rows [H_F^-1]_0,: up to a factor that cancels) and block-wise lazy updates, so the two agree
to float64 rounding. The grid is `model.groupwise`'s (asymmetric, each group's scale and zero point
from its columns as they are when its first column is reached).
"""

from __future__ import annotations

import torch

from decodelab.model.gptq import DAMP
from decodelab.model.groupwise import group_params, round_to_grid


def direct_gptq(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, damp: float = DAMP) -> torch.Tensor:
    """w [out, in], calibration inputs x [N, in] -> GPTQ's quantized weight read back, float64 [out, in].

    H = 2 X^T X / N; an input never active gets H_jj = 1 and its weight column 0; damp * mean(diag H)
    is added to the diagonal. ValueError unless w is [out, in] with group_size dividing in, x [..., in].
    """
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or w.shape[1] % group_size:
        raise ValueError(f"need w [out, in] with in a multiple of {group_size} and x [..., in], got {tuple(w.shape)}")
    rows = x.reshape(-1, x.shape[-1]).double()  # [N, in]
    h = 2 * rows.T @ rows / rows.shape[0]  # [in, in]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    w = w.double().clone()
    w[:, dead] = 0
    inputs = w.shape[1]
    for j in range(inputs):
        if j % group_size == 0:  # the group's grid from its columns as they are now
            scale, zero = (p.double() for p in group_params(w[:, j : j + group_size], bits))
        q = round_to_grid(w[:, j : j + 1], scale, zero, bits)  # [out, 1]
        h_inv = torch.linalg.inv(h[j:, j:])  # [in - j, in - j]: the remaining columns' inverse, from scratch
        error = (w[:, j : j + 1] - q) / h_inv[0, 0]  # [out, 1]
        w[:, j:] -= error @ h_inv[:1, :]  # the columns after j absorb column j's error
        w[:, j : j + 1] = q  # exactly on the grid (the update above lands there up to rounding)
    return w


__all__ = ["direct_gptq"]

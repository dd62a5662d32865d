"""Activation outliers and LLM.int8()-style mixed-precision decomposition (Dettmers et al., 2022).

`outlier_stats` measures one layer's inputs (which dims exceed the threshold, how large, in how many
tokens); `model_outliers` measures every decoder linear of a model in one pass.

In trained transformers a few hidden dimensions carry activations far larger than the rest, in
most tokens. Quantizing activations to int8 with one absmax scale per token then spends the
scale on those few values, and every other input of that token is rounded on a coarse grid.
LLM.int8() splits the product by input dimension: the dimensions whose activations exceed a
threshold (6.0 in the paper) are multiplied in float, the rest in int8 (activations per token,
weights per output row, both absmax):

    y = x[:, O] W[:, O]^T  +  deq(q(x[:, R])) deq(q(W[:, R]))^T       O: outlier dims, R: the rest

Here O is fixed per layer from calibration inputs (every dimension whose |x| exceeded the
threshold in some token), so the layer keeps W[:, O] in float32 and W[:, R] in int8: the extra
bytes are 3 per weight of O (4 instead of 1). threshold = inf: no float columns, the plain int8
x int8 product; threshold = 0: every dimension that is ever nonzero is float, the float product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decodelab.model.calibration import decoder_linears
from decodelab.model.quantization import INT8_MAX, absmax_scale, dequantize_int8, quantize_int8_per_channel

THRESHOLD = 6.0  # the LLM.int8() paper's


@dataclass
class OutlierStats:
    """One layer's input outliers at `threshold`: dims [k] (sorted by max |x|, largest first), their
    max |x| [k] and the fraction of tokens in which each exceeds the threshold [k]; tokens: N."""

    threshold: float
    dims: torch.Tensor
    max_abs: torch.Tensor
    frequency: torch.Tensor
    tokens: int


def outlier_stats(x: torch.Tensor, threshold: float = THRESHOLD) -> OutlierStats:
    """Calibration inputs x [N, in] (or [..., in]) -> the dims whose |x| exceeds threshold in some token."""
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0 (inf: none), got {threshold!r}")
    rows = x.reshape(-1, x.shape[-1]).float().abs()  # [N, in]
    above = rows > threshold  # [N, in]
    dims = torch.nonzero(above.any(dim=0)).flatten()
    max_abs = rows.amax(dim=0)[dims]
    order = torch.argsort(max_abs, descending=True)
    return OutlierStats(threshold, dims[order], max_abs[order], above.float().mean(dim=0)[dims][order], rows.shape[0])


@torch.inference_mode()
def model_outliers(model, ids: torch.Tensor, threshold: float = THRESHOLD) -> dict[str, OutlierStats]:
    """Run the model on ids [B, T]; {decoder linear's name: `outlier_stats` of its inputs}. Each layer's
    statistics are taken as its inputs pass (a forward pre-hook), so no input is kept."""
    found: dict[str, OutlierStats] = {}

    def hook_for(name):
        def hook(module, args):
            found[name] = outlier_stats(args[0], threshold)

        return hook

    handles = [m.register_forward_pre_hook(hook_for(name)) for name, m in decoder_linears(model).items()]
    try:
        model(torch.as_tensor(ids, dtype=torch.long, device=model.device))
    finally:
        for handle in handles:
            handle.remove()
    return found


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, k] -> (q int8 [N, k], scale float32 [N, 1]): absmax per token (vector-wise, as LLM.int8())."""
    scale = absmax_scale(x.abs().amax(dim=1, keepdim=True), INT8_MAX)
    return torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


@dataclass
class Decomposition:
    """A weight [out, in] split by input dims: `float_dims` [k] kept in float32 (`float_weight`
    [out, k]), the others (`int8_dims`) as int8 per output row (`weight_q` [out, in - k], `weight_scale`
    [out, 1])."""

    float_dims: torch.Tensor
    int8_dims: torch.Tensor
    float_weight: torch.Tensor
    weight_q: torch.Tensor
    weight_scale: torch.Tensor

    @classmethod
    def split(cls, w: torch.Tensor, float_dims: torch.Tensor) -> "Decomposition":
        keep = torch.zeros(w.shape[1], dtype=torch.bool)
        keep[float_dims] = True
        int8_dims = torch.nonzero(~keep).flatten()
        if int8_dims.numel():
            q, scale = quantize_int8_per_channel(w[:, int8_dims])
        else:  # every input dim in float: no int8 weights and no scales
            q, scale = torch.empty(w.shape[0], 0, dtype=torch.int8), torch.empty(w.shape[0], 0)
        return cls(torch.nonzero(keep).flatten(), int8_dims, w[:, keep].float().clone(), q, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] float32: float part plus int8 x int8 part."""
        rows = x.reshape(-1, x.shape[-1]).float()  # [N, in]
        out = rows[:, self.float_dims] @ self.float_weight.T  # [N, out]
        if self.int8_dims.numel():
            q, scale = quantize_rows_int8(rows[:, self.int8_dims])
            out = out + dequantize_int8(q, scale) @ dequantize_int8(self.weight_q, self.weight_scale).T
        return out.reshape(*x.shape[:-1], -1)

    @property
    def nbytes(self) -> int:
        """Float columns (4 bytes a weight) + int8 weights + their row scales."""
        return self.float_weight.nbytes + self.weight_q.nbytes + self.weight_scale.nbytes

    def extra_bytes(self) -> int:
        """What the float columns cost beyond int8: 3 bytes for each of their weights."""
        return self.float_weight.numel() * 3


def decompose(w: torch.Tensor, x: torch.Tensor, threshold: float = THRESHOLD) -> Decomposition:
    """w [out, in], calibration inputs x [N, in] -> the decomposition keeping `outlier_stats(x, threshold)`'s
    dims in float (threshold = inf: none)."""
    dims = torch.empty(0, dtype=torch.long) if math.isinf(threshold) else outlier_stats(x, threshold).dims
    return Decomposition.split(w, dims)


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||reference - approx|| / ||reference|| over all elements."""
    return float((reference.float() - approx.float()).norm() / reference.float().norm().clamp(min=1e-30))


__all__ = [
    "THRESHOLD",
    "OutlierStats",
    "outlier_stats",
    "model_outliers",
    "quantize_rows_int8",
    "Decomposition",
    "decompose",
    "relative_error",
]

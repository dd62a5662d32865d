"""GPTQ (Frantar et al., 2022): quantize a linear layer column by column, correcting the columns not yet
quantized for the error of each one, with second-order information from calibration inputs.

For a weight W [out, in] and calibration inputs X [N, in] (one row per token), the layer's error
is ||X W^T - X Ŵ^T||^2 = sum over rows of (w - ŵ) H (w - ŵ)^T / 2 with the Hessian

    H = 2 X^T X / N    [in, in]   (from the layer's INPUTS; the 1/N only rescales it)

Quantizing column j moves row r by e = w[r, j] - ŵ[r, j]; with the columns F = j, j+1, ... not
yet fixed free to move, the least-squares correction (Optimal Brain Surgeon) is

    w[r, F] -= e / [H_F^-1]_jj * [H_F^-1]_j,:        (H_F: H restricted to F)

which leaves column j exactly on the grid and spreads its error over the columns after it.
GPTQ computes every row [H_F^-1]_j,: at once: they are the rows of the upper Cholesky factor U of
H^-1 (U^T U = H^-1), up to a factor, so that e / [H_F^-1]_jj * [H_F^-1]_j,: = e / U_jj * U_j,:
(the factor cancels). Then it works in blocks of `block_size` columns: inside a block the
updates are applied column by column, to that block's columns only; the block's accumulated
errors reach the columns after it in one matrix product (the "lazy batch" update), which is
the same arithmetic in a cache-friendly order.

Dampening adds `damp` * mean(diag H) to the diagonal: with fewer tokens than inputs, or inputs
that are always zero or always equal, H is singular and its inverse (and Cholesky) does not
exist or explodes. An input that is zero in every calibration token ("dead") gets H_jj = 1 and
its weight column is set to zero (it never contributes), as the reference implementation does.

Groups: each group of `group_size` columns gets its scale and zero point (`groupwise.group_params`)
from the current, already corrected, weights of its columns when its first column is reached.
`block_size` and `group_size` must divide one another, so that those columns are up to date.
Columns are taken in their order (no "act-order").
"""

from __future__ import annotations

import torch

from decodelab.model.groupwise import GroupwiseWeight, check_bits, group_params, to_levels
from decodelab.model.quantization import check_group_size

DAMP = 0.01  # the paper's default: 1% of the mean diagonal
BLOCK_SIZE = 128


def hessian(x: torch.Tensor) -> torch.Tensor:
    """Calibration inputs x [N, in] (or [..., in]) -> H = 2 X^T X / N, float64 [in, in]."""
    rows = x.reshape(-1, x.shape[-1]).double()  # [N, in]
    if rows.shape[0] == 0:
        raise ValueError("the Hessian needs at least one calibration input row")
    return 2 * rows.T @ rows / rows.shape[0]


def dampened(h: torch.Tensor, damp: float = DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """H [in, in] -> (H with dead inputs set to H_jj = 1 and damp * mean(diag) on the diagonal, dead
    [in] bool: the inputs whose H_jj is 0)."""
    if not damp >= 0:
        raise ValueError(f"damp must be >= 0, got {damp!r}")
    h = h.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    return h, dead


def inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """A positive definite H [in, in] -> U, upper triangular, with U^T U = H^-1 (float64).

    Raises ValueError when H is not positive definite (e.g. singular: no dampening).
    """
    lower, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise ValueError(
            f"the Hessian is not positive definite (Cholesky failed at column {int(info) - 1}): "
            "too few calibration tokens, or no dampening"
        )
    inverse = torch.cholesky_inverse(lower)
    upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
    if int(info) or not torch.isfinite(upper).all():
        raise ValueError("the inverse Hessian is not positive definite: increase the dampening")
    return upper


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    bits: int,
    group_size: int = 128,
    block_size: int = BLOCK_SIZE,
    damp: float = DAMP,
    symmetric: bool = False,
) -> GroupwiseWeight:
    """GPTQ for one linear: w [out, in], h [in, in] from `hessian` of its inputs -> GroupwiseWeight.

    The grid is `groupwise`'s (asymmetric unless symmetric). block_size: columns per lazy batch,
    a divisor or multiple of group_size (it is cut to `in` if larger).
    """
    if w.dim() != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"need w [out, in] and h [in, in], got {tuple(w.shape)} and {tuple(h.shape)}")
    check_bits(bits)
    out, inputs = w.shape
    check_group_size(inputs, group_size)
    if block_size < 1 or (block_size % group_size and group_size % block_size):
        raise ValueError(f"block_size must divide group_size {group_size} or be a multiple of it, got {block_size}")
    h, dead = dampened(h, damp)
    u = inverse_cholesky(h)  # [in, in], float64
    w = w.double().clone()
    w[:, dead] = 0
    levels = torch.zeros(out, inputs, dtype=torch.float64)
    scales = torch.zeros(out, inputs // group_size, dtype=torch.float64)
    zeros = torch.zeros_like(scales)
    for start in range(0, inputs, block_size):
        end = min(start + block_size, inputs)
        block = w[:, start:end].clone()  # [out, b]: corrected column by column below
        errors = torch.zeros_like(block)  # [out, b]: each column's scaled error e / U_jj
        for i in range(end - start):
            j = start + i
            if j % group_size == 0:  # a new group: its grid from its columns as they are now
                inside = i + group_size <= end - start
                columns = block[:, i : i + group_size] if inside else w[:, j : j + group_size]
                scale, zero = group_params(columns, bits, symmetric)  # [out, 1] each, float32
                scale, zero = scale.double(), zero.double()
                scales[:, j // group_size], zeros[:, j // group_size] = scale[:, 0], zero[:, 0]
            column = block[:, i : i + 1]  # [out, 1]
            level = to_levels(column, scale, zero, bits).double()
            levels[:, j : j + 1] = level
            error = (column - (level - zero) * scale) / u[j, j]  # [out, 1]
            block[:, i:] -= error @ u[j : j + 1, j:end]  # this block's columns only (column i lands on the grid)
            errors[:, i : i + 1] = error
        w[:, end:] -= errors @ u[start:end, end:]  # the lazy batch update of every column after the block
    return GroupwiseWeight(levels.to(torch.uint8), scales.float(), zeros.float(), bits, group_size)


def gptq_quantize_layer(
    w: torch.Tensor,
    x: torch.Tensor,
    bits: int,
    group_size: int = 128,
    block_size: int = BLOCK_SIZE,
    damp: float = DAMP,
) -> GroupwiseWeight:
    """GPTQ for one linear from its calibration INPUTS: w [out, in], x [N, in] -> GroupwiseWeight.

    `gptq_quantize(w, hessian(x), ...)`: H = 2 X^T X / N, dampened, U the upper Cholesky factor of H^-1,
    columns in order, blocks of block_size with lazy updates, the asymmetric group-wise grid.
    ValueError: w not [out, in], x not [..., in], bits not in (3, 4, 8), a group size that does not
    divide in, or a Hessian that is not positive definite.
    """
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"need w [out, in] and x [..., in], got {tuple(w.shape)} and {tuple(x.shape)}")
    return gptq_quantize(w, hessian(x), bits, group_size, block_size, damp)


def layer_objective(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """||X W^T - X Ŵ^T||^2 summed over tokens and outputs: w, w_hat [out, in], x [N, in]."""
    rows = x.reshape(-1, x.shape[-1]).double()
    return float((rows @ (w.double() - w_hat.double()).T).pow(2).sum())


__all__ = [
    "DAMP",
    "BLOCK_SIZE",
    "hessian",
    "dampened",
    "inverse_cholesky",
    "gptq_quantize",
    "gptq_quantize_layer",
    "layer_objective",
]

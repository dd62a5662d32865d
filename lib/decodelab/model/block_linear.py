"""The layer shape that `Q4Linear` and `Q8Linear` share: a linear layer whose weight stays in a
GGUF file's own blocks (`q4_linear`, `q8_linear`), multiplied by the C kernels (`q4_kernel`).

`forward(x [..., K])` runs the format's C product for float32 CPU inputs of up to
`KERNEL_MAX_ROWS` rows, else (another device or dtype, no kernel, many rows) F.linear on
`dequantized_weight()`, the float32 weight [N, K] bit for bit as gguf dequantizes it (in C where
the kernels load, else the format's torch reference). A subclass gives its block tensors
(`blocks()`, the first one [N, ...]) and its format's three functions.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.model import weight_moves
from decodelab.model.q4_kernel import dequantizes_here, runs_on_kernel


class BlockLinear(nn.Module):
    """y = x @ W.T (+ bias), W [N, K] held as GGUF blocks; `in_features`, `out_features` and `bias`
    (None or [N]) set by the subclass."""

    FORMAT: str  # the GGUF type name, "Q4_1" or "Q8_0"
    BLOCK_NAMES: tuple[str, ...]  # the buffers `blocks()` returns, in its order
    BLOCK_DTYPES: tuple[torch.dtype, ...]  # their dtypes, the format's: the C kernels read them as these
    reference_dequantize: Callable[..., torch.Tensor]  # torch: blocks -> W float32 [N, K]
    c_dequantize: Callable[..., torch.Tensor]  # the C kernels' version, bit for bit the same
    c_product: Callable[..., torch.Tensor]  # x [M, K], blocks -> y [M, N]

    def blocks(self) -> tuple[torch.Tensor, ...]:
        """The buffers named in BLOCK_NAMES, in that order (read from `_buffers` directly: nn.Module's
        attribute lookup costs ~0.5 us a buffer, per token)."""
        return tuple(map(self._buffers.__getitem__, self.BLOCK_NAMES))

    def dequantized_weight(self) -> torch.Tensor:
        """The weight float32 [N, K], equal bit for bit to gguf's dequantization of the blocks."""
        blocks = self.blocks()
        if dequantizes_here(blocks[0]):
            return self.c_dequantize(*blocks)
        return self.reference_dequantize(*blocks)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Will `forward(x)` run the C kernel? Float32 CPU input of 1..KERNEL_MAX_ROWS rows, no autograd."""
        return runs_on_kernel(x, self.blocks()[0], self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]."""
        blocks = self.blocks()  # once: each buffer read through nn.Module costs ~0.6 us, 211 layers a token
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects inputs [..., {self.in_features}], got {tuple(x.shape)}")
        if not runs_on_kernel(x, blocks[0], self.in_features):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantized_weight().to(x.dtype), bias)
        y = self.c_product(x.reshape(-1, self.in_features), *blocks)  # [M, N]
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn, *args, **kwargs):
        """nn.Module's (`.to()`, `.half()`, ...), but the blocks keep their format's dtypes: a model's
        `.float()` or `.to(torch.bfloat16)` converts every floating buffer, and these are the block
        format, not the model's dtype. Counted by `weight_moves`: it puts new tensors in `_buffers`
        without registering them, and a table of the blocks' addresses must see it."""
        weight_moves.moved()
        originals = [self._buffers[name] for name in self.BLOCK_NAMES]
        module = super()._apply(fn, *args, **kwargs)
        for name, dtype, original in zip(self.BLOCK_NAMES, self.BLOCK_DTYPES, originals):
            block = self._buffers[name]
            if block is not None and block.dtype != dtype:  # converted: the original's values, where fn put them
                self._buffers[name] = original.to(device=block.device, dtype=dtype)
        return module

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"{self.FORMAT}"
        )


__all__ = ["BlockLinear"]

"""An lm_head read straight from the GGUF's own Q8_0 blocks, multiplied by a fused CPU kernel.

SmolLM2's GGUF holds its token embedding (49,152 x 576, to which the lm_head is tied) as Q8_0.
In float32 that matrix is 113 MB, more than the 210 Q4_1 linears together: with `Q4Linear`
layers it is most of what a decode step reads. Its Q8_0 blocks are 30 MB.

Q8_0 (llama.cpp): a row's weights in blocks of 32, each block 34 bytes: an fp16 scale d, then
32 signed bytes q; weight = d * q (`gguf.quants.Q8_0.dequantize_blocks`).

`Q8Linear` holds them as q int8 [N, K] and d float32 [N, K/32]; `forward` runs the C kernel
(`q4_kernel.q8_0_matmul`) where `Q4Linear` would run its own, else dequantizes and calls
F.linear. `use_gguf_q8_lm_head(model, tensors)` gives a tied model an untied lm_head of the
embedding's Q8_0 blocks: the embedding stays float32 for its lookups, the product reads bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from decodelab.model.block_linear import BlockLinear
from decodelab.model.q4_kernel import q8_0_dequantize, q8_0_matmul

BLOCK = 32  # weights per Q8_0 block
BLOCK_BYTES = 34  # fp16 d, 32 int8


def q8_0_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF tensor (`read_gguf_tensors`) of type Q8_0, [N, K] in PyTorch's order -> (q int8 [N, K],
    d float32 [N, K/32]). ValueError for any other type."""
    kind = tensor.tensor_type.name
    if kind != "Q8_0":
        raise ValueError(f"tensor {tensor.name!r} is {kind}, not Q8_0: only Q8_0 tensors become a Q8Linear")
    n, k = (int(size) for size in reversed(tensor.shape))  # GGUF lists dims innermost first
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // BLOCK, BLOCK_BYTES)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # [N, K/32]
    q = torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(n, k))  # [N, K]
    return q, d


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K], d float32 [N, K/32] -> weight float32 [N, K] = d * q, one float32 multiply
    per weight, as gguf computes it."""
    n, blocks = d.shape
    return (q.reshape(n, blocks, BLOCK).to(torch.float32) * d[..., None]).reshape(n, blocks * BLOCK)


class Q8Linear(BlockLinear):
    """y = x @ W.T, W [N, K] held as Q8_0 blocks: q int8 [N, K], d float32 [N, K/32]. No bias.
    `forward`, `uses_kernel` and `dequantized_weight` from `BlockLinear`."""

    FORMAT = "Q8_0"
    BLOCK_NAMES, BLOCK_DTYPES = ("q", "d"), (torch.int8, torch.float32)
    reference_dequantize = staticmethod(dequantize_q8_0)
    c_dequantize = staticmethod(q8_0_dequantize)
    c_product = staticmethod(q8_0_matmul)

    def __init__(self, q: torch.Tensor, d: torch.Tensor):
        super().__init__()
        n, k = q.shape
        if q.dtype != torch.int8 or k % BLOCK or d.shape != (n, k // BLOCK):
            raise ValueError(
                f"Q8Linear needs q int8 [N, K] with K a multiple of {BLOCK} and d [N, K/{BLOCK}]; "
                f"got q {q.dtype} {tuple(q.shape)}, d {tuple(d.shape)}"
            )
        self.in_features, self.out_features = k, n
        self.register_buffer("q", q.contiguous())  # [N, K] int8
        self.register_buffer("d", d.to(torch.float32).contiguous())  # [N, K/32]
        self.bias = None


def use_gguf_q8_lm_head(model: nn.Module, tensors) -> bool:
    """Give `model` (the one the GGUF converts to) an lm_head of Q8_0 blocks, in place, when the
    GGUF's lm_head is Q8_0: its own `output.weight`, or, tied, the `token_embd.weight` (the
    embedding then keeps its float32 table for lookups). -> whether it did."""
    by_name = {tensor.name: tensor for tensor in tensors}
    source = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if source is None or source.tensor_type.name != "Q8_0":
        return False
    if source.name == "token_embd.weight" and not model.config.tie_word_embeddings:
        return False
    q, d = q8_0_blocks(source)
    head = model.lm_head
    if tuple(q.shape) != tuple(head.weight.shape):
        raise ValueError(
            f"Q8_0 tensor {source.name!r} {tuple(q.shape)} does not match lm_head {tuple(head.weight.shape)}"
        )
    device = head.weight.device
    model.lm_head = Q8Linear(q.to(device), d.to(device))
    return True


__all__ = ["Q8Linear", "dequantize_q8_0", "q8_0_blocks", "use_gguf_q8_lm_head"]

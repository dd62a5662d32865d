"""4-bit weights read straight from the GGUF's own Q4_1 blocks, multiplied by a fused CPU kernel.

SmolLM2 ships as a Q4_1 GGUF, and the library's float32 model IS those blocks dequantized
(`gguf_import`). A decode step reads every weight once per token, so it is bound by memory;
multiplying the 4-bit blocks themselves reads ~5 bits a weight instead of 32.

Q4_1 (llama.cpp): a row's weights in blocks of 32, each block 20 bytes: fp16 scale d, fp16
offset m, then 16 bytes of nibbles, byte j's low nibble the block's weight j and its high
nibble weight j + 16; weight = d * q + m (`gguf.quants.Q4_1.dequantize_blocks`).

`Q4Linear` holds them as nibbles uint8 [N, K/2] (row n's block b at bytes 16b..16b+15) and d, m
float16 [N, K/32], as the file does (20 bytes a block; float32 scales made it 24, and a decode step
reads every block once). Its `forward` runs the C kernel (`q4_kernel`) for float32 CPU inputs of up to
`KERNEL_MAX_ROWS` rows, else (another device or dtype, no kernel, or many rows, where dequantize
+ F.linear's blocked GEMM wins) the reference: `dequantized_weight()` then F.linear. Both see the
same float32 weights bit for bit; the kernel reads x as 16-bit integers per block of 32 values
(exact integer dot products, `csrc/gguf_gemv.c`), which moves each of x's values by at most
1/65534 of its block's largest, and sums in another order.

`use_gguf_q4_weights(model, gguf_path)` swaps every nn.Linear whose GGUF tensor is Q4_1 for a
`Q4Linear` from that tensor's blocks, and a Q8_0 lm_head (SmolLM2's, tied to its Q8_0 token_embd)
for a `Q8Linear` (`q8_linear`). The F32 norms and the embedding's lookup table stay as they are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from decodelab.model.block_linear import BlockLinear
from decodelab.model.gguf_import import hf_tensor_name, unpermute_rows
from decodelab.model.gguf_tensors import read_gguf_tensors
from decodelab.model.q4_kernel import KERNEL_MAX_ROWS, Q4_1_DTYPES, kernel_loads, q4_1_dequantize, q4_1_matmul
from decodelab.model.q4_layer import use_q4_layers
from decodelab.model.q4_stack import use_q4_backbone
from decodelab.model.q4_swiglu import use_q4_swiglu
from decodelab.model.q8_linear import use_gguf_q8_lm_head
from decodelab.model.registry import check_device, default_device
from decodelab.model.weights import resolve_dtype

BLOCK = 32  # weights per Q4_1 block
BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles


def q4_1_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF tensor (`read_gguf_tensors` / `GGUFReader.tensors`) of type Q4_1, [N, K] in PyTorch's
    order -> (nibbles uint8 [N, K/2], d float16 [N, K/32], m float16 [N, K/32]), in the file's row
    order. ValueError for any other type."""
    kind = tensor.tensor_type.name
    if kind != "Q4_1":
        raise ValueError(f"tensor {tensor.name!r} is {kind}, not Q4_1: only Q4_1 tensors become a Q4Linear")
    n, k = (int(size) for size in reversed(tensor.shape))  # GGUF lists dims innermost first
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // BLOCK, BLOCK_BYTES)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0])  # [N, K/32]
    m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0])  # [N, K/32]
    nibbles = torch.from_numpy(raw[..., 4:].reshape(n, k // 2).copy())  # [N, K/2]
    return nibbles, d, m


def dequantize_q4_1(nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """nibbles uint8 [N, K/2], d and m [N, K/32] (float16, or any float) -> weight float32 [N, K],
    d * q + m rounded as gguf rounds it (d and m widened to float32, a float32 multiply, then a
    float32 add)."""
    n, blocks = d.shape
    packed = nibbles.reshape(n, blocks, BLOCK // 2)  # [N, K/32, 16]
    levels = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.float32)  # [N, K/32, 32]
    return (levels * d.float()[..., None] + m.float()[..., None]).reshape(n, blocks * BLOCK)


class Q4Linear(BlockLinear):
    """y = x @ W.T (+ bias), W [N, K] held as Q4_1 blocks (see the module's docstring); `forward`,
    `uses_kernel` and `dequantized_weight` from `BlockLinear`."""

    FORMAT = "Q4_1"
    BLOCK_NAMES, BLOCK_DTYPES = ("nibbles", "d", "m"), Q4_1_DTYPES
    reference_dequantize = staticmethod(dequantize_q4_1)
    c_dequantize = staticmethod(q4_1_dequantize)
    c_product = staticmethod(q4_1_matmul)

    def __init__(self, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        n, half = nibbles.shape
        if nibbles.dtype != torch.uint8 or half * 2 % BLOCK or d.shape != (n, half * 2 // BLOCK) or m.shape != d.shape:
            raise ValueError(
                f"Q4Linear needs nibbles uint8 [N, K/2] with K a multiple of {BLOCK} and d, m [N, K/{BLOCK}]; "
                f"got nibbles {nibbles.dtype} {tuple(nibbles.shape)}, d {tuple(d.shape)}, m {tuple(m.shape)}"
            )
        self.in_features, self.out_features = half * 2, n
        self.register_buffer("nibbles", nibbles.contiguous())  # [N, K/2] uint8
        self.register_buffer("d", d.to(torch.float16).contiguous())  # [N, K/32], Q4_1's own fp16
        self.register_buffer("m", m.to(torch.float16).contiguous())  # [N, K/32]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)


def _hf_row_order(name: str, blocks: tuple, config) -> tuple:
    """The blocks of q_proj and k_proj put back in HF's row order, as `load_gguf_state_dict` does."""
    if config.model_type != "llama":  # llama.cpp permutes q/k only for its "llama" arch
        return blocks
    if name.endswith("q_proj.weight"):
        return tuple(unpermute_rows(part, config.num_attention_heads).contiguous() for part in blocks)
    if name.endswith("k_proj.weight"):
        return tuple(unpermute_rows(part, config.num_key_value_heads).contiguous() for part in blocks)
    return blocks


def use_gguf_q4_weights(model: nn.Module, gguf_path: str | Path) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` whose weight is a Q4_1 tensor in `gguf_path`
    by a `Q4Linear` from that tensor's blocks, a Q8_0 lm_head by a `Q8Linear`
    (`use_gguf_q8_lm_head`), each MLP of three Q4Linears by a `Q4SwiGLU` (`use_q4_swiglu`) and
    then each layer whose linears are all Q4 by a `Q4DecoderLayer` (`use_q4_layers`); returns the
    model. The model must be the one the GGUF converts to (`registry.load("smollm2")` for SmolLM2's
    file). ValueError when the file holds no Q4_1
    tensor, or one that matches no linear of the model."""
    tensors = read_gguf_tensors(gguf_path)
    swapped = 0
    for tensor in tensors:
        if tensor.tensor_type.name != "Q4_1":
            continue
        name = hf_tensor_name(tensor.name)
        parent_name, _, child_name = name.removesuffix(".weight").rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child_name)
        except AttributeError:
            raise ValueError(f"{gguf_path}: Q4_1 tensor {tensor.name!r} matches no layer {name}") from None
        blocks = _hf_row_order(name, q4_1_blocks(tensor), model.config)
        shape = (blocks[0].shape[0], blocks[0].shape[1] * 2)  # [N, K]
        if not isinstance(linear, nn.Linear) or tuple(linear.weight.shape) != shape:
            raise ValueError(f"{gguf_path}: Q4_1 tensor {tensor.name!r} does not match the model's {name}")
        device = linear.weight.device
        q4 = Q4Linear(*(part.to(device) for part in blocks), bias=linear.bias)
        setattr(parent, child_name, q4)
        swapped += 1
    if swapped == 0:
        raise ValueError(f"{gguf_path} holds no Q4_1 tensor: Q4 weights need a Q4_1 GGUF")
    use_gguf_q8_lm_head(model, tensors)
    use_q4_swiglu(model)  # each MLP's three Q4 products in one C call
    use_q4_layers(model)  # each layer's norms, products, RoPE and residuals in two C calls around its attention
    use_q4_backbone(model)  # a decode step: every layer, its cache write and attention, in one C call
    return model


def q4_pays(model, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None) -> bool:
    """Should `model` run on its GGUF's Q4_1 blocks by default (the command line's `generate` and
    `serve` ask)? Yes for "smollm2" on the CPU in float32 where the C kernels load: the float32
    SmolLM2 is that GGUF dequantized, so Q4 weights are the same numbers bit for bit, read as 98 MB
    a token instead of 538 (several times the tokens/s: bench/decode_speed.py --end-to-end); the
    kernels' 16-bit activations and order of sums move the logits by ~3e-4 of their size. No
    elsewhere: another model has no such GGUF, a GPU or half precision takes the float path, and
    without the kernels the Q4 path is slower than float32."""
    if not isinstance(model, str) or model != "smollm2":
        return False
    device = check_device(device) if device is not None else default_device()
    return device.type == "cpu" and resolve_dtype(dtype) == torch.float32 and kernel_loads()


__all__ = ["KERNEL_MAX_ROWS", "Q4Linear", "dequantize_q4_1", "q4_1_blocks", "q4_pays", "use_gguf_q4_weights"]

"""Small random Llama models for tests, hidden checks, widgets and benchmarks: instant to build,
with logits of order 1 so that tolerances and greedy comparisons prove something.

PyTorch's default init (std 0.02) gives logits of ~1e-2: a 1e-4 tolerance would then prove
nothing, and greedy output would hang on near-ties. `randomize_` redraws every parameter at
unit scale instead; `random_llama` builds a model of any shape and randomizes it.
`scramble_rope_` makes a model's positions matter on their own, not only as distances, so
that a check sees a position off by the same amount for every token. `random_mamba` is the same
for the state-space model (`model.mamba`).
"""

from __future__ import annotations

import math

import torch

from decodelab.config import ModelConfig
from decodelab.model.llama import LlamaForCausalLM
from decodelab.model.mamba import MambaConfig, MambaForCausalLM

# Two layers, 4 query heads over 2 KV heads: every code path of the real model, in microseconds.
TOY_CONFIG = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def toy_config(**overrides) -> ModelConfig:
    """TOY_CONFIG with any field replaced (`num_key_value_heads=1`, `head_dim=16`, ...)."""
    return ModelConfig(**{**TOY_CONFIG, **overrides})


@torch.no_grad()
def randomize_(
    model: torch.nn.Module,
    seed: int = 0,
    weight_scale: float = 1.0,
    norm_jitter: float = 0.2,
    embedding_std: float | None = 1.0,
) -> torch.nn.Module:
    """Redraw every parameter in place from a generator seeded with `seed`; returns the model.

    Matrices: N(0, weight_scale^2 / fan_in), so activations stay O(1) layer after layer.
    Embeddings: N(0, embedding_std^2), or the matrices' rule if embedding_std is None.
    Norm weights: 1 + norm_jitter * N(0, 1) (nonzero jitter makes a dropped norm show).
    Biases: 0.5 * N(0, 1).
    """
    generator = torch.Generator().manual_seed(seed)

    def normal(p):
        return torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + norm_jitter * normal(p))
        elif name.endswith(".bias"):
            p.copy_(0.5 * normal(p))
        elif "embed_tokens" in name and embedding_std is not None:
            p.copy_(embedding_std * normal(p))
        else:
            p.copy_(weight_scale * normal(p) / p.shape[-1] ** 0.5)
    return model


def random_llama(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    weight_scale: float = 1.0,
    norm_jitter: float = 0.2,
    embedding_std: float | None = 1.0,
    **config_overrides,
) -> LlamaForCausalLM:
    """A Llama of shape toy_config(**config_overrides), randomized by `randomize_`, in eval mode
    with gradients off, on the CPU in `dtype`."""
    torch.manual_seed(seed)  # the module constructors draw too; keep them repeatable
    model = LlamaForCausalLM(toy_config(**config_overrides))
    randomize_(model, seed, weight_scale=weight_scale, norm_jitter=norm_jitter, embedding_std=embedding_std)
    return model.to(dtype).eval().requires_grad_(False)


def random_mamba(seed: int = 0, dtype: torch.dtype = torch.float32, **config_fields) -> MambaForCausalLM:
    """A small Mamba (vocabulary 61, hidden 32, 2 layers, state 8 unless overridden) with every weight
    moved by noise of std 0.2 from its init, A_log and D included, so no piece sits at its initial value;
    eval mode, gradients off, on the CPU in dtype."""
    fields = {"vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, **config_fields}
    torch.manual_seed(seed)
    model = MambaForCausalLM(MambaConfig(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.to(dtype).eval().requires_grad_(False)


def tiny_model(
    seed: int = 0, sliding_window: int | None = None, dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """Notebook 03's model: a random 2-layer Llama (4 query heads sharing 2 KV heads, vocabulary
    61, context 64) with plain norms; random weights give O(1) logits whose argmax depends on
    the whole context."""
    return random_llama(
        seed,
        dtype=dtype,
        norm_jitter=0.0,
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=64,
        sliding_window=sliding_window,
    )


@torch.no_grad()
def scramble_rope_(model: LlamaForCausalLM, seed: int = 0) -> LlamaForCausalLM:
    """Replace the model's RoPE tables in place by a random angle for every position and channel
    pair; returns the model. Queries and keys are still rotated (their norms kept), but attention
    no longer depends only on the distance between two tokens: shifting every position by the
    same amount changes the output, as it would with absolute position embeddings (GPT-2's).
    Checks use it where a wrong but uniform position shift must show."""
    generator = torch.Generator().manual_seed(seed)
    max_positions, head_dim = model.rope_cos.shape
    angles = 2 * math.pi * torch.rand(max_positions, head_dim // 2, generator=generator)  # [max_pos, D/2]
    angles = torch.cat([angles, angles], dim=-1).to(model.rope_cos.device)  # channel i and i + D/2 share one
    model.rope_cos.copy_(angles.cos())
    model.rope_sin.copy_(angles.sin())
    return model

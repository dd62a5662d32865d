"""Small random Llama models for tests, hidden checks, widgets and benchmarks: instant to build,
with logits of order 1 so that tolerances and greedy comparisons prove something."""
from __future__ import annotations

import torch

from decodelab.config import ModelConfig
from decodelab.model.llama import LlamaForCausalLM


def tiny_model(seed: int = 0, sliding_window: int | None = None, dtype=torch.float32) -> LlamaForCausalLM:
    """A random 2-layer Llama (4 query heads sharing 2 KV heads, vocabulary 61, context 64) for
    quick tests: random weights give O(1) logits whose argmax depends on the whole context."""
    config = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):  # unit-scale activations, so argmaxes are not near-ties
                p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype) / (1 if "embed" in name else p.shape[-1] ** 0.5))
    return model

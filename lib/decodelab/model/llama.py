"""The Llama decoder in plain PyTorch: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Parameter names follow Hugging Face's `LlamaForCausalLM` exactly, so `state_dict()` loads
from and saves to HF-layout safetensors without renaming. Covers SmolLM2 (tied
embeddings), Llama 3 (rope_scaling) and Qwen2 (q/k/v biases).

Shapes: B batch, T new tokens, S tokens attended to, H query heads, H_kv KV heads,
D head_dim, E hidden_size, V vocab_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.config import ModelConfig
from decodelab.model.attention import causal_attention
from decodelab.model.rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as `transformers` does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.sliding_window
        bias = config.has_qkv_bias
        e, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(e, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(e, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(e, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, e, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache=None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, kv_cache)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """q [B, H, T, D], k, v [B, H_kv, T, D] (RoPE applied) -> [B, H, T, D]: over `kv_cache`
        (which stores k, v beside what it holds), or causal within this pass without one."""
        if kv_cache is None:
            return causal_attention(q, k, v, 0, self.sliding_window)
        return kv_cache.attend(self.layer_idx, q, k, v)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(e, f, bias=False)
        self.up_proj = nn.Linear(e, f, bias=False)
        self.down_proj = nn.Linear(f, e, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named `model` inside `LlamaForCausalLM`; holds embeddings, layers and the final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """x [B, T, E] through every decoder layer in turn -> [B, T, E]. (`q4_stack.Q4Backbone` runs a
        decode step's layers in one C call instead.)"""
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos, D], float32
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device  # not lm_head's: it may be packed (decodelab.model.packed_linear)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        kv_cache=None,
        last_only: bool = False,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), float32.

        logits_indices [M]: compute logits only at these token indices -> [B, M, V]; the
        vocabulary projection is the largest matmul, so skipping unused rows matters.

        positions: [T] or [B, T] token positions; by default they continue after the
        tokens already in `kv_cache` (or start at 0 without one). `kv_cache` is any object
        with ``attend(layer_idx, q, k, v)`` — see `decodelab.model.kv_cache.KVCache`.
        """
        x = self.layers_output(input_ids, positions, kv_cache)  # [B, T, E]
        if last_only:
            x = x[:, -1:]
        elif logits_indices is not None:
            x = x[:, logits_indices]
        return self.lm_head(self.model.norm(x)).float()

    def features(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:
        """input_ids [B, T] -> the last hidden states after the final norm [B, T, E]: the
        vectors the lm_head turns into logits (`lm_head(features)` = forward's logits).
        A feature drafter (`decodelab.decoding.eagle`) reads them."""
        return self.model.norm(self.layers_output(input_ids, positions, kv_cache))

    def layers_output(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, kv_cache=None
    ) -> torch.Tensor:
        """input_ids [B, T] -> the residual stream after the last decoder layer [B, T, E]
        (before the final norm). positions and kv_cache as in `forward`."""
        t = input_ids.shape[1]
        if positions is None:
            start = kv_cache.seq_len if kv_cache is not None else 0
            positions = torch.arange(start, start + t, device=input_ids.device)
        # A compiled step (decodelab.decoding.compiled) checks its position before the call: here
        # the check would read a tensor's value and break the graph.
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(positions.max())} is beyond the model's context of "
                f"{self.config.max_position_embeddings} tokens"
            )
        cos, sin = self.rope_at(positions)
        x = self.model.embed_tokens(input_ids)  # [B, T, E]
        return self.model.run_layers(x, cos, sin, kv_cache)

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] or [B, T] -> (cos, sin) in the model's dtype, [T, D] or [B, 1, T, D]
        (per-sequence positions broadcast over heads)."""
        cos = self.rope_cos[positions].to(self.dtype)  # [T, D] or [B, T, D]
        sin = self.rope_sin[positions].to(self.dtype)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        return cos, sin

    def num_parameters(self) -> int:
        """Distinct parameters (a tied lm_head counts once)."""
        return sum(p.numel() for p in self.parameters())

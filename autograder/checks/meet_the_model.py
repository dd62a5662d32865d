"""Checks for notebook 00, meet the model: counting parameters from a config, and the
memory-bandwidth bound on batch-1 decode speed.

Each ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and
returns None or raises ``AssertionError`` naming the input, the expected and the actual result.

Expected parameter counts never come from a formula written here:
* SmolLM2-135M-Instruct: the tensors in the real checkpoint (its safetensors header: shapes
  only, nothing is loaded); the tied lm_head is stored once.
* Published checkpoints: the totals `transformers` reports for Llama-3.1-8B (untied, GQA 32/8)
  and Qwen2.5-0.5B (tied, GQA 14/2, q/k/v biases).
* Random small configs: `decodelab.model.llama.LlamaForCausalLM(config).num_parameters()`, the
  model the course runs, built for real on the CPU (each is a few hundred thousand numbers).
"""
from __future__ import annotations

import math
import numbers
import random

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises


# exercise function -> the library's reference it is graded against (tests/notebooks.py reads this)
REFERENCES = {
    "count_parameters": "decodelab.lessons.kv_size:parameter_count",
    "decode_tokens_per_second_bound": "decodelab.lessons.measure:decode_tokens_per_second_bound",
}

__all__ = ["check_count_parameters", "check_decode_tokens_per_second_bound", "check_q_embedding_share_percent",
           "check_q_llama8b_tokens_per_s"]

# The config.json fields of two published checkpoints and the totals transformers reports for them.
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": (dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                                     intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, tie_word_embeddings=False), 8_030_261_248),
    "Qwen/Qwen2.5-0.5B": (dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                               tie_word_embeddings=True), 494_032_768),
}


def _describe_config(config) -> str:
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "has_qkv_bias")
    return "ModelConfig(" + ", ".join(f"{f}={getattr(config, f)}" for f in fields) + ")"


def _smollm2_checkpoint():
    """(config, number of parameters stored in the real checkpoint), or None if it is not prepared."""
    from decodelab.config import ModelConfig
    from decodelab.model.registry import SMOLLM2_DIR_NAME
    from decodelab.paths import cache_dir

    folder = cache_dir() / SMOLLM2_DIR_NAME
    if not (folder / "model.safetensors").exists():
        return None
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        total = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return ModelConfig.from_file(folder / "config.json"), total


def _random_configs(seed: int = 0):
    """Small Llama-family configs covering tied/untied, MHA/GQA/MQA, biases, explicit head_dim."""
    from decodelab.config import ModelConfig

    rng = random.Random(seed)
    cases = [
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),   # MHA, tied
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),  # MHA, untied
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),  # GQA
        dict(num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=True),   # MQA
        dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True),        # llama with biases
        dict(num_attention_heads=4, num_key_value_heads=2, model_type="qwen2"),         # qwen2: biases always
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24),                # head_dim != hidden / heads
    ]
    for case in cases:
        heads = case["num_attention_heads"]
        yield ModelConfig(vocab_size=rng.randrange(50, 400), hidden_size=heads * rng.choice([8, 12, 16]),
                          intermediate_size=rng.randrange(20, 120), num_hidden_layers=rng.randrange(1, 4),
                          **case)


def _expect_count(desc: str, got, expected: int, hint: str = "") -> None:
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        extra = " (use // rather than / so that the count stays an int)" if isinstance(got, float) else ""
        raise AssertionError(f"{desc} returned {type(got).__name__} {got!r}; expected the integer {expected:,}{extra}")
    if int(got) != expected:
        diff = int(got) - expected
        raise AssertionError(f"{desc} returned {int(got):,}; the model has {expected:,} parameters "
                             f"({'+' if diff > 0 else '-'}{abs(diff):,}){hint}")


def check_count_parameters(fn) -> None:
    """fn(config: ModelConfig) -> int, the number of distinct parameters of the Llama-family model."""
    from decodelab.config import ModelConfig
    from decodelab.model.llama import LlamaForCausalLM

    real = _smollm2_checkpoint()
    if real is not None:
        config, total = real
        _expect_count(f"count_parameters on SmolLM2-135M-Instruct's config.json {_describe_config(config)}",
                      call("count_parameters(SmolLM2's config)", fn, config), total,
                      "; the real checkpoint stores these tensors (its lm_head is tied to the embeddings)")
    for name, (fields, total) in PUBLISHED.items():
        config = ModelConfig(**fields)
        _expect_count(f"count_parameters on {name}'s config {_describe_config(config)}",
                      call(f"count_parameters({name})", fn, config), total,
                      f"; transformers reports {total:,} for {name}")
    for config in _random_configs():
        expected = LlamaForCausalLM(config).num_parameters()
        hints = []
        if config.tie_word_embeddings:
            hints.append("the lm_head is tied to the embeddings: count that matrix once")
        if config.num_key_value_heads != config.num_attention_heads:
            hints.append(f"k_proj and v_proj have {config.num_key_value_heads} KV heads, not "
                         f"{config.num_attention_heads}")
        if config.has_qkv_bias:
            hints.append("q_proj, k_proj and v_proj have biases")
        if config.head_dim * config.num_attention_heads != config.hidden_size:
            hints.append(f"head_dim x heads = {config.head_dim * config.num_attention_heads} "
                         f"differs from hidden_size {config.hidden_size}")
        _expect_count(f"count_parameters on {_describe_config(config)}",
                      call(f"count_parameters({_describe_config(config)})", fn, config), expected,
                      " (LlamaForCausalLM(config).num_parameters())" + (f"; note: {'; '.join(hints)}" if hints else ""))


def check_decode_tokens_per_second_bound(fn) -> None:
    """fn(num_params, bytes_per_param, bandwidth_bytes_per_s) -> tokens/s = bandwidth / (params x bytes)."""
    cases = [
        (70e9, 2, 3.35e12, 23.9285714, "70B fp16 on 3.35 TB/s (an H100): 140 GB per token, ~42 ms, ~24 tokens/s"),
        (70e9, 2, 2e12, 14.2857143, "70B fp16 on 2 TB/s: 0.07 s per token, ~14 tokens/s"),
        (70e9, 0.5, 3.35e12, 95.7142857, "int4 weights (half a byte each) read 4x fewer bytes than fp16"),
        (134_515_008, 4, 20e9, 37.1705, "SmolLM2-135M in fp32 on 20 GB/s"),
        (8_030_261_248, 1, 1e12, 124.5290, "Llama-3.1-8B in int8 on 1 TB/s"),
        (1, 1, 1, 1.0, "one parameter of one byte at one byte per second"),
    ]
    for num_params, bytes_per_param, bandwidth, expected, note in cases:
        desc = f"decode_tokens_per_second_bound({num_params:g}, {bytes_per_param:g}, {bandwidth:g})"
        got = call(desc, fn, num_params, bytes_per_param, bandwidth)
        try:
            value = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"{desc} returned {type(got).__name__} {got!r}; expected a number "
                                 f"(tokens per second)") from None
        if not math.isclose(value, expected, rel_tol=1e-4):
            ratio = value / expected if expected else float("nan")
            why = ""
            if math.isclose(value, 1 / expected, rel_tol=1e-4):
                why = " (that is seconds per token; the bound asks for tokens per second)"
            elif math.isclose(ratio, 1 / 8, rel_tol=1e-3) or math.isclose(ratio, 8, rel_tol=1e-3):
                why = " (off by 8: bytes, not bits)"
            raise AssertionError(f"{desc} returned {value:.6g}; expected {expected:.6g} tokens/s = bandwidth / "
                                 f"(num_params x bytes_per_param){why}. Case: {note}")
    for args, bad in (((0, 2, 1e12), "num_params"), ((-5e9, 2, 1e12), "num_params"), ((7e9, 0, 1e12), "bytes_per_param"),
                      ((7e9, -2, 1e12), "bytes_per_param"), ((7e9, 2, 0), "bandwidth_bytes_per_s"),
                      ((7e9, 2, -1e12), "bandwidth_bytes_per_s")):
        expect_raises(f"decode_tokens_per_second_bound{args}", ValueError, f"{bad} must be > 0", fn, *args)


def check_q_embedding_share_percent(value) -> None:
    """Percent of SmolLM2-135M's parameters in its (tied) token embedding table."""
    from decodelab.lessons import kv_size

    fields = kv_size.config_fields("SmolLM2-135M")
    expected = 100 * fields["vocab_size"] * fields["hidden_size"] / kv_size.parameter_count(fields)
    expect_answer(value, expected, "q_embedding_share_percent: SmolLM2-135M's embedding table (49,152 x 576, "
                  "stored once) as a percentage of its 134,515,008 parameters", rel_tol=0.05)


def check_q_llama8b_tokens_per_s(value) -> None:
    """The batch-1 decode bound of Llama-3.1-8B in bf16 on 3.35 TB/s, in tokens per second."""
    from decodelab.lessons import kv_size, measure

    expected = measure.decode_tokens_per_second_bound(kv_size.parameter_count("Llama-3.1-8B"), 2, 3.35e12)
    expect_answer(value, expected, "q_llama8b_tokens_per_s: 3.35e12 bytes/s over (8,030,261,248 parameters x 2 "
                  "bytes) for Llama-3.1-8B in bf16 on an H100", rel_tol=0.05)

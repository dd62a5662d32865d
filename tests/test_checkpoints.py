"""Checkpoints written by transformers load here with the same logits, and ours load there.

Random small models only: every parameter (norms and biases included) is redrawn at O(1)
scale so that a wrong tensor, a dropped bias or a wrong RoPE shows far above the tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch
from oracles import quiet_transformers, random_ids, random_model

from decodelab.config import ModelConfig
from decodelab.model.rope import inverse_frequencies, rope_tables
from decodelab.model.toy import randomize_
from decodelab.model.weights import load_model, save_model

transformers = pytest.importorskip("transformers")

TOL = 1e-4
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
SMALL = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model ("llama" or "qwen2") with O(1) weights."""
    torch.manual_seed(seed)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**SMALL, **overrides})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**{**SMALL, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    return randomize_(model, seed).eval()


def save_hf(model, folder, **kwargs):
    with quiet_transformers():
        model.save_pretrained(folder, **kwargs)
    return folder


def load_hf(folder):
    with quiet_transformers() as tf:
        return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def max_diff(ours_model, hf, ids) -> float:
    with torch.no_grad():
        return (ours_model(ids) - hf(ids).logits.float()).abs().max().item()


# ----------------------------------------------------------- Llama 3: GQA + rope_scaling
@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    hf = hf_model(
        "llama", seed=1, head_dim=16, rope_theta=10000.0, rope_scaling=dict(LLAMA3_SCALING), tie_word_embeddings=False
    )
    folder = save_hf(hf, tmp_path_factory.mktemp("llama3"))
    ids = random_ids(100, SMALL["vocab_size"], seed=1, batch=2)  # longer than the original 64
    return hf, folder, ids


def test_llama3_scaling_changes_frequencies():
    """With original_max_position_embeddings=64 all three bands of llama3 scaling are in use."""
    config = ModelConfig(**SMALL, head_dim=16, rope_scaling=dict(LLAMA3_SCALING))
    plain = ModelConfig(**SMALL, head_dim=16)
    ratio = inverse_frequencies(plain) / inverse_frequencies(config)
    assert torch.isclose(ratio[0], torch.tensor(1.0))  # fast channel kept
    assert torch.isclose(ratio[-1], torch.tensor(8.0))  # slow channels stretched by factor
    assert ((ratio > 1.01) & (ratio < 7.99)).any()  # and some interpolated in between


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rope_frequencies_equal_transformers_bit_for_bit(scaling):
    """Computed in float32 as transformers does: in float64 11 of SmolLM2's 32 frequencies
    differ in the last bit, enough to move its logits by ~1e-4 over 350 tokens."""
    hf = hf_model("llama", head_dim=16, rope_theta=100000.0, rope_scaling=dict(scaling) if scaling else None)
    ours = ModelConfig(**SMALL, head_dim=16, rope_theta=100000.0, rope_scaling=dict(scaling) if scaling else None)
    assert torch.equal(inverse_frequencies(ours), hf.model.rotary_emb.inv_freq)


def test_llama_gqa_llama3_untied_loads_with_same_logits(llama3_checkpoint):
    hf, folder, ids = llama3_checkpoint
    raw = json.loads((folder / "config.json").read_text())
    model = load_model(folder)
    assert model.config.num_key_value_heads == 2 and model.config.num_attention_heads == 4
    assert model.config.rope_scaling["rope_type"] == "llama3", raw  # also from transformers 5's rope_parameters
    assert not model.config.tie_word_embeddings
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    diff = max_diff(model, hf, ids)
    assert diff <= TOL, f"max |logit difference| {diff:.3g}"


def test_dropping_rope_scaling_would_be_caught(llama3_checkpoint):
    """The test above can fail: the same weights without rope_scaling give other logits."""
    hf, folder, ids = llama3_checkpoint
    model = load_model(folder)
    model.config.rope_scaling = None
    model.rope_cos, model.rope_sin = rope_tables(model.config)
    assert max_diff(model, hf, ids) > 1e-2


def test_dropping_rope_theta_would_be_caught(tmp_path):
    """A config that loses rope_theta (as reading only the pre-v5 fields did) is caught."""
    hf = hf_model("llama", seed=2, rope_theta=500.0)
    folder = save_hf(hf, tmp_path)
    ids = random_ids(40, SMALL["vocab_size"], seed=2)
    model = load_model(folder)
    assert model.config.rope_theta == 500.0
    assert max_diff(model, hf, ids) <= TOL
    model.config.rope_theta = 10000.0
    model.rope_cos, model.rope_sin = rope_tables(model.config)
    assert max_diff(model, hf, ids) > 1e-2


# ----------------------------------------------------------------- Qwen2: q/k/v biases
def test_qwen2_with_biases_loads_with_same_logits(tmp_path):
    hf = hf_model("qwen2", seed=3, tie_word_embeddings=True)
    assert hf.model.layers[0].self_attn.q_proj.bias.abs().min() > 0  # random, nonzero biases
    folder = save_hf(hf, tmp_path)
    ids = random_ids(48, SMALL["vocab_size"], seed=3, batch=2)
    model = load_model(folder)
    assert model.config.model_type == "qwen2" and model.config.has_qkv_bias
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(
            getattr(model.model.layers[1].self_attn, name).bias, getattr(hf.model.layers[1].self_attn, name).bias
        )
    diff = max_diff(model, hf, ids)
    assert diff <= TOL, f"max |logit difference| {diff:.3g}"
    model.model.layers[0].self_attn.k_proj.bias.zero_()  # a loader that dropped biases is caught
    assert max_diff(model, hf, ids) > 1e-2


# ------------------------------------------------------------------------ shards
def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("llama", seed=4, tie_word_embeddings=False)
    folder = save_hf(hf, tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(shards) >= 2 and sorted(set(index["weight_map"].values())) == shards
    ids = random_ids(32, SMALL["vocab_size"], seed=4)
    diff = max_diff(load_model(folder), hf, ids)
    assert diff <= TOL, f"max |logit difference| {diff:.3g}"


# ------------------------------------------------------------ ours -> transformers
@pytest.mark.parametrize("variant", ["llama_tied", "llama3_untied_gqa", "qwen2_bias"])
def test_our_checkpoint_loads_in_transformers(tmp_path, variant):
    kwargs = {
        "llama_tied": dict(tie_word_embeddings=True, num_key_value_heads=4),
        "llama3_untied_gqa": dict(tie_word_embeddings=False, rope_scaling=dict(LLAMA3_SCALING), head_dim=16),
        "qwen2_bias": dict(model_type="qwen2", tie_word_embeddings=False),
    }[variant]
    ours = random_model(seed=5, **{**SMALL, **kwargs})
    save_model(ours, tmp_path)
    hf = load_hf(tmp_path)
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if variant == "qwen2_bias" else "LlamaForCausalLM")
    ids = random_ids(96, SMALL["vocab_size"], seed=5, batch=2)
    diff = max_diff(ours, hf, ids)
    assert diff <= TOL, f"{variant}: max |logit difference| {diff:.3g}"
    again = load_model(tmp_path)  # and our own round trip is exact
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))

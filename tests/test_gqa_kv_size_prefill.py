"""Grouped-query attention, KV-head pooling, the KV-size calculator and prefill.

The `check_*` functions state what a correct implementation must do; they pass on the
reference modules and catch the kept buggy versions in fixtures/library/buggy_gqa_kv_size_prefill.py.
The two that notebook 05 grades (`check_broadcast_gqa_attention`, `check_pool_kv_heads`) are its
graded checks, imported from autograder/checks/gqa.py rather than copied.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import load_fixture

from autograder.checks.gqa import check_broadcast_gqa_attention, check_pool_kv_heads  # graded (notebook 05), not copied
from decodelab.config import ModelConfig
from decodelab.decoding.generate import stream_token_ids
from decodelab.lessons import gqa, kv_size
from decodelab.lessons import prefill_decode as pf
from decodelab.lessons.measure import Roofline
from decodelab.lessons.tiled_attention import measure_tensor_memory
from decodelab.model.attention import causal_attention
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import LlamaForCausalLM
from decodelab.model.toy import random_llama
from decodelab.params import SamplingParams

buggy = load_fixture("library/buggy_gqa_kv_size_prefill")
KiB, MiB, GiB = 2**10, 2**20, 2**30


def random_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A small random-weight model with O(1) logits: 3 layers, 8 query heads over 2 KV heads of 16."""
    return random_llama(seed, **{"num_hidden_layers": 3, "num_attention_heads": 8, "head_dim": 16, **overrides})


# --------------------------------------------------------------------------- checks


def check_group_query_attention(fn):
    torch.manual_seed(1)
    cases = [  # (batch, heads, kv_heads, queries, q_offset, head_dim)
        (2, 8, 2, 5, 0, 16),
        (1, 8, 2, 1, 9, 16),
        (2, 8, 4, 3, 6, 8),  # GQA, prompt / decode / chunk
        (1, 6, 6, 4, 3, 8),  # MHA
        (2, 4, 1, 4, 5, 8),  # MQA
    ]
    for b, h, h_kv, t, offset, d in cases:
        q = torch.randn(b, h, t, d)
        k, v = torch.randn(b, h_kv, offset + t, d), torch.randn(b, h_kv, offset + t, d)
        got, want = fn(q, k, v, offset), causal_attention(q, k, v, offset)
        err = (got - want).abs().max().item()
        assert err < 1e-5, (
            f"attention with {h} query heads over {h_kv} KV heads, {t} queries at "
            f"q_offset={offset}: differs from causal_attention by {err:.3g}"
        )


def check_kv_bytes(fn):
    seed = {  # (preset, tokens, batch): bytes
        ("Llama-3.1-8B", 1, 1): 128 * KiB,
        ("Llama-3.1-8B", 4096, 1): 512 * MiB,
        ("Llama-3.1-8B", 128 * 1024, 1): 16 * GiB,
        ("Llama-3.1-8B", 4096, 32): 16 * GiB,
        ("Qwen3-8B", 1, 1): 144 * KiB,
        ("GPT-3-175B", 2048, 1): 2 * 96 * 12288 * 2048 * 2,
        # gpt-oss-20b: 12 full layers hold all 131072 positions, 12 windowed layers 128
        ("gpt-oss-20b", 131072, 1): 2 * 8 * 64 * 2 * (12 * 131072 + 12 * 128),
    }
    for (preset, tokens, batch), want in seed.items():
        got = fn(preset, tokens, batch=batch, dtype="fp16")
        assert got == want, (
            f"{preset}, {tokens} tokens x {batch} sequences in fp16: expected "
            f"{want:,} bytes ({kv_size.format_bytes(want)}), got {got:,}"
        )


def check_prefill(fn):
    model = random_model(3, num_hidden_layers=3)
    ids = torch.randint(0, 97, (12,)).tolist()
    cache_fast, cache_slow = KVCache(model.config, 1, 16), KVCache(model.config, 1, 16)
    fast, slow = fn(model, ids, cache_fast), pf.feed_one_by_one(model, ids, cache_slow)
    err = (fast - slow).abs().max().item()
    assert err < 1e-5, f"prefill's last logits differ from feeding the 12 tokens one by one by {err:.3g}"
    with torch.inference_mode():  # the cache it leaves must serve the next token the same way
        nxt = torch.tensor([[5]])
        err = (model(nxt, kv_cache=cache_fast) - model(nxt, kv_cache=cache_slow)).abs().max().item()
    assert err < 1e-5, f"the next token's logits after prefill differ by {err:.3g}: the cached K/V are wrong"


REFERENCE = {
    "check_group_query_attention": gqa.group_query_attention,
    "check_broadcast_gqa_attention": gqa.broadcast_gqa_attention,
    "check_pool_kv_heads": gqa.pool_kv_heads,
    "check_kv_bytes": kv_size.kv_bytes,
    "check_prefill": pf.prefill,
}


CHECKS = {
    check.__name__: check
    for check in (
        check_group_query_attention,
        check_broadcast_gqa_attention,
        check_pool_kv_heads,
        check_kv_bytes,
        check_prefill,
    )
}


@pytest.mark.parametrize("check_name", sorted(REFERENCE))
def test_reference_passes(check_name):
    CHECKS[check_name](REFERENCE[check_name])


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    fn, check_name, what = buggy.BUGS[bug]
    with pytest.raises(AssertionError) as info:
        CHECKS[check_name](fn)
    assert len(str(info.value)) > 40, f"{bug} ({what}): message too terse: {info.value}"


# --------------------------------------------------------------------------- GQA


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2, 3, 4]),
    group=st.sampled_from([1, 2, 3]),
    queries=st.integers(1, 6),
    q_offset=st.integers(0, 7),
    head_dim=st.sampled_from([2, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_explicit_gqa_equals_sdpa_path(batch, kv_heads, group, queries, q_offset, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, queries, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, q_offset + queries, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, q_offset + queries, head_dim, generator=g)
    torch.testing.assert_close(
        gqa.group_query_attention(q, k, v, q_offset), causal_attention(q, k, v, q_offset), atol=1e-5, rtol=1e-5
    )


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2, 3, 4]),
    group=st.sampled_from([1, 2, 3, 4]),
    queries=st.integers(1, 6),
    q_offset=st.integers(0, 40),
    head_dim=st.sampled_from([2, 8, 16]),
    seed=st.integers(0, 2**16),
)
def test_broadcast_gqa_equals_sdpa_path(batch, kv_heads, group, queries, q_offset, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, queries, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, q_offset + queries, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, q_offset + queries, head_dim, generator=g)
    torch.testing.assert_close(
        gqa.broadcast_gqa_attention(q, k, v, q_offset), causal_attention(q, k, v, q_offset), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_broadcast_gqa_allocates_no_repeated_kv(kv_heads):
    """measure_tensor_memory sees every tensor made, the copy inside a broadcasting matmul included:
    broadcasting holds only [B, H, T, S] blocks; repeat_kv makes [B, H, S, D] copies of K and V."""
    batch, heads, seq, dim = 2, 8, 1024, 64
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, kv_heads, seq, dim), torch.randn(batch, kv_heads, seq, dim)
    out, seen = measure_tensor_memory(gqa.broadcast_gqa_attention, q, k, v, seq - 1)
    torch.testing.assert_close(out, causal_attention(q, k, v, seq - 1), atol=1e-5, rtol=1e-5)
    repeated = batch * heads * seq * dim * 4  # [B, H, S, D] float32
    scores = batch * heads * 1 * seq * 4  # [B, H, T, S] float32
    assert seen.peak_bytes <= 4 * scores < repeated // 8, seen
    _, copied = measure_tensor_memory(gqa.group_query_attention, q, k, v, seq - 1)
    g = heads // kv_heads
    # K and V repeated to H heads (for MQA repeat_kv's reshape is still a view: the copy happens in matmul)
    assert copied.peak_bytes >= (repeated if g > 1 else 0), copied
    _, matmul = measure_tensor_memory(  # the same scores by @ on a broadcast axis: matmul copies K inside
        lambda q, k: q.view(batch, kv_heads, g, 1, dim) @ k.unsqueeze(2).transpose(-2, -1), q, k
    )
    assert matmul.peak_bytes >= (repeated if g > 1 else 0), matmul


def test_broadcast_gqa_keeps_dtype_and_rejects_bad_shapes():
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    got = gqa.broadcast_gqa_attention(q, k.bfloat16(), v.bfloat16(), 3)
    want = gqa.group_query_attention(q, k.bfloat16(), v.bfloat16(), 3)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)  # the same float32 arithmetic, rounded once
    with pytest.raises(ValueError, match="3"):
        gqa.broadcast_gqa_attention(torch.randn(1, 8, 2, 4), torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4))
    with pytest.raises(ValueError, match="q_offset"):
        gqa.broadcast_gqa_attention(torch.randn(1, 8, 2, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), 1)


def test_mha_and_mqa_are_the_extremes():
    assert [gqa.attention_kind(8, n) for n in (8, 4, 2, 1)] == ["MHA", "GQA", "GQA", "MQA"]
    assert [gqa.kv_head_for_query_head(h, 8, 2) for h in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    mqa = gqa.group_query_attention(q, k, v)  # one shared KV head == that head copied to all 4
    mha = gqa.group_query_attention(q, k.expand(1, 4, 3, 8), v.expand(1, 4, 3, 8))
    torch.testing.assert_close(mqa, mha)
    with pytest.raises(ValueError, match="3"):
        gqa.attention_kind(8, 3)


def test_group_query_attention_rejects_bad_shapes():
    q, k = torch.randn(1, 8, 2, 4), torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="3"):
        gqa.group_query_attention(q, k, k)
    with pytest.raises(ValueError, match="q_offset"):
        gqa.group_query_attention(q, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), q_offset=1)


def expand_to_mha(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """An MHA model whose KV head j is a copy of the GQA model's head j // group."""
    config = model.config
    mha = LlamaForCausalLM(dataclasses.replace(config, num_key_value_heads=config.num_attention_heads))
    state = dict(model.state_dict())
    group, d = config.num_queries_per_kv, config.head_dim
    for name, tensor in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            heads = tensor.reshape(config.num_key_value_heads, d, *tensor.shape[1:])
            state[name] = heads.repeat_interleave(group, dim=0).reshape(-1, *tensor.shape[1:])
    mha.load_state_dict(state)
    return mha.eval()


@pytest.mark.parametrize("bias", [False, True])
def test_repeated_kv_heads_equal_mha_with_duplicated_projections(bias):
    model = random_model(5, attention_bias=bias)  # 8 query heads, 2 KV heads
    mha = expand_to_mha(model)
    assert mha.config.num_key_value_heads == 8
    ids = torch.randint(0, 97, (2, 10))
    with torch.inference_mode():
        torch.testing.assert_close(mha(ids), model(ids), atol=1e-5, rtol=1e-5)
        back = gqa.pool_model_kv_heads(mha, 2)  # pooling identical copies gives the GQA model back
        torch.testing.assert_close(back(ids), model(ids), atol=1e-5, rtol=1e-5)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, msg=name)


def test_pooling_to_the_same_count_is_identity():
    model = random_model(6, attention_bias=True, tie_word_embeddings=True)
    same = gqa.pool_model_kv_heads(model, 2)
    assert same is not model and same.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(same.state_dict()[name], tensor), name
    assert same.lm_head.weight is same.model.embed_tokens.weight  # still tied
    weight = torch.randn(3 * 8, 5)
    assert torch.equal(gqa.pool_kv_heads(weight, 3, 8), weight)


def test_pooled_model_runs_and_its_cache_is_smaller_by_the_exact_factor():
    model = random_model(7, num_key_value_heads=8, attention_bias=True)
    ids = torch.randint(0, 97, (1, 9)).tolist()[0]
    sizes = {}
    for kv_heads in (8, 4, 2, 1):
        pooled = gqa.pool_model_kv_heads(model, kv_heads)
        assert pooled.config.num_key_value_heads == kv_heads
        assert pooled.model.layers[0].self_attn.k_proj.bias.shape == (kv_heads * 16,)
        cache = KVCache(pooled.config, 1, 16)
        logits = pf.prefill(pooled, ids, cache)
        assert logits.shape == (1, 97) and torch.isfinite(logits).all()
        sizes[kv_heads] = cache.nbytes()
        assert sizes[kv_heads] == kv_size.kv_bytes(pooled.config, 9, dtype="fp32")
        tokens = list(stream_token_ids(pooled, ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
        assert len(tokens) == 3
    assert [sizes[8] / sizes[n] for n in (8, 4, 2, 1)] == [1, 2, 4, 8]
    assert model.config.num_key_value_heads == 8 and model.model.layers[0].self_attn.k_proj.out_features == 128


def test_pooling_rejects_a_count_that_does_not_divide():
    model = random_model(8, num_key_value_heads=8)
    for bad in (3, 0, 16):
        with pytest.raises(ValueError, match=f"got {bad}"):
            gqa.pool_model_kv_heads(model, bad)
    with pytest.raises(ValueError, match="got 3"):
        gqa.pool_kv_heads(torch.randn(8 * 4, 5), 3, 4)
    with pytest.raises(ValueError, match="head_dim"):
        gqa.pool_kv_heads(torch.randn(30, 5), 2, 4)


# --------------------------------------------------------------------------- KV size


def test_seed_figures_exactly():
    assert kv_size.kv_bytes("Llama-3.1-8B", 1) == 128 * KiB == 131072
    assert kv_size.kv_bytes("Llama-3.1-8B", 4096) == 512 * MiB
    assert kv_size.kv_bytes("Llama-3.1-8B", 128 * 1024) == 16 * GiB
    assert kv_size.kv_bytes("Llama-3.1-8B", 4096, batch=32) == 16 * GiB
    assert kv_size.kv_bytes("Qwen3-8B", 1) == 144 * KiB
    assert [kv_size.format_bytes(kv_size.kv_bytes("Llama-3.1-8B", n)) for n in (1, 4096, 131072)] == [
        "128 KiB",
        "512 MiB",
        "16 GiB",
    ]
    gpt3 = kv_size.kv_bytes("GPT-3-175B", 2048)
    assert gpt3 == 9_663_676_416  # 2 * 96 * 12288 * 2048 * 2 = 9.66e9 bytes = 9 GiB
    # The seed's "9.6 GB" truncates 9.66 GB (rounding would say 9.7 GB); the per-token figure is 4.5 MiB.
    assert math.floor(gpt3 / 1e8) / 10 == 9.6 and round(gpt3 / 1e9, 1) == 9.7
    assert kv_size.kv_bytes("GPT-3-175B", 1) == 4.5 * MiB and gpt3 == 9 * GiB


def test_sliding_window_layers_hold_at_most_the_window():
    windows = kv_size.layer_windows("gpt-oss-20b")
    assert windows == [128, None] * 12
    per_position = 2 * 8 * 64 * 2  # one layer, fp16
    assert kv_size.kv_bytes("gpt-oss-20b", 100) == 24 * 100 * per_position  # under the window: all layers full
    assert kv_size.kv_bytes("gpt-oss-20b", 4096) == (12 * 4096 + 12 * 128) * per_position
    # every token past 128 costs only the 12 full layers: half of a same-shaped full-attention model
    grown = kv_size.kv_bytes("gpt-oss-20b", 5000) - kv_size.kv_bytes("gpt-oss-20b", 4000)
    assert grown == 1000 * 12 * per_position


def test_kv_bytes_options_and_errors():
    assert kv_size.kv_bytes("Llama-3.1-8B", 10, dtype="fp32") == 2 * kv_size.kv_bytes("Llama-3.1-8B", 10)
    assert kv_size.kv_bytes("llama-3.1-8b", 10, dtype=torch.bfloat16) == kv_size.kv_bytes("Llama-3.1-8B", 10)
    assert kv_size.kv_bytes("smollm2", 1, dtype="int4") == 2 * 30 * 3 * 64 // 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seq_len"):
            kv_size.kv_bytes("tiny", bad)
    with pytest.raises(ValueError, match="batch"):
        kv_size.kv_bytes("tiny", 4, batch=0)
    with pytest.raises(ValueError, match="fp12"):
        kv_size.kv_bytes("tiny", 4, dtype="fp12")
    with pytest.raises(ValueError, match="Llama-3.1-8B"):  # lists the presets
        kv_size.kv_bytes("llama-9", 4)


def test_70b_decode_bound_from_the_roofline():
    weights = 140e9  # 70B parameters in fp16
    h100 = Roofline(bandwidth=3.35e12, peak_flops=989e12)
    assert round(1e3 * weights / h100.bandwidth) == 42  # ms per token
    assert round(h100.decode_tokens_per_second(weights)) == 24
    assert round(Roofline(bandwidth=2e12, peak_flops=312e12).decode_tokens_per_second(weights)) == 14


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"attention_bias": True},
        {"model_type": "qwen2"},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 8, "head_dim": 8},
        {
            "hidden_size": 48,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": None,
            "tie_word_embeddings": True,
            "attention_bias": True,
        },
    ],
)
def test_parameter_count_matches_the_model(overrides):
    fields = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
    )
    fields.update(overrides)
    config = ModelConfig(**fields)
    model = LlamaForCausalLM(config)
    assert kv_size.parameter_count(config) == model.num_parameters()
    assert kv_size.parameter_count(config.to_dict()) == model.num_parameters()


def test_parameter_count_smollm2(smollm2, smollm2_folder):
    model, _ = smollm2  # the real model, loaded once per session (conftest)
    assert kv_size.parameter_count(model.config) == model.num_parameters() == 134_515_008
    assert kv_size.parameter_count("smollm2") == 134_515_008
    raw = json.loads((smollm2_folder / "config.json").read_text())  # the preset holds its values
    assert {k: raw[k] for k in kv_size.PRESETS["SmolLM2-135M"]} == kv_size.PRESETS["SmolLM2-135M"]
    assert kv_size.kv_bytes(model.config, 1, dtype="fp32") == kv_size.kv_bytes("smollm2", 1, dtype="fp32") == 46080


def test_parameter_count_published_models():
    assert kv_size.parameter_count("Llama-3.1-8B") == 8_030_261_248
    qwen = kv_size.parameter_count("Qwen3-8B")  # model card: 8.2B, 6.95B non-embedding
    assert round(qwen / 1e9, 1) == 8.2 and round((qwen - 2 * 151936 * 4096) / 1e9, 2) == 6.95
    with pytest.raises(ValueError, match="gpt_oss"):
        kv_size.parameter_count("gpt-oss-20b")


def test_tiny_preset_matches_the_trained_model():
    from decodelab.paths import PACKAGE_DATA
    from decodelab.training.train_tiny import MODELS

    preset = kv_size.PRESETS["tiny"]
    assert {k: preset[k] for k in MODELS["target"][1]} == MODELS["target"][1]
    path = PACKAGE_DATA / "tiny" / "config.json"
    if not path.exists():
        pytest.skip("the tiny model is not trained yet")
    raw = json.loads(path.read_text())
    assert {k: raw[k] for k in preset} == preset


# --------------------------------------------------------------------------- prefill


def test_prefill_equals_one_by_one():
    model = random_model(9)
    ids = torch.randint(0, 97, (2, 20))  # a batch of two prompts
    fast, slow = KVCache(model.config, 2, 24), KVCache(model.config, 2, 24)
    torch.testing.assert_close(pf.prefill(model, ids, fast), pf.feed_one_by_one(model, ids, slow), atol=1e-5, rtol=0)
    assert fast.seq_len == slow.seq_len == 20
    torch.testing.assert_close(fast.keys, slow.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.values, slow.values, atol=1e-5, rtol=0)
    with torch.inference_mode():  # and the same as no cache at all
        torch.testing.assert_close(
            model(ids)[:, -1], pf.prefill(model, ids, KVCache(model.config, 2, 24)), atol=1e-5, rtol=0
        )


def test_reuse_prefix_equals_recompute():
    model = random_model(10)
    prefix = torch.randint(0, 97, (30,)).tolist()
    suffixes = [torch.randint(0, 97, (n,)).tolist() for n in (1, 7, 12)]
    reused = pf.reuse_prefix(model, prefix, suffixes)
    again = pf.reuse_prefix(model, prefix, suffixes[::-1])[::-1]  # order does not matter: copies are independent
    with torch.inference_mode():
        for suffix, got, got_again in zip(suffixes, reused, again):
            want = model(torch.tensor([prefix + suffix]))[:, -1]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            torch.testing.assert_close(got_again, got, atol=1e-6, rtol=0)
    one = pf.reuse_prefix(model, prefix, suffixes[1])  # a flat list is one suffix
    assert len(one) == 1 and torch.allclose(one[0], reused[1], atol=1e-6)


def test_clone_cache_is_independent():
    model = random_model(11)
    cache = KVCache(model.config, 1, 16)
    pf.prefill(model, [1, 2, 3], cache)
    copy = pf.clone_cache(cache)
    pf.prefill(model, [4, 5], copy)
    assert (cache.seq_len, copy.seq_len) == (3, 5)
    assert cache.keys[:, :, :, 3:].abs().sum() == 0 and copy.keys[:, :, :, 3:5].abs().sum() > 0


def test_arithmetic_intensity():
    decode = pf.arithmetic_intensity("Llama-3.1-8B", 1, kv_len=4096, bytes_per_param="fp16")
    prompt = pf.arithmetic_intensity("Llama-3.1-8B", 512, kv_len=0, bytes_per_param="fp16")
    assert 0.9 < decode < 1.0  # 2 FLOPs per 2-byte weight, a little less for the KV bytes
    assert 500 < prompt < 512
    intensities = [pf.arithmetic_intensity("tiny", t, 0, 4) for t in (1, 8, 64, 512)]
    assert intensities == sorted(intensities)
    config = random_model(12).config
    want = (
        2
        * kv_size.parameter_count(config)
        * 4
        / (kv_size.parameter_count(config) * 4 + kv_size.kv_bytes(config, 14, dtype="fp32"))
    )
    assert pf.arithmetic_intensity(config, 4, 10, "fp32") == pytest.approx(want)
    with pytest.raises(ValueError, match="num_tokens"):
        pf.arithmetic_intensity("tiny", 0, 0, 2)


def test_measure_latency():
    model = random_model(13)
    prompt = torch.randint(0, 97, (6,)).tolist()
    out = pf.measure_latency(model, prompt, 5)
    assert out["ttft_s"] > 0 and len(out["itl_s"]) == 4 and all(t > 0 for t in out["itl_s"])
    greedy = list(stream_token_ids(model, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert out["token_ids"] == greedy
    with pytest.raises(ValueError, match="n must"):
        pf.measure_latency(model, prompt, 0)


def test_gqa_decode_step_writes_the_row_and_matches_sdpa():
    """The decode step over a preallocated cache equals SDPA over the rows held plus the new one, writes only
    its own row, and counts the bytes of K and V of the H_kv heads."""
    torch.manual_seed(12)
    q, k_new, v_new = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    k_cache, v_cache = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    before = k_cache.clone()
    out, bytes_read = gqa.gqa_decode_step(q, k_new, v_new, k_cache, v_cache, 6)
    assert torch.equal(k_cache[:, :, 6:7], k_new) and torch.equal(k_cache[:, :, 7:], before[:, :, 7:])
    torch.testing.assert_close(out, causal_attention(q, k_cache[:, :, :7], v_cache[:, :, :7], 6))
    assert bytes_read == 2 * 2 * 2 * 7 * 16 * 4
    with pytest.raises(ValueError, match="no room"):
        gqa.gqa_decode_step(q, k_new, v_new, k_cache, v_cache, 10)

"""decodelab.lessons.forward_pass, the functional forward pass of notebook 01, against the library's
LlamaForCausalLM: random toy Llamas with grouped-query heads (logits within 1e-5), SmolLM2-135M
with its real weights (within 1e-3, the same greedy tokens), and a KV-cached pass equal to one
pass over the whole sequence. Also the attend interface: the same layer code over the library's
own cache and over the engine's paged batch."""

from __future__ import annotations

import functools

import pytest
import torch
from oracles import random_ids

from decodelab.config import ModelConfig
from decodelab.decoding.generate import generate_with_cache
from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice
from decodelab.lessons import forward_pass as fp
from decodelab.model.kv_cache import KVCache
from decodelab.model.rope import inverse_frequencies, plain_inverse_frequencies
from decodelab.model.toy import random_llama

TOYS = [  # config overrides: grouped, multi-query, multi-head, tied, a bias, odd sizes
    dict(),
    dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48),
    dict(num_attention_heads=4, num_key_value_heads=1),
    dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_hidden_layers=3),
    dict(tie_word_embeddings=True, rope_theta=100000.0),
    dict(attention_bias=True),
]


def _attend(config, batch: int, length: int):
    return fp.cache_attend(KVCache(config, batch, length))


@pytest.mark.parametrize("overrides", TOYS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@torch.no_grad()
def test_logits_match_the_library_on_toy_models(overrides):
    model = random_llama(3, **overrides)
    ids = random_ids(13, model.config.vocab_size, seed=4, batch=2)
    want = model(ids)
    got = fp.forward(model.state_dict(), model.config, ids, _attend(model.config, 2, 13))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("overrides", TOYS[:4])
@torch.no_grad()
def test_cached_pass_equals_one_pass(overrides):
    """Prefill 5, a chunk of 3, then single tokens through the cache: the logits of one pass."""
    model = random_llama(5, **overrides)
    config, weights = model.config, model.state_dict()
    ids = random_ids(12, config.vocab_size, seed=6, batch=2)
    full = fp.forward(weights, config, ids, _attend(config, 2, 12))
    attend, pieces, held = _attend(config, 2, 12), [], 0
    for n in (5, 3, 1, 1, 1, 1):
        pieces.append(fp.forward(weights, config, ids[:, held : held + n], attend, torch.arange(held, held + n)))
        held += n
    assert (torch.cat(pieces, 1) - full).abs().max().item() < 1e-5
    assert (full - model(ids)).abs().max().item() < 1e-5


@torch.no_grad()
def test_decoder_layer_equals_the_library_layer():
    model = random_llama(7, num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    config, weights = model.config, model.state_dict()
    x = torch.randn(2, 6, config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6)
    cos, sin = model.rope_at(positions)
    for i, layer in enumerate(model.model.layers):
        want = layer(x, cos, sin, KVCache(config, 2, 6))
        got = fp.decoder_layer(weights, config, i, x, positions, _attend(config, 2, 6))
        assert (got - want).abs().max().item() < 1e-5


def test_rms_norm_computes_in_float32():
    x = torch.tensor([[300.0, -200.0, 400.0, 100.0]], dtype=torch.float16)  # squares overflow float16
    got = fp.rms_norm(x, torch.ones(4, dtype=torch.float16), 1e-5)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    want = x.float() / x.float().pow(2).mean().sqrt()
    assert (got.float() - want).abs().max() < 2e-3


def test_rope_matches_the_model_tables_at_any_positions():
    model = random_llama(0, rope_theta=100000.0, head_dim=64, max_position_embeddings=5000)
    x = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    positions = torch.tensor([4093, 7, 4999, 0])
    model = model.to(torch.bfloat16)
    cos, sin = model.rope_at(positions)
    from decodelab.model.rope import apply_rope

    assert torch.equal(fp.rope(x, positions, 100000.0), apply_rope(x, cos, sin))
    config = ModelConfig(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        rope_theta=100000.0,
    )
    assert torch.equal(plain_inverse_frequencies(64, 100000.0), inverse_frequencies(config))


def test_scaled_rope_and_sliding_windows_are_refused():
    for overrides in (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), dict(sliding_window=4)):
        model = random_llama(0, **overrides)
        with pytest.raises(ValueError, match="rope_scaling|sliding_window"):
            fp.forward(model.state_dict(), model.config, torch.tensor([[1, 2]]), _attend(model.config, 1, 2))


@torch.no_grad()
def test_the_same_layers_run_over_paged_blocks():
    """attend is the only door to the keys and values: the engine's PagedBatch.attend serves the
    same forward, two sequences packed into one row with their own positions."""
    model = random_llama(8)
    config, weights = model.config, model.state_dict()
    a, b = random_ids(7, config.vocab_size, seed=1)[0], random_ids(5, config.vocab_size, seed=2)[0]
    store = PagedKVStore(config, num_blocks=8, block_size=4)
    tables = [[3, 0], [5, 6]]  # blocks 3, 0 hold sequence a; 5, 6 hold b
    slots = [tables[0][i // 4] * 4 + i % 4 for i in range(7)] + [tables[1][i // 4] * 4 + i % 4 for i in range(5)]
    batch = PagedBatch(
        store, [SequenceSlice(0, 7, 7, tables[0]), SequenceSlice(7, 5, 5, tables[1])], torch.tensor(slots)
    )
    packed = torch.cat([a, b])[None]  # [1, 12]
    positions = torch.cat([torch.arange(7), torch.arange(5)])
    got = fp.forward(weights, config, packed, batch.attend, positions)[0]  # [12, V]
    want = torch.cat([model(a[None])[0], model(b[None])[0]])
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.slow
def test_smollm2_logits_and_greedy_tokens(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is gravity?"}]))
    weights = model.state_dict()
    with torch.inference_mode():
        want = model(torch.tensor([prompt]))
        got = fp.forward(weights, model.config, torch.tensor([prompt]), _attend(model.config, 1, len(prompt)))
    assert (got - want).abs().max().item() < 1e-3
    new = 8
    assert fp.greedy_generate(weights, model.config, prompt, new) == generate_with_cache(model, prompt, new)


def test_greedy_generate_uses_the_given_parts():
    model = random_llama(9)
    calls = []

    def counting_attention(cache, layer_index, q, k, v):
        calls.append(q.shape[2])
        return fp.attention(cache, layer_index, q, k, v)

    ids = fp.greedy_generate(
        model.state_dict(),
        model.config,
        [1, 2, 3],
        4,
        forward_fn=functools.partial(fp.forward),
        attention_fn=counting_attention,
    )
    assert ids == generate_with_cache(model, [1, 2, 3], 4)
    assert calls == [3] * 2 + [1] * 2 * 3  # the prompt once per layer, then one token per layer and step

"""A decode step through every Q4 decoder layer in one C call (decodelab.model.q4_stack, issue 30).

Oracle: the same model run layer by layer (`Backbone.run_layers`: each `Q4DecoderLayer`'s two C
calls around torch's attention over the KVCache), on the same steps and cache, within the rounding the
fused-layer test allows; and the calls that must not take the one-call path, which must give what the
layers give.
"""

from __future__ import annotations

import pytest
import torch
from test_q4_linear import random_q4_llama, require_kernel

from decodelab.model import q4_kernel
from decodelab.model.kv_cache import KVCache, SlidingWindowKVCache
from decodelab.model.llama import Backbone
from decodelab.model.q4_stack import Q4Backbone, use_q4_backbone
from decodelab.model.toy import random_llama


@pytest.fixture
def one_calls(monkeypatch):
    """The list of batch sizes `q4_1_decode_layers` was called with, as the test runs."""
    calls = []
    original = q4_kernel.q4_1_decode_layers

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(q4_kernel, "q4_1_decode_layers", counted)
    return calls


def q4_stack(seed: int = 0, **config_overrides):
    model = random_q4_llama(seed=seed, **config_overrides)
    assert use_q4_backbone(model) and isinstance(model.model, Q4Backbone)
    return model


def decode(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits [B, T, V] of a 5-token prefill then one token at a time to the end of ids [B, T]."""
    with torch.inference_mode():
        outs = [model(ids[:, :5], kv_cache=cache)]
        outs += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(5, ids.shape[1])]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("window", [None, 4], ids=["all_keys", "window_4"])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_call_decode_is_the_layers_one_by_one(monkeypatch, one_calls, batch, window):
    require_kernel()
    model = q4_stack(seed=2, sliding_window=window)
    ids = torch.randint(0, model.config.vocab_size, (batch, 10), generator=torch.Generator().manual_seed(batch))
    cache = KVCache(model.config, batch_size=batch, max_seq_len=12)
    got = decode(model, ids, cache)
    assert one_calls == [batch] * 5  # the five one-token steps; the prefill ran layer by layer
    assert cache.lengths == [10] * model.config.num_hidden_layers
    with monkeypatch.context() as patched:
        patched.setattr(Q4Backbone, "run_layers", Backbone.run_layers)
        expected_cache = KVCache(model.config, batch_size=batch, max_seq_len=12)
        expected = decode(model, ids, expected_cache)
    assert one_calls == [batch] * 5
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    scale = expected_cache.keys.abs().max().item()
    torch.testing.assert_close(cache.keys, expected_cache.keys, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(cache.values, expected_cache.values, rtol=1e-4, atol=1e-4 * scale)


def test_a_hook_a_full_cache_or_another_cache_runs_the_layers(one_calls):
    require_kernel()
    model = q4_stack(seed=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *_: seen.append(1))
    try:
        decode(model, ids, KVCache(model.config, max_seq_len=8))
    finally:
        handle.remove()
    assert one_calls == [] and len(seen) == 2  # the prefill and the one step, both through the modules
    full = KVCache(model.config, max_seq_len=5)
    with pytest.raises(ValueError, match="KV cache is full"):
        decode(model, ids, full)  # the modules' own error, as without the one-call path
    assert one_calls == []
    decode(model, ids, SlidingWindowKVCache(model.config, window=4))
    assert one_calls == []
    decode(model, ids, KVCache(model.config, max_seq_len=8))
    assert one_calls == [1]


def test_only_a_stack_of_q4_layers_becomes_a_q4_backbone():
    model = random_llama(seed=0)  # float layers
    assert not use_q4_backbone(model) and type(model.model) is Backbone
    model = random_q4_llama(seed=0)
    model.model.layers[1] = random_llama(seed=1).model.layers[1]  # one float layer among Q4 ones
    with pytest.raises(TypeError, match="every layer to be a Q4DecoderLayer"):
        Q4Backbone.from_backbone(model.model)
    assert not use_q4_backbone(model)

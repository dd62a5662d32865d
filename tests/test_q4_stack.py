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

from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice
from decodelab.model import q4_kernel, thread_team
from decodelab.model.kv_cache import KVCache, SlidingWindowKVCache
from decodelab.model.llama import Backbone
from decodelab.model.q4_stack import Q4Backbone, use_q4_backbone
from decodelab.model.toy import random_llama


def counted_calls(monkeypatch, name: str) -> list[int]:
    """The list of batch sizes q4_kernel's `name` is called with from now on."""
    calls = []
    original = getattr(q4_kernel, name)

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(q4_kernel, name, counted)
    return calls


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"team_{n}")
def team(request, monkeypatch) -> int:
    """The threads of the one-call step's parallel region (3: an uneven split of every phase)."""
    monkeypatch.setattr(thread_team, "threads_for", lambda work, below: request.param)
    return request.param


@pytest.fixture
def one_calls(monkeypatch):
    """The batch sizes of the one-call decode steps over a KVCache (`q4_1_decode_layers`)."""
    return counted_calls(monkeypatch, "q4_1_decode_layers")


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
def test_one_call_decode_is_the_layers_one_by_one(monkeypatch, one_calls, team, batch, window):
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


def engine_step(model, store: PagedKVStore, contexts: list[int], prefill: int = 0):
    """Logits [1, N, V] of one packed engine step over `store` (block size 4, sequence i in blocks
    4i .. 4i + 3): one new token for each sequence of `contexts` (its context with that token), and a
    `prefill`-token prompt after them when prefill > 0."""
    slices, slots, positions = [], [], []
    for i, context in enumerate(contexts):
        table = list(range(4 * i, 4 * i + 4))
        slices.append(SequenceSlice(i, 1, context, table))
        slots.append(table[(context - 1) // 4] * 4 + (context - 1) % 4)
        positions.append(context - 1)
    if prefill:
        table = list(range(4 * len(contexts), 4 * len(contexts) + 4))
        slices.append(SequenceSlice(len(contexts), prefill, prefill, table))
        slots += [table[p // 4] * 4 + p % 4 for p in range(prefill)]
        positions += range(prefill)
    batch = PagedBatch(store, slices, torch.tensor(slots), model.config.sliding_window)
    ids = torch.randint(0, model.config.vocab_size, (1, len(positions)), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        return model(ids, positions=torch.tensor(positions), kv_cache=batch)


@pytest.mark.parametrize("window", [None, 5], ids=["all_keys", "window_5"])
def test_the_engines_decode_step_in_one_call_is_the_layers_one_by_one(monkeypatch, team, window):
    """Three sequences at contexts 3, 9 and 14 (their own positions, their own block tables) over the
    engine's paged store: the one C call writes the same K/V into the same slots and gives the logits the
    layers give one by one; a step with a prefill in it runs the layers."""
    require_kernel()
    paged_calls = counted_calls(monkeypatch, "q4_1_decode_layers_paged")
    model = q4_stack(seed=4, sliding_window=window)
    store = PagedKVStore(model.config, num_blocks=16, block_size=4)
    store.keys.normal_(generator=torch.Generator().manual_seed(1))
    store.values.normal_(generator=torch.Generator().manual_seed(2))
    expected_store = PagedKVStore(model.config, num_blocks=16, block_size=4)
    expected_store.keys.copy_(store.keys)
    expected_store.values.copy_(store.values)
    got = engine_step(model, store, [3, 9, 14])
    assert paged_calls == [3]
    with monkeypatch.context() as patched:
        patched.setattr(Q4Backbone, "run_layers", Backbone.run_layers)
        expected = engine_step(model, expected_store, [3, 9, 14])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    scale = expected_store.keys.abs().max().item()
    torch.testing.assert_close(store.keys, expected_store.keys, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(store.values, expected_store.values, rtol=1e-4, atol=1e-4 * scale)
    engine_step(model, store, [4, 10], prefill=3)
    assert paged_calls == [3]


def twice(tensor: torch.Tensor) -> torch.Tensor:
    return tensor * 2


def replace_buffer(layer) -> None:  # setattr: a new tensor object registered in _buffers
    layer.mlp.gate_proj.d = twice(layer.mlp.gate_proj.d)


def repoint_storage(layer) -> None:  # the same tensor object, another storage
    layer.self_attn.v_proj.m.data = twice(layer.self_attn.v_proj.m)


def scale_in_place(layer) -> None:  # the same storage, other values
    layer.mlp.down_proj.d.mul_(2)


def convert_and_back(layer) -> None:  # _apply: new tensors put in _buffers, no registration
    layer.mlp.up_proj.half().float()
    layer.mlp.up_proj.d.mul_(2)  # on the new tensor only: a table of the old ones would miss it


def replace_norm(layer) -> None:  # a new Parameter
    layer.post_attention_layernorm.weight = torch.nn.Parameter(twice(layer.post_attention_layernorm.weight))


@pytest.mark.parametrize(
    "change",
    [replace_buffer, repoint_storage, scale_in_place, convert_and_back, replace_norm],
    ids=lambda f: f.__name__,
)
def test_the_one_call_step_reads_the_weights_the_modules_hold_now(monkeypatch, one_calls, change):
    """The step keeps its table of weight addresses between tokens (`Q4Backbone.layout`); after any
    way of changing a layer's weights the next step must compute with the new ones, as the modules do."""
    require_kernel()
    model = q4_stack(seed=5)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    cache = KVCache(model.config, max_seq_len=9)
    decode(model, ids[:, :7], cache)
    assert one_calls == [1, 1]
    with torch.no_grad():
        change(model.model.layers[1])
    expected_cache = KVCache(model.config, max_seq_len=9)
    expected_cache.keys.copy_(cache.keys)
    expected_cache.values.copy_(cache.values)
    expected_cache.lengths = list(cache.lengths)
    with torch.inference_mode():
        got = model(ids[:, 7:], kv_cache=cache)
        with monkeypatch.context() as patched:
            patched.setattr(Q4Backbone, "run_layers", Backbone.run_layers)
            expected = model(ids[:, 7:], kv_cache=expected_cache)
    assert one_calls == [1, 1, 1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_decode_steps_keep_one_table_and_a_hook_added_between_them_is_seen(one_calls):
    require_kernel()
    model = q4_stack(seed=6)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = KVCache(model.config, max_seq_len=10)
    decode(model, ids[:, :6], cache)
    layout = model.model.layout()
    table = layout.table
    with torch.inference_mode():
        model(ids[:, 6:7], kv_cache=cache)
        model(ids[:, 7:8], kv_cache=cache)
    assert one_calls == [1, 1, 1] and model.model.layout() is layout and layout.table is table
    seen = []
    handle = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda *_: seen.append(1))
    try:
        with torch.inference_mode():
            model(ids[:, 8:9], kv_cache=cache)
    finally:
        handle.remove()
    assert one_calls == [1, 1, 1] and seen == [1]  # the step ran the modules, so the hook saw it

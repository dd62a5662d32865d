"""Notebook 03's hidden checks: they pass on the library's references (and on a cache written
another valid way), and catch every kept bug (tests/fixtures/buggy_kv_cache.py) with a message
that names the case. Also the small library functions the notebook added."""

from __future__ import annotations

import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import kv_cache as checks
from decodelab.course.widgets.kv_cache import (
    bytes_held_after,
    cache_class_or_reference,
    kv_size_calculator,
    per_token_ms,
)
from decodelab.decoding.generate import generate_with_cache, generate_without_cache, stream_token_ids
from decodelab.lessons.kv_size import kv_bytes
from decodelab.lessons.measure import CountingModel
from decodelab.model.attention import causal_attention
from decodelab.model.kv_cache import KVCache, SlidingWindowKVCache
from decodelab.model.toy import tiny_model
from decodelab.params import SamplingParams

buggy = load_fixture("buggy_kv_cache")


def test_references_pass():
    checks.check_generate_without_cache(generate_without_cache)
    checks.check_kv_cache_class(KVCache)
    checks.check_generate_with_cache(generate_with_cache)
    checks.check_kv_cache_bytes(kv_bytes)
    checks.check_sliding_window_kv_cache(SlidingWindowKVCache)


def test_a_list_based_cache_passes():
    """Behaviour is graded, not layout: a torch.cat cache is as right as a preallocated one."""
    checks.check_kv_cache_class(buggy.CacheBase)
    checks.check_generate_with_cache(
        lambda m, p, n, cache_class=buggy.CacheBase: generate_with_cache(m, p, n, cache_class)
    )


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match="whole sequence so far"):
        checks.check_generate_without_cache(buggy.no_cache_feeds_only_last_token)
    with pytest.raises(AssertionError, match="not the prompt"):
        checks.check_generate_without_cache(buggy.no_cache_returns_prompt_too)
    with pytest.raises(AssertionError, match="changed the caller's prompt_ids"):
        checks.check_generate_without_cache(buggy.no_cache_mutates_prompt)
    with pytest.raises(AssertionError, match="cache_class"):
        checks.check_generate_with_cache(buggy.with_cache_ignores_cache_class)
    with pytest.raises(AssertionError, match="Llama-3.1-8B.*128 KiB per token.*131,072"):
        checks.check_kv_cache_bytes(buggy.kv_bytes_forgets_values)
    with pytest.raises(AssertionError, match="gpt-oss-20b"):
        checks.check_kv_cache_bytes(buggy.kv_bytes_ignores_window)
    with pytest.raises(AssertionError, match="the rows held, in order: position 4, position 5, position 2, position 3"):
        checks.check_sliding_window_kv_cache(buggy.RingInSlotOrder)
    with pytest.raises(
        AssertionError,
        match=r"expected shape \[2, 2, 6, 2\] \(the held positions 0..2 then "
        r"the new 3..5.*got \[2, 2, 4, 2\]",
    ):
        checks.check_sliding_window_kv_cache(buggy.RingReturnsWindowAfterWrite)
    with pytest.raises(AssertionError, match=r"seq_len .*\(every position seen.*expected 6, got 4"):
        checks.check_sliding_window_kv_cache(buggy.RingSeqLenCountsHeld)


class _ListRing:
    """A ring written another valid way: K/V kept as a list of the last W rows per layer (torch.cat,
    then a cloned slice), no slot arithmetic. Behaviour is graded, not layout."""

    def __init__(self, config, batch_size=1, max_seq_len=None, device=None, dtype=torch.float32, window=None):
        self.window = config.sliding_window if window is None else window
        if not self.window or self.window < 1:
            raise ValueError(f"window {self.window!r}")
        empty = torch.zeros(batch_size, config.num_key_value_heads, 0, config.head_dim, device=device, dtype=dtype)
        self.held = [(empty, empty) for _ in range(config.num_hidden_layers)]
        self.seen = [0] * config.num_hidden_layers

    @property
    def seq_len(self):
        return self.seen[-1]

    def append(self, layer, k, v):
        old_k, old_v = self.held[layer]
        if k.shape != v.shape or k[:, :, :0].shape != old_k[:, :, :0].shape:
            raise ValueError(f"k, v of shape {list(k.shape)}, {list(v.shape)} do not fit {list(old_k.shape)}")
        k_all, v_all = torch.cat([old_k, k], 2), torch.cat([old_v, v], 2)
        self.held[layer] = (k_all[:, :, -self.window :].clone(), v_all[:, :, -self.window :].clone())
        self.seen[layer] += k.shape[2]
        return k_all, v_all

    def view(self, layer):
        return self.held[layer]

    def attend(self, layer, q, k, v):
        k_all, v_all = self.append(layer, k, v)
        return causal_attention(q, k_all, v_all, q_offset=k_all.shape[2] - k.shape[2], sliding_window=self.window)


def test_a_ring_written_another_way_passes_and_a_slice_that_keeps_its_buffer_fails():
    checks.check_sliding_window_kv_cache(_ListRing)

    class SliceKeepsBuffer(_ListRing):  # the last W rows as a view: the whole growing buffer stays alive
        def append(self, layer, k, v):
            k_all, v_all = _ListRing.append(self, layer, k, v)
            self.held[layer] = (k_all[:, :, -self.window :], v_all[:, :, -self.window :])
            return k_all, v_all

    with pytest.raises(AssertionError, match="holds tensors of .* bytes .* W=4 slots"):
        checks.check_sliding_window_kv_cache(SliceKeepsBuffer)


def test_generate_with_and_without_cache_agree_with_the_streaming_generator():
    model = tiny_model(3)
    prompt = [1, 2, 3, 4]
    streamed = list(stream_token_ids(model, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    assert generate_without_cache(model, prompt, 10) == generate_with_cache(model, prompt, 10) == streamed
    counting = CountingModel(model)
    generate_with_cache(counting, prompt, 5)
    assert counting.calls == [(4, True)] + [(1, True)] * 4
    counting = CountingModel(model)
    generate_without_cache(counting, prompt, 3)
    assert counting.calls == [(4, False), (5, False), (6, False)]
    with pytest.raises(ValueError, match="exceed the model's context"):
        generate_with_cache(model, prompt, 61)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_without_cache(model, prompt, -1)


def test_stream_token_ids_uses_the_given_cache_class():
    made = []

    class Recording(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    model = tiny_model(4)
    list(stream_token_ids(model, [5, 6], SamplingParams(temperature=0, max_tokens=3), cache_class=Recording))
    assert len(made) == 1 and made[0].seq_len == 4


def test_view_returns_the_held_rows():
    model = tiny_model(5)
    cache = KVCache(model.config, 1, 10)
    model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
    keys, values = cache.view(0)
    assert keys.shape == values.shape == (1, 2, 3, model.config.head_dim)
    assert torch.equal(keys, cache.keys[0, :, :, :3])


def test_timing_and_calculator_run():
    times = per_token_ms(tiny_model(0), [4, 8], KVCache, repeats=1)
    assert all(len(v) == 2 and min(v) > 0 for v in times.values())
    box = kv_size_calculator(kv_bytes)
    assert "Llama-3.1-8B, 4,096 tokens x 1 sequence in bf16: <b>512 MiB</b>" in box.figure.layout.title.text
    box.controls["seq_len"].value = 131072
    assert "16 GiB" in box.figure.layout.title.text
    box.controls["preset"].value = "gpt-oss-20b"
    assert "3 GiB" in box.figure.layout.title.text or "3.0" in box.figure.layout.title.text


def test_memory_sweep_measures_a_growing_full_cache_and_a_flat_ring():
    config = tiny_model(0).config  # 2 layers, 2 KV heads of dim 8: 2 x 2 x 2 x 8 x 4 = 256 bytes a position in float32
    lengths = [8, 16, 32]
    full = bytes_held_after(lambda n: KVCache(config, 1, n), config, lengths, chunk=5)
    ring = bytes_held_after(lambda n: SlidingWindowKVCache(config, 1, n, window=4), config, lengths, chunk=5)
    assert full == [256 * n for n in lengths] and ring == [256 * 4] * 3


def test_an_unfinished_ring_falls_back_to_the_reference(capsys):
    class Unfinished:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError

    assert cache_class_or_reference(Unfinished, SlidingWindowKVCache, sliding_window=2) is SlidingWindowKVCache
    assert "not written yet" in capsys.readouterr().out
    assert (
        cache_class_or_reference(buggy.RingInSlotOrder, SlidingWindowKVCache, sliding_window=2) is buggy.RingInSlotOrder
    )


# --------------------------------------------------------------------------- issue 34: a second blind learner


def _notebook():
    from notebooks import read, solution_path

    return read(solution_path("03_kv_cache"))


def test_a_ring_that_offsets_by_seq_len_is_named_by_q_offset():
    """attend with q_offset = seq_len (positions seen) instead of the positions held: right until the ring is
    full, then causal_attention's ValueError. The hidden check and the visible tests both fail with a message
    naming q_offset, not with the ValueError from inside causal_attention."""
    from notebooks import run_visible

    with pytest.raises(
        AssertionError,
        match=r"attention got 9 keys for 4 queries at offset 7\. If causal_attention "
        r"raised it, check attend's q_offset.*min\(S, W\) = 5 here, not seq_len",
    ):
        checks.check_sliding_window_kv_cache(buggy.RingOffsetCountsSeen)
    nb = _notebook()
    assert run_visible(nb, "test_SlidingWindowKVCache", "SlidingWindowKVCache", SlidingWindowKVCache) is None
    failure = run_visible(nb, "test_SlidingWindowKVCache", "SlidingWindowKVCache", buggy.RingOffsetCountsSeen)
    assert isinstance(failure, AssertionError), repr(failure)
    assert "q_offset is how many those are (4 held), not seq_len (5 positions seen)" in str(failure), failure


def _seed_model_parameters(vocab=96, width=96, layers=4, context=512) -> int:
    """The seed's numpy model (4 layers, width 96, 4 heads, 96 characters, 512 positions): learned token and
    position embeddings, pre-LN blocks (two LayerNorms with weight and bias), attention without biases, a GELU
    MLP of 4 x width with biases, a final LayerNorm and an untied output matrix without bias."""
    block = 2 * 2 * width + 4 * width * width + (width * 4 * width + 4 * width) + (4 * width * width + width)
    return vocab * width + context * width + layers * block + 2 * width + width * vocab


def test_the_notebooks_figures_are_computed():
    """SmolLM2 against the seed model: both counts computed (the seed prints 513,600 for its model), their ratio
    as the text states it; the seed's GPT-3 figures, 9.6 GB x 32 = 307 GB, said to be rounded (309 GB unrounded)."""
    import re

    from decodelab.lessons.kv_size import parameter_count

    seed, smollm2 = _seed_model_parameters(), parameter_count("SmolLM2-135M")
    assert seed == 513_600 and smollm2 == 134_515_008
    text = "\n".join(c.source for c in _notebook().cells if c.cell_type == "markdown")
    stated = re.search(r"SmolLM2's ([\d.]+) million parameters are about (\d+) times the seed model's ([\d,]+)", text)
    assert stated, "03 no longer states SmolLM2's size against the seed model's"
    assert float(stated.group(1)) == round(smollm2 / 1e6, 1) and int(stated.group(3).replace(",", "")) == seed
    assert int(stated.group(2)) == round(smollm2 / seed), (stated.group(0), smollm2 / seed)
    request = kv_bytes("GPT-3-175B", 2048, 1, "fp16")
    assert round(request / 1e9, 2) == 9.66 and round(32 * request / 1e9) == 309 and round(9.6 * 32) == 307
    assert re.search(
        r"9\.6 GB × 32 ≈ 307 GB for a\s+batch of 32 \(a rounded figure:.*?32\s+take 309 GB\)", text, re.DOTALL
    )

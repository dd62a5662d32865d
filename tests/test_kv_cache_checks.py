"""Notebook 03's hidden checks: they pass on the library's references (and on a cache written
another valid way), and catch every kept bug (tests/fixtures/buggy_kv_cache.py) with a message
that names the case. Also the small library functions the notebook added."""
from __future__ import annotations

import pytest
import torch

from autograder.checks import kv_cache as checks
from decodelab.decoding.generate import generate_with_cache, generate_without_cache, stream_token_ids
from decodelab.model.kv_cache import KVCache
from decodelab.lessons.kv_size import kv_bytes
from decodelab.params import SamplingParams
from decodelab.course.widgets.kv_cache import kv_size_calculator, per_token_ms
from decodelab.lessons.measure import CountingModel
from decodelab.model.toy import tiny_model
from oracles import expect_bug_caught, load_fixture

buggy = load_fixture("buggy_kv_cache")


def test_references_pass():
    checks.check_generate_without_cache(generate_without_cache)
    checks.check_kv_cache_class(KVCache)
    checks.check_generate_with_cache(generate_with_cache)
    checks.check_kv_cache_bytes(kv_bytes)


def test_a_list_based_cache_passes():
    """Behaviour is graded, not layout: a torch.cat cache is as right as a preallocated one."""
    checks.check_kv_cache_class(buggy.CacheBase)
    checks.check_generate_with_cache(lambda m, p, n, cache_class=buggy.CacheBase: generate_with_cache(m, p, n, cache_class))


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

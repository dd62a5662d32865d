"""Notebook 04's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_prefill_decode.py) with a message that names the case. Also the
two small library functions the notebook added (latencies_from_timestamps, decode_greedy), and the
rule that each exercise has exactly its reference's signature and docstring."""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest
import torch
from notebooks import grade_id, read, solution_path
from oracles import expect_bug_caught, load_fixture, random_model

from autograder.checks import prefill_decode as checks
from decodelab.decoding.generate import stream_token_ids
from decodelab.lessons import prefill_decode as pf
from decodelab.lessons.detokenize import CountingTokenizer, sentencepiece_style_tokenizer
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams

buggy = load_fixture("buggy_prefill_decode")
NAME = "04_prefill_decode"


def _reference(function: str):
    module, _, attr = checks.REFERENCES[function].partition(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("function", sorted(checks.REFERENCES))
def test_reference_passes(function):
    check = "check_" + re.sub(r"(?<=[a-z])(?=[A-Z])", "_", function).lower()  # IncrementalDetokenizer: a class
    getattr(checks, check)(_reference(function))


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match="one token at a time: a prefill is one pass over all 11"):
        checks.check_timed_generate(buggy.timed_prefill_one_by_one)
    with pytest.raises(AssertionError, match="start_s was read after 1 forward passes"):
        checks.check_timed_generate(buggy.timed_clock_after_prefill)
    with pytest.raises(AssertionError, match="the last token needs no pass"):
        checks.check_timed_generate(buggy.timed_feeds_last_token_back)
    with pytest.raises(AssertionError, match=r"\['itl_s'\]\[0\].*expected 0.125 s, got 0.625 s"):
        checks.check_latencies_from_timestamps(buggy.latencies_from_start)
    with pytest.raises(AssertionError, match="should raise ValueError"):
        checks.check_latencies_from_timestamps(buggy.latencies_unchecked)
    with pytest.raises(AssertionError, match=r"\['tpot_s'\].*expected 0.166667 s, got 0.25 s"):
        checks.check_latencies_from_timestamps(buggy.latencies_tpot_includes_ttft)
    with pytest.raises(AssertionError, match="Llama-3.1-8B.*kv_len=4096"):
        checks.check_arithmetic_intensity(buggy.intensity_without_kv)
    with pytest.raises(AssertionError, match="fed 75 tokens.*35"):
        checks.check_reuse_prefix(buggy.reuse_recomputes_prefix)
    with pytest.raises(AssertionError, match="own copy|5-token suffix"):
        checks.check_reuse_prefix(buggy.reuse_shares_one_cache)
    with pytest.raises(AssertionError, match="Japanese.*U\\+FFFD: part of a character was sent"):
        checks.check_incremental_detokenizer(buggy.DetokenizeEachTokenAlone)
    with pytest.raises(AssertionError, match=r"decoded \d+ ids in all.*expected at most 32"):
        checks.check_incremental_detokenizer(buggy.DetokenizeEverythingAgain)
    with pytest.raises(AssertionError, match="flush\\(\\) returned ''; expected flush to return '\ufffd'"):
        checks.check_incremental_detokenizer(buggy.DetokenizeFlushLosesTail)
    with pytest.raises(AssertionError, match="SentencePiece-style.*sent 'Helloworl', expected 'Hello wor'"):
        checks.check_incremental_detokenizer(buggy.DetokenizeWithoutContext)


def _exercise_defs():
    """function or class name -> its FunctionDef or ClassDef in the notebook's exercise cells."""
    found = {}
    for cell in read(solution_path(NAME)).cells:
        gid = grade_id(cell) or ""
        if gid.startswith("ex_"):
            tree = ast.parse(cell.source)
            for node in tree.body:  # an exercise cell may define helpers too (timed_generate's prefill)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    found[node.name] = node
    return found


def _expect_same_signature(name: str, node: ast.FunctionDef, reference: ast.FunctionDef) -> None:
    assert ast.unparse(node.args) == ast.unparse(reference.args), f"{name}: arguments differ from the reference's"
    returns = [ast.unparse(n.returns) if n.returns else None for n in (node, reference)]
    assert returns[0] == returns[1], f"{name}: return annotation differs"


def test_exercises_have_the_references_signature_and_docstring():
    defs = _exercise_defs()
    assert set(defs) == set(checks.REFERENCES) | {"prefill"}
    for function, node in defs.items():
        reference = pf.prefill if function == "prefill" else _reference(function)
        assert ast.get_docstring(node) == inspect.getdoc(reference), (
            f"{function}: docstring differs from the reference's"
        )
        source = ast.parse(inspect.getsource(reference).lstrip()).body[0]
        if isinstance(node, ast.ClassDef):  # a class: the same methods, each with the same signature and docstring
            methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
            wanted = {n.name: n for n in source.body if isinstance(n, ast.FunctionDef)}
            assert set(methods) == set(wanted), f"{function}: methods {sorted(methods)}, reference {sorted(wanted)}"
            for name, method in methods.items():
                _expect_same_signature(f"{function}.{name}", method, wanted[name])
                assert ast.get_docstring(method) == ast.get_docstring(wanted[name]), f"{function}.{name}: docstring"
        else:
            _expect_same_signature(function, node, source)


def test_stream_decoder_takes_integer_ids_only():
    """The engine's detokenizer (the exercise's reference) takes ids as ints, NumPy or 0-d tensors."""
    import numpy as np

    from decodelab.model.tokenizer import StreamDecoder

    tokenizer = sentencepiece_style_tokenizer()
    decoder = StreamDecoder(tokenizer)
    hello, world = tokenizer.encode("Hello world")
    assert decoder.push(torch.tensor(hello)) + decoder.push(np.int64(world)) + decoder.flush() == "Hello world"
    with pytest.raises(TypeError):
        decoder.push(1.5)
    with pytest.raises(ValueError, match=">= 0"):
        decoder.push(-3)


def test_counting_tokenizer_counts_and_offers_only_decode():
    tokenizer = sentencepiece_style_tokenizer()
    counter = CountingTokenizer(tokenizer)
    ids = tokenizer.encode("say hi in Japanese: 日本")
    assert counter.decode(ids) == tokenizer.decode(ids) and counter.decode(ids[:3], True) == "say hi in"
    mark = counter.mark()
    counter.decode(ids[:2])
    assert counter.decoded == [len(ids), 3, 2] and counter.since(mark) == 2
    with pytest.raises(AttributeError, match="only decode"):
        counter.encode("hi")


def test_latencies_from_timestamps():
    out = pf.latencies_from_timestamps(10.0, [10.5, 10.75, 11.0])
    assert out == {"ttft_s": 0.5, "itl_s": [0.25, 0.25], "tpot_s": 0.25, "e2e_s": 1.0}
    assert pf.latencies_from_timestamps(1.0, [1.0]) == {"ttft_s": 0.0, "itl_s": [], "tpot_s": None, "e2e_s": 0.0}
    for times in ([], [0.5], [2.0, 1.5]):
        with pytest.raises(ValueError):
            pf.latencies_from_timestamps(1.0, times)


def test_decode_greedy_continues_a_prefill_like_the_generator():
    model = random_model(14)
    prompt = torch.randint(0, 97, (7,)).tolist()
    cache = KVCache(model.config, 1, 7 + 6)
    got = pf.decode_greedy(model, cache, pf.prefill(model, prompt, cache), 6)
    want = list(stream_token_ids(model, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    assert got == want and cache.seq_len == 7 + 5  # the last token is never fed back
    stop = want[2]
    cache = KVCache(model.config, 1, 13)
    assert (
        pf.decode_greedy(model, cache, pf.prefill(model, prompt, cache), 6, stop_token_ids=[stop])
        == want[: want.index(stop) + 1]
    )
    with pytest.raises(ValueError, match="max_tokens"):
        pf.decode_greedy(model, cache, torch.zeros(1, 97), 0)


def test_token_timestamps_and_measure_latency_agree_with_the_generator():
    model = random_model(15)
    prompt = torch.randint(0, 97, (6,)).tolist()
    start, times, ids = pf.token_timestamps(model, prompt, 5)
    assert len(times) == 5 and start <= times[0] and times == sorted(times)
    assert ids == list(stream_token_ids(model, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    out = pf.measure_latency(model, prompt, 5)
    assert out["token_ids"] == ids and out["ttft_s"] > 0 and len(out["itl_s"]) == 4
    with pytest.raises(ValueError, match="n must"):
        pf.token_timestamps(model, prompt, 0)


def test_timed_generate_with_the_real_clock():
    model = random_model(16)
    prompt = torch.randint(0, 97, (6,)).tolist()
    run = pf.timed_generate(model, prompt, 4, KVCache(model.config, 1, 10))
    assert run["token_ids"] == list(
        stream_token_ids(model, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    )
    assert run["start_s"] <= run["token_times_s"][0] and run["token_times_s"] == sorted(run["token_times_s"])


def test_predictions_are_graded_within_five_percent():
    checks.check_q_kv_share_percent(21.1)
    checks.check_q_prefill_tokens_to_ridge(296)
    for check, wrong in (
        (checks.check_q_kv_share_percent, 100 * 4.3e9 / 16.06e9),  # K/V over the weights alone
        (checks.check_q_prefill_tokens_to_ridge, 2 * 296),
    ):  # 1 FLOP per token and weight
        with pytest.raises(AssertionError, match="you predicted"):
            check(wrong)

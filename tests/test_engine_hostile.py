"""Hostile input to the engine (issue 27): every bad value is a clear, one-line error naming the
value and its range, raised before anything is queued; a request whose sampling fails ends alone;
an exception or a KeyboardInterrupt part-way through a call aborts that call's requests; two
threads each get their own tokens. After each, no KV block is held and the next call gives the
tokens a fresh engine gives.

One tiny engine for the module (a small pool of 8-token blocks, so prompts fill whole blocks and
the prefix cache is in play); the references are computed once by a fresh engine on the same model.
"""

from __future__ import annotations

import math
import shutil
import threading

import pytest
import torch

from decodelab import LLM, SamplingParams
from decodelab.decoding.sampling import apply_repetition_penalty, sample
from decodelab.engine.llm import EngineHooks, engine_step
from decodelab.params import (
    FLOAT32_MAX,
    LARGEST_SAFE_LOGIT,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
)
from decodelab.paths import PACKAGE_DATA

SETTINGS = dict(num_kv_blocks=64, kv_block_size=8)
PROMPTS = ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\nimport re\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, seed=11)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", **SETTINGS)


def fresh(llm, **kwargs) -> LLM:
    """A new engine on the same model and tokenizer (nothing loaded again)."""
    return LLM((llm.model, llm.tokenizer), **{**SETTINGS, **kwargs})


def token_ids(outputs) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def reference(llm):
    """What a fresh engine gives for PROMPTS: {"greedy": token ids, "seeded": token ids}."""
    engine = fresh(llm)
    return {
        name: token_ids(engine.generate(PROMPTS, params, use_tqdm=False))
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED))
    }


def assert_idle(llm: LLM) -> None:
    """Nothing waiting or running, and every KV block back in the pool."""
    assert not llm.scheduler.waiting and not llm.scheduler.running, "requests left in the scheduler"
    assert llm.allocator.num_free == llm.allocator.num_blocks, (
        f"{llm.allocator.num_blocks - llm.allocator.num_free} KV blocks still held"
    )
    llm.allocator.check_invariants([])


def assert_serves_like_a_fresh_engine(llm: LLM, reference) -> None:
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference["greedy"]
    assert token_ids(llm.generate(PROMPTS, SEEDED, use_tqdm=False)) == reference["seeded"]
    assert_idle(llm)


# ------------------------------------------------------------------ SamplingParams
@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (
            dict(temperature=1e-40),
            r"temperature must be >= 0: 0 \(greedy\) or a number in \[1e-08, 1e\+08\].*got 1e-40",
        ),
        (dict(temperature=-0.5), r"temperature must be >= 0.*got -0.5"),
        (dict(temperature=math.inf), r"temperature must be .*got inf"),
        (dict(temperature=math.nan), r"temperature must be .*got nan"),
        (dict(temperature="0.7"), r"temperature must be .*got '0.7'"),
        (dict(temperature=True), r"temperature must be .*got True"),
        (dict(repetition_penalty=1e-300), r"repetition_penalty must be > 0: a number in \[1e-08, 1e\+08\].*got 1e-300"),
        (dict(repetition_penalty=math.inf), r"repetition_penalty must be .*got inf"),
        (dict(repetition_penalty=0), r"repetition_penalty must be > 0.*got 0"),
        (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
        (dict(top_p=1.0000001), r"top_p must be in \(0, 1\], got 1.0000001"),
        (dict(top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
        (dict(top_k=-2), r"top_k must be an integer >= 1, or 0 / -1 to disable, got -2"),
        (dict(top_k=3.0), r"top_k must be an integer .*got 3.0"),
        (dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
        (dict(max_tokens=-3), r"max_tokens must be an integer >= 1, got -3"),
        (dict(n=0), r"n must be an integer >= 1, got 0"),
        (dict(seed=2**63), r"seed must be an integer in 0..2\*\*63-1, or None, got 9223372036854775808"),
        (dict(seed=-1), r"seed must be an integer in 0..2\*\*63-1, or None, got -1"),
        (dict(seed=1.5), r"seed must be an integer in 0..2\*\*63-1, or None, got 1.5"),
        (dict(stop=7), r"stop must be a string or a list of non-empty strings, got 7"),
        (dict(stop=["ok", 3]), r"stop must be a string or a list of non-empty strings, got \['ok', 3\]"),
        (dict(stop=""), r"stop must be a string or a list of non-empty strings, got \[''\]"),
        (dict(stop_token_ids=[2.7]), r"stop_token_ids must be a list of token ids \(integers >= 0\), got \[2.7\]"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids must be a list of token ids \(integers >= 0\), got \[-1\]"),
        (dict(ignore_eos="yes"), r"ignore_eos must be True or False, got 'yes'"),
    ],
)
def test_sampling_params_out_of_range_is_a_clear_error(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_sampling_ranges_end_exactly_at_their_bounds():
    for name, low, high in (
        ("temperature", MIN_TEMPERATURE, MAX_TEMPERATURE),
        ("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    ):
        SamplingParams(**{name: low})
        SamplingParams(**{name: high})
        for outside in (math.nextafter(low, 0), math.nextafter(high, math.inf)):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: outside})
    assert SamplingParams(seed=2**63 - 1, stop=("a", "b"), stop_token_ids=(torch.tensor(3),)).stop_token_ids == [3]
    assert FLOAT32_MAX == torch.finfo(torch.float32).max


@pytest.mark.parametrize(
    "temperature, penalty",
    [
        (MIN_TEMPERATURE, MIN_REPETITION_PENALTY),
        (MIN_TEMPERATURE, MAX_REPETITION_PENALTY),
        (MAX_TEMPERATURE, MIN_REPETITION_PENALTY),
        (MAX_TEMPERATURE, MAX_REPETITION_PENALTY),
    ],
)
def test_every_allowed_setting_samples_the_largest_safe_logits(temperature, penalty):
    """The bound is real: at the ends of both ranges, logits of magnitude LARGEST_SAFE_LOGIT (seen
    and unseen, positive and negative) keep a finite distribution; below the range they do not."""
    logits = torch.tensor([LARGEST_SAFE_LOGIT, -LARGEST_SAFE_LOGIT, 0.5 * LARGEST_SAFE_LOGIT, -3.0, 2.0])
    seen = torch.tensor([0, 1, 3])
    params = SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9, top_k=4)
    penalized = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    token = sample(penalized, params, torch.Generator().manual_seed(0))
    assert 0 <= int(token) < len(logits)
    params.temperature = MIN_TEMPERATURE / 1e32  # what the check now refuses: float32 overflows
    with pytest.raises(RuntimeError, match="inf"):
        sample(penalized, params, torch.Generator().manual_seed(0))


def test_the_extreme_settings_run_in_the_engine(llm):
    params = SamplingParams(
        temperature=MIN_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY, max_tokens=4, seed=1
    )
    [out] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert_idle(llm)


# ------------------------------------------------------------------ a request whose sampling fails
def test_a_request_whose_sampling_fails_ends_alone(llm, reference):
    """Its params changed in flight, past the admission check: that request (both its samples)
    ends with finish_reason "error" and the reason; the others finish as they would have."""
    spoiled = SamplingParams(temperature=0.8, max_tokens=6, seed=3, n=2)

    def step_then_spoil(engine):
        events = engine_step(engine)
        spoiled.temperature = 1e-40
        return events

    engine = fresh(llm, hooks=EngineHooks(step=step_then_spoil))
    outputs = engine.generate(PROMPTS, [GREEDY, spoiled, GREEDY], use_tqdm=False)
    for i in (0, 2):
        assert outputs[i].outputs[0].token_ids == reference["greedy"][i][0]
        assert outputs[i].outputs[0].finish_reason == "length" and outputs[i].outputs[0].error is None
    for sample_output in outputs[1].outputs:
        assert sample_output.finish_reason == "error"
        assert len(sample_output.token_ids) == 1, "the first token came before the params changed"
        assert "sampling failed (probability tensor contains" in sample_output.error
        assert "temperature=1e-40" in sample_output.error
    assert outputs[1].error is None  # the prompt itself was fine
    assert_idle(engine)
    spoiled.temperature = 0.8
    assert token_ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference["greedy"]


def test_admission_checks_params_again(llm, reference):
    params = SamplingParams(temperature=0.5)
    params.repetition_penalty = 1e-300  # after construction: generate checks again, before queueing
    with pytest.raises(ValueError, match=r"params for prompt 1: repetition_penalty must be > 0.*got 1e-300"):
        llm.generate(PROMPTS[:2], [GREEDY, params], use_tqdm=False)
    assert_idle(llm)


# ------------------------------------------------------------------ bad prompts
@pytest.mark.parametrize(
    "prompts, error, phrase",
    [
        (["def f():", 5, "x = 1"], TypeError, r"prompt 1 must be a str or a list of token ids, got int 5"),
        ([[1, 2], [3, 2.5]], TypeError, r"prompt 1: token ids must be integers, got 2.5 at position 1"),
        ([1, "a"], TypeError, r"prompt 0: token ids must be integers, got 'a' at position 1"),
        (["ok", None], TypeError, r"prompt 1 must be a str or a list of token ids, got NoneType"),
        ({"prompt": "x"}, TypeError, r"prompts must be a str, a list of token ids or a list of those, got dict"),
        (42, TypeError, r"prompts must be a str, a list of token ids or a list of those, got int"),
    ],
)
def test_bad_prompts_are_refused_before_anything_is_queued(llm, prompts, error, phrase):
    with pytest.raises(error, match=phrase):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_prompts_that_cannot_run_fail_alone(llm, reference):
    too_long = list(range(llm.max_seq_len))
    outputs = llm.generate([PROMPTS[0], [], too_long, [5, llm.config.vocab_size]], GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == reference["greedy"][0][0]
    for out, phrase in zip(
        outputs[1:],
        ("the prompt is empty", f"prompt of {llm.max_seq_len} tokens does not fit", "outside the vocabulary"),
    ):
        assert phrase in out.error and out.outputs[0].finish_reason == "error" and phrase in out.outputs[0].error
    assert_idle(llm)


def test_wrong_params_are_refused_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="params for prompt 1 must be a SamplingParams, got dict"):
        llm.generate(PROMPTS[:2], [GREEDY, {"temperature": 0}], use_tqdm=False)
    assert_idle(llm)


# ------------------------------------------------------------------ interrupted calls
def interrupt_between_steps(engine, monkeypatch):
    """A KeyboardInterrupt after two engine steps (Ctrl-C in a notebook)."""
    steps = []

    def step():
        steps.append(1)
        if len(steps) > 2:
            raise KeyboardInterrupt
        return engine_step(engine)

    monkeypatch.setattr(engine, "step", step)


def interrupt_inside_the_first_forward_pass(engine, monkeypatch):
    """A KeyboardInterrupt once the first prefill has its blocks (and their prefix-cache names) but
    before its K/V is written: a later prompt must not reuse those blocks."""

    def packed_forward(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "packed_forward", packed_forward)


def fail_in_the_sampling_hook(engine, monkeypatch):
    """A learner's sampling hook that raises: a bug in their code, not a request's fault, so the
    call raises (course.parts falls back to the reference on it)."""

    def sample_hook(logits, params, generator):
        raise RuntimeError("this sampler only knows one row")

    monkeypatch.setattr(engine.hooks, "sample", sample_hook)


@pytest.mark.parametrize(
    "interrupt, error",
    [
        (interrupt_between_steps, KeyboardInterrupt),
        (interrupt_inside_the_first_forward_pass, KeyboardInterrupt),
        (fail_in_the_sampling_hook, RuntimeError),
    ],
)
def test_an_interrupted_call_leaves_nothing_behind(llm, reference, monkeypatch, interrupt, error):
    engine = fresh(llm)  # its prefix cache has never seen PROMPTS: the interrupted call names their blocks
    interrupt(engine, monkeypatch)
    with pytest.raises(error):
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, n=2), use_tqdm=False)
    monkeypatch.undo()
    assert_idle(engine)
    assert_serves_like_a_fresh_engine(engine, reference)


def test_closing_a_stream_early_aborts_its_requests(llm, reference):
    stream = llm.stream(PROMPTS, GREEDY)
    next(stream)
    stream.close()
    assert_idle(llm)
    assert_serves_like_a_fresh_engine(llm, reference)


def run_to_the_end(llm: LLM) -> None:
    while llm.scheduler.has_unfinished():
        llm.step()


def test_abort_frees_one_request_and_spares_the_others(llm, reference):
    """A server's client goes away mid-generation: `abort` retires that request alone, its blocks go
    back to the pool, and the request beside it gets the tokens it gets alone."""
    kept = llm.add_request(PROMPTS[0], GREEDY, index=0)
    gone = llm.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, n=2), index=1)
    llm.step()  # both prefilled; gone's second sample forked from its first
    assert len(gone.seqs[1].output_token_ids) == 1
    llm.abort(gone)
    assert [seq.finish_reason for seq in gone.seqs] == ["abort", "abort"] and gone.is_done
    run_to_the_end(llm)
    assert [kept.seqs[0].output_token_ids] == reference["greedy"][0]
    assert_idle(llm)
    llm.abort(gone)  # twice is harmless
    llm.abort(kept)  # so is a finished request
    assert kept.seqs[0].finish_reason in {"stop", "length"}
    assert_serves_like_a_fresh_engine(llm, reference)


def test_abort_before_the_prefill_never_starts_the_samples(llm):
    waiting = llm.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, n=3), index=0)
    llm.abort(waiting)
    assert [seq.finish_reason for seq in waiting.seqs] == ["abort"] * 3
    assert not llm.scheduler.has_unfinished() and llm.step() == []
    assert_idle(llm)


# ------------------------------------------------------------------ threads
def test_two_threads_get_the_tokens_they_get_alone(llm):
    """Two threads call generate at once, different prompts, seeded sampling: each gets exactly the
    tokens it gets alone (the engine's lock runs one call at a time)."""
    jobs = [
        (PROMPTS[:2], SamplingParams(temperature=0.9, max_tokens=10, seed=5)),
        (
            PROMPTS[2:] + ["x = [i for i in range(10)]\n"],
            SamplingParams(temperature=0.7, top_k=20, max_tokens=10, seed=9),
        ),
    ]
    alone = [token_ids(fresh(llm).generate(prompts, params, use_tqdm=False)) for prompts, params in jobs]
    together, errors = [None, None], []
    start = threading.Barrier(len(jobs))

    def run(i):
        try:
            start.wait()
            together[i] = token_ids(llm.generate(*jobs[i], use_tqdm=False))
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a generate call hung"
    assert not errors, errors
    assert together == alone
    assert_idle(llm)


# ------------------------------------------------------------------ engine arguments and model folders
@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (dict(kv_block_size=0), r"kv_block_size must be an integer >= 1, got 0"),
        (dict(kv_block_size=-4), r"kv_block_size must be an integer >= 1, got -4"),
        (dict(kv_block_size=2.5), r"kv_block_size must be an integer >= 1, got 2.5"),
        (dict(max_model_len=0), r"max_model_len must be an integer >= 1, or None \(the model's context\), got 0"),
        (dict(max_model_len=-1), r"max_model_len must be an integer >= 1, or None \(the model's context\), got -1"),
        (
            dict(max_model_len=5000),
            r"max_model_len must be at most the model's context of 1024 tokens \(max_position_embeddings\), got 5000",
        ),
        (dict(num_kv_blocks=0), r"num_kv_blocks must be an integer >= 1, or None"),
        (dict(kv_cache_memory=0), r"kv_cache_memory must be a number of bytes >= 1"),
        (dict(max_num_seqs=0), r"max_num_seqs must be an integer >= 1, got 0"),
        (dict(max_num_batched_tokens=-1), r"max_num_batched_tokens must be an integer >= 1, got -1"),
        (dict(enable_prefix_caching="no"), r"enable_prefix_caching must be True or False, got 'no'"),
        (dict(prepack_weights=1), r"prepack_weights must be None, True or False, got 1"),
        (dict(speculative_model="tiny-draft", num_speculative_tokens=0), r"num_speculative_tokens must be >= 1, got 0"),
    ],
)
def test_engine_arguments_out_of_range_are_clear_errors(llm, kwargs, phrase):
    with pytest.raises(ValueError, match=phrase) as info:
        fresh(llm, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        (
            dict(device="cuda"),
            r"device 'cuda' asked for, but CUDA is not available here \(torch.cuda.is_available\(\) is False\)",
        ),
        (dict(device="cuda:1"), r"device 'cuda:1' asked for, but CUDA is not available"),
        (dict(device="gpu"), r"device 'gpu' is not a torch device name: use 'cpu', 'cuda', 'cuda:N' or 'mps'"),
        (dict(dtype="float8"), r"unknown dtype 'float8'; choose one of float32"),
        (dict(model="no-such-model"), r"unknown model 'no-such-model': use one of smollm2, tiny, tiny-draft"),
    ],
)
def test_loading_arguments_are_clear_errors(monkeypatch, kwargs, phrase):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    with pytest.raises(ValueError, match=phrase):
        LLM(**{"model": "tiny", "device": "cpu", **kwargs})


@pytest.mark.parametrize(
    "file, content, phrase",
    [
        ("model.safetensors", b"not a safetensors file", "model.safetensors is not a readable safetensors file"),
        ("model.safetensors", b"", "model.safetensors is not a readable safetensors file"),
        ("model.safetensors", "truncated", "model.safetensors is not a readable safetensors file"),
        ("tokenizer.json", b'{"version": ', "tokenizer.json is not a readable tokenizer file"),
        ("tokenizer_config.json", b"{not json", "tokenizer_config.json is not valid JSON"),
        ("tokenizer_config.json", b"[1, 2]", "tokenizer_config.json must hold a JSON object, got a list"),
        ("model.safetensors.index.json", b"{}", "model.safetensors.index.json is not a safetensors index"),
        ("config.json", b"{oops", "config.json is not valid JSON"),
    ],
)
def test_a_corrupt_file_in_a_model_folder_is_named(tmp_path, file, content, phrase):
    folder = tmp_path / "model"
    shutil.copytree(PACKAGE_DATA / "tiny", folder)
    path = folder / file
    path.write_bytes(path.read_bytes()[:4000] if content == "truncated" else content)
    with pytest.raises(ValueError, match=phrase) as info:
        LLM(str(folder), device="cpu")
    assert str(folder) in str(info.value)

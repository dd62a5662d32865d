"""Notebook 10's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_capstone_engine.py) with a message that names the case."""

from __future__ import annotations

import pytest
from oracles import expect_bug_caught, load_fixture

from autograder.checks import capstone_engine as checks
from decodelab.engine.llm import LLM, engine_step, kv_blocks_for_memory
from decodelab.lessons.measure import decode_roofline_fraction
from decodelab.lessons.serving_loop import generate_all
from decodelab.params import SamplingParams

buggy = load_fixture("buggy_capstone_engine")


def test_reference_passes():
    checks.check_engine_step(engine_step)
    checks.check_generate_all(generate_all)
    checks.check_kv_blocks_for_memory(kv_blocks_for_memory)
    checks.check_decode_roofline_fraction(decode_roofline_fraction)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_small_pool_scenario_really_preempts():
    """The check's preemption scenario only proves something if the engine does preempt there."""
    case, kwargs, prompts, params = checks._scenarios()[2]
    llm = checks._engine(engine_step, **dict(kwargs))
    outputs, _ = checks._drive(llm, prompts, params)
    assert sum(out.metrics["preemptions"] for out in outputs) > 0, case


def test_a_step_that_makes_no_progress_fails_instead_of_hanging():
    with pytest.raises(AssertionError, match="did not finish"):
        checks._drive(checks._engine(lambda engine: []), ["x = 1"], [SamplingParams(max_tokens=2)])


def test_engine_sizes_its_pool_with_kv_blocks_for_memory():
    (model, tokenizer), _ = checks._tiny()
    llm = LLM(model=(model, tokenizer), kv_cache_memory=2**20, max_num_seqs=10**6)
    assert llm.allocator.num_blocks == kv_blocks_for_memory(model.config, 2**20, 16, model.dtype)
    with pytest.raises(ValueError, match="no KV block"):
        LLM(model=(model, tokenizer), kv_cache_memory=100)


def test_loop_scenarios_test_what_they_name():
    """The outer loop's scenarios only prove something if, on the oracle, the first one finishes out of
    prompt order and refuses its empty prompt, and the stop one really stops on a stop string or token."""
    scenarios = checks._loop_scenarios()
    case, kwargs, prompts, params = scenarios[0]
    llm = checks._engine(engine_step, **dict(kwargs))
    events = list(llm.stream(prompts, params))
    finish_order = [e.request_index for e in events if e.finished]
    assert finish_order != sorted(finish_order), case
    assert llm.generate(prompts, params, use_tqdm=False)[3].error, case
    case, kwargs, prompts, params = scenarios[2]
    outputs = checks._engine(engine_step, **dict(kwargs)).generate(prompts, params, use_tqdm=False)
    reasons = [c.finish_reason for out in outputs for c in out.outputs]
    assert reasons.count("stop") >= 2 and any(c.text for out in outputs for c in out.outputs), (case, outputs)


def test_generate_all_refuses_bad_calls():
    llm = checks._engine(engine_step)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        generate_all(llm, ["x"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="max_steps"):
        generate_all(llm, ["x"], SamplingParams(), max_steps=0)
    llm.add_request("x = 1", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="in flight"):
        generate_all(llm, ["x"], SamplingParams())

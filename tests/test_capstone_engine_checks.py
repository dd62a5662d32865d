"""Notebook 10's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_capstone_engine.py) with a message that names the case."""
from __future__ import annotations

import pytest

from autograder.checks import capstone_engine as checks
from decodelab.engine.llm import LLM, engine_step, kv_blocks_for_memory
from decodelab.lessons.measure import decode_roofline_fraction
from decodelab.params import SamplingParams
from oracles import expect_bug_caught, load_fixture

buggy = load_fixture("buggy_capstone_engine")


def test_reference_passes():
    checks.check_engine_step(engine_step)
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

"""Notebook 08's hidden checks: they pass on the library's reference step pieces
(`decodelab.engine.scheduler`) and padded prefill (`decodelab.lessons.padded_batch`), and catch
every kept bug (tests/fixtures/buggy_continuous_batching.py) with a message that names the case;
plus the simulator and serving helpers the notebook uses (`decodelab.lessons.continuous_batching`)."""

from __future__ import annotations

import math

import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import continuous_batching as checks
from decodelab.engine import scheduler
from decodelab.lessons import continuous_batching as batching_sim
from decodelab.lessons import padded_batch

buggy = load_fixture("buggy_continuous_batching")


def test_reference_passes():
    checks.check_decode_batch(scheduler.decode_batch)
    checks.check_preempt(scheduler.preempt)
    checks.check_finish(scheduler.finish)
    checks.check_schedule_chunked(scheduler.schedule_chunked)
    checks.check_padded_prefill(padded_batch.padded_prefill)


def test_scheduler_methods_are_the_graded_functions():
    """A learner's subclass replaces exactly what the checks grade (padded_prefill is no Scheduler method)."""
    for name in set(checks.REFERENCES) - {"padded_prefill"}:
        assert getattr(scheduler.Scheduler, name) is getattr(scheduler, name)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    message = expect_bug_caught(checks, buggy.BUGS, bug)
    assert "expected" in message or "raised" in message, message


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match="waiting afterwards"):
        checks.check_preempt(buggy.preempt_queues_at_back)
    with pytest.raises(AssertionError, match="block table of seq 1"):
        checks.check_finish(buggy.finish_leaks_blocks)
    with pytest.raises(AssertionError, match="OutOfBlocksError"):
        checks.check_decode_batch(buggy.decode_never_preempts)
    with pytest.raises(AssertionError, match="budget 10.*tokens each feeds.*expected \\{0: 1, 1: 1, 2: 8\\}"):
        checks.check_schedule_chunked(buggy.chunked_ignores_budget)
    with pytest.raises(AssertionError, match="not decoded.*expected \\[0, 2\\], got \\[0, 1, 2\\]"):
        checks.check_decode_batch(buggy.decode_decodes_unfinished_prompts)
    with pytest.raises(AssertionError, match="scrambled.*row 0 \\(a prompt of 3 tokens after 4 pads\\).*alone"):
        checks.check_padded_prefill(buggy.padded_positions_from_padded_start)
    with pytest.raises(AssertionError, match="pad fraction expected 0.285714 \\(6 pad slots of 3 x 7\\), got 0.4"):
        checks.check_padded_prefill(buggy.padded_fraction_of_real_tokens)


def test_padded_prefill_check_wants_one_pass():
    """Running each prompt alone gives the right logits, but it is not a static batch."""

    def one_by_one(model, prompts, pad_id):
        rows = [model(torch.tensor([prompt]), last_only=True)[0, -1] for prompt in prompts]
        longest = max(map(len, prompts))
        return torch.stack(rows), 1 - sum(map(len, prompts)) / (len(prompts) * longest)

    with pytest.raises(AssertionError, match="ONE forward pass over the padded batch of 7 columns, got 3 calls"):
        checks.check_padded_prefill(one_by_one)


# --------------------------------------------------------------------------- the simulator


def _four_requests():
    return [batching_sim.Request(0.0, 4, out) for out in (1, 9, 1, 9)]


def test_static_vs_continuous_by_hand():
    """Two slots, one step = 1 s whatever the batch; outputs 1, 9, 1, 9 tokens, all at t=0.
    Static: [1, 9] takes 9 steps (prefill gives each its first token), then [1, 9] again: 18 s.
    Continuous: prefill [a, b] (t=1, a done), prefill c (t=2, c done), prefill d (t=3),
    then 8 decode steps for b and d together: 11 s."""
    cost = batching_sim.StepCost(1.0, 0.0, 0.0)
    static = batching_sim.simulate(_four_requests(), "static", max_num_seqs=2, cost=cost)
    continuous = batching_sim.simulate(_four_requests(), "continuous", max_num_seqs=2, cost=cost)
    assert static.makespan == 18 and continuous.makespan == 11
    assert static.latency == [1, 9, 10, 18] and continuous.latency == [1, 11, 2, 11]
    assert static.throughput == pytest.approx(20 / 18) and continuous.throughput == pytest.approx(20 / 11)
    assert [s.num_running for s in static.steps[:3]] == [2, 1, 1]
    assert continuous.occupancy > static.occupancy


def test_simulation_finishes_everything_and_keeps_limits():
    workload = batching_sim.mixed_workload(40, 20.0, prompt_lens=(4, 16), output_lens=(4, 32), seed=3)
    for policy in batching_sim.POLICIES:
        result = batching_sim.simulate(workload, policy, max_num_seqs=6, num_blocks=36, block_size=8)
        assert len(result.latency) == 40 and all(l > 0 for l in result.latency)
        assert all(0 < s.num_seqs <= s.num_running <= 6 for s in result.steps if not s.is_prefill)
        assert 0 < result.occupancy <= 1
        assert result.output_tokens == sum(r.output_len for r in workload)
    tight = batching_sim.simulate(workload, "continuous", max_num_seqs=6, num_blocks=12, block_size=8)
    assert tight.num_preemptions > 0 and len(tight.latency) == 40
    with pytest.raises(ValueError, match="does not fit"):
        batching_sim.simulate(workload, "continuous", num_blocks=4, block_size=8)


def test_workload_and_cost_fit():
    burst = batching_sim.mixed_workload(5, math.inf)
    assert [r.arrival for r in burst] == [0.0] * 5
    spaced = batching_sim.mixed_workload(2000, 10.0, seed=1)
    assert spaced[-1].arrival / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate
    cost = batching_sim.StepCost.fit([1, 4, 16], [0.012, 0.018, 0.042], [64, 128], [0.01 + 0.064, 0.01 + 0.128])
    assert cost.fixed_s == pytest.approx(0.01) and cost.per_seq_s == pytest.approx(0.002)
    assert cost.prefill_token_s == pytest.approx(0.001)
    assert cost.step(3, 40, False) == pytest.approx(0.016) and cost.step(3, 40, True) == pytest.approx(0.05)
    noisy = batching_sim.StepCost.fit([1, 2, 4, 8, 16, 32], [0.012, 0.014, 0.018, 0.026, 0.042, 0.5])
    assert noisy.fixed_s == pytest.approx(0.01) and noisy.per_seq_s == pytest.approx(0.002)  # one slow outlier
    with pytest.raises(ValueError):
        batching_sim.mixed_workload(3, 0.0)
    with pytest.raises(ValueError):
        batching_sim.simulate(burst, "dynamic")


def test_serve_on_the_real_engine_static_and_continuous_agree():
    from decodelab.engine.llm import LLM, EngineHooks
    from decodelab.model.registry import load
    from decodelab.params import SamplingParams

    model, tokenizer = load("tiny", device="cpu")
    llm = LLM(
        (model, tokenizer),
        max_num_seqs=3,
        num_kv_blocks=64,
        kv_block_size=4,
        hooks=EngineHooks(scheduler=batching_sim.recording(scheduler.Scheduler)),
    )
    prompts = [[5 + i, 6, 7, 8] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 6, 3, 5, 4)]
    runs = {p: batching_sim.serve(llm, prompts, params, p) for p in batching_sim.POLICIES}
    for run in runs.values():
        assert run.output_tokens == 20 and len(run.latency) == 5 and run.makespan > 0
        assert all(s.num_running <= 3 for s in run.steps)
    assert [o.outputs[0].token_ids for o in runs["static"].outputs] == [
        o.outputs[0].token_ids for o in runs["continuous"].outputs
    ]
    steps, cost = batching_sim.measure_step_cost(llm, [1, 2, 3], num_tokens=3)
    assert set(steps) == {1, 2, 3} and all(s > 0 for s in steps.values()) and cost.fixed_s > 0
    with pytest.raises(ValueError, match="max_num_seqs"):
        batching_sim.measure_step_cost(llm, [4])


def test_simulation_stops_a_scheduler_that_never_finishes():
    class Stuck(scheduler.Scheduler):
        finish = buggy.finish_stays_running

    with pytest.raises(RuntimeError, match="without finishing|ran nothing"):
        batching_sim.simulate(_four_requests(), "continuous", Stuck, max_num_seqs=2)

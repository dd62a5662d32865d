"""Notebook 14's hidden checks: they pass on the library's reference (`decodelab.lessons.serving`) and
catch every kept bug (tests/fixtures/buggy_serving.py) with a message that names the behaviour; plus
the lesson's helpers the notebook leans on (`run_sync` inside a running loop, the workload, the
load run's tokens against the engine's own)."""

from __future__ import annotations

import asyncio

import pytest
from oracles import expect_bug_caught, load_fixture

from autograder.checks import serving as checks
from decodelab.lessons import serving

buggy = load_fixture("buggy_serving")

# the words each kept bug's hidden failure must contain: the behaviour it breaks
NAMES = {
    "loop_joins_only_when_idle": "join between steps",
    "loop_abort_forgets_the_engine": "aborted",
    "loop_never_ends_a_stream": "never ends",
    "loop_skips_a_token_each_step": "the stream must equal the engine's tokens",
    "stream_no_abort_on_disconnect": "aborted",
    "stream_no_backpressure": "refused with QueueFull",
    "stream_counts_running_as_waiting": "running requests do not wait",
    "stream_aborts_only_on_cancel": "closing the stream is a disconnect",
    "metrics_tpot_over_all_tokens": "tpot",
    "metrics_goodput_counts_completed": "goodput",
    "metrics_ttft_from_first_sent": "ttft",
}


def test_reference_passes():
    checks.check_engine_loop(serving.engine_loop)
    checks.check_stream(serving.stream)
    checks.check_serving_metrics(serving.serving_metrics)


def test_the_predictions_answers():
    assert checks.answer_q_refused_of_10() == 6.0
    assert checks.answer_q_blocks_freed() == 3.0  # ceil((20 + 4) / 8): the 5th token has no slot yet
    checks.check_q_refused_of_10(6)
    with pytest.raises(AssertionError, match="only max_waiting"):
        checks.check_q_refused_of_10(10)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    message = expect_bug_caught(checks, buggy.BUGS, bug)
    assert NAMES[bug] in message, message


def test_run_sync_works_inside_a_running_loop():
    """As in a notebook cell: a loop is running, and run_sync still returns the coroutine's result."""

    async def outer():
        async def inner():
            await asyncio.sleep(0)
            return 42

        return serving.run_sync(inner)

    assert asyncio.run(outer()) == 42


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="max_waiting"):
        serving.StreamingServer(None, max_waiting=0)
    with pytest.raises(ValueError, match="rate"):
        serving.poisson_workload(3, 0.0, 0, 100)
    with pytest.raises(ValueError, match="duration"):
        serving.serving_metrics([], 0.0, 1.0, 0.1)


def test_the_workload_is_seeded_and_long_tailed():
    a = serving.poisson_workload(200, 5.0, 1, 1000)
    assert [(r.send_at, r.prompt, r.max_tokens) for r in a] == [
        (r.send_at, r.prompt, r.max_tokens) for r in serving.poisson_workload(200, 5.0, 1, 1000)
    ]
    gaps = [b.send_at - x.send_at for x, b in zip(a, a[1:])]
    assert 0.15 < sum(gaps) / len(gaps) < 0.25  # mean gap 1 / rate
    outputs = sorted(r.max_tokens for r in a)
    assert outputs[len(outputs) // 2] < sum(outputs) / len(outputs)  # median below mean: a long tail


def test_the_load_explorer_moves_between_runs_and_the_timeline_draws_each_request():
    from decodelab.course.widgets import serving as widgets_serving

    runs = {"one slot": [(0.0, [0.5, 0.6, 0.7]), (0.1, [0.9])], "four slots": [(0.0, [0.2, 0.3]), (0.1, [])]}
    durations = {"one slot": 1.0, "four slots": 1.0}
    box = widgets_serving.load_explorer(runs, durations, ttft_slo=0.4, tpot_slo=0.2)
    assert box.figure.layout.title.text.startswith("one slot: p99 TTFT")
    box.controls["run"].value = "four slots"
    assert box.figure.layout.title.text.startswith("four slots: p99 TTFT")
    fig = widgets_serving.timeline_figure(runs["one slot"], "one slot")
    waits, streams = fig.data
    assert list(waits.x) == pytest.approx([0.5, 0.8]) and list(waits.base) == pytest.approx([0.0, 0.1])
    assert list(streams.y) == [0] and list(streams.x) == pytest.approx([0.2])  # one token: no stream bar
    with pytest.raises(ValueError, match="at least one run"):
        widgets_serving.load_explorer({}, {}, 1.0, 1.0)

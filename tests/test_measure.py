"""The timers of `decodelab.lessons.measure`, the one home of the benches' and notebooks' timing."""

from __future__ import annotations

import time

import pytest

from decodelab.lessons.measure import time_call, timed


def test_timed_returns_the_result_and_the_seconds_of_the_clock_given():
    ticks = iter([10.0, 12.5])
    seconds, result = timed(lambda: "done", clock=lambda: next(ticks))
    assert (seconds, result) == (2.5, "done")
    seconds, result = timed(lambda: time.sleep(0.01) or 7)
    assert result == 7 and 0.01 <= seconds < 1.0


def test_time_call_warms_up_then_times_each_repeat():
    calls = []
    times = time_call(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def test_memory_bandwidth_is_the_fastest_pass_over_the_buffer(monkeypatch):
    # Other work on the machine only slows a pass: the probe reports the fastest one, so a
    # disturbed pass cannot pull the bound below what a decode reading the same bytes reaches.
    from decodelab.lessons import measure

    passes = {"read": [0.4, 0.1, 0.2], "copy": [0.5, 0.25, 0.3]}
    for method, seconds in passes.items():

        def time_call(fn, device, repeats, seconds=seconds):  # the passes' times, after one real call
            fn()
            return seconds

        monkeypatch.setattr(measure, "time_call", time_call)
        bandwidth = measure.memory_bandwidth(megabytes=4, repeats=3, method=method)
        read_and_written = 1 if method == "read" else 2
        assert bandwidth == pytest.approx(read_and_written * 4 * 2**20 / min(seconds))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"megabytes": 0}, "megabytes must be an integer >= 1"),
        ({"repeats": 0}, "repeats must be an integer >= 1"),
        ({"method": "write"}, "method must be 'read' or 'copy'"),
    ],
)
def test_memory_bandwidth_refuses_bad_arguments(kwargs, message):
    from decodelab.lessons.measure import memory_bandwidth

    with pytest.raises(ValueError, match=message):
        memory_bandwidth(**{"megabytes": 1, **kwargs})

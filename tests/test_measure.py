"""The timers of `decodelab.lessons.measure`, the one home of the benches' and notebooks' timing."""

from __future__ import annotations

import time

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

"""Speed credit, for an instructor who wants it: the learner's code within a ratio of the library's
time, measured side by side on the grading machine, never an absolute time.

Not a topic's check module (it grades no one notebook): a hidden-test cell calls one of the
parts' checks with the learner's code, for example in notebook 07's

    hidden("speed.check_paged_attention_speed", paged_decode_attention)   # at most 1.5x the library's

or, for another bound or any function, `check_part_speed` / `check_speed_ratio` directly.

Both checks first guard that the work was done: the learner's output must match the reference's
on fresh inputs (drawn from a random seed, so that no input can be special-cased); a fast but
wrong answer earns nothing. Then the two sides run in pairs whose order alternates
(`decodelab.course.speed_credit.paired_times`), and the median of the pairs' ratios must be at
most `max_ratio`. A ratio of 1 is the library's speed; leave room for the grading machine's noise
(1.5 is a fair bound on a busy CPU: identical code measures 0.8-1.25).
"""

from __future__ import annotations

import random

from decodelab.course.speed_credit import Spread, paired_times, ratios
from decodelab.course.speed_parts import function_workload, outputs_differ, part_named, reference_namespace

DEFAULT_PAIRS = 21
SPEED_CREDIT_RATIO = 1.5  # the parts' checks: at most this many times the library's time

__all__ = [
    "check_decode_step_speed",
    "check_int8_linear_speed",
    "check_paged_attention_speed",
    "check_part_speed",
    "check_scheduler_step_speed",
    "check_speed_ratio",
]


def _fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _expect_fast_enough(what: str, learner, reference, max_ratio: float, pairs: int, device) -> float:
    if not max_ratio > 0:
        raise ValueError(f"max_ratio must be > 0, got {max_ratio!r}")
    learner_s, reference_s = paired_times(learner, reference, pairs, device)
    spread = Spread.of(ratios(learner_s, reference_s))
    if spread.median > max_ratio:
        raise AssertionError(
            f"{what}: yours took {spread.median:.2f}x the library's time on this machine (median of "
            f"{pairs} pairs in alternating order, quartiles {spread.q1:.2f}-{spread.q3:.2f}); "
            f"speed credit needs at most {max_ratio:g}x"
        )
    return spread.median


def check_speed_ratio(
    learner_fn,
    reference_fn,
    make_inputs,
    max_ratio: float = 1.5,
    pairs: int = DEFAULT_PAIRS,
    tolerance: float = 1e-4,
    device="cpu",
) -> float:
    """learner_fn(*make_inputs(seed)) gives reference_fn's output (within `tolerance` for tensors)
    on two fresh seeds, and takes at most max_ratio times its time (the median of `pairs`
    order-alternated pairs on the last inputs). Returns that median ratio; AssertionError otherwise."""
    name = getattr(learner_fn, "__name__", "your function")
    for _ in range(2):
        seed = _fresh_seed()
        args = make_inputs(seed)
        problem = outputs_differ(learner_fn(*args), reference_fn(*args), tolerance)
        if problem:
            raise AssertionError(
                f"{name}: {problem} on fresh inputs (seed {seed}): speed is credited only for the reference's work"
            )
    return _expect_fast_enough(
        name, function_workload(learner_fn, args), function_workload(reference_fn, args), max_ratio, pairs, device
    )


def check_part_speed(
    part: str, learner, max_ratio: float = 1.5, size: str = "small", pairs: int = DEFAULT_PAIRS, device="cpu"
) -> float:
    """The same for one of the engine's timed parts (`decodelab.course.speed_parts`: "paged
    attention", "int8 linear", "decode step", "scheduler step"), on its own inputs; `learner` is
    what the part times (the function, or Int8Linear's class, or the scheduler's class)."""
    timed = part_named(part)
    seed = _fresh_seed()
    mine = timed.workload(learner, size, seed, device)
    theirs = timed.workload(timed.build(reference_namespace(timed)), size, seed, device)
    try:
        problem = outputs_differ(mine.output(), theirs.output(), timed.tolerance)
    except Exception as exc:  # noqa: BLE001 - the learner's code may raise anything
        raise AssertionError(
            f"{part}: yours raised {type(exc).__name__}: {exc} on fresh inputs (seed {seed})"
        ) from None
    if problem:
        raise AssertionError(
            f"{part}: {problem} on fresh inputs (seed {seed}): speed is credited only for the reference's work"
        )
    return _expect_fast_enough(part, mine, theirs, max_ratio, pairs, device)


def check_paged_attention_speed(paged_decode_attention) -> None:
    """Notebook 07's paged_decode_attention, within SPEED_CREDIT_RATIO of the library's."""
    check_part_speed("paged attention", paged_decode_attention, SPEED_CREDIT_RATIO)


def check_int8_linear_speed(int8_linear_class) -> None:
    """Notebook 06's Int8Linear (its from_linear and forward), within SPEED_CREDIT_RATIO of the library's."""
    check_part_speed("int8 linear", int8_linear_class, SPEED_CREDIT_RATIO)


def check_decode_step_speed(forward) -> None:
    """Notebook 01's forward (with the rms_norm, rope and mlp it calls), one decode step, within
    SPEED_CREDIT_RATIO of the library's."""
    check_part_speed("decode step", forward, SPEED_CREDIT_RATIO)


def check_scheduler_step_speed(scheduler_class) -> None:
    """Notebook 08's scheduler (a Scheduler subclass with its methods), one chunked-prefill step,
    within SPEED_CREDIT_RATIO of the library's."""
    check_part_speed("scheduler step", scheduler_class, SPEED_CREDIT_RATIO)

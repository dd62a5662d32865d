"""How the hidden checks grade a prediction (a notebook's ``q_<name>`` answer cell).

Not a check module (it has no ``check_*``). A topic's check module states each answer, computed
from the library rather than typed in, and its tolerance:

    def check_q_kv_mib(value):
        expect_answer(value, kv_size.kv_bytes("Llama-3.1-8B", 4096, 1, "fp16") / 2**20, "q_kv_mib: ...", rel_tol=0.05)

The failure message gives the prediction, the answer and the tolerance: a prediction is graded
once, after the learner has seen the experiment, so the answer is no secret in the feedback.
"""
from __future__ import annotations

import math
import numbers

__all__ = ["expect_answer"]


def expect_answer(value, expected: float, what: str, rel_tol: float = 0.05, abs_tol: float = 0.0) -> None:
    """value within max(rel_tol * |expected|, abs_tol) of expected, else AssertionError."""
    tolerance = max(rel_tol * abs(expected), abs_tol)
    stated = f"within {rel_tol:.0%}" if tolerance == rel_tol * abs(expected) else f"within {abs_tol:g}"
    if value is None:
        raise AssertionError(f"{what}: no prediction (the cell still says None); the answer is {expected:,.6g}")
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise AssertionError(f"{what}: expected a number {stated} of {expected:,.6g}, got {type(value).__name__} "
                             f"{value!r}")
    if abs(value - expected) > tolerance:
        raise AssertionError(f"{what}: you predicted {value:,.6g}; the answer is {expected:,.6g} "
                             f"(graded {stated})")

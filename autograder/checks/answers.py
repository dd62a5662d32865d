"""How the hidden checks grade a prediction (a notebook's ``q_<name>`` answer cell).

Not a check module (it has no ``check_*``). A topic's check module computes each answer from the
library rather than typing it in, in ``answer_q_<name>()``, and grades with it:

    def answer_q_kv_mib() -> float:
        return kv_size.kv_bytes("Llama-3.1-8B", 4096, 1, "fp16") / 2**20

    def check_q_kv_mib(value):
        expect_answer("q_kv_mib", value, answer_q_kv_mib(), "Llama-3.1-8B's K and V for 4,096 tokens in fp16")

The tolerance is the question's row in ``decodelab.course.predictions.QUESTIONS`` (one home: the
answer cell states it, the notebook's feedback applies it through the same ``passes``). The
failure message gives the prediction, the answer and the tolerance: a prediction is graded once,
after the learner has seen the experiment, so the answer is no secret in the feedback.
"""

from __future__ import annotations

import math
import numbers

from decodelab.course.predictions import passes, question

__all__ = ["expect_answer"]


def expect_answer(name: str, value, expected: float, why: str) -> None:
    """value passes question `name` (QUESTIONS' tolerance around expected), else AssertionError."""
    q = question(name)
    answer = f"the answer is {expected:,.6g}{' ' + q.unit if q.unit else ''}"
    if value is None:
        raise AssertionError(f"{name}: no prediction (the cell still says None); {answer} ({why})")
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise AssertionError(
            f"{name}: expected a number {q.tolerance_text} {expected:,.6g}, got "
            f"{type(value).__name__} {value!r}".replace("of the answer ", "of ")
        )
    if not passes(name, value, expected):
        raise AssertionError(f"{name}: you predicted {value:,.6g}; {answer} (graded {q.tolerance_text}): {why}")

"""Predict, then measure: the learner writes a number down before an experiment runs.

A graded prediction is a pair of nbgrader cells (tests/notebooks.py has the conventions):

    # q_kv_mib: an answer cell; the release holds `q_kv_mib = None`
    q_kv_mib = 512

    # test_q_kv_mib: its graded cell
    from decodelab.course.predictions import expect_prediction
    expect_prediction(q_kv_mib, "q_kv_mib", unit="MiB")
    ### BEGIN HIDDEN TESTS  (the answer, with a stated tolerance: autograder/checks/<topic>.py)

`expect_prediction` only checks that a number was written: the answer itself is graded when the
notebook is submitted, and the experiment below the question shows it. A prediction still at None
is *unanswered*: the visible part says so and returns, so that Run All goes on to the experiment
(nbgrader's Validate lists it as passing); the graded outcome is still 0, because the cell's
hidden block, `hidden("<topic>.check_q_<name>", None)`, fails (`expect_answer` rejects None), and
a graded cell scores 0 when it raises. After the experiment,
`show_beside` puts the prediction next to what was measured. A machine-dependent question
(how much faster is the cache *on this machine*?) is asked in a plain cell and never graded: it
goes through `show_beside` only.
"""
from __future__ import annotations

import math
import numbers

__all__ = ["expect_prediction", "show_beside"]


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def expect_prediction(value, name: str, unit: str = "") -> None:
    """The visible part of a prediction's graded cell: a finite number was written.

    While `value` is still None (the released cell) it prints that the prediction is unanswered and
    returns, so that the notebook runs on (the hidden check grades None 0); AssertionError for
    anything else that is not a finite real number; prints the prediction otherwise.
    """
    if value is None:
        print(f"{name} is unanswered (still None): write your prediction (a number) in the cell above and run it, "
              "then this cell. Unanswered, it scores 0 when the notebook is graded; the notebook goes on.")
        return
    if not _is_number(value):
        raise AssertionError(f"{name} must be a finite number{f' (in {unit})' if unit else ''}, "
                             f"got {type(value).__name__} {value!r}")
    print(f"prediction recorded: {name} = {value:,g}{f' {unit}' if unit else ''}. "
          "The experiment below measures it; the grader checks it when you submit.")


def show_beside(name: str, prediction, measured: float, unit: str = "") -> str:
    """Print (and return) one line: the prediction next to the measured value, and their ratio.

    `prediction` may be None (not answered) or anything the learner typed; `measured` is a number.
    """
    suffix = f" {unit}" if unit else ""
    if prediction is None:
        line = f"{name}: measured {measured:,.4g}{suffix}; you made no prediction (it is None)"
    elif not _is_number(prediction):
        line = f"{name}: measured {measured:,.4g}{suffix}; your prediction {prediction!r} is not a number"
    elif prediction == 0 or measured == 0:
        line = f"{name}: you predicted {prediction:,.4g}{suffix}, measured {measured:,.4g}{suffix}"
    else:
        ratio = measured / prediction
        verdict = "close" if 0.9 <= ratio <= 1.1 else ("more than you said" if ratio > 1 else "less than you said")
        line = (f"{name}: you predicted {prediction:,.4g}{suffix}, measured {measured:,.4g}{suffix} "
                f"(measured / predicted = {ratio:.3g}: {verdict})")
    print(line)
    return line

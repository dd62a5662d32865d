"""Predict, then check: the learner writes a number down before an experiment runs.

A graded prediction is a pair of nbgrader cells (tests/notebooks.py has the conventions):

    # q_kv_mib: an answer cell; the release holds `q_kv_mib = None`
    # Answer in MiB; it passes within 5% of the answer.      <- QUESTIONS["q_kv_mib"].statement
    q_kv_mib = 512

    # test_q_kv_mib: its graded cell
    from decodelab.course.predictions import expect_prediction
    expect_prediction(q_kv_mib, "q_kv_mib")
    ### BEGIN HIDDEN TESTS  (autograder/checks/<topic>.py: answer_q_kv_mib() and check_q_kv_mib)

`QUESTIONS` is the one table of the questions: each one's notebook, unit, tolerance and what its
answer is. The answer cell states the unit and the tolerance (a test holds it to the table), the
grader (`autograder/checks/answers.py`, `expect_answer`) reads the tolerance from it, and so does
the feedback, through the same `passes`: the line the notebook prints and the grade cannot
disagree.

`expect_prediction` only checks that a number was written. A prediction still at None is
*unanswered*: the visible part says so and returns, so that Run All goes on (nbgrader's Validate
lists it as passing); the graded outcome is still 0, because the cell's hidden block fails on
None, and a graded cell scores 0 when it raises.

After the experiment, `show_answer` prints one line: the prediction beside the answer the
notebook has just computed (the same quantity the grader computes), and whether it passes. A
question about a hypothetical (08's 20 ms + 1 ms a sequence) is checked against the hypothetical's
answer; what this machine measures is a different quantity and goes on its own line,
`show_measured`, never compared with the prediction. A machine-dependent question (how much faster
is the cache *on this machine*?) is asked in a plain cell, never graded, and goes through
`show_beside` only. Each prints its line once and returns None (a returned string, as the cell's
last value, would be shown a second time).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = [
    "QUESTIONS",
    "Question",
    "answer_line",
    "expect_prediction",
    "passes",
    "question",
    "show_answer",
    "show_beside",
    "show_measured",
]


@dataclass(frozen=True)
class Question:
    """One graded prediction: where it is asked, its unit, its tolerance, and what its answer is.

    A value passes when |value - answer| <= max(rel_tol x |answer|, abs_tol).
    """

    notebook: str
    unit: str  # printed after numbers: "MiB", "%", "x", "" for a plain number
    answer_is: str  # what the answer is, and how the notebook gets it
    rel_tol: float = 0.05
    abs_tol: float = 0.0
    unit_words: str = ""  # how the answer cell asks for the unit, when "in <unit>" does not say it

    def tolerance(self, answer: float) -> float:
        return max(self.rel_tol * abs(answer), self.abs_tol)

    @property
    def tolerance_text(self) -> str:
        """ "within 5% of the answer", or "within 0.5 of the answer (the exact whole number)"."""
        if self.abs_tol and not self.rel_tol:
            whole = " (the exact whole number)" if self.abs_tol == 0.5 else ""
            return f"within {self.abs_tol:g} of the answer{whole}"
        if self.abs_tol:
            return f"within {self.rel_tol:.0%} of the answer or {self.abs_tol:g}, whichever is larger"
        return f"within {self.rel_tol:.0%} of the answer"

    @property
    def statement(self) -> str:
        """The sentence the answer cell holds: its unit and its tolerance."""
        unit = self.unit_words or (f"in {self.unit}" if self.unit else "as a plain number")
        return f"Answer {unit}; it passes {self.tolerance_text}."


def _q(notebook, unit, answer_is, rel_tol=0.05, abs_tol=0.0, unit_words=""):
    return Question(notebook, unit, answer_is, rel_tol, abs_tol, unit_words)


PERCENT = "in percent (for 3.5%, write 3.5)"
RATIO = "as a ratio (for 12 times, write 12)"

QUESTIONS: dict[str, Question] = {
    "q_embedding_share_percent": _q(
        "00_meet_the_model",
        "%",
        "V x E over all of SmolLM2-135M's parameters, counted by your count_parameters",
        unit_words=PERCENT,
    ),
    "q_llama8b_tokens_per_s": _q(
        "00_meet_the_model", "tokens/s", "3.35e12 bytes/s over Llama-3.1-8B's bf16 weight bytes, by your decode bound"
    ),
    "q_layer_params": _q("01_forward_pass", "parameters", "layer 0's tensors, counted", rel_tol=0.02),
    "q_rope_slowest_period": _q("01_forward_pass", "tokens", "2 pi over the slowest pair's radians per token"),
    "q_top_p_uniform_kept": _q("02_sampling", "tokens", "the tokens your top_p_filter keeps", rel_tol=0.02),
    "q_frequency_std_error": _q("02_sampling", "", "the binomial's standard deviation over 10,000 draws"),
    "q_rows_without_cache": _q(
        "03_kv_cache", "rows", "rows counted while the tiny model generates without a cache", rel_tol=0.01
    ),
    "q_qwen3_kv_gib": _q("03_kv_cache", "GiB", "your kv_bytes for Qwen3-8B"),
    "q_kv_share_percent": _q(
        "04_prefill_decode",
        "%",
        "the K/V share of the step's bytes, by your arithmetic_intensity's count",
        unit_words=PERCENT,
    ),
    "q_prefill_tokens_to_ridge": _q(
        "04_prefill_decode",
        "tokens",
        "the shortest prompt whose intensity reaches the ridge, by your arithmetic_intensity",
    ),
    "q_mha_kv_mib": _q("05_gqa", "MiB", "kv_bytes for Llama-3.1-8B with 32 KV heads"),
    "q_repeat_kv_mib": _q("05_gqa", "MiB", "the bytes of the tensor repeat_kv returned"),
    "q_int8_max_error": _q("06_quantization", "", "half a step: half of the scale your quantizer chose"),
    "q_int4_group_bytes": _q(
        "06_quantization",
        "bytes",
        "the bytes your quantize_int4_groupwise returned for one group",
        rel_tol=0.0,
        abs_tol=0.5,
    ),
    "q_reservation_mib": _q("07_paged_kv", "MiB", "2,048 tokens of SmolLM2's K and V in float32"),
    "q_waste_pct_blocks_32": _q(
        "07_paged_kv",
        "%",
        "your kv_waste over every length from 50 to 2,047 once: the expected waste",
        rel_tol=0.1,
        unit_words=PERCENT,
    ),
    "q_throughput_gain_b32": _q(
        "08_continuous_batching",
        "x",
        "the cost model 20 ms + 1 ms a sequence, computed, not measured",
        unit_words=RATIO,
    ),
    "q_chunked_steps": _q(
        "08_continuous_batching", "steps", "the library's chunked step, counted", rel_tol=0.0, abs_tol=0.5
    ),
    "q_alpha": _q("09_speculative_decoding", "", "1 - TVD of p and q", rel_tol=0.02),
    "q_tokens_per_call": _q(
        "09_speculative_decoding", "tokens", "the formula, 1 + alpha + ... + alpha^k", rel_tol=0.02
    ),
    "q_llama_blocks_in_40_gib": _q("10_capstone_engine", "blocks", "the engine's kv_blocks_for_memory", rel_tol=0.01),
    "q_memory_roof_tokens_per_s": _q(
        "10_capstone_engine", "tokens/s", "the speed your decode_roofline_fraction puts at 100% of the roof"
    ),
    "q_llama_scores_gib": _q("11_tiled_attention", "GiB", "your attention_memory_bytes, plain"),
    "q_smollm2_scores_mib": _q(
        "11_tiled_attention", "MiB", "your attention_memory_bytes, plain: the score matrix alone"
    ),
    "q_programs_batch32": _q(
        "12_gpu_kernel", "programs", "the launcher's grid, read off a batch of 32", rel_tol=0.0, abs_tol=0.5
    ),
    "q_min_read_mib": _q("12_gpu_kernel", "MiB", "kv_bytes_read for 32 x 2,048 tokens"),
    "q_outlier_extra_bytes": _q(
        "13_calibrated_quantization",
        "bytes",
        "the extra_bytes of the library's Decomposition with 3 float columns of a 576 x 576 weight",
        rel_tol=0.0,
        abs_tol=0.5,
    ),
    "q_int3_bits_per_weight": _q(
        "13_calibrated_quantization",
        "bits",
        "8 x (packed int3 levels + float32 scale and uint8 zero per group) / 1,536 weights, groupwise.packed_bytes",
    ),
    "q_refused_of_10": _q(
        "14_serving", "requests", "the library's stream, max_waiting 4, ten clients", rel_tol=0.0, abs_tol=0.5
    ),
    "q_blocks_freed": _q(
        "14_serving", "blocks", "the engine's free blocks before and after the abort", rel_tol=0.0, abs_tol=0.5
    ),
    "q_state_kib": _q("15_state_space", "KiB", "tiny-mamba's MambaState after a prefill, its nbytes() / 1024"),
    "q_crossover_tokens": _q(
        "15_state_space",
        "tokens",
        "the shortest prefill after which tiny's KVCache.nbytes() exceeds tiny-mamba's MambaState.nbytes()",
        rel_tol=0.1,
    ),
}


def question(name: str) -> Question:
    """QUESTIONS[name]; KeyError naming the table when a notebook asks a question it lacks."""
    try:
        return QUESTIONS[name]
    except KeyError:
        raise KeyError(
            f"{name!r} is not in decodelab.course.predictions.QUESTIONS: add its row "
            "(notebook, unit, what its answer is, tolerance)"
        ) from None


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def passes(name: str, value, answer: float) -> bool:
    """Whether `value` passes question `name` whose answer is `answer`: the grader's rule and the
    feedback's. False for None and for anything that is not a finite real number."""
    if not _is_number(value):
        return False
    return abs(value - answer) <= question(name).tolerance(answer)


def _with_unit(value: float, unit: str) -> str:
    return f"{value:,.4g}{' ' + unit if unit else ''}"


def expect_prediction(value, name: str) -> None:
    """The visible part of a prediction's graded cell: a finite number was written.

    While `value` is still None (the released cell) it prints that the prediction is unanswered and
    returns, so that the notebook runs on (the hidden check grades None 0); AssertionError for
    anything else that is not a finite real number; prints the prediction otherwise.
    """
    q = question(name)
    if value is None:
        print(
            f"{name} is unanswered (still None): write your prediction (a number) in the cell above and run it, "
            "then this cell. Unanswered, it scores 0 when the notebook is graded; the notebook goes on."
        )
        return
    if not _is_number(value):
        raise AssertionError(
            f"{name} must be a finite number{f' (in {q.unit})' if q.unit else ''}, got {type(value).__name__} {value!r}"
        )
    print(
        f"prediction recorded: {name} = {value:,g}{f' {q.unit}' if q.unit else ''}. It passes "
        f"{q.tolerance_text} when you submit; the experiment below computes the answer."
    )


def answer_line(name: str, prediction, answer: float) -> str:
    """The feedback on a graded prediction: the prediction, the answer, and whether it passes."""
    q = question(name)
    head = f"{name}: the answer is {_with_unit(answer, q.unit)} ({q.answer_is})"
    if prediction is None:
        return f"{head}; you made no prediction (still None): it scores 0"
    if not _is_number(prediction):
        return f"{head}; your prediction {prediction!r} is not a number: it scores 0"
    verdict = "it passes" if passes(name, prediction, answer) else "outside, so it scores 0"
    off = f", off by {abs(prediction - answer) / abs(answer):.1%} of the answer" if answer else ""
    return f"{head}; you predicted {_with_unit(prediction, q.unit)}{off}; graded {q.tolerance_text}: {verdict}"


def show_answer(name: str, prediction, answer: float) -> None:
    """Print `answer_line` once: the prediction beside the answer the notebook computed."""
    print(answer_line(name, prediction, answer))


def show_measured(label: str, measured: float, unit: str = "") -> None:
    """Print one line of what was measured here, not compared with any prediction (a hypothetical's
    prediction is checked against the hypothesis's answer by `show_answer`)."""
    print(f"measured here, not graded: {label}: {_with_unit(measured, unit)}")


def show_beside(name: str, prediction, measured: float, unit: str = "") -> None:
    """Print one line: an ungraded guess next to the measured value of the same quantity, and their ratio.

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
        line = (
            f"{name}: you predicted {prediction:,.4g}{suffix}, measured {measured:,.4g}{suffix} "
            f"(measured / predicted = {ratio:.3g}: {verdict})"
        )
    print(line)

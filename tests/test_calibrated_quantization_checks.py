"""Notebook 13's hidden checks (autograder/checks/calibrated_quantization.py): they pass on the library's
references and catch every kept bug of tests/fixtures/buggy_calibrated_quantization.py; the slow, direct GPTQ
they compare with (`lessons.calibrated_quantization.direct_gptq`) agrees with the library's blocked GPTQ and
with its dead-input rule."""

from __future__ import annotations

import importlib

import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import calibrated_quantization as checks
from decodelab.lessons.calibrated_quantization import direct_gptq
from decodelab.model import gptq

buggy = load_fixture("buggy_calibrated_quantization")

GRADED_CHECKS = {
    "decompose": "check_decompose",
    "search_scales": "check_search_scales",
    "gptq_quantize_layer": "check_gptq_quantize_layer",
}


def _reference(function: str):
    module, _, attr = checks.REFERENCES[function].partition(":")
    return getattr(importlib.import_module(module), attr)


def test_references_cover_the_checks():
    assert set(checks.REFERENCES) == set(GRADED_CHECKS)
    assert sorted(GRADED_CHECKS.values()) == sorted(checks.__all__)


@pytest.mark.parametrize("function", sorted(GRADED_CHECKS))
def test_reference_passes(function):
    getattr(checks, GRADED_CHECKS[function])(_reference(function))


def test_every_check_has_a_kept_bug():
    assert {check for _, check, _ in buggy.BUGS.values()} == set(checks.__all__)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_behaviour():
    with pytest.raises(AssertionError, match="strictly"):
        checks.check_decompose(buggy.decompose_threshold_inclusive)
    with pytest.raises(AssertionError, match="least loss"):
        checks.check_search_scales(buggy.awq_largest_loss)
    with pytest.raises(AssertionError, match="not yet quantized"):
        checks.check_gptq_quantize_layer(buggy.gptq_updates_quantized_columns)


@pytest.mark.parametrize("bits, block_size", [(4, 32), (3, 64), (4, 128)])
def test_direct_gptq_equals_the_blocked_one(bits, block_size):
    g = torch.Generator().manual_seed(bits + block_size)
    w = torch.randn(5, 128, generator=g)
    x = torch.randn(200, 128, generator=g) * torch.linspace(0.1, 3, 128)
    x[:, 7] = 0  # a dead input: H_jj = 1, weight column 0, in both
    blocked = gptq.gptq_quantize(w, gptq.hessian(x), bits, 64, block_size).dequantize().double()
    assert torch.allclose(blocked, direct_gptq(w, x, bits, 64), atol=1e-4)
    assert (blocked[:, 7] == 0).all()


def test_predictions_answers():
    assert checks.answer_q_outlier_extra_bytes() == 3 * 576 * 3
    assert abs(checks.answer_q_int3_bits_per_weight() - 8 * (4 * 154 + 12 * 5) / 1536) < 1e-12

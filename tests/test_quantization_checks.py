"""Notebook 06's hidden checks (autograder/checks/quantization.py): they pass on the library's
reference implementations and catch every kept bug, those of tests/fixtures/buggy_quantization.py
and those of tests/fixtures/library/buggy_quantization.py whose check the notebook grades, with a message
that names the case."""
from __future__ import annotations

import importlib

import pytest

from autograder.checks import quantization as checks
from oracles import expect_bug_caught, load_fixture

buggy = load_fixture("buggy_quantization")
buggy_library = load_fixture("library/buggy_quantization")  # tests/test_quantization.py's kept bugs, graded here as well

GRADED_CHECKS = {
    "quantize_int8_per_tensor": "check_quantize_int8_per_tensor",
    "quantize_int8_per_channel": "check_quantize_int8_per_channel",
    "pack_int4": "check_pack_int4",
    "unpack_int4": "check_unpack_int4",
    "quantize_int4_groupwise": "check_quantize_int4_groupwise",
}
ALL_BUGS = {**buggy.BUGS, **{name: bug for name, bug in buggy_library.BUGS.items() if hasattr(checks, bug[1])}}


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
    assert {check for _, check, _ in ALL_BUGS.values()} == set(checks.__all__)
    assert len(ALL_BUGS) >= len(buggy.BUGS) + 5  # library/buggy_quantization.py's five count too


@pytest.mark.parametrize("bug", sorted(ALL_BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, ALL_BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match="truncates toward zero"):
        checks.check_quantize_int8_per_tensor(buggy.int8_per_tensor_truncates)
    with pytest.raises(AssertionError, match="all-zero w .3, 5.: the scale must be 1.0"):
        checks.check_quantize_int8_per_tensor(buggy.int8_per_tensor_zero_scale)
    with pytest.raises(AssertionError, match="wrapped around"):
        checks.check_quantize_int8_per_tensor(buggy_library.int8_per_tensor_scale_128)
    with pytest.raises(AssertionError, match=r"scale has shape \(16,\), expected \(16, 1\)"):
        checks.check_quantize_int8_per_channel(buggy.int8_per_channel_flat_scale)
    with pytest.raises(AssertionError, match=r"should give bytes \[0x7f, 0x08\]"):
        checks.check_pack_int4(buggy.pack_int4_no_mask)
    with pytest.raises(AssertionError, match="0xF is -1"):
        checks.check_unpack_int4(buggy_library.unpack_int4_unsigned)
    with pytest.raises(AssertionError, match=r"expected packed uint8 \[6, 128\]"):
        checks.check_quantize_int4_groupwise(buggy.int4_groupwise_unpacked)
    with pytest.raises(AssertionError, match="scale should be max.w. / 7|the error must be <= scale / 2"):
        checks.check_quantize_int4_groupwise(buggy.int4_groupwise_one_scale_per_row)


def test_hidden_runner_reports_the_message():
    """What the learner sees: the check's message through autograder.run.hidden, no traceback."""
    from autograder.run import HiddenTestFailed, hidden

    hidden("quantization.check_pack_int4", _reference("pack_int4"))
    with pytest.raises(HiddenTestFailed, match="hidden test failed: .*unpack_int4 of the byte"):
        hidden("quantization.check_unpack_int4", buggy.unpack_int4_high_first)

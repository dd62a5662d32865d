"""Notebook 00's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_meet_the_model.py) with a message that names the case."""
from __future__ import annotations


import pytest

from autograder.checks import meet_the_model as checks
from decodelab.lessons.kv_size import parameter_count
from decodelab.lessons.measure import decode_tokens_per_second_bound
from oracles import expect_bug_caught, load_fixture


buggy = load_fixture("buggy_meet_the_model")


def test_reference_passes():
    checks.check_count_parameters(parameter_count)
    checks.check_decode_tokens_per_second_bound(decode_tokens_per_second_bound)


def test_model_num_parameters_passes():
    """The oracle itself: counting by building the model agrees with the checks."""
    from decodelab.model.llama import LlamaForCausalLM

    checks.check_count_parameters(lambda config: LlamaForCausalLM(config).num_parameters()
                                  if config.vocab_size * config.hidden_size < 10**6 else parameter_count(config))


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match="SmolLM2.*134,515,008|Llama-3.1-8B.*8,030,261,248"):
        checks.check_count_parameters(buggy.count_always_untied)
    with pytest.raises(AssertionError, match="expected the integer"):
        checks.check_count_parameters(buggy.count_returns_float)
    with pytest.raises(AssertionError, match="seconds per token"):
        checks.check_decode_tokens_per_second_bound(buggy.bound_seconds_per_token)
    with pytest.raises(AssertionError, match="bytes, not bits"):
        checks.check_decode_tokens_per_second_bound(buggy.bound_in_bits)
    with pytest.raises(AssertionError, match="should raise ValueError"):
        checks.check_decode_tokens_per_second_bound(buggy.bound_no_validation)


def test_real_checkpoint_count_matches_the_loaded_model(smollm2):
    model, _ = smollm2
    config, total = checks._smollm2_checkpoint()
    assert total == model.num_parameters() == parameter_count(config) == 134_515_008


def test_predictions_are_graded_within_five_percent():
    checks.check_q_embedding_share_percent(21.0)  # 28,311,552 of 134,515,008
    checks.check_q_llama8b_tokens_per_s(3.35e12 / (8e9 * 2))  # a round 8 billion is close enough
    for check, wrong in ((checks.check_q_embedding_share_percent, 10.5),  # the table counted as half its size
                         (checks.check_q_llama8b_tokens_per_s, 3.35e12 / 8.03e9)):  # one byte per weight, not two
        with pytest.raises(AssertionError, match="you predicted"):
            check(wrong)

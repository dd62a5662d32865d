"""Notebook 00's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_meet_the_model.py) with a message that names the case."""

from __future__ import annotations

import pytest
from oracles import expect_bug_caught, load_fixture

from autograder.checks import meet_the_model as checks
from decodelab.lessons.kv_size import parameter_count
from decodelab.lessons.measure import decode_tokens_per_second_bound

buggy = load_fixture("buggy_meet_the_model")


def test_reference_passes():
    checks.check_count_parameters(parameter_count)
    checks.check_decode_tokens_per_second_bound(decode_tokens_per_second_bound)


def test_model_num_parameters_passes():
    """The oracle itself: counting by building the model agrees with the checks."""
    from decodelab.model.llama import LlamaForCausalLM

    checks.check_count_parameters(
        lambda config: (
            LlamaForCausalLM(config).num_parameters()
            if config.vocab_size * config.hidden_size < 10**6
            else parameter_count(config)
        )
    )


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
    for check, wrong in (
        (checks.check_q_embedding_share_percent, 10.5),  # the table counted as half its size
        (checks.check_q_llama8b_tokens_per_s, 3.35e12 / 8.03e9),
    ):  # one byte per weight, not two
        with pytest.raises(AssertionError, match="you predicted"):
            check(wrong)


def test_bpe_reference_passes_and_matches_the_rust_tokenizer_on_the_notebook_prompt(smollm2):
    """The Python BPE, word by word, gives the library tokenizer's ids; ' gravity' is one token."""
    from decodelab.lessons.bpe import ByteLevelBPE, bpe_encode, bpe_merge_steps

    checks.check_bpe_encode(bpe_encode)
    _, tokenizer = smollm2
    bpe = ByteLevelBPE.from_tokenizer(tokenizer)
    assert bpe.encode("What is gravity?") == tokenizer.encode("What is gravity?")
    steps = bpe_merge_steps(b" gravity", bpe.merges)
    assert steps[0] == [bytes([b]) for b in b" gravity"] and steps[-1] == [b" gravity"]
    assert all(len(after) < len(before) and b"".join(after) == b" gravity" for before, after in zip(steps, steps[1:]))


def test_bpe_messages_name_the_mistake():
    with pytest.raises(AssertionError, match="lowest rank"):
        checks.check_bpe_encode(buggy.bpe_highest_rank_first)
    with pytest.raises(AssertionError, match="keep merging"):
        checks.check_bpe_encode(buggy.bpe_one_merge)
    with pytest.raises(AssertionError, match="not the word"):
        checks.check_bpe_encode(buggy.bpe_overlapping)
    with pytest.raises(AssertionError, match="No merge makes the piece"):
        checks.check_bpe_encode(buggy.bpe_from_characters)
    with pytest.raises(AssertionError, match="expected a list of bytes"):
        checks.check_bpe_encode(lambda word, merges: [p.decode("latin-1") for p in buggy._bpe(word, merges)])


def test_bpe_oracle_agrees_with_the_real_tokenizer_model():
    """The random-table oracle (tokenizers.models.BPE built from a merge table) gives the real
    tokenizer's own pieces when built from the real table."""
    bpe = checks._real_tables()[1][1]  # the tiny model's 767 merges: quick to rebuild
    oracle = checks._oracle_bpe(bpe.merges)
    for word in [w for text in checks.BPE_TEXTS for w in bpe.words(text)]:
        assert oracle(word) == bpe.pieces(word), word

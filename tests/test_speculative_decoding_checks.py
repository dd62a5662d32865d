"""Notebook 09's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_speculative_decoding.py) with a message that names the case."""

from __future__ import annotations

import math

import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import speculative_decoding as checks
from decodelab.decoding import speculative
from decodelab.decoding.lookup import propose_from_prompt
from decodelab.lessons.speculative_decoding import verify_tree

buggy = load_fixture("buggy_speculative_decoding")


def test_reference_passes():
    checks.check_accept_draft_tokens(speculative.accept_draft_tokens)
    checks.check_speculative_step(speculative.speculative_step)
    checks.check_propose_from_prompt(propose_from_prompt)
    checks.check_verify_tree(verify_tree)


def test_written_out_step_passes():
    """The fixtures' step with no switch flipped (the notebook's solution, written out) passes:
    each kept step bug differs from a right answer in its one switch."""
    checks.check_speculative_step(buggy.step_written_out)


def test_references_name_the_library_functions():
    assert checks.REFERENCES == {
        "accept_draft_tokens": "decodelab.decoding.speculative.steps:accept_draft_tokens",
        "speculative_step": "decodelab.decoding.speculative.steps:speculative_step",
        "propose_from_prompt": "decodelab.decoding.lookup:propose_from_prompt",
        "verify_tree": "decodelab.lessons.speculative_decoding:verify_tree",
    }


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug, min_message=60)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match="residual max\\(0, p - q\\) = \\[0, 0, 0.5, 0\\].*expected \\[2\\]"):
        checks.check_accept_draft_tokens(buggy.accept_resample_from_target)
    with pytest.raises(AssertionError, match="bonus token from target_probs\\[3\\]"):
        checks.check_accept_draft_tokens(buggy.accept_no_bonus_token)
    with pytest.raises(AssertionError, match="exactly ONE more token"):
        checks.check_accept_draft_tokens(buggy.accept_bonus_after_rejection)
    with pytest.raises(AssertionError, match="ran 2 forward passes, fed \\[1, 1\\] tokens.*ONE forward"):
        checks.check_speculative_step(buggy.step_verifies_token_by_token)
    with pytest.raises(AssertionError, match="target cache holds 17 positions; expected 14"):
        checks.check_speculative_step(buggy.step_target_cache_not_rolled_back)
    with pytest.raises(AssertionError, match="draft cache holds 16 positions, more than the 14"):
        checks.check_speculative_step(buggy.step_draft_cache_not_rolled_back)
    with pytest.raises(AssertionError, match="top_k=1.*one-hot at the argmax"):
        checks.check_speculative_step(buggy.step_raw_target_probs)
    with pytest.raises(AssertionError, match="noise bound.*the one you drew d_i from"):
        checks.check_speculative_step(buggy.step_raw_draft_probs)
    with pytest.raises(AssertionError, match=r"expected \[8\] \(the 3-gram \[3, 1, 2\] occurred at 0.*got \[9\]"):
        checks.check_propose_from_prompt(buggy.lookup_shortest_ngram_first)
    with pytest.raises(AssertionError, match=r"the latest occurrence \(followed by 6\) wins\), got \[5\]"):
        checks.check_propose_from_prompt(buggy.lookup_earliest_occurrence)


@pytest.mark.parametrize("bug", ["step_raw_target_probs", "step_raw_softmax"])
def test_distribution_part_alone_catches_a_raw_p(bug):
    """With top-k and top-p on, a p from the unfiltered softmax emits tokens the target never
    samples: the distribution part sees the first one (the top_k=1 part sees it earlier)."""
    with checks._one_thread(), pytest.raises(AssertionError, match="never samples.*not the raw softmax"):
        checks._check_sampled_distribution(buggy.BUGS[bug][0])


def test_top_k_one_part_catches_a_draft_that_ignores_the_filters():
    """A draft that samples (and records) its unfiltered softmax keeps the output's law exact (the
    rule corrects any q), so only the steps' lengths show it: at top_k=1 its guesses miss."""
    with checks._one_thread(), pytest.raises(AssertionError, match="top_k=1"):
        checks._check_top_k_one(buggy.step_draft_ignores_filters)
    with checks._one_thread():
        checks._check_sampled_distribution(buggy.step_draft_ignores_filters)  # the law alone cannot tell


@pytest.mark.parametrize("bug", ["step_target_cache_not_rolled_back", "step_keeps_pending"])
def test_loop_part_alone_catches_output_bugs(bug):
    """The library's loop with the step swapped in sees the bugs that change the output on its own."""
    with pytest.raises(AssertionError, match="in the library's loop"):
        checks._check_in_loop(buggy.BUGS[bug][0])


def test_greedy_part_runs_both_branches():
    """The greedy part's steps end in rejections and in full acceptances (bonus tokens, a draft
    cache that lags by one), and end with a k = 0 step."""
    outcomes = []

    def spy(target, draft, target_cache, draft_cache, ids, k, params, generator=None):
        emitted = speculative.speculative_step(target, draft, target_cache, draft_cache, ids, k, params, generator)
        outcomes.append((k, len(emitted) - 1))
        return emitted

    checks._check_greedy_steps(spy)
    assert sum(n < k for k, n in outcomes) >= 8 and sum(n == k for k, n in outcomes if k) >= 3, outcomes
    assert outcomes[-1][0] == 0


def test_raw_draft_bias_is_far_above_the_bound():
    """The exact law of the first token when q is recorded as softmax(logits / T), or as the
    softmax without temperature, but drawn after top-k and top-p: 3 and 2 times the bound at
    N_SAMPLED_STEPS (0.46 and 0.29 against 0.136); and both filters cut there (top-k alone would
    keep 4 tokens, top-p keeps 3)."""
    from decodelab.decoding.sampling import probs
    from decodelab.params import SamplingParams

    target, draft, prompt = checks._pair(checks.SAMPLED_PROMPT_SEED)
    params = SamplingParams(**checks.SAMPLED)
    with torch.inference_mode():
        target_logits, draft_logits = target(torch.tensor([prompt]))[0, -1], draft(torch.tensor([prompt]))[0, -1]
    p, q = probs(target_logits, params).double(), probs(draft_logits, params).double()
    top_k_only = probs(target_logits, SamplingParams(temperature=params.temperature, top_k=params.top_k))
    assert int((p > 0).sum()) == 3 and int((top_k_only > 0).sum()) == 4
    bound = checks.tvd_bound(p, checks.N_SAMPLED_STEPS)
    for temperature, margin in ((params.temperature, 3), (1.0, 2)):
        recorded = (draft_logits.double() / temperature).softmax(-1)
        accepted = q * (p / recorded).clamp(max=1)
        residual = (p - recorded).clamp(min=0)
        law = accepted + (1 - accepted.sum()) * residual / residual.sum()
        bias = float(0.5 * (law - p).abs().sum())
        assert bias > margin * bound, (temperature, bias, bound)


def test_distribution_test_catches_a_bias_its_exact_cases_miss():
    """A rule that is exact on the deterministic cases but accepts with min(1, p/q)^2 (too few
    acceptances; the residual then over-weights tokens where p > q): only the frequency test sees it."""

    def squared_ratio(draft_tokens, draft_probs, target_probs, generator=None):
        k = len(draft_tokens)
        for i in range(k):
            p, q = target_probs[i, draft_tokens[i]], draft_probs[i, draft_tokens[i]]
            ratio = min(1.0, float(p / q))
            if torch.rand(1, generator=generator).item() >= ratio**2:
                residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
                return torch.cat(
                    [draft_tokens[:i], torch.multinomial(residual / residual.sum(), 1, generator=generator)]
                )
        return torch.cat([draft_tokens, torch.multinomial(target_probs[k], 1, generator=generator)])

    with pytest.raises(AssertionError, match="noise bound"):
        checks.check_accept_draft_tokens(squared_ratio)


def test_tvd_bound_holds_for_exact_draws_and_is_tight_enough():
    """The bound is rarely reached by exact draws (200 trials, none above) and is well below the
    bias of the seed's bug (0.13 on row 0) at the check's sample size."""
    p = checks.P[0].double()
    generator = torch.Generator().manual_seed(0)
    bound = checks.tvd_bound(p, checks.N_STEPS)
    worst = 0.0
    for _ in range(200):
        law = (
            torch.bincount(
                torch.multinomial(p, checks.N_STEPS, replacement=True, generator=generator), minlength=6
            ).double()
            / checks.N_STEPS
        )
        worst = max(worst, float(0.5 * (law - p).abs().sum()))
    assert worst < bound < 0.13 / 1.5, (worst, bound)
    assert math.isclose(checks.tvd_bound(torch.tensor([1.0, 0.0]), 100), math.sqrt(math.log(1e6) / 200))


def test_check_restores_the_thread_count():
    before = torch.get_num_threads()
    with checks._one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_written_out_tree_step_passes():
    """The fixtures' tree step with no switch flipped passes: each kept tree bug is one switch."""
    checks.check_verify_tree(buggy.tree_written_out)


def test_tree_oracle_has_no_near_ties_and_runs_deep_paths():
    """The oracle's argmax along every path the check visits wins by more than 1e-3 (a tree pass
    and a plain pass agree to ~1e-5, so no case hangs on rounding), and the cases accept paths of
    every length from 0 to 3, in branches other than the first."""
    lengths = []

    def spy(target, cache, pending, tree_tokens, parents):
        out = verify_tree(target, cache, pending, tree_tokens, parents)
        lengths.append(len(out) - 1)
        return out

    checks.check_verify_tree(spy)
    with torch.inference_mode():
        _, _, choice_after, memo = checks._tree_prompt()
        for case in checks._named_trees(choice_after):
            checks._expected_tree_output(choice_after, case[0], case[1])
        rng = torch.Generator().manual_seed(checks.TREE_PROMPT_SEED)
        for _ in range(checks.TREE_RANDOM_CASES):
            tree_tokens, parents = checks._guided_tree(
                rng, choice_after, int(torch.randint(3, 10, (1,), generator=rng))
            )
            checks._expected_tree_output(choice_after, tree_tokens, parents)
    assert min(margin for _, margin in memo.values()) > 1e-3
    assert set(lengths) >= {0, 1, 2, 3}, lengths


def test_tree_messages_name_the_case():
    with pytest.raises(AssertionError, match="the accepted nodes' rows must end up right after the pending token's"):
        checks.check_verify_tree(buggy.tree_rows_not_moved)
    with pytest.raises(AssertionError, match="the target's choice after its last node"):
        checks.check_verify_tree(buggy.tree_last_token_from_root)

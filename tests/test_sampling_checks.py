"""Notebook 02's hidden checks (autograder/checks/sampling.py) pass on the references
`decodelab.decoding.sampling` (and `decodelab.lessons.beam_search`) and catch the kept buggy versions
(tests/fixtures/buggy_sampling.py), with and without transformers, with messages that give the input, the expected and the got."""

from __future__ import annotations

import sys

import pytest
import torch
from oracles import load_fixture

from autograder.checks import sampling as checks
from decodelab.decoding import sampling
from decodelab.decoding.sampling import process_logits
from decodelab.lessons.beam_search import beam_search

buggy = load_fixture("buggy_sampling")

REFERENCE = {
    "check_top_k_filter": sampling.top_k_filter,
    "check_top_p_filter": sampling.top_p_filter,
    "check_repetition_penalty": sampling.apply_repetition_penalty,
    "check_process_logits": process_logits,
    "check_sample": sampling.sample,
    "check_beam_search": beam_search,
}


@pytest.fixture(params=["transformers", "analytic-only"])
def hf_mode(request, monkeypatch):
    """Run each check with the Hugging Face comparison, and as if transformers were missing."""
    if request.param == "transformers":
        if checks._load_hf() is None:
            pytest.skip("transformers is not importable")
    else:
        monkeypatch.setattr(checks, "_load_hf", lambda: None)
    return request.param


@pytest.mark.parametrize("check_name", sorted(REFERENCE))
def test_reference_passes(check_name, hf_mode):
    getattr(checks, check_name)(REFERENCE[check_name])


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug, hf_mode):
    fn, check_name, what = buggy.BUGS[bug]
    with pytest.raises(AssertionError) as info:
        getattr(checks, check_name)(fn)
    message = str(info.value)
    assert len(message) > 40, f"{bug} ({what}): message too terse to help: {message!r}"


def test_messages_give_input_expected_and_got():
    with pytest.raises(AssertionError) as info:
        checks.check_top_p_filter(buggy.top_p_one_too_few)
    message = str(info.value)
    assert "kept 2 tokens for p=0.9" in message and "has 3" in message
    assert "[2, 1, 0.5, -1]" in message  # the input
    with pytest.raises(AssertionError) as info:
        checks.check_top_k_filter(buggy.top_k_drops_ties)
    message = str(info.value)
    assert "expected" in message and "got" in message and "tied" in message
    with pytest.raises(AssertionError, match="should raise ValueError"):
        checks.check_top_k_filter(buggy.top_k_no_validation)
    frequency_message = r"frequency 0\.\d+, but its exact probability is 0\.6225.*standard errors"
    with pytest.raises(AssertionError, match=frequency_message):
        checks.check_sample(buggy.sample_ignores_temperature)
    with pytest.raises(AssertionError, match="drew token 2 .* times, but .* its probability is 0"):
        checks.check_sample(buggy.sample_top_p_before_top_k)
    with pytest.raises(AssertionError, match="drew token 2 .* times, but .* its probability is 0"):
        checks.check_sample(buggy.sample_forgets_top_p)
    with pytest.raises(AssertionError, match="modified its input logits in place"):
        checks.check_repetition_penalty(buggy.repetition_in_place)
    with pytest.raises(AssertionError, match="gave different ids"):
        checks.check_sample(buggy.sample_ignores_generator)


def test_beam_search_messages_and_no_transformers(monkeypatch):
    """The grader has no transformers: check_beam_search compares with the library's beam search only.
    A cache that does not follow its beams is named by the uncached rescoring of the learner's ids."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it now fails
    checks.check_beam_search(beam_search)
    with pytest.raises(AssertionError) as info:
        checks.check_beam_search(buggy.beam_cache_not_reordered)
    message = str(info.value)
    assert "expected ids" in message and "got      ids" in message and "'def add(a, b):\\n'" in message
    assert "without a cache" in message and "cache.reorder" in message
    with pytest.raises(AssertionError, match=r"num_beams=3.*' _'"):
        checks.check_beam_search(buggy.beam_top_b_per_beam)


def test_crash_in_function_under_test_becomes_assertion():
    def crashes(logits, k):
        raise IndexError("boom")

    with pytest.raises(AssertionError, match="raised IndexError: boom"):
        checks.check_top_k_filter(crashes)


def test_check_sample_restores_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    checks.check_sample(sampling.sample)
    assert torch.equal(torch.rand(3), expected)


def test_tolerance_is_derived_from_n_draws():
    # Bonferroni: two-sided tail ALPHA / K per category; more categories -> wider bound.
    z8 = checks._z_bound(8)
    assert 5.0 < z8 < 6.0
    assert checks._z_bound(16) > z8
    from statistics import NormalDist

    assert 2 * 8 * (1 - NormalDist().cdf(z8)) == pytest.approx(checks.ALPHA, rel=1e-6)


# --------------------------------------------------------------------------- issue 34: a second blind learner


def _notebook():
    from notebooks import read, solution_path

    return read(solution_path("02_sampling"))


def test_only_the_first_b_candidates_may_finish():
    """Dropping the rule "only candidates ranked among the first B may finish", which the text states, fails
    the hidden check and the visible tests, and the visible message names the rule."""
    from notebooks import run_visible

    with pytest.raises(AssertionError, match=r"(?s)'print\(', num_beams=2.*only the first num_beams may finish"):
        checks.check_beam_search(buggy.beam_any_rank_finishes)
    nb = _notebook()
    assert run_visible(nb, "test_beam_search", "beam_search", beam_search) is None
    failure = run_visible(nb, "test_beam_search", "beam_search", buggy.beam_any_rank_finishes)
    assert isinstance(failure, AssertionError) and "Only a candidate ranked among the first num_beams" in str(
        failure
    ), failure


def test_reproducibility_failures_name_the_first_difference():
    """Two runs of a sampler that ignores its generator: the visible test and the hidden check say where
    the draws first differ, not two identical descriptions of [500] tensors."""
    from notebooks import run_visible

    with pytest.raises(AssertionError, match=r"differ, the first at row \d+: \d, then \d\)"):
        checks.check_sample(buggy.sample_ignores_generator)

    def same_seed_differs(logits, params, generator=None):  # right draws, except that a second call moves on
        same_seed_differs.calls += 1
        ids = sampling.sample(logits, params, generator)
        if logits.shape[0] == 500 and same_seed_differs.calls % 2 == 0:
            ids[123] = (ids[123] + 1) % logits.shape[-1]
        return ids

    same_seed_differs.calls = 0
    failure = run_visible(_notebook(), "test_sample", "sample", same_seed_differs)
    assert isinstance(failure, AssertionError), failure
    assert "seeded 42" in str(failure) and "first differ at index 123" in str(failure), failure


def test_the_penalty_text_credits_the_sign_aware_rule_rightly():
    """CTRL (Keskar et al. 2019) divides every seen token's logit by theta whatever its sign; dividing a positive
    logit and multiplying a negative one is Hugging Face's RepetitionPenaltyLogitsProcessor and vLLM's. The
    notebook says so where it teaches the rule, in the docstring and in its further reading."""
    nb = _notebook()
    section = next(
        c.source for c in nb.cells if c.cell_type == "markdown" and "## 4. The repetition penalty" in c.source
    )
    assert "CTRL paper's repetition penalty" not in section
    assert "whatever its sign" in section and "Hugging Face" in section and "vLLM" in section
    exercise = next(
        c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ex_apply_repetition_penalty"
    )
    assert "CTRL's rule" not in exercise
    reading = next(c.source for c in nb.cells if c.cell_type == "markdown" and "## Further reading" in c.source)
    assert "and why it divides the logits" not in reading
    # the kept bug that divides negative logits too is CTRL's own formula, and the check names the sign-aware rule
    with pytest.raises(AssertionError, match="sign"):
        checks.check_repetition_penalty(buggy.repetition_always_divides)

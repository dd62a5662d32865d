"""Sampling: the autograder's checks pass on the reference `decodelab.decoding.sampling` and catch kept
buggy versions (with and without transformers), plus SamplingParams validation and `probs`."""
from __future__ import annotations

import re

import pytest
import torch

from autograder.checks import sampling as checks
from decodelab.decoding import sampling
from decodelab.params import SamplingParams
from oracles import load_fixture


buggy = load_fixture("buggy_sampling")

REFERENCE = {
    "check_apply_temperature": sampling.apply_temperature,
    "check_top_k_filter": sampling.top_k_filter,
    "check_top_p_filter": sampling.top_p_filter,
    "check_repetition_penalty": sampling.apply_repetition_penalty,
    "check_sample": sampling.sample,
    "check_probs": sampling.probs,
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
        checks.check_apply_temperature(buggy.temperature_no_validation)
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


def test_top_p_one_keeps_a_tiny_tail():
    # float32: the mass before the second token rounds to exactly 1.0; p = 1 must still keep it.
    x = torch.tensor([0.0, -20.0])
    assert torch.equal(sampling.top_p_filter(x, 1.0), x)


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": -0.5}, ["temperature", ">= 0", "-0.5"]),
        ({"top_k": -2}, ["top_k", ">= 1", "-2"]),
        ({"top_k": 2.5}, ["top_k", "2.5"]),
        ({"top_p": 0.0}, ["top_p", "(0, 1]", "0.0"]),
        ({"top_p": 1.5}, ["top_p", "(0, 1]", "1.5"]),
        ({"repetition_penalty": 0.0}, ["repetition_penalty", "> 0", "0.0"]),
        ({"repetition_penalty": -1.0}, ["repetition_penalty", "> 0", "-1.0"]),
        ({"max_tokens": 0}, ["max_tokens", ">= 1", "0"]),
        ({"n": 0}, ["n must", ">= 1", "0"]),
        ({"seed": "7"}, ["seed", "'7'"]),
        ({"stop": ["ok", ""]}, ["stop", "non-empty"]),
    ],
)
def test_sampling_params_rejects(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{kwargs}: {word!r} missing from {message!r}"


def test_sampling_params_defaults_and_switches():
    p = SamplingParams()
    assert (p.greedy, p.uses_top_k, p.uses_top_p) == (False, False, False)
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(top_k=-1).uses_top_k and not SamplingParams(top_k=0).uses_top_k
    assert SamplingParams(top_k=1).uses_top_k and SamplingParams(top_p=0.99).uses_top_p
    assert SamplingParams(stop="END").stop == ["END"]


# --------------------------------------------------------------------------- probs


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8),
     SamplingParams(temperature=0.9, top_k=20, top_p=0.6)],
    ids=["plain", "top_k", "top_p", "both"],
)
def test_probs_is_softmax_of_filtered_logits(params):
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(5)) * 3
    dist = sampling.probs(logits, params)
    assert dist.shape == logits.shape and dist.dtype == torch.float32
    torch.testing.assert_close(dist.sum(dim=-1), torch.ones(2, 3))
    filtered = sampling.filter_logits(logits, params)
    torch.testing.assert_close(dist, filtered.softmax(dim=-1))
    assert torch.equal(dist == 0, filtered == float("-inf"))


def test_probs_greedy_is_one_hot_lowest_tie():
    logits = torch.tensor([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]])
    dist = sampling.probs(logits, SamplingParams(temperature=0))
    assert torch.equal(dist, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_value_errors_name_the_bad_value():
    x = torch.zeros(3)
    for call, pattern in [
        (lambda: sampling.apply_temperature(x, -2.0), "-2.0"),
        (lambda: sampling.top_k_filter(x, 0), re.escape(">= 1") + ".*0"),
        (lambda: sampling.top_p_filter(x, 1.5), re.escape("0 < p <= 1") + ".*1.5"),
        (lambda: sampling.apply_repetition_penalty(x, torch.tensor([0]), 0.0), re.escape("> 0") + ".*0.0"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            call()

"""Sampling in the library: top-p's edge cases, SamplingParams validation and `probs`."""
from __future__ import annotations

import re

import pytest
import torch

from decodelab.decoding import sampling
from decodelab.params import SamplingParams


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

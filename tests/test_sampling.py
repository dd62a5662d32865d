"""Sampling in the library: top-p's edge cases, SamplingParams validation, `apply_temperature` and `probs`.

`apply_temperature` and `probs` are no notebook's exercise, so no hidden check grades them: their
checks live here, built on notebook 02's graded oracles and message helpers
(autograder/checks/sampling.py), and catch the kept bugs of fixtures/library/buggy_sampling.py."""

from __future__ import annotations

import re

import pytest
import torch
from oracles import load_fixture

from autograder.checks import sampling as graded
from decodelab.decoding import sampling
from decodelab.params import SamplingParams

library_bugs = load_fixture("library/buggy_sampling")


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
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.6),
    ],
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


# --------------------------------------------------------------------------- apply_temperature and probs


def check_apply_temperature(fn) -> None:
    """fn(logits [..., V], temperature) -> logits / temperature; ValueError for temperature <= 0."""
    hf = graded._load_hf()
    cases = [
        ([2.0, -1.0, 0.0, 0.5], 0.5, "temperature < 1 sharpens: logits / 0.5 = 2 x logits"),
        ([2.0, -1.0, 0.0, 0.5], 2.0, "temperature > 1 flattens: logits / 2"),
        ([2.0, -1.0, 0.0, 0.5], 1.0, "temperature 1 changes nothing"),
        ([1e4, -1e4, graded.NEG_INF, 3.0], 0.5, "extreme values; -inf stays -inf"),
        ([[1.0, -2.0, 3.0], [0.0, 4.0, graded.NEG_INF]], 0.25, "leading dim [2]"),
    ]
    for values, t, note in cases:
        x = torch.tensor(values)
        before = x.clone()
        desc = f"apply_temperature(logits, temperature={t})"
        got = graded.call(f"{desc} on logits {graded.format_values(x)}", fn, x, t)
        graded._check_unchanged(desc, before, x)
        graded._compare(desc, x, graded._ref_temperature(x, t), got, source="logits / temperature", note=note)
    for i, (shape, t) in enumerate([((7,), 0.7), ((3, 11), 1.8), ((2, 3, 50), 0.3), ((2, 3, 50), 1.0)]):
        x = graded._random_logits(shape, seed=100 + i)
        desc = f"apply_temperature(logits, temperature={t}) on random logits of shape {list(shape)}"
        got = graded.call(desc, fn, x.clone(), t)
        if hf is not None:
            expected, source = graded._hf_apply(hf.temperature(float(t)), x), "Hugging Face TemperatureLogitsWarper"
        else:
            expected, source = graded._ref_temperature(x, t), "logits / temperature"
        graded._compare(desc, x, expected, got, source=source)
    x = torch.tensor([1.0, 2.0, 3.0])
    for t in (0.0, -1.0):
        graded.expect_raises(
            f"apply_temperature(logits, temperature={t})",
            ValueError,
            "temperature must be > 0; 0 means greedy decoding, which never divides",
            fn,
            x,
            t,
        )


def check_probs(fn) -> None:
    """fn(logits [..., V], params) -> the distribution sample draws from (one-hot when greedy)."""
    cases = [(values, t, k, p) for values, t, k, p in graded._FREQUENCY_CASES]
    cases += [
        ([2.0, 1.0, 0.5, -1.0], 1.0, 0, 0.9),
        ([3.0, 1.0, 2.0, 2.0, 0.5], 0.5, 2, 1.0),
        ([[0.5, 3.0, 3.0, -1.0], [4.0, 4.0, 1.0, graded.NEG_INF]], 0.0, 0, 1.0),
        (graded._random_logits((2, 3, 12), seed=600).tolist(), 0.9, 5, 0.8),
    ]
    for values, t, k, p in cases:
        x = torch.tensor(values)
        desc = f"probs(logits, {graded._params_str(t, k, p)})"
        got = graded.call(f"{desc} on logits {graded.format_values(x)}", fn, x.clone(), graded._params(t, k, p))
        graded._check_tensor(desc, got, x)
        expected = graded._ref_sampling_probs(x, t, k, p)
        g = got.detach().cpu().double()
        bad = ~torch.isclose(g, expected, rtol=1e-4, atol=1e-6) | ((expected == 0) & (g != 0))
        if bad.any():
            r = int(bad.reshape(-1, x.shape[-1]).any(dim=-1).nonzero()[0])
            rows = lambda v: v.reshape(-1, x.shape[-1])[r]  # noqa: E731
            raise AssertionError(
                f"{desc}: wrong distribution{graded._row_name(r, x.shape[:-1])}"
                + (
                    " (temperature 0: a one-hot on the argmax, lowest id among ties)"
                    if t == 0
                    else " (temperature, then top-k, then top-p, then softmax; filtered tokens get exactly 0)"
                )
                + f"\n  input:    {graded.format_values(rows(x))}"
                + f"\n  expected: {graded.format_values([round(v, 6) for v in rows(expected).tolist()])}"
                + f"\n  got:      {graded.format_values([round(v, 6) for v in rows(g).tolist()])}"
            )


LIBRARY_CHECKS = {
    "check_apply_temperature": (check_apply_temperature, sampling.apply_temperature),
    "check_probs": (check_probs, sampling.probs),
}


@pytest.mark.parametrize("check_name", sorted(LIBRARY_CHECKS))
def test_library_reference_passes(check_name):
    check, reference = LIBRARY_CHECKS[check_name]
    check(reference)


@pytest.mark.parametrize("bug", sorted(library_bugs.BUGS))
def test_library_bug_is_caught(bug):
    fn, check_name, what = library_bugs.BUGS[bug]
    with pytest.raises(AssertionError) as info:
        LIBRARY_CHECKS[check_name][0](fn)
    assert len(str(info.value)) > 40, f"{bug} ({what}): message too terse to help: {info.value}"


def test_library_check_messages_name_the_case():
    with pytest.raises(AssertionError, match=r"apply_temperature\(logits, temperature=0.0\) should raise ValueError"):
        check_apply_temperature(library_bugs.temperature_no_validation)
    with pytest.raises(AssertionError, match=r"probs\(logits, .*\): wrong distribution"):
        check_probs(library_bugs.probs_unfiltered)

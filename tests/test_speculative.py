"""Speculative decoding: the acceptance rule keeps the target's distribution (and kept buggy
rules do not), greedy output equals target-only greedy (and kept buggy loops do not), the
verify pass equals one-token-at-a-time decoding, the theory helpers, the lookup drafter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import load_fixture

from decodelab.decoding import speculative
from decodelab.decoding.generate import stream_token_ids
from decodelab.decoding.lookup import propose_from_prompt
from decodelab.decoding.speculative import (
    SpeculativeStats,
    SpeculativeSteps,
    accept_draft_tokens,
    accept_draft_tokens_batched,
    acceptance_rate,
    expected_speedup,
    expected_tokens_per_call,
    greedy_accept,
    speculative_generate,
    stream_speculative,
    truncated_draft,
    tvd,
)
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import LlamaForCausalLM
from decodelab.model.toy import random_llama
from decodelab.params import SamplingParams

buggy = load_fixture("library/buggy_speculative")

# Rows i = 0..3 of the target's distributions p_i and rows 0..2 of the draft's q_i, V = 6. Each
# position's rows are fixed (they do not depend on the tokens before), so the j-th emitted
# token, whenever a step emits one, must be distributed exactly as P[j]. Position 0 has a low
# acceptance rate (0.35: rejections and the residual matter), later ones a high one (0.9, so
# that enough steps reach the bonus position), and neighbouring rows differ (TVD >= 0.4).
P = torch.tensor(
    [
        [0.50, 0.30, 0.10, 0.05, 0.03, 0.02],
        [0.10, 0.40, 0.20, 0.10, 0.10, 0.10],
        [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
        [0.30, 0.05, 0.05, 0.05, 0.05, 0.50],
    ]
)
Q = torch.tensor(
    [[0.05, 0.10, 0.15, 0.20, 0.25, 0.25], [0.20, 0.30, 0.20, 0.10, 0.10, 0.10], [0.05, 0.15, 0.40, 0.20, 0.10, 0.10]]
)
N_STEPS = 40_000
FAILURE_PROB = 1e-6


def tvd_noise_bound(num_categories: int, n: int, failure_prob: float = FAILURE_PROB) -> float:
    """A TVD that n draws from the true law exceed with probability below failure_prob.

    Bretagnolle-Huber-Carol: P(||p_hat - p||_1 >= lam) <= 2^V exp(-n lam^2 / 2). TVD is half the
    L1 distance, so P(TVD >= eps) <= 2^V exp(-2 n eps^2); solving for eps at failure_prob gives
    eps = sqrt((V ln 2 + ln(1 / failure_prob)) / (2 n)): 0.015 for V = 6, n = 40,000. (The
    typical TVD, sum_x sqrt(p(1-p) / (2 pi n)), is about 0.004 there.)
    """
    return math.sqrt((num_categories * math.log(2) + math.log(1 / failure_prob)) / (2 * n))


def emitted_position_laws(accept_batched, k: int, n: int = N_STEPS, seed: int = 0):
    """Run n independent steps with drafts d_i ~ Q[i]; for each position j = 0..k return
    (empirical law of the j-th emitted token [V], number of steps that emitted one)."""
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q[:k], n, replacement=True, generator=generator).T  # [n, k]
    num_accepted, next_token = accept_batched(drafts, Q[:k].expand(n, k, 6), P[: k + 1].expand(n, k + 1, 6), generator)
    laws = []
    for j in range(k + 1):
        reached = num_accepted >= j
        token = torch.where(num_accepted > j, drafts[:, min(j, k - 1)], next_token)[reached]
        laws.append((torch.bincount(token, minlength=6).double() / len(token), len(token)))
    return laws


def check_preserves_target(accept_batched, k: int) -> None:
    for j, (law, count) in enumerate(emitted_position_laws(accept_batched, k)):
        distance, bound = float(tvd(law, P[j].double())), tvd_noise_bound(6, count)
        assert distance <= bound, (
            f"k={k}: emitted token {j} is off the target's distribution: TVD "
            f"{distance:.4f} over {count} draws, noise bound {bound:.4f}"
        )


def first_token_law(accept_prob: torch.Tensor, residual: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact law of the first emitted token: draft x accepted with accept_prob(x), else residual."""
    return q * accept_prob + (1 - (q * accept_prob).sum()) * residual


# ------------------------------------------------------------------- the acceptance rule
@pytest.mark.parametrize("k", [1, 2, 3])
def test_accept_preserves_target_distribution(k):
    check_preserves_target(accept_draft_tokens_batched, k)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("bug", sorted(buggy.ACCEPT_BUGS))
def test_accept_bug_is_caught(bug, k):
    fn, what = buggy.ACCEPT_BUGS[bug]
    with pytest.raises(AssertionError, match="off the target's distribution"):
        check_preserves_target(fn, k)


def test_unclamped_residual_fails_loudly():
    with pytest.raises(RuntimeError, match="probability"):
        check_preserves_target(buggy.residual_unclamped, 1)


def test_bug_biases_are_far_above_the_noise_bound():
    """The exact law each buggy rule gives, against P: at least 3x the bound at N_STEPS draws."""
    p, q = P[0], Q[0]
    ratio = (p / q).clamp(max=1)
    residual = (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
    biases = {
        "resample_from_target": tvd(first_token_law(ratio, p, q), p),
        "residual_abs": tvd(first_token_law(ratio, (p - q).abs() / (p - q).abs().sum(), q), p),
        "residual_not_normalized": tvd(
            first_token_law(ratio, (p - q).clamp(min=0) + (1 - (p - q).clamp(min=0).sum()) * torch.eye(6)[5], q), p
        ),  # the rest falls on token 5
        "inverted_ratio": tvd(first_token_law((q / p).clamp(max=1), residual, q), p),
        "bonus_from_previous_row": min(tvd(P[j], P[j - 1]) for j in (1, 2, 3)),
    }
    assert set(biases) == set(buggy.ACCEPT_BUGS)
    assert float(tvd(first_token_law(ratio, residual, q), p)) < 1e-6  # the right rule is exact
    bound = tvd_noise_bound(6, N_STEPS)
    for name, bias in biases.items():
        print(f"{name}: exact TVD to p {float(bias):.3f}, bound {bound:.4f}")
        assert float(bias) > 3 * bound, f"{name}: bias {float(bias):.3f} vs bound {bound:.3f}"
    # the seed article's bug: min(p, q) + (1 - alpha) p, 0.13 from p
    assert abs(float(biases["resample_from_target"]) - 0.13) < 1e-6


def test_measured_acceptance_matches_sum_of_minimum():
    """A draft is accepted with probability sum_x min(p, q) = 1 - TVD. With n = 10^6 steps,
    Hoeffding: |mean - alpha| <= sqrt(ln(2 / 1e-6) / (2n)) = 0.0027 except with prob 1e-6."""
    n = 1_000_000
    bound = math.sqrt(math.log(2 / FAILURE_PROB) / (2 * n))
    generator = torch.Generator().manual_seed(1)
    for p, q in [(P[0], Q[0]), (P[1], Q[1]), (P[3], Q[2])]:
        alpha = float(acceptance_rate(p, q))
        assert abs(alpha - (1 - float(tvd(p, q)))) < 1e-6
        drafts = torch.multinomial(q, n, replacement=True, generator=generator)[:, None]  # [n, 1]
        num_accepted, _ = accept_draft_tokens_batched(
            drafts, q.expand(n, 1, 6), torch.stack([p, p]).expand(n, 2, 6), generator
        )
        measured = num_accepted.double().mean().item()
        assert abs(measured - alpha) <= bound, f"alpha {alpha:.4f}, measured {measured:.4f}, bound {bound:.4f}"


def test_expected_tokens_per_call_matches_simulation():
    """Every position accepts independently with alpha = 0.9 here (rows 1 and 2, both 0.9)."""
    n, k = 200_000, 2
    generator = torch.Generator().manual_seed(2)
    drafts = torch.multinomial(Q[1:3], n, replacement=True, generator=generator).T
    num_accepted, _ = accept_draft_tokens_batched(drafts, Q[1:3].expand(n, k, 6), P[1:4].expand(n, k + 1, 6), generator)
    expected = expected_tokens_per_call(0.9, k)  # 1 + 0.9 + 0.81
    assert abs((num_accepted + 1).double().mean().item() - expected) < 0.01


def test_single_step_distribution_and_contract():
    """The one-step function on the same rows (fewer draws: it runs one step per call)."""
    n, k = 2000, 2
    generator = torch.Generator().manual_seed(3)
    first = torch.zeros(6)
    for _ in range(n):
        drafts = torch.multinomial(Q[:k], 1, generator=generator)[:, 0]
        out = accept_draft_tokens(drafts, Q[:k], P[: k + 1], generator)
        assert out.dtype == torch.int64 and out.dim() == 1 and 1 <= len(out) <= k + 1
        assert torch.equal(out[:-1], drafts[: len(out) - 1])
        first[out[0]] += 1
    assert float(tvd(first / n, P[0])) <= tvd_noise_bound(6, n)


@pytest.mark.parametrize("fn", [accept_draft_tokens, buggy.no_bonus_token], ids=["reference", "no_bonus_token"])
def test_all_accepted_gives_bonus_token(fn):
    """q == p: every draft passes; the bonus comes from target_probs[k] (one-hot at 5 here)."""
    k = 3
    target = torch.cat([Q, torch.eye(6)[5:]])  # [k+1, V]
    generator = torch.Generator().manual_seed(4)
    drafts = torch.multinomial(Q, 1, generator=generator)[:, 0]
    out = fn(drafts, Q, target, generator)
    if fn is buggy.no_bonus_token:
        assert len(out) == k  # the bug this test exists for
    else:
        assert out.tolist() == drafts.tolist() + [5]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_rejected_draft_is_never_emitted(vocab, k, seed):
    """After a rejection the next token comes from max(0, p - q), which is 0 at the rejected
    draft (it was rejected only because q > p there)."""
    generator = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=generator).pow(3)
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(k, vocab, generator=generator).pow(3)
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=generator)[:, 0] if k else torch.zeros(0, dtype=torch.long)
    out = accept_draft_tokens(drafts, q, p, generator)
    n = len(out) - 1
    assert torch.equal(out[:n], drafts[:n])
    last_p = p[n]
    if n < k:
        assert out[-1] != drafts[n] and p[n, out[-1]] > q[n, out[-1]]
    else:
        assert last_p[out[-1]] > 0


def test_greedy_accept_equals_general_rule_on_one_hots():
    generator = torch.Generator().manual_seed(5)
    for _ in range(50):
        logits = torch.randn(4, 7, generator=generator)  # target, k = 3
        drafts = torch.where(
            torch.rand(3, generator=generator) < 0.7,
            logits[:3].argmax(-1),
            torch.randint(0, 7, (3,), generator=generator),
        )
        one_hot = torch.nn.functional.one_hot
        general = accept_draft_tokens(
            drafts, one_hot(drafts, 7).float(), one_hot(logits.argmax(-1), 7).float(), generator
        )
        assert torch.equal(greedy_accept(drafts, logits), general)


@pytest.mark.parametrize(
    "shapes",
    [
        ((3,), (3, 6), (3, 6)),
        ((3,), (2, 6), (4, 6)),
        ((3,), (3, 5), (4, 6)),
        ((1, 3), (3, 6), (4, 6)),
        ((3,), (3, 6), (4, 6, 1)),
    ],
)
def test_accept_rejects_mismatched_shapes(shapes):
    tokens, q, p = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match="expected"):
        accept_draft_tokens(tokens.long(), q, p)


def test_accept_rejects_float_token_ids():
    with pytest.raises(ValueError, match="int64"):
        accept_draft_tokens(torch.zeros(2), Q[:2], P[:3])


def test_stats_alpha_counts_judged_drafts_only():
    """k = 4, two steps: 4 accepted + bonus, then 1 accepted + 1 rejected (2 never judged)."""
    stats = SpeculativeStats(proposed=8, accepted=5, rejected=1, target_calls=2, draft_calls=8, generated=7)
    assert stats.acceptance_rate == 5 / 6 and stats.accepted_per_proposed == 5 / 8
    assert stats.tokens_per_target_call == 3.5
    assert math.isnan(SpeculativeStats().acceptance_rate)


def test_theory_helpers():
    assert expected_tokens_per_call(0.0, 4) == 1
    assert expected_tokens_per_call(1.0, 4) == 5
    assert expected_tokens_per_call(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens_per_call(0.8, 4))
    assert expected_speedup(0.8, 3, 0.2) == pytest.approx((1 - 0.8**4) / (0.2 * 1.6))
    assert float(tvd(P[0], P[0])) == 0 and float(acceptance_rate(P[0], P[0])) == pytest.approx(1)
    for bad in [
        lambda: expected_tokens_per_call(1.5, 2),
        lambda: expected_tokens_per_call(0.5, -1),
        lambda: expected_speedup(0.5, 2, -0.1),
    ]:
        with pytest.raises(ValueError):
            bad()


# ---------------------------------------------------------------------------------- the loop
def random_model(seed: int, layers: int = 4, hidden: int = 64, vocab: int = 96) -> LlamaForCausalLM:
    """Every matrix, embeddings included, ~ N(0, 4 / fan_in), plain norms: larger than the default
    init, so that greedy output does not settle into repeating one token and drafts get both
    accepted and rejected."""
    return random_llama(
        seed,
        weight_scale=2.0,
        norm_jitter=0.0,
        embedding_std=None,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


@pytest.fixture(scope="module")
def target():
    return random_model(0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0)).tolist()


def greedy_reference(target, prompt_ids, max_tokens=32) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return list(stream_token_ids(target, prompt_ids, params))


@pytest.fixture(scope="module")
def reference(target, prompt):
    return greedy_reference(target, prompt)


def assert_same_greedy(target, drafter, prompt_ids, k, reference, steps=None):
    """Speculative greedy equals target-only greedy (`reference`) token for token, the loop running
    `steps` (None: the library's); returns the stats."""
    params = SamplingParams(temperature=0, max_tokens=len(reference), ignore_eos=True)
    stats = SpeculativeStats()
    ours = stream_speculative(target, drafter, prompt_ids, params, k, stats=stats, steps=steps)
    for i, (mine, theirs) in enumerate(zip(ours, reference)):
        assert mine == theirs, f"k={k}: token {i} differs: speculative {mine}, target-only {theirs}"
    assert stats.generated == len(reference), f"k={k}: {stats.generated} tokens, expected {len(reference)}"
    return stats


@pytest.mark.parametrize("drafter_name", ["truncated", "separate", "lookup"])
def test_greedy_equals_target_only(target, prompt, reference, drafter_name):
    drafter = {
        "truncated": lambda: truncated_draft(target, 2),
        "separate": lambda: random_model(1, 1, 32),
        "lookup": lambda: propose_from_prompt,
    }[drafter_name]()
    totals = SpeculativeStats()
    for k in (1, 2, 3, 4):
        stats = assert_same_greedy(target, drafter, prompt, k, reference)
        assert stats.accepted + stats.rejected <= stats.proposed <= k * stats.target_calls
        assert stats.rejected <= stats.target_calls
        assert stats.generated == stats.accepted + stats.target_calls  # one extra token per call
        totals.accepted += stats.accepted
        totals.proposed += stats.proposed
    if drafter_name == "truncated":  # both branches of the rule ran, rollback included
        assert 0 < totals.accepted < totals.proposed


@pytest.mark.parametrize("bug", sorted(buggy.LOOP_BUGS))
def test_loop_bug_breaks_greedy_identity(target, prompt, reference, bug):
    """Seen here: the kept target cache diverges at token 1 (k=1, 2, 4) or 2 (k=3); the unmasked
    verify at token 1 (k=1, 2) or 0 (k=3, 4). The bug is passed as one of the loop's steps, and the
    library's whole step for a draft model runs it."""
    step, fn, what = buggy.LOOP_BUGS[bug]
    steps = SpeculativeSteps(**{step: fn})
    caught = []
    for k in (1, 2, 3, 4):
        try:
            assert_same_greedy(target, truncated_draft(target, 2), prompt, k, reference, steps)
        except AssertionError:
            caught.append(k)
    assert caught == [1, 2, 3, 4], f"{bug} ({what}) was not caught at every k: only at {caught}"


def test_loop_runs_the_speculative_step_it_is_given(target, prompt, reference):
    """A draft model's steps go through `SpeculativeSteps.speculative_step` when one is given
    (notebook 09 passes the learner's); a function drafter's do not."""
    calls = []

    def spy(*args):
        calls.append(args[5])  # k
        return speculative.speculative_step(*args)

    steps = SpeculativeSteps(speculative_step=spy)
    assert_same_greedy(target, truncated_draft(target, 2), prompt, 3, reference, steps)
    assert calls and set(calls) <= {0, 1, 2, 3} and calls[0] == 3
    calls.clear()
    assert_same_greedy(target, propose_from_prompt, prompt, 3, reference, steps)
    assert calls == []


@pytest.mark.parametrize("drafter_name", ["truncated", "truncated, the library's step named", "lookup"])
def test_loop_runs_the_acceptance_rule_it_is_given(target, prompt, drafter_name):
    """Sampling, the rule in `SpeculativeSteps.accept_draft_tokens` judges every chain's drafts: a draft
    model's (through the library's whole step, by default or named, as notebook 09's fallback names it)
    and a function's."""
    judged = []

    def spy(draft_tokens, draft_probs, target_probs, generator=None):
        judged.append(len(draft_tokens))
        return accept_draft_tokens(draft_tokens, draft_probs, target_probs, generator)

    drafter = propose_from_prompt if drafter_name == "lookup" else truncated_draft(target, 2)
    steps = SpeculativeSteps(accept_draft_tokens=spy)
    if drafter_name.endswith("named"):
        steps = SpeculativeSteps(accept_draft_tokens=spy, speculative_step=speculative.speculative_step)
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=0)
    _, stats = speculative_generate(target, drafter, prompt, params, 2, steps=steps)
    assert len(judged) == stats.target_calls > 0


def test_steps_must_be_functions(target, prompt):
    with pytest.raises(TypeError, match="SpeculativeSteps.rollback must be a function, got 3"):
        SpeculativeSteps(rollback=3)
    with pytest.raises(TypeError, match="steps must be a SpeculativeSteps, got dict"):
        speculative_generate(target, propose_from_prompt, prompt, SamplingParams(), 2, steps={})


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculative_step_one_verify_pass_and_rollback(target, prompt, temperature):
    """One step: one target forward over [pending, d_1 .. d_k], k draft forwards, then the target
    cache holds the text but the new pending token and the draft cache min(its own, that)."""
    from decodelab.lessons.measure import CountingModel

    draft = truncated_draft(target, 2)
    params = SamplingParams(temperature=temperature, top_k=10, top_p=0.9)
    generator = torch.Generator().manual_seed(0)
    ids = list(prompt)
    target_cache, draft_cache = KVCache(target.config, 1, 64), KVCache(draft.config, 1, 64)
    with torch.inference_mode():
        speculative.prefill(target, target_cache, ids[:-1])
        speculative.prefill(draft, draft_cache, ids[:-1])
        for k in (3, 1, 4, 2, 0):
            counted_target, counted_draft = CountingModel(target), CountingModel(draft)
            draft_before = draft_cache.seq_len  # len(ids) - 1, or - 2 after a step that accepted every draft
            emitted = speculative.speculative_step(
                counted_target, counted_draft, target_cache, draft_cache, ids, k, params, generator
            )
            length = len(ids) + len(emitted) - 1
            assert counted_target.tokens_fed() == [k + 1] and len(counted_draft.calls) == k
            assert target_cache.seq_len == length
            assert draft_cache.seq_len == (min(len(ids) + k - 1, length) if k else min(draft_before, length))
            ids += emitted.tolist()


def check_verify_logits(target, prompt_ids, drafts, verify=speculative.verify, tolerance=1e-4) -> float:
    """The verify pass over [pending, drafts] equals the logits of the full sequence."""
    cache = KVCache(target.config, 1, len(prompt_ids) + len(drafts))
    with torch.inference_mode():
        speculative.prefill(target, cache, prompt_ids[:-1])
        logits = verify(target, cache, torch.tensor(prompt_ids[-1:]), torch.tensor(drafts))
        reference = target(torch.tensor([prompt_ids + drafts]))[0, len(prompt_ids) - 1 :]
    difference = float((logits - reference).abs().max())
    assert difference <= tolerance, f"verify logits differ from full-sequence logits by {difference:.3g}"
    return difference


def test_verify_logits_equal_full_sequence(target, prompt):
    check_verify_logits(target, prompt, [5, 17, 3, 88])
    _, fn, _ = buggy.LOOP_BUGS["verify_without_causal_mask"]
    with pytest.raises(AssertionError, match="differ"):
        check_verify_logits(target, prompt, [5, 17, 3, 88], fn)


def test_stop_tokens_and_max_tokens(target, prompt):
    params = SamplingParams(temperature=0, max_tokens=30)
    reference = list(stream_token_ids(target, prompt, params))
    stop = reference[9]
    expected = reference[: reference.index(stop) + 1]
    for k in (1, 3):
        out, stats = speculative_generate(target, truncated_draft(target, 2), prompt, params, k, [stop])
        assert out == expected and stats.generated == len(out)
        params_stop = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
        assert speculative_generate(target, truncated_draft(target, 2), prompt, params_stop, k)[0] == expected
        assert (
            speculative_generate(target, propose_from_prompt, prompt, SamplingParams(temperature=0, max_tokens=7), k)[0]
            == reference[:7]
        )


def test_sampling_is_seeded_and_runs_with_filters(target, prompt):
    draft = truncated_draft(target, 2)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, seed=7)
    first, stats = speculative_generate(target, draft, prompt, params, 3)
    assert len(first) == 24 and stats.target_calls < 24
    assert speculative_generate(target, draft, prompt, params, 3)[0] == first
    assert speculative_generate(target, propose_from_prompt, prompt, params, 3)[1].generated == 24


def test_loop_rejects_bad_arguments(target, prompt):
    draft = truncated_draft(target, 1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        speculative_generate(target, draft, prompt, SamplingParams(repetition_penalty=1.2), 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        speculative_generate(target, draft, prompt, SamplingParams(), 0)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, random_model(2, 1, 32, vocab=64), prompt, SamplingParams(), 2)
    with pytest.raises(ValueError, match="drafter"):
        speculative_generate(target, "tiny-draft", prompt, SamplingParams(), 2)


def test_truncated_draft_shares_weights(target):
    draft = truncated_draft(target, 2)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert draft.model.layers[1].mlp.up_proj.weight.data_ptr() == target.model.layers[1].mlp.up_proj.weight.data_ptr()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        x = target.model.embed_tokens(ids)
        cos, sin = target.rope_cos[:5], target.rope_sin[:5]
        for layer in target.model.layers[:2]:
            x = layer(x, cos, sin)
        torch.testing.assert_close(draft(ids), target.lm_head(target.model.norm(x)))
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="num_layers"):
            truncated_draft(target, bad)


def test_greedy_equals_target_only_on_tiny_pair():
    from decodelab.model.registry import load
    from decodelab.paths import PACKAGE_DATA

    if not all((PACKAGE_DATA / name / "config.json").exists() for name in ("tiny", "tiny-draft")):
        pytest.skip("the tiny models are not trained yet")
    (model, tokenizer), (draft, _) = load("tiny", device="cpu"), load("tiny-draft", device="cpu")
    prompt_ids = tokenizer.encode("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n")
    reference = greedy_reference(model, prompt_ids, max_tokens=40)
    for k in (1, 2, 3, 4):
        stats = assert_same_greedy(model, draft, prompt_ids, k, reference)
        assert 0 < stats.accepted < stats.proposed


@pytest.mark.slow
def test_greedy_equals_target_only_on_smollm2():
    from decodelab.model.registry import UnknownModelError, load

    try:
        model, tokenizer = load("smollm2", device="cpu")
    except UnknownModelError as error:
        pytest.skip(str(error))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
    )
    prompt_ids = tokenizer.encode(chat)
    reference = greedy_reference(model, prompt_ids, max_tokens=14)
    draft = truncated_draft(model, 4)
    for k in (1, 2, 3, 4):
        assert_same_greedy(model, draft, prompt_ids, k, reference[:6])
    stats = assert_same_greedy(model, propose_from_prompt, prompt_ids, 4, reference)
    assert 0 < stats.accepted < stats.proposed  # lookup guesses the repeated words, then misses


# ----------------------------------------------------------------------------------- lookup
def test_lookup_proposes_what_followed_the_latest_match():
    ids = [1, 2, 3, 9, 8, 1, 2, 3, 7, 5, 4, 1, 2, 3]
    assert propose_from_prompt(ids, 2) == [7, 5]
    assert propose_from_prompt(ids, 10) == [7, 5, 4, 1, 2, 3]  # runs to the end of the text
    assert propose_from_prompt(ids, 0) == []


def test_lookup_falls_back_to_shorter_ngrams():
    assert propose_from_prompt([4, 6, 9, 5, 6, 9], 2) == [5, 6]  # [6, 9] matches, [5, 6, 9] does not
    assert propose_from_prompt([4, 7, 8, 5, 6, 9, 5, 7, 3, 8], 3) == [5, 6, 9]  # only [8] matches
    assert propose_from_prompt([1, 2, 3, 4], 3) == []
    assert propose_from_prompt([5], 3) == [] and propose_from_prompt([], 3) == []
    assert propose_from_prompt([5, 5, 5], 3) == [5]  # overlapping match
    assert propose_from_prompt([1, 2, 8, 3, 2, 9, 1, 2], 2, max_ngram=1) == [9, 1]  # [2] alone


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=25), st.integers(1, 5), st.integers(1, 4))
def test_lookup_matches_brute_force(ids, k, max_ngram):
    expected = []
    for n in range(max_ngram, 0, -1):
        starts = [s for s in range(len(ids) - n) if n < len(ids) and ids[s : s + n] == ids[-n:]]
        if starts:
            expected = ids[max(starts) + n : max(starts) + n + k]
            break
    assert propose_from_prompt(ids, k, max_ngram) == expected


def test_lookup_rejects_bad_arguments():
    for k, n in [(-1, 3), (2, 0), (1.5, 3), (2, True)]:
        with pytest.raises(ValueError):
            propose_from_prompt([1, 2, 1], k, n)

"""Checks for notebook 09, speculative decoding: the acceptance rule, the total variation
distance, and the rollback that keeps the KV caches in step with the accepted tokens.

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and returns
None or raises ``AssertionError`` naming the input, the expected and the actual result.

Oracles:
* ``check_total_variation``: 1/2 sum |p - q| in float64, written here, plus analytic cases.
* ``check_accept_draft_tokens``: deterministic cases whose outcome the rule fixes exactly
  (certain acceptance, certain rejection with a one-point residual, the bonus row), then a
  distribution test: every emitted position must follow the target's row. The bound on the
  TVD between N empirical draws and their true law is dimension-free: E[TVD] <= 1/2 sum_x
  sqrt(p_x (1 - p_x) / N) (Jensen), and the TVD of N independent draws moves by at most 1/N
  when one draw changes, so McDiarmid gives P(TVD > E[TVD] + t) <= exp(-2 N t^2); at
  FAILURE_PROB = 1e-6 that is t = sqrt(ln(1e6) / (2N)). A correct rule fails with probability
  below 1e-6 per position, whatever order it draws its random numbers in.
* ``check_rollback_caches``: the cache lengths after a rollback, then the whole loop
  (``decodelab.decoding.speculative.stream_speculative`` with the function swapped in for its
  ``rollback``) must give target-only greedy output token for token (LLMs-from-scratch's
  equivalence test).
"""
from __future__ import annotations

import contextlib
import math

import torch

from autograder.checks.calling import call
from decodelab.model.toy import random_llama

REFERENCES = {
    "tvd": "decodelab.decoding.speculative:tvd",
    "accept_draft_tokens": "decodelab.decoding.speculative:accept_draft_tokens",
    "rollback": "decodelab.decoding.speculative:rollback",
}

__all__ = ["check_total_variation", "check_accept_draft_tokens", "check_rollback_caches", "tvd_bound"]

FAILURE_PROB = 1e-6
VOCAB = 96  # of the random models of the rollback check


def tvd_bound(p: torch.Tensor, n: int, failure_prob: float = FAILURE_PROB) -> float:
    """A TVD that the empirical law of n exact draws from p exceeds with probability below
    failure_prob: 1/2 sum_x sqrt(p_x (1 - p_x) / n) + sqrt(ln(1 / failure_prob) / (2 n))."""
    p = p.double()
    return float(0.5 * (p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / failure_prob) / (2 * n))


def _fmt(t: torch.Tensor) -> str:
    values = t.detach().cpu().tolist()
    if isinstance(values, float):
        return f"{values:.4g}"
    if t.dim() == 1:
        return "[" + ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in values) + "]"
    return "[" + ", ".join(_fmt(row) for row in t) + "]"


# ------------------------------------------------------------------------------------ tvd
def _ref_tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p.double() - q.double()).abs().sum(dim=-1)


def check_total_variation(tvd) -> None:
    cases = [
        ("identical distributions", torch.tensor([0.2, 0.3, 0.5]), torch.tensor([0.2, 0.3, 0.5]), 0.0),
        ("disjoint supports", torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 0.5, 0.5]), 1.0),
        ("p [0.5, 0.3, 0.2], q [0.2, 0.3, 0.5]", torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5]), 0.3),
        ("p [0.9, 0.1], q [0.6, 0.4]", torch.tensor([0.9, 0.1]), torch.tensor([0.6, 0.4]), 0.3),
    ]
    for name, p, q, expected in cases:
        got = call(f"tvd(p, q) on {name}", tvd, p, q)
        if not isinstance(got, torch.Tensor) or got.dim() != 0:
            raise AssertionError(f"tvd on {name} (vectors of shape [{len(p)}]): expected a 0-dim tensor "
                                 f"{expected}, got {got!r}")
        if abs(float(got) - expected) > 1e-6:
            raise AssertionError(f"tvd on {name}: expected {expected}, got {float(got):.6g} "
                                 f"(p = {_fmt(p)}, q = {_fmt(q)}; the TVD is 1/2 sum_x |p(x) - q(x)|)")
        swapped = call(f"tvd(q, p) on {name}", tvd, q, p)
        if abs(float(swapped) - expected) > 1e-6:
            raise AssertionError(f"tvd is symmetric: tvd(q, p) on {name} should also be {expected}, "
                                 f"got {float(swapped):.6g}")
    generator = torch.Generator().manual_seed(11)
    p = torch.rand(2, 3, 50, generator=generator, dtype=torch.float64).pow(4)
    q = torch.rand(2, 3, 50, generator=generator, dtype=torch.float64).pow(4)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    got, expected = call("tvd(p, q) on random p, q of shape [2, 3, 50]", tvd, p, q), _ref_tvd(p, q)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (2, 3):
        raise AssertionError(f"tvd on p, q of shape [2, 3, 50] (one distribution per row): expected a tensor of "
                             f"shape [2, 3], one distance per row, got "
                             f"{tuple(got.shape) if isinstance(got, torch.Tensor) else got!r}")
    bad = (got.double() - expected).abs() > 1e-6
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise AssertionError(f"tvd on random p, q of shape [2, 3, 50]: row {i} expected {float(expected[i]):.6g}, "
                             f"got {float(got[i]):.6g}")
    if float(got.max()) > 1 or float(got.min()) < 0:
        raise AssertionError(f"tvd must lie in [0, 1]; got values from {float(got.min()):.4g} to {float(got.max()):.4g}")


# ---------------------------------------------------------------------- the acceptance rule
# Target rows p_0..p_3 and draft rows q_0..q_2 over V = 6 tokens (as in tests/test_speculative.py):
# position 0 has a low acceptance rate (0.35), the next ones a high one, neighbouring rows differ.
P = torch.tensor([[0.50, 0.30, 0.10, 0.05, 0.03, 0.02],
                  [0.10, 0.40, 0.20, 0.10, 0.10, 0.10],
                  [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
                  [0.30, 0.05, 0.05, 0.05, 0.05, 0.50]])
Q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.25, 0.25],
                  [0.20, 0.30, 0.20, 0.10, 0.10, 0.10],
                  [0.05, 0.15, 0.40, 0.20, 0.10, 0.10]])
N_STEPS = 2000


def _accept_step(accept, drafts, q, p, generator, what):
    out = call(f"accept_draft_tokens on {what}", accept, drafts, q, p, generator)
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.dtype != torch.int64:
        raise AssertionError(f"accept_draft_tokens on {what}: expected a 1-D int64 tensor of token ids, got "
                             f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__} "
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else out!r}")
    k = len(drafts)
    if not 1 <= len(out) <= k + 1:
        raise AssertionError(f"accept_draft_tokens on {what}: emitted {len(out)} tokens {out.tolist()}; a step with "
                             f"k={k} drafts emits between 1 and {k + 1}")
    if out[:-1].tolist() != drafts[:len(out) - 1].tolist():
        raise AssertionError(f"accept_draft_tokens on {what}: the emitted tokens {out.tolist()} must start with the "
                             f"accepted prefix of the drafts {drafts.tolist()}")
    return out


def _deterministic_cases(accept) -> None:
    generator = torch.Generator().manual_seed(0)
    # 1. q == p everywhere: every draft passes; row k of target_probs is one-hot at 5: the bonus is 5.
    target = torch.cat([Q, torch.eye(6)[5:]])  # [4, 6]
    for trial in range(5):
        drafts = torch.multinomial(Q, 1, generator=generator)[:, 0]
        out = _accept_step(accept, drafts, Q, target, generator, f"drafts {drafts.tolist()} with q == p for k=3")
        if out.tolist() != drafts.tolist() + [5]:
            raise AssertionError(f"accept_draft_tokens with draft_probs equal to target_probs[:3] (k=3, drafts "
                                 f"{drafts.tolist()}) must accept all 3 and add the bonus token from target_probs[3] = "
                                 f"one-hot at token 5: expected {drafts.tolist() + [5]}, got {out.tolist()}")
    # 2. p(d) >= q(d): always accepted (u < p/q with p/q >= 1).
    p = torch.tensor([[0.6, 0.2, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = torch.tensor([[0.3, 0.3, 0.4, 0.0]])
    for trial in range(20):
        out = _accept_step(accept, torch.tensor([0]), q, p, generator, "draft [0], q_0 [0.3, 0.3, 0.4, 0], "
                           "target_probs [[0.6, 0.2, 0.2, 0], [0, 0, 0, 1]]")
        if out.tolist() != [0, 3]:
            raise AssertionError(f"accept_draft_tokens(draft_tokens [0], draft_probs [[0.3, 0.3, 0.4, 0]], target_probs "
                                 f"[[0.6, 0.2, 0.2, 0], [0, 0, 0, 1]]): p(0) = 0.6 >= q(0) = 0.3, so the draft is always "
                                 f"accepted and the bonus comes from row 1 (one-hot at 3): expected [0, 3], got "
                                 f"{out.tolist()}")
    # 3. p(d) = 0: always rejected; max(0, p - q) = [0, 0, 0.5, 0] is one point: token 2, every time.
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for trial in range(20):
        out = _accept_step(accept, torch.tensor([0]), q, p, generator, "draft [0] with p(0) = 0")
        if out.tolist() != [2]:
            raise AssertionError(f"accept_draft_tokens(draft_tokens [0], draft_probs [[0.5, 0.5, 0, 0]], target_probs "
                                 f"[[0, 0.5, 0.5, 0], [0.25, 0.25, 0.25, 0.25]]): p(0) = 0, so the draft is always "
                                 f"rejected, and the residual max(0, p - q) = [0, 0, 0.5, 0] normalizes to token 2: "
                                 f"expected [2] every time, got {out.tolist()} (trial {trial + 1})")
    # 4. k = 0: nothing to judge, one token from target_probs[0].
    out = _accept_step(accept, torch.zeros(0, dtype=torch.long), torch.zeros(0, 4), torch.eye(4)[1:2], generator,
                       "k=0 (no drafts)")
    if out.tolist() != [1]:
        raise AssertionError(f"accept_draft_tokens with k=0 drafts and target_probs [[0, 1, 0, 0]]: expected [1] "
                             f"(the bonus token alone), got {out.tolist()}")


def _position_laws(accept, k: int, n: int, seed: int):
    """Run n steps with drafts d_i ~ Q[i]; per emitted position j: (counts [V], steps that reached j)."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(k + 1, 6, dtype=torch.float64)
    for _ in range(n):
        drafts = torch.multinomial(Q[:k], 1, generator=generator)[:, 0]
        out = _accept_step(accept, drafts, Q[:k], P[:k + 1], generator, f"drafts {drafts.tolist()} from the draft "
                           f"rows q_0..q_{k - 1} of the distribution test (k={k})")
        for j, token in enumerate(out.tolist()):
            counts[j, token] += 1
    return counts


def check_accept_draft_tokens(accept_draft_tokens) -> None:
    _deterministic_cases(accept_draft_tokens)
    for k, n, seed in ((1, N_STEPS, 1), (2, N_STEPS, 2)):
        counts = _position_laws(accept_draft_tokens, k, n, seed)
        for j in range(k + 1):
            reached = int(counts[j].sum())
            if reached < 200:
                continue  # too few draws at this position for a useful bound
            law = counts[j] / reached
            distance, bound = float(_ref_tvd(law, P[j])), tvd_bound(P[j], reached)
            if distance > bound:
                raise AssertionError(
                    f"accept_draft_tokens, k={k}, over {n} steps: the token emitted at position {j} should follow the "
                    f"target's row p_{j} = {_fmt(P[j])}, but its {reached} draws have frequencies {_fmt(law)}: "
                    f"TVD {distance:.3f}, above the noise bound {bound:.3f} for {reached} draws. The output is "
                    f"not distributed as the target's (check the residual max(0, p - q) after a rejection, and "
                    f"which row the bonus token comes from)")


# ------------------------------------------------------------------------------- rollback
def _random_model(seed: int):
    """A 4-layer random Llama with every matrix, embeddings included, ~ N(0, 4 / fan_in) and plain
    norms: greedy output does not settle into one repeated token (17 distinct in the check's 24),
    and a 2-layer truncated draft agrees with it about one token in five (both branches of the
    rule run)."""
    return random_llama(seed, weight_scale=2.0, norm_jitter=0.0, embedding_std=None, vocab_size=VOCAB,
                        intermediate_size=128, num_hidden_layers=4, max_position_embeddings=256)


def _filled_cache(config, length: int):
    from decodelab.model.kv_cache import KVCache

    cache = KVCache(config, 1, 32)
    for layer in range(config.num_hidden_layers):
        shape = (1, config.num_key_value_heads, length, config.head_dim)
        cache.append(layer, torch.randn(shape), torch.randn(shape))
    return cache


@contextlib.contextmanager
def _swapped(module, name, fn):
    saved = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, saved)


def check_rollback_caches(rollback) -> None:
    _check_rollback_lengths(rollback)
    _check_rollback_in_loop(rollback)


def _check_rollback_lengths(rollback) -> None:
    config = _random_model(0).config
    # 1. the lengths: target keeps exactly `length`; the draft keeps min(its own, length).
    for target_len, draft_len, length in ((10, 9, 7), (10, 6, 8), (5, 5, 5), (9, 9, 4)):
        target_cache, draft_cache = _filled_cache(config, target_len), _filled_cache(config, draft_len)
        kept_keys = target_cache.view(0)[0][:, :, :length].clone()
        call(f"rollback(target cache of {target_len} positions, draft cache of {draft_len}, length={length})",
             rollback, target_cache, draft_cache, length)
        got = (target_cache.seq_len, draft_cache.seq_len)
        expected = (length, min(draft_len, length))
        if got != expected:
            raise AssertionError(f"rollback(target cache of {target_len} positions, draft cache of {draft_len}, "
                                 f"length={length}): expected the caches to hold {expected[0]} and {expected[1]} "
                                 f"positions (the draft may lag by one and keeps min(its own, length)), got {got[0]} "
                                 f"and {got[1]}")
        if not torch.equal(target_cache.view(0)[0], kept_keys):
            raise AssertionError(f"rollback to length={length} changed the keys of the positions it keeps")
    target_cache = _filled_cache(config, 6)
    call("rollback(target cache, None, 3) (a drafter function has no cache)", rollback, target_cache, None, 3)
    if target_cache.seq_len != 3:
        raise AssertionError(f"rollback(target cache of 6 positions, None, 3): expected 3 positions kept, got "
                             f"{target_cache.seq_len}")


def _check_rollback_in_loop(rollback) -> None:
    """With this rollback, greedy speculative output equals target-only greedy output."""
    from decodelab.decoding import speculative
    from decodelab.decoding.generate import stream_token_ids
    from decodelab.params import SamplingParams

    target = _random_model(0)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = list(stream_token_ids(target, prompt, params))
    draft = speculative.truncated_draft(target, 2)
    for k in (1, 3):
        with _swapped(speculative, "rollback", rollback):
            ours = call(f"speculative greedy decoding (k={k}) with your rollback",
                        lambda: list(speculative.stream_speculative(target, draft, prompt, params, k)))
        if ours != reference:
            first = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
            raise AssertionError(f"speculative greedy decoding with your rollback (k={k}, a 4-layer random target, "
                                 f"its first 2 layers as the draft, 24 tokens) must equal target-only greedy decoding "
                                 f"token for token; it differs first at token {first}: expected "
                                 f"{reference[first:first + 4]}..., got {ours[first:first + 4]}...")

"""Checks for notebook 09, speculative decoding: the acceptance rule, one whole step with a
draft model (propose, verify, accept, rollback), the prompt-lookup drafter, and a draft tree
verified in one pass.

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and returns
None or raises ``AssertionError`` naming the input, the expected and the actual result.

Oracles:
* ``check_accept_draft_tokens``: deterministic cases whose outcome the rule fixes exactly
  (certain acceptance, certain rejection with a one-point residual, the bonus row), then a
  distribution test: every emitted position must follow the target's row. The bound on the
  TVD between N empirical draws and their true law is dimension-free: E[TVD] <= 1/2 sum_x
  sqrt(p_x (1 - p_x) / N) (Jensen), and the TVD of N independent draws moves by at most 1/N
  when one draw changes, so McDiarmid gives P(TVD > E[TVD] + t) <= exp(-2 N t^2); at
  FAILURE_PROB = 1e-6 that is t = sqrt(ln(1e6) / (2N)). A correct rule fails with probability
  below 1e-6 per position, whatever order it draws its random numbers in.
* ``check_speculative_step``, on a 4-layer random target and a copy of its first 2 layers as
  the draft (they agree about two tokens in five, so steps end in rejections and in bonus tokens):
  1. temperature 0, step after step: each step emits exactly what the library's step emits in
     lockstep on its own caches (both distributions are one-hot, so the tokens and their number
     are fixed), makes ONE target forward over the k+1 tokens [pending, d_1 .. d_k] (counted by a
     hook on the target's embedding, however it is called), and leaves the target cache holding
     the text but the new pending token and the draft cache no more than that; then k = 0;
  2. temperature 0.7 with top_k = 1: the filtered p and q are again one-hot at the argmax, so
     each step must emit what the greedy step emits. The raw softmax (no filters) lets other
     tokens through: a raw p emits them, a raw q proposes them and loses the accepted drafts;
  3. temperature 1.2, top_k = 4, top_p = 0.8 (3 tokens kept), k = 2, N = 600 steps from one
     state: no emitted token (first or second) may lie outside the target's filtered support
     there, and the first token's frequencies must be within the TVD noise bound above of
     p = probs(logits, params). A q recorded from softmax(logits / T) while the guess is drawn
     after top-k and top-p over-accepts drafts (p / q_unfiltered > p / q): TVD 0.46 there (0.29
     from the softmax without temperature), against a bound of 0.136; an unfiltered p puts 0.69
     of the first token's mass outside the filtered support;
  4. the function in the library's loop (`stream_speculative` with
     `steps=SpeculativeSteps(speculative_step=fn)`): greedy output equals target-only greedy
     output token for token.
* ``check_verify_tree``, on the same random target after a 12-token prompt: four named trees (a
  chain of the target's own tokens, the accepted path in a second branch, no match, nodes out of
  depth order) and 12 random trees of 3 to 9 nodes in which about half the nodes carry the
  target's choice after their parent's path. The oracle runs every path alone (a plain forward
  over prompt + path, no cache, no tree) and walks down the tree by its argmax: the emitted
  tokens must be that walk's; the target runs ONE forward over the n + 1 flattened tokens; the
  cache then holds the text but the new pending token, its K/V equal to a plain pass over it
  (1e-4). The oracle's argmax wins by more than 1e-3 on every path visited (a test says so), so
  no case hangs on rounding between a tree pass and a plain one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, format_values
from decodelab.course.exercises import references
from decodelab.model.toy import random_llama

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("09_speculative_decoding")

__all__ = [
    "check_accept_draft_tokens",
    "check_speculative_step",
    "check_propose_from_prompt",
    "check_verify_tree",
    "tvd_bound",
]

FAILURE_PROB = 1e-6
VOCAB = 96  # of the random models of the step check


def tvd_bound(p: torch.Tensor, n: int, failure_prob: float = FAILURE_PROB) -> float:
    """A TVD that the empirical law of n exact draws from p exceeds with probability below
    failure_prob: 1/2 sum_x sqrt(p_x (1 - p_x) / n) + sqrt(ln(1 / failure_prob) / (2 n))."""
    p = p.double()
    return float(0.5 * (p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / failure_prob) / (2 * n))


def _ref_tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p.double() - q.double()).abs().sum(dim=-1)


# ---------------------------------------------------------------------- the acceptance rule
# Target rows p_0..p_3 and draft rows q_0..q_2 over V = 6 tokens (as in tests/test_speculative.py):
# position 0 has a low acceptance rate (0.35), the next ones a high one, neighbouring rows differ.
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
N_STEPS = 2000


def _accept_step(accept, drafts, q, p, generator, what):
    out = call(f"accept_draft_tokens on {what}", accept, drafts, q, p, generator)
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.dtype != torch.int64:
        raise AssertionError(
            f"accept_draft_tokens on {what}: expected a 1-D int64 tensor of token ids, got "
            f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__} "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else out!r}"
        )
    k = len(drafts)
    if not 1 <= len(out) <= k + 1:
        raise AssertionError(
            f"accept_draft_tokens on {what}: emitted {len(out)} tokens {out.tolist()}; a step with "
            f"k={k} drafts emits between 1 and {k + 1}"
        )
    if out[:-1].tolist() != drafts[: len(out) - 1].tolist():
        raise AssertionError(
            f"accept_draft_tokens on {what}: emitted {out.tolist()}; a step emits the accepted "
            f"prefix of the drafts {drafts.tolist()}, then exactly ONE more token (the residual's "
            f"draw at the first rejection, or the bonus token when all {k} pass)"
        )
    return out


def _deterministic_cases(accept) -> None:
    generator = torch.Generator().manual_seed(0)
    # 1. q == p everywhere: every draft passes; row k of target_probs is one-hot at 5: the bonus is 5.
    target = torch.cat([Q, torch.eye(6)[5:]])  # [4, 6]
    for trial in range(5):
        drafts = torch.multinomial(Q, 1, generator=generator)[:, 0]
        out = _accept_step(accept, drafts, Q, target, generator, f"drafts {drafts.tolist()} with q == p for k=3")
        if out.tolist() != drafts.tolist() + [5]:
            raise AssertionError(
                f"accept_draft_tokens with draft_probs equal to target_probs[:3] (k=3, drafts "
                f"{drafts.tolist()}) must accept all 3 and add the bonus token from target_probs[3] = "
                f"one-hot at token 5: expected {drafts.tolist() + [5]}, got {out.tolist()}"
            )
    # 2. p(d) >= q(d): always accepted (u < p/q with p/q >= 1).
    p = torch.tensor([[0.6, 0.2, 0.2, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = torch.tensor([[0.3, 0.3, 0.4, 0.0]])
    for trial in range(20):
        out = _accept_step(
            accept,
            torch.tensor([0]),
            q,
            p,
            generator,
            "draft [0], q_0 [0.3, 0.3, 0.4, 0], target_probs [[0.6, 0.2, 0.2, 0], [0, 0, 0, 1]]",
        )
        if out.tolist() != [0, 3]:
            raise AssertionError(
                f"accept_draft_tokens(draft_tokens [0], draft_probs [[0.3, 0.3, 0.4, 0]], target_probs "
                f"[[0.6, 0.2, 0.2, 0], [0, 0, 0, 1]]): p(0) = 0.6 >= q(0) = 0.3, so the draft is always "
                f"accepted and the bonus comes from row 1 (one-hot at 3): expected [0, 3], got "
                f"{out.tolist()}"
            )
    # 3. p(d) = 0: always rejected; max(0, p - q) = [0, 0, 0.5, 0] is one point: token 2, every time.
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for trial in range(20):
        out = _accept_step(accept, torch.tensor([0]), q, p, generator, "draft [0] with p(0) = 0")
        if out.tolist() != [2]:
            raise AssertionError(
                f"accept_draft_tokens(draft_tokens [0], draft_probs [[0.5, 0.5, 0, 0]], target_probs "
                f"[[0, 0.5, 0.5, 0], [0.25, 0.25, 0.25, 0.25]]): p(0) = 0, so the draft is always "
                f"rejected, and the residual max(0, p - q) = [0, 0, 0.5, 0] normalizes to token 2: "
                f"expected [2] every time, got {out.tolist()} (trial {trial + 1})"
            )
    # 4. k = 0: nothing to judge, one token from target_probs[0].
    out = _accept_step(
        accept, torch.zeros(0, dtype=torch.long), torch.zeros(0, 4), torch.eye(4)[1:2], generator, "k=0 (no drafts)"
    )
    if out.tolist() != [1]:
        raise AssertionError(
            f"accept_draft_tokens with k=0 drafts and target_probs [[0, 1, 0, 0]]: expected [1] "
            f"(the bonus token alone), got {out.tolist()}"
        )


def _position_laws(accept, k: int, n: int, seed: int):
    """Run n steps with drafts d_i ~ Q[i]; per emitted position j: (counts [V], steps that reached j)."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(k + 1, 6, dtype=torch.float64)
    for _ in range(n):
        drafts = torch.multinomial(Q[:k], 1, generator=generator)[:, 0]
        out = _accept_step(
            accept,
            drafts,
            Q[:k],
            P[: k + 1],
            generator,
            f"drafts {drafts.tolist()} from the draft rows q_0..q_{k - 1} of the distribution test (k={k})",
        )
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
                    f"target's row p_{j} = {format_values(P[j], digits=4)}, but its {reached} draws have "
                    f"frequencies {format_values(law, digits=4)}: "
                    f"TVD {distance:.3f}, above the noise bound {bound:.3f} for {reached} draws. The output is "
                    f"not distributed as the target's (check the residual max(0, p - q) after a rejection, and "
                    f"which row the bonus token comes from)"
                )


# ------------------------------------------------------------------------- one whole step
STEP_TOKENS = 24  # generated per run of the greedy, top-k-1 and loop parts
GREEDY_KS = (1, 3, 2, 1, 4, 2)  # k of successive steps, in turn: 16 steps, 12 with a rejection, 4 all accepted
SAMPLED = dict(temperature=1.2, top_k=4, top_p=0.8)  # the distribution part's filters: both cut (3 tokens kept)
SAMPLED_PROMPT_SEED = 3  # the distribution part's prompt: alpha 0.54 there
N_SAMPLED_STEPS = 600
TREE_PROMPT_SEED = 5  # verify_tree's prompt
TREE_RANDOM_CASES = 12


def _random_model(seed: int):
    """A 4-layer random Llama with every matrix, embeddings included, ~ N(0, 2.25 / fan_in) and
    plain norms: greedy output does not settle into one repeated token, and a copy of its first 2
    layers agrees with it about two tokens in five (both branches of the rule run)."""
    return random_llama(
        seed,
        weight_scale=1.5,
        norm_jitter=0.0,
        embedding_std=None,
        vocab_size=VOCAB,
        intermediate_size=128,
        num_hidden_layers=4,
        max_position_embeddings=256,
    )


@functools.lru_cache(maxsize=1)
def _models():
    """(target, draft): the draft is a copy of the target's first 2 layers (no module shared, so
    each model's forwards can be counted apart). Built once: the checks only read them."""
    from decodelab.decoding.speculative import truncated_draft

    target = _random_model(0)
    return target, copy.deepcopy(truncated_draft(target, 2))


def _pair(prompt_seed: int = 0):
    """(target, draft, a 12-token random prompt)."""
    target, draft = _models()
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(prompt_seed)).tolist()
    return target, draft, prompt


class _Forwards:
    """Counts a model's forward passes and the tokens each is fed: a hook on its embedding sees
    every pass, however the model is called (model(...), .forward, .features)."""

    def __init__(self, model):
        self.fed: list[int] = []
        self.handle = model.model.embed_tokens.register_forward_hook(
            lambda module, inputs, output: self.fed.append(int(inputs[0].shape[-1]))
        )

    def take(self) -> list[int]:
        fed, self.fed = self.fed, []
        return fed

    def remove(self) -> None:
        self.handle.remove()


@contextlib.contextmanager
def _counting(*models):
    counters = [_Forwards(m) for m in models]
    try:
        yield counters
    finally:
        for counter in counters:
            counter.remove()


def _caches(target, draft, ids):
    """Fresh caches holding ids[:-1] (the pending token ids[-1] in neither), as the loop starts."""
    from decodelab.decoding import speculative
    from decodelab.model.kv_cache import KVCache

    target_cache, draft_cache = KVCache(target.config, 1, 128), KVCache(draft.config, 1, 128)
    speculative.prefill(target, target_cache, ids[:-1])
    speculative.prefill(draft, draft_cache, ids[:-1])
    return target_cache, draft_cache


def _emitted(out, what: str, k: int) -> list[int]:
    if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.dtype != torch.int64:
        raise AssertionError(
            f"{what}: expected a 1-D int64 tensor of the emitted token ids, got "
            f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__} "
            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else out!r}"
        )
    if not 1 <= len(out) <= k + 1:
        raise AssertionError(
            f"{what}: emitted {len(out)} tokens {out.tolist()}; a step with k={k} drafts emits between 1 and {k + 1}"
        )
    return out.tolist()


def _check_step_bookkeeping(
    what: str,
    k: int,
    ids: list[int],
    emitted: list[int],
    target_fed: list[int],
    target_cache,
    draft_cache,
    draft_before: int,
) -> None:
    """One target forward over k+1 tokens; the target cache holds the text but the new pending
    token; the draft cache no more than that (and, for k = 0, what it held)."""
    if len(target_fed) != 1 or target_fed[0] != k + 1:
        raise AssertionError(
            f"{what}: the target model ran {len(target_fed)} forward passes, fed "
            f"{target_fed} tokens; a step verifies all of [pending, d_1 .. d_{k}] in ONE forward "
            f"of the target over {k + 1} tokens (the causal mask gives the {k + 1} distributions "
            f"at once: that single pass is where the speed-up comes from)"
        )
    length = len(ids) + len(emitted) - 1
    if target_cache.seq_len != length:
        raise AssertionError(
            f"{what}: after the step the target cache holds {target_cache.seq_len} positions; "
            f"expected {length}, the {len(ids)} tokens before the step plus the {len(emitted)} "
            f"emitted, but not the last emitted one (the new pending token, fed by the next "
            f"verify). Roll it back with target_cache.truncate({length}): the rejected drafts' "
            f"keys and values must not stay in it"
        )
    if draft_cache.seq_len > length:
        raise AssertionError(
            f"{what}: after the step the draft cache holds {draft_cache.seq_len} positions, more "
            f"than the {length} the text has (all tokens but the new pending one): the rejected "
            f"guesses are still in it. Roll it back with "
            f"draft_cache.truncate(min(draft_cache.seq_len, {length}))"
        )
    if k == 0 and draft_cache.seq_len != min(draft_before, length):
        raise AssertionError(
            f"{what}: with k=0 there is nothing to draft, yet the draft cache went from "
            f"{draft_before} to {draft_cache.seq_len} positions"
        )


def _run_steps(step, target, draft, prompt, params, label: str, generator=None) -> None:
    """Steps from the prompt, k cycling through GREEDY_KS, then one k = 0 step: each must emit what
    the library's greedy step emits in lockstep on its own caches, with the bookkeeping above."""
    from decodelab.decoding import speculative
    from decodelab.params import SamplingParams

    greedy = SamplingParams(temperature=0)
    ids, ref_ids = list(prompt), list(prompt)
    target_cache, draft_cache = _caches(target, draft, ids)
    ref_caches = _caches(target, draft, ref_ids)
    ks = [GREEDY_KS[i % len(GREEDY_KS)] for i in range(STEP_TOKENS)]
    with _counting(target, draft) as (target_count, draft_count), torch.inference_mode():
        for index, k in enumerate(ks + [0]):
            if k and len(ids) - len(prompt) >= STEP_TOKENS:
                continue  # enough tokens: go on to the k = 0 step
            what = (
                f"speculative_step, {label}, step {index + 1} (k={k}, {len(ids) - len(prompt)} tokens generated "
                f"after a {len(prompt)}-token prompt)"
            )
            before, draft_before = list(ids), draft_cache.seq_len
            target_count.take(), draft_count.take()
            out = call(what, step, target, draft, target_cache, draft_cache, ids, k, params, generator)
            target_fed = target_count.take()
            emitted = _emitted(out, what, k)
            if ids != before:
                raise AssertionError(
                    f"{what}: the step changed `ids` (the tokens so far) in place, from "
                    f"{len(before)} to {len(ids)} tokens; return the emitted tokens instead (the "
                    f"loop appends them)"
                )
            expected = speculative.speculative_step(target, draft, *ref_caches, ref_ids, k, greedy).tolist()
            if emitted != expected:
                raise AssertionError(
                    f"{what}: expected the tokens {expected}, got {emitted}. "
                    + (
                        "At temperature 0 "
                        if params.greedy
                        else f"At temperature {params.temperature} with top_k=1 (p and q after the filters, "
                        f"`probs(logits, params)`) "
                    )
                    + "both distributions are one-hot at the argmax: the draft's guesses are its greedy tokens, kept "
                    "while they equal the target's, and then the target's own greedy token comes"
                    + (
                        ""
                        if params.greedy
                        else "; a raw softmax (no temperature, top-k or top-p) would let other tokens through"
                    )
                )
            _check_step_bookkeeping(what, k, ids, emitted, target_fed, target_cache, draft_cache, draft_before)
            ids += emitted
            ref_ids += expected


def _check_greedy_steps(step) -> None:
    from decodelab.params import SamplingParams

    target, draft, prompt = _pair()
    _run_steps(step, target, draft, prompt, SamplingParams(temperature=0), "temperature 0")


def _check_top_k_one(step) -> None:
    from decodelab.params import SamplingParams

    target, draft, prompt = _pair()
    params = SamplingParams(temperature=0.7, top_k=1, seed=0)
    _run_steps(step, target, draft, prompt, params, "temperature 0.7, top_k=1", torch.Generator().manual_seed(0))


def _restore(cache, model, ids: list[int]) -> None:
    """The cache back to holding ids[:-1] (refilled if the step left it shorter)."""
    from decodelab.decoding import speculative

    if cache.seq_len >= len(ids) - 1:
        cache.truncate(len(ids) - 1)
    else:
        cache.truncate(0)
        speculative.prefill(model, cache, ids[:-1])


def _support(target, ids: list[int], params) -> torch.Tensor:
    """p = probs(target's logits after ids, params), float64 [V]."""
    from decodelab.decoding.sampling import probs

    return probs(target(torch.tensor([ids]))[0, -1], params).double()


def _check_sampled_distribution(step) -> None:
    """N steps from one state (k = 2) under top-k and top-p: no emitted token outside the target's
    filtered support; the first token's law within the noise bound of p."""
    from decodelab.params import SamplingParams

    target, draft, prompt = _pair(SAMPLED_PROMPT_SEED)
    params = SamplingParams(**SAMPLED, seed=1)
    generator = torch.Generator().manual_seed(1)
    k, n = 2, N_SAMPLED_STEPS
    filters = ", ".join(f"{key}={value}" for key, value in SAMPLED.items())
    with torch.inference_mode():
        p = _support(target, prompt, params)  # [V]
        unfiltered = (target(torch.tensor([prompt]))[0, -1].double() / params.temperature).softmax(-1)
        target_cache, draft_cache = _caches(target, draft, prompt)
        counts = torch.zeros(VOCAB, dtype=torch.float64)
        seconds: dict[int, set[int]] = {}
        for trial in range(n):
            what = f"speculative_step at {filters}, k={k} (step {trial + 1} of {n} from the same 12-token prompt)"
            emitted = _emitted(
                call(what, step, target, draft, target_cache, draft_cache, list(prompt), k, params, generator), what, k
            )
            first = emitted[0]
            if p[first] == 0:
                raise AssertionError(
                    f"{what}: emitted token {first} first, which the target never samples at {filters}: its "
                    f"probability there is 0 (softmax(logits / T) without top-k and top-p gives it "
                    f"{float(unfiltered[first]):.3f}; the filtered p keeps only tokens {p.nonzero()[:, 0].tolist()}). "
                    f"p_i and q_i must be the distributions after "
                    f"temperature, top-k and top-p, `probs(logits, params)`, not the raw softmax"
                )
            counts[first] += 1
            if len(emitted) > 1:
                seconds.setdefault(first, set()).add(emitted[1])
            _restore(target_cache, target, prompt)
            _restore(draft_cache, draft, prompt)
        for first, tokens in sorted(seconds.items()):
            p_next = _support(target, prompt + [first], params)
            outside = sorted(t for t in tokens if p_next[t] == 0)
            if outside:
                raise AssertionError(
                    f"speculative_step at {filters}, k={k}, {n} steps from one prompt: after the first token {first} "
                    f"it emitted {outside}, which the target never samples there (probability 0 after the filters; "
                    f"it keeps {p_next.nonzero()[:, 0].tolist()}). p_i and q_i must be `probs(logits, params)`, "
                    f"not the raw softmax"
                )
    law = counts / n
    distance, bound = float(_ref_tvd(law, p)), tvd_bound(p, n)
    if distance > bound:
        support = p.nonzero()[:, 0].tolist()
        raise AssertionError(
            f"speculative_step at {filters}, k={k}: over {n} steps from one prompt the first emitted token has "
            f"frequencies {format_values(law[support], digits=4)} on tokens {support}, but the target's p there (after "
            f"the filters) is {format_values(p[support], digits=4)}: TVD {distance:.3f}, above the noise bound "
            f"{bound:.3f} for {n} draws. The output does not follow the target. Check that q_i, the distribution you "
            f"record for draft i, is the one you drew d_i from: `probs(draft_logits, params)`, after the filters, "
            f"not the raw softmax"
        )


def _check_in_loop(step) -> None:
    """The function in the library's loop: greedy output equals target-only greedy output."""
    from decodelab.decoding import speculative
    from decodelab.decoding.generate import stream_token_ids
    from decodelab.params import SamplingParams

    target, draft, prompt = _pair()
    params = SamplingParams(temperature=0, max_tokens=STEP_TOKENS, ignore_eos=True)
    reference = list(stream_token_ids(target, prompt, params))
    steps = speculative.SpeculativeSteps(speculative_step=step)
    for k in (1, 3):
        ours = call(
            f"speculative greedy decoding (k={k}) with your speculative_step in the library's loop",
            lambda: list(speculative.stream_speculative(target, draft, prompt, params, k, steps=steps)),
        )
        if ours != reference:
            first = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
            raise AssertionError(
                f"speculative greedy decoding with your speculative_step in the library's loop "
                f"(decodelab.decoding.speculative.stream_speculative, k={k}, a 4-layer random target, "
                f"its first 2 layers as the draft, {STEP_TOKENS} tokens) must equal target-only greedy "
                f"decoding token for token; it differs first at token {first}: expected "
                f"{reference[first : first + 4]}..., got {ours[first : first + 4]}..."
            )


@contextlib.contextmanager
def _one_thread():
    """Models this small run fastest on one thread (two threads spend longer synchronizing than
    computing, far longer on a busy machine); the caller's setting comes back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_speculative_step(speculative_step) -> None:
    with _one_thread():
        _check_greedy_steps(speculative_step)
        _check_top_k_one(speculative_step)
        _check_sampled_distribution(speculative_step)
        _check_in_loop(speculative_step)


# --------------------------------------------------------------------------- propose_from_prompt


def _ref_lookup(ids: list[int], k: int, max_ngram: int) -> list[int]:
    """The rule, written from its definition: the longest n <= max_ngram whose last-n suffix occurs
    earlier with at least one token after it; of those occurrences the latest; the <= k tokens after it."""
    for n in range(max_ngram, 0, -1):
        starts = [s for s in range(len(ids) - n) if s + n < len(ids) and ids[s : s + n] == ids[len(ids) - n :]]
        if n < len(ids) and starts:
            return ids[max(starts) + n : max(starts) + n + k]
    return []


LOOKUP_CASES = [  # (token ids, k, max_ngram, why)
    ([1, 2, 3, 4, 1, 2], 2, 3, "the 2-gram [1, 2] occurred at position 0, followed by [3, 4]"),
    (
        [3, 1, 2, 8, 5, 1, 2, 9, 3, 1, 2],
        1,
        3,
        "the 3-gram [3, 1, 2] occurred at 0 (followed by 8); the longer "
        "n-gram wins over the later 2-gram [1, 2] (followed by 9)",
    ),
    ([1, 2, 5, 1, 2, 6, 1, 2], 1, 2, "[1, 2] occurred at 0 and at 3: the latest occurrence (followed by 6) wins"),
    ([4, 5, 6, 7, 4, 5], 5, 3, "[4, 5] at 0 is followed by only 4 tokens before the end: [6, 7, 4, 5]"),
    ([4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 4, 5], 3, 2, "k = 3 tokens after the latest [4, 5] (at 4): [6, 7, 8], not more"),
    ([1, 1, 1, 1], 3, 3, "[1, 1, 1] occurs at 0, overlapping the suffix, and one token follows it: [1]"),
    ([7, 8, 9], 2, 3, "no token occurs twice: nothing to propose"),
    ([5, 6, 5], 0, 3, "k = 0: no guesses"),
    ([9], 2, 3, "a single token has no earlier context"),
    ([], 2, 3, "an empty text"),
    (
        [2, 7, 1, 2, 7, 3, 2, 7],
        4,
        1,
        "max_ngram = 1: only the last token [7] is looked up (latest at 4, followed by [3, 2, 7])",
    ),
]


def check_propose_from_prompt(fn) -> None:
    """Named cases (longest n-gram first, latest occurrence, at most k, the suffix itself never
    matched), then 300 random texts over small vocabularies against the oracle above."""
    for ids, k, max_ngram, why in LOOKUP_CASES:
        what = f"propose_from_prompt({ids}, k={k}, max_ngram={max_ngram})"
        got = call(what, fn, list(ids), k, max_ngram)
        expected = _ref_lookup(ids, k, max_ngram)
        if not isinstance(got, (list, tuple)) or [int(t) for t in got] != expected:
            raise AssertionError(f"{what}: expected {expected} ({why}), got {got!r}")
    rng = torch.Generator().manual_seed(9)
    for case in range(300):
        vocab, length = int(torch.randint(2, 6, (1,), generator=rng)), int(torch.randint(2, 40, (1,), generator=rng))
        ids = torch.randint(0, vocab, (length,), generator=rng).tolist()
        k, max_ngram = int(torch.randint(1, 6, (1,), generator=rng)), int(torch.randint(1, 5, (1,), generator=rng))
        what = f"propose_from_prompt({ids}, k={k}, max_ngram={max_ngram})"
        got = call(what, fn, list(ids), k, max_ngram)
        expected = _ref_lookup(ids, k, max_ngram)
        if not isinstance(got, (list, tuple)) or [int(t) for t in got] != expected:
            raise AssertionError(
                f"{what} (random case {case}): expected {expected}, got {got!r}: look up the longest "
                f"suffix of at most max_ngram tokens first, take its latest earlier occurrence, and "
                f"return at most k tokens after it"
            )


# --------------------------------------------------------------------------- verify_tree
def _tree_prompt():
    """(target, a 12-token random prompt, the target's greedy choice after it and after any path)."""
    target, _, prompt = _pair(TREE_PROMPT_SEED)
    memo: dict[tuple[int, ...], tuple[int, float]] = {}

    def choice_after(path: tuple[int, ...]) -> int:
        """The oracle: the target run alone over prompt + path (no cache, no tree) -> its argmax."""
        if path not in memo:
            logits = target(torch.tensor([prompt + list(path)]))[0, -1]
            top = logits.topk(2).values
            memo[path] = int(logits.argmax()), float(top[0] - top[1])
        return memo[path][0]

    return target, prompt, choice_after, memo


def _named_trees(choice_after):
    """(tree_tokens, parents, what) whose accepted path the target's greedy tokens g1, g2, ... fix."""
    g = []
    for _ in range(4):
        g.append(choice_after(tuple(g)))
    wrong = [t for t in range(VOCAB) if t not in g][:4]
    a, b, x, y = wrong
    return [
        (
            [g[0], g[1], g[2]],
            [-1, 0, 1],
            f"a chain [g1, g2, g3] = {g[:3]} of the target's own greedy tokens: all 3 accepted, then g4 = {g[3]}",
        ),
        (
            [a, g[0], b, x, g[1], y],
            [-1, -1, 0, 1, 1, 4],
            f"two branches from the root, [{a}, {b}] and [g1 = {g[0]}] "
            f"with children [{x}] and [g2 = {g[1]}, then {y}]: the second branch holds the path g1, g2, so it emits "
            f"{g[:3]}",
        ),
        ([a, b], [-1, -1], f"two candidates {a}, {b}, neither the target's choice {g[0]}: it emits [{g[0]}] alone"),
        (
            [a, g[0], x, b, g[1]],
            [-1, -1, 1, 0, 1],
            f"nodes out of depth order: g1 = {g[0]} (node 1) has children "
            f"[{x}] and [g2 = {g[1]}] (node 4), the wrong branch [{a}] a child [{b}]: it emits {g[:3]}",
        ),
    ]


def _guided_tree(rng: torch.Generator, choice_after, size: int):
    """A random tree (parents[i] < i, distinct sibling tokens) in which about half the nodes carry
    the target's choice after their parent's path, so accepted paths run deep in any branch."""
    tree_tokens, parents, paths = [], [], {-1: ()}
    for node in range(size):
        parent = int(torch.randint(-1, node, (1,), generator=rng))
        siblings = {tree_tokens[i] for i in range(node) if parents[i] == parent}
        token = choice_after(paths[parent])
        if token in siblings or float(torch.rand(1, generator=rng)) < 0.5:
            token = next(t for t in torch.randperm(VOCAB, generator=rng).tolist() if t not in siblings | {token})
        tree_tokens.append(token)
        parents.append(parent)
        paths[node] = paths[parent] + (token,)
    return tree_tokens, parents


def _expected_tree_output(choice_after, tree_tokens, parents) -> list[int]:
    """Greedy acceptance from the paths run one by one: follow the child carrying the oracle's choice."""
    path, node = (), -1
    while True:
        want = choice_after(path)
        child = next((i for i, parent in enumerate(parents) if parent == node and tree_tokens[i] == want), None)
        if child is None:
            return list(path) + [want]
        path, node = path + (tree_tokens[child],), child


def _check_one_tree(fn, target, prompt, choice_after, tree_tokens, parents, what) -> None:
    from decodelab.model.kv_cache import KVCache

    call_what = (
        f"verify_tree(pending {prompt[-1]} after an 11-token prefix, tree_tokens {tree_tokens}, parents "
        f"{parents}) ({what})"
    )
    expected = _expected_tree_output(choice_after, tree_tokens, parents)
    start = len(prompt) - 1
    cache = KVCache(target.config, 1, 64)
    target(torch.tensor([prompt[:-1]]), kv_cache=cache)
    with _counting(target) as (counter,):
        out = call(call_what, fn, target, cache, prompt[-1], list(tree_tokens), list(parents))
        fed = counter.take()
    got = _emitted(out, call_what, len(tree_tokens))
    if fed != [len(tree_tokens) + 1]:
        raise AssertionError(
            f"{call_what}: the target ran {len(fed)} forward passes, fed {fed} tokens; the whole tree "
            f"is judged in ONE pass over the {len(tree_tokens) + 1} tokens [pending, node 0 .. node "
            f"{len(tree_tokens) - 1}], the tree mask keeping each node to its own path"
        )
    if got != expected:
        raise AssertionError(
            f"{call_what}: expected {expected}, got {got}. Running each path of the tree alone through "
            f"the target, its argmax after the root and after each accepted node gives {expected}: "
            f"the deepest path of accepted nodes, then the target's choice after its last node. Check "
            f"the mask (a node sees only its ancestors and itself), the positions (start + depth, not "
            f"start + index) and which row the last token comes from"
        )
    length = start + len(got)
    if cache.seq_len != length:
        raise AssertionError(
            f"{call_what}: after the step the cache holds {cache.seq_len} positions; expected "
            f"{length}: the {start} before the pending token, the pending token and the "
            f"{len(got) - 1} accepted nodes (the new pending token {got[-1]} is not in it yet)"
        )
    plain = KVCache(target.config, 1, 64)
    target(torch.tensor([prompt + got[:-1]]), kv_cache=plain)
    error = max(
        float((plain.keys[:, :, :, :length] - cache.keys[:, :, :, :length]).abs().max()),
        float((plain.values[:, :, :, :length] - cache.values[:, :, :, :length]).abs().max()),
    )
    if error > 1e-4:
        raise AssertionError(
            f"{call_what}: the cache's keys and values after the step differ by up to {error:.3g} from "
            f"a plain pass over the text {got[:-1]} that the step accepted: the accepted nodes' rows "
            f"must end up right after the pending token's, in path order (their rows in the tree "
            f"pass are start + 1 + their index), and those rows must be computed with the tree mask "
            f"and start + depth positions"
        )


def check_verify_tree(verify_tree) -> None:
    """Named trees (a chain, the path in a second branch, no match, nodes out of depth order), then
    random guided trees, each against running every path separately; one pass; the cache's rows."""
    with _one_thread(), torch.inference_mode():
        target, prompt, choice_after, memo = _tree_prompt()
        cases = _named_trees(choice_after)
        rng = torch.Generator().manual_seed(TREE_PROMPT_SEED)
        for case in range(TREE_RANDOM_CASES):
            tree_tokens, parents = _guided_tree(rng, choice_after, int(torch.randint(3, 10, (1,), generator=rng)))
            cases.append((tree_tokens, parents, f"random tree {case + 1}"))
        for tree_tokens, parents, what in cases:
            _check_one_tree(verify_tree, target, prompt, choice_after, tree_tokens, parents, what)


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_alpha() -> float:
    """The acceptance rate for p = [0.5, 0.3, 0.2, 0] and q uniform over 4 tokens: 1 - TVD(p, q)."""
    from decodelab.decoding.speculative import tvd

    expected = 1 - float(
        tvd(torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64), torch.full((4,), 0.25, dtype=torch.float64))
    )
    return expected


def check_q_alpha(value) -> None:
    """Graded q_alpha (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_alpha",
        value,
        answer_q_alpha(),
        "the acceptance rate for p = [0.5, 0.3, 0.2, 0] and q = [0.25, 0.25, 0.25, 0.25] (sum of min(p, q))",
    )


def answer_q_tokens_per_call() -> float:
    """Mean tokens per target call for alpha = 0.8 and k = 4 drafts: (1 - alpha^(k+1)) / (1 - alpha)."""
    from decodelab.decoding.speculative import expected_tokens_per_call

    return expected_tokens_per_call(0.8, 4)


def check_q_tokens_per_call(value) -> None:
    """Graded q_tokens_per_call (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_tokens_per_call",
        value,
        answer_q_tokens_per_call(),
        "tokens per target call for alpha = 0.8, k = 4 (1 + 0.8 + 0.8^2 + 0.8^3 + 0.8^4)",
    )

"""Speculative decoding: a cheap drafter guesses k tokens, the target checks all of them in
ONE forward pass, and a rejection rule keeps the output distributed exactly as the target's
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

One step, with the tokens so far in `ids`; the last one (the *pending* token) is not yet in
either KV cache:

    propose:  d_1 .. d_k from the drafter, recording q_i, its distribution for d_i
    verify:   ONE target forward over [pending, d_1 .. d_k] -> p_1 .. p_{k+1}
    accept:   d_i with probability min(1, p_i(d_i) / q_i(d_i)), left to right; at the first
              rejection draw from normalize(max(0, p_i - q_i)) and stop; if all k pass,
              draw a bonus token from p_{k+1}
    rollback: both caches forget the rejected drafts (`KVCache.truncate`)

Each step emits 1 .. k+1 tokens for one target forward. A drafter is either a draft model
(any `LlamaForCausalLM` with the target's vocabulary; it keeps its own KVCache) or a
function ``(token_ids, k) -> list of <= k ids`` such as `decodelab.decoding.lookup.propose_from_prompt`,
or a `decodelab.decoding.eagle.FeatureDrafter`, which also reads the target's last hidden states.
A function's guesses are deterministic, so q_i is one-hot: d_i is accepted with probability
p_i(d_i), and a rejection draws from p_i with d_i removed. At temperature 0, a feature
drafter can also put its top-w candidates for the next token to the target in one pass
(`tree_width=w`, `decodelab.decoding.draft_tree`).

This module holds the acceptance rule, the steps above, one whole step for a draft model
(`speculative_step`: propose, verify, accept, rollback), the loop (`stream_speculative`) and
the theory (expected tokens per call and speedup). The loop sees every kind of drafter through
one protocol, `decodelab.decoding.proposers.DraftProposer`, with one adapter per kind, chosen by
`make_proposer`; the adapters call this module's steps through the module (a draft model's
adapter calls `speculative_step`, which calls the steps through this module's globals), so a
step swapped in here (notebook 09, the kept-bug tests) is the one that runs. The feature
drafter's adapters (`decodelab.decoding.feature_proposers`, with `eagle` and `draft_tree`) are
imported only when one is used.

Shapes: k drafted tokens, V vocab_size, B independent steps (the batched acceptance rule).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.decoding.generate import check_prompt, make_generator, stop_token_set
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import LlamaForCausalLM
from decodelab.params import SamplingParams
from decodelab.decoding.sampling import draw_draft_token, greedy, probs
from decodelab.validation import check_int

if TYPE_CHECKING:
    from decodelab.decoding.eagle import FeatureDraftSession
    from decodelab.decoding.proposers import Draft, Drafter


# ----------------------------------------------------------------------- the acceptance rule
def accept_draft_tokens_batched(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                                target_probs: torch.Tensor, generator: torch.Generator | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule for B independent steps at once.

    draft_tokens [B, k] int64, draft_probs [B, k, V], target_probs [B, k+1, V] ->
    (num_accepted [B] in 0..k, next_token [B]): step b emits draft_tokens[b, :num_accepted[b]],
    then next_token[b].
    """
    if draft_tokens.dim() != 2 or draft_probs.dim() != 3 or target_probs.dim() != 3:
        raise ValueError(f"expected draft_tokens [B, k], draft_probs [B, k, V], target_probs [B, k+1, V]; got "
                         f"{tuple(draft_tokens.shape)}, {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}")
    b, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs.shape != (b, k, vocab) or target_probs.shape != (b, k + 1, vocab):
        raise ValueError(f"for draft_tokens {tuple(draft_tokens.shape)} expected draft_probs {(b, k, vocab)} and "
                         f"target_probs {(b, k + 1, vocab)}, got {tuple(draft_probs.shape)} and "
                         f"{tuple(target_probs.shape)}")
    p_of_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    q_of_draft = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    u = torch.rand(b, k, generator=generator, device=target_probs.device)  # [B, k], uniform in [0, 1)
    accepted = u * q_of_draft < p_of_draft  # u < p/q without dividing by q: always when p >= q
    num_accepted = accepted.cumprod(dim=-1).sum(dim=-1)  # [B]: length of the accepted prefix
    # The next token: residual max(0, p - q) at the first rejection. A zero q row after the
    # last draft makes the same formula give p_{k+1} itself: the bonus token.
    rows = torch.arange(b, device=target_probs.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    q_next = F.pad(draft_probs, (0, 0, 0, 1))[rows, num_accepted]  # [B, V]
    residual = (p_next - q_next).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # An all-zero residual (p == q: rejection had probability 0, float rounding aside): use p.
    residual = torch.where(mass > 0, residual / mass, p_next)
    next_token = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [B]
    return num_accepted, next_token


def accept_draft_tokens(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """draft_tokens [k] int64, draft_probs [k, V], target_probs [k+1, V] (from
    `decodelab.decoding.sampling.probs`) -> the tokens this step emits, 1-D int64 of length 1 .. k+1:
    the accepted prefix of draft_tokens, then one token drawn from the residual at the first
    rejection, or from target_probs[k] (the bonus token) when all k were accepted.
    """
    if draft_tokens.dim() != 1 or draft_probs.dim() != 2 or target_probs.dim() != 2:
        raise ValueError(f"expected draft_tokens [k], draft_probs [k, V], target_probs [k+1, V]; got "
                         f"{tuple(draft_tokens.shape)}, {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}")
    if draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64 token ids, got {draft_tokens.dtype}")
    num_accepted, next_token = accept_draft_tokens_batched(draft_tokens[None], draft_probs[None],
                                                           target_probs[None], generator)
    return torch.cat([draft_tokens[:int(num_accepted)], next_token])


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """The rule at temperature 0, where p and q are one-hot: keep drafts while they equal the
    target's argmax, then emit the target's own argmax. draft_tokens [k], target_logits
    [k+1, V] -> tokens [n+1] (they are the target's choices, so no gather is needed)."""
    choice = greedy(target_logits)  # [k+1]
    num_accepted = int((choice[:-1] == draft_tokens).cumprod(dim=0).sum())
    return choice[:num_accepted + 1]


# ------------------------------------------------------------------------- the loop's steps
def prefill(model, cache: KVCache, token_ids: list[int]) -> None:
    """Put token_ids into the cache (nothing to do for none)."""
    if token_ids:
        model(torch.tensor([token_ids], device=model.device), kv_cache=cache, last_only=True)


def propose(drafter: Drafter, cache: KVCache | FeatureDraftSession | None, ids: list[int], k: int,
            params: SamplingParams, generator: torch.Generator | None, vocab_size: int, device
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Up to k guesses after ids -> (draft_tokens [k'], draft_probs [k', V], or None when greedy).
    `cache` is the draft model's KVCache, a feature drafter's session, or None for a function.

    A draft model runs k forwards: the first feeds the 1 or 2 tokens its cache lacks (2 after a
    step where all drafts were accepted: the last draft was never fed), each later one the
    previous guess.
    """
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=device), torch.empty(0, vocab_size, device=device)
    if hasattr(cache, "propose"):  # a FeatureDraftSession drafts from its own state (a KVCache has no `propose`)
        return cache.propose(ids, k, params, generator)
    if cache is None:  # a function: deterministic guesses, one-hot q
        tokens = torch.tensor(list(drafter(ids, k))[:k], dtype=torch.long, device=device)
        return tokens, None if params.greedy else F.one_hot(tokens, vocab_size).float()
    x = torch.tensor([ids[cache.seq_len:]], device=device)  # [1, 1 or 2]
    tokens, dists = [], []
    for _ in range(k):
        logits = drafter(x, kv_cache=cache, last_only=True)[0, -1]  # [V]
        token, q = draw_draft_token(logits, params, generator)  # [1], [V] or None
        tokens.append(token)
        dists += [q] if q is not None else []
        x = token[None]  # [1, 1]
    return torch.cat(tokens), torch.stack(dists) if dists else None


def verify(target, cache: KVCache, pending: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """ONE target forward over [pending, d_1 .. d_k] (pending [1], draft_tokens [k]) -> logits
    [k+1, V]: row i is the target's next-token logits after d_i (row 0: after pending). The
    cache's `attend` applies the causal mask, so row i sees nothing after d_i."""
    tokens = torch.cat([pending, draft_tokens])[None]  # [1, k+1]
    return target(tokens, kv_cache=cache)[0]


def verify_with_features(target, cache: KVCache, pending: torch.Tensor, draft_tokens: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` that also returns the target's features there: (logits [k+1, V], features [k+1, E])."""
    tokens = torch.cat([pending, draft_tokens])[None]  # [1, k+1]
    features = target.features(tokens, kv_cache=cache)[0]  # [k+1, E]
    return target.lm_head(features).float(), features


def rollback(target_cache: KVCache, draft_cache: KVCache | None, length: int) -> None:
    """Forget the rejected drafts: keep `length` positions (all tokens but the new pending one).
    The draft cache may hold one fewer (its last guess is fed at the next step)."""
    target_cache.truncate(length)
    if draft_cache is not None:
        draft_cache.truncate(min(draft_cache.seq_len, length))


def speculative_step(target, draft, target_cache: KVCache, draft_cache: KVCache, ids: list[int], k: int,
                     params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """One step of speculative decoding with a draft model -> the emitted tokens, LongTensor [n+1].

    ids: the tokens so far; the last one (the pending token) is in neither cache: target_cache
    holds len(ids) - 1 positions, draft_cache len(ids) - 1 or len(ids) - 2. k >= 0 drafts.
    propose: k draft forwards, the first over the 1 or 2 tokens the draft cache lacks, each
        guess d_i drawn from q_i = `probs(draft logits, params)` (after temperature, top-k, top-p);
    verify: ONE target forward over [pending, d_1 .. d_k] -> p_1 .. p_{k+1} = `probs(logits, params)`;
    accept: `accept_draft_tokens` (at temperature 0 its one-hot case, `greedy_accept`);
    rollback: the target cache keeps len(ids) + n positions, the text but the new pending token;
        the draft cache min(what it holds, that) (one fewer when all k were accepted: it never
        saw d_k).
    The loop (`stream_speculative`) runs it for a draft model, read from this module at each call.
    """
    device = target.device
    draft_tokens, draft_probs = propose(draft, draft_cache, ids, k, params, generator, target.config.vocab_size,
                                        device)  # [k], [k, V] or None (greedy)
    target_logits = verify(target, target_cache, torch.tensor(ids[-1:], device=device), draft_tokens)  # [k+1, V]
    if params.greedy:
        emitted = greedy_accept(draft_tokens, target_logits)
    else:
        emitted = accept_draft_tokens(draft_tokens, draft_probs, probs(target_logits, params), generator)
    rollback(target_cache, draft_cache, len(ids) + len(emitted) - 1)  # every token but the new pending one
    return emitted


# ----------------------------------------------------------------------------- generation
@dataclass
class SpeculativeStats:
    """Counts over one or more generations (pass the same object to add them up)."""

    proposed: int = 0  # draft tokens put to the target
    accepted: int = 0  # of those, accepted
    rejected: int = 0  # steps that ended in a rejection (drafts after it are never judged)
    target_calls: int = 0  # verify forwards (the prompt's prefill not counted)
    draft_calls: int = 0  # draft-model forwards, or drafter-function calls
    generated: int = 0  # tokens emitted

    @property
    def acceptance_rate(self) -> float:
        """alpha, measured: of the drafts the rule judged, the fraction accepted. Not accepted /
        proposed, which also counts the drafts after a rejection and so falls as k grows."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else float("nan")

    @property
    def accepted_per_proposed(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_target_call(self) -> float:
        return self.generated / self.target_calls if self.target_calls else float("nan")

    def record_step(self, draft: Draft, num_emitted: int) -> None:
        """Count one step that put `draft` to the target and emitted num_emitted tokens (its
        accepted drafts and one more); `generated` counts the tokens as they are yielded."""
        self.record(len(draft.tokens), draft.positions, draft.calls, num_emitted)

    def record(self, proposed: int, positions: int, draft_calls: int, num_emitted: int) -> None:
        """`record_step` in numbers: `proposed` guesses for `positions` positions (equal for a
        chain), `draft_calls` drafter calls, num_emitted tokens emitted for one target call."""
        num_accepted = num_emitted - 1
        self.proposed += proposed
        self.accepted += num_accepted
        self.rejected += num_accepted < positions
        self.target_calls += 1
        self.draft_calls += draft_calls


@torch.inference_mode()
def stream_speculative(target, drafter: Drafter, prompt_ids: list[int], params: SamplingParams,
                       num_speculative_tokens: int = 4, stop_token_ids=(),
                       stats: SpeculativeStats | None = None, tree_width: int = 1) -> Iterator[int]:
    """Yield generated ids one by one, as `decodelab.decoding.generate.stream_token_ids` does, and count
    into `stats` (pass a `SpeculativeStats` to read them). Greedy output equals the target's own.

    drafter: a draft model, a function (token_ids, k) -> up to k guesses, or a feature drafter
    (module docstring); `make_proposer` wraps it in a `DraftProposer`. Each step proposes
    min(k, tokens still to generate - 1) tokens, so no work goes past max_tokens, verifies them
    in one target pass, accepts a prefix and one more token, and lets the drafter observe the
    result and both caches roll back the rejected guesses.
    tree_width > 1 (a feature drafter, greedy, k = 1): the drafter's top tree_width tokens are
    judged together in one pass (`decodelab.decoding.draft_tree`); a step's draft then counts as accepted
    when any candidate is, so stats' alpha is per position, not per candidate.
    """
    # Imported here, not at the top: the adapters call this module's steps, so `proposers` imports
    # this module, and importing it back at module level would make the two a cycle.
    from decodelab.decoding.proposers import is_feature_drafter, make_proposer

    k = num_speculative_tokens
    check_int("num_speculative_tokens", k, minimum=1)
    check_int("tree_width", tree_width, minimum=1)
    if tree_width > 1 and not (is_feature_drafter(drafter) and params.greedy and k == 1):
        raise ValueError("tree_width > 1 needs a feature drafter, temperature 0 and num_speculative_tokens=1")
    if params.repetition_penalty != 1:
        raise ValueError("speculative decoding does not support repetition_penalty != 1")
    proposer = make_proposer(target, drafter, params, make_generator(params.seed, target.device), tree_width)
    check_prompt(prompt_ids, proposer.context, target.config.vocab_size)
    max_len = len(prompt_ids) + min(params.max_tokens, proposer.context - len(prompt_ids))
    proposer.start(KVCache(target.config, 1, max_len, device=target.device, dtype=target.dtype), prompt_ids, max_len)
    stops = stop_token_set(params, stop_token_ids)
    stats = stats if stats is not None else SpeculativeStats()
    ids = list(prompt_ids)
    while len(ids) < max_len:
        # propose, verify, accept, observe, rollback: [n+1] tokens, n accepted drafts, then the target's
        emitted = proposer.step(ids, min(k, max_len - len(ids) - 1), stats)  # never draft past max_tokens
        for token_id in emitted.tolist():
            ids.append(token_id)
            stats.generated += 1
            yield token_id
            if token_id in stops:
                return


def speculative_generate(target, drafter: Drafter, prompt_ids: list[int], params: SamplingParams,
                         num_speculative_tokens: int = 4, stop_token_ids=(), tree_width: int = 1
                         ) -> tuple[list[int], SpeculativeStats]:
    """The whole output of `stream_speculative` -> (output_ids, stats)."""
    stats = SpeculativeStats()
    output = list(stream_speculative(target, drafter, prompt_ids, params, num_speculative_tokens,
                                     stop_token_ids, stats, tree_width))
    return output, stats


def truncated_draft(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A draft that shares the model's weights: embeddings, the first num_layers layers, the
    final norm and lm_head (an "early exit" model; same tokenizer, no extra memory)."""
    total = model.config.num_hidden_layers
    check_int("num_layers", num_layers, minimum=1, maximum=total)
    config = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    with torch.device("meta"):  # build the skeleton without allocating weights, then share
        draft = LlamaForCausalLM(config)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = nn.ModuleList(model.model.layers[:num_layers])
    draft.model.norm = model.model.norm
    draft.lm_head = model.lm_head
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    return draft.eval()


# ---------------------------------------------------------------------------------- theory
def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - tvd(p, q): the chance that one draft is accepted.
    p, q [..., V] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance 1/2 sum_x |p(x) - q(x)|: p, q [..., V] -> [...]."""
    return 0.5 * (p - q).abs().sum(dim=-1)


def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    check_int("k", k, minimum=0)


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per target call when each draft is accepted
    independently with probability alpha (k+1 at alpha = 1)."""
    _check_alpha_k(alpha, k)
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Leviathan et al., Theorem 3.8: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), the walltime
    gain when a draft step costs c = draft_cost target steps and verifying k+1 tokens costs
    one target step (on real hardware it costs a bit more: measure it)."""
    if not draft_cost >= 0:
        raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
    return expected_tokens_per_call(alpha, k) / (k * draft_cost + 1)

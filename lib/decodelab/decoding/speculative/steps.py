"""The steps of speculative decoding, and the rule that keeps its output the target's: the
lowest layer of `decodelab.decoding.speculative`, importing nothing back from the package.

One step, with the tokens so far in `ids`; the last one (the *pending* token) is not yet in
either KV cache:

    propose:  d_1 .. d_k from the drafter, recording q_i, its distribution for d_i
    verify:   ONE target forward over [pending, d_1 .. d_k] -> p_1 .. p_{k+1}
    accept:   d_i with probability min(1, p_i(d_i) / q_i(d_i)), left to right; at the first
              rejection draw from normalize(max(0, p_i - q_i)) and stop; if all k pass,
              draw a bonus token from p_{k+1}
    rollback: both caches forget the rejected drafts (`KVCache.truncate`)

This module holds the acceptance rule (`accept_draft_tokens`, batched and greedy forms), each
step as a function (`prefill`, `propose`, `verify`, `rollback`), one whole step for a draft
model (`speculative_step`), and `SpeculativeSteps`: the steps the loop runs, the library's by
default. A caller swaps in its own by passing `steps=SpeculativeSteps(speculative_step=mine)`
to `stream_speculative` (notebook 09 passes the learner's step and rule), as the engine takes
an `EngineHooks`; nothing is patched.

Shapes: k drafted tokens, V vocab_size, B independent steps (the batched acceptance rule).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.decoding.sampling import draw_draft_token, greedy, probs
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams

if TYPE_CHECKING:
    from decodelab.decoding.eagle import FeatureDrafter, FeatureDraftSession

# What a caller passes as `drafter`: a draft model (a `LlamaForCausalLM` with the target's
# vocabulary), a feature drafter, or a function (token_ids, k) -> up to k guesses.
Drafter = Union[nn.Module, "FeatureDrafter", Callable[[list, int], list]]


# ----------------------------------------------------------------------- the acceptance rule
def accept_draft_tokens_batched(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule for B independent steps at once.

    draft_tokens [B, k] int64, draft_probs [B, k, V], target_probs [B, k+1, V] ->
    (num_accepted [B] in 0..k, next_token [B]): step b emits draft_tokens[b, :num_accepted[b]],
    then next_token[b].
    """
    if draft_tokens.dim() != 2 or draft_probs.dim() != 3 or target_probs.dim() != 3:
        raise ValueError(
            f"expected draft_tokens [B, k], draft_probs [B, k, V], target_probs [B, k+1, V]; got "
            f"{tuple(draft_tokens.shape)}, {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}"
        )
    b, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs.shape != (b, k, vocab) or target_probs.shape != (b, k + 1, vocab):
        raise ValueError(
            f"for draft_tokens {tuple(draft_tokens.shape)} expected draft_probs {(b, k, vocab)} and "
            f"target_probs {(b, k + 1, vocab)}, got {tuple(draft_probs.shape)} and "
            f"{tuple(target_probs.shape)}"
        )
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


def accept_draft_tokens(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """draft_tokens [k] int64, draft_probs [k, V], target_probs [k+1, V] (from
    `decodelab.decoding.sampling.probs`) -> the tokens this step emits, 1-D int64 of length 1 .. k+1:
    the accepted prefix of draft_tokens, then one token drawn from the residual at the first
    rejection, or from target_probs[k] (the bonus token) when all k were accepted.
    """
    if draft_tokens.dim() != 1 or draft_probs.dim() != 2 or target_probs.dim() != 2:
        raise ValueError(
            f"expected draft_tokens [k], draft_probs [k, V], target_probs [k+1, V]; got "
            f"{tuple(draft_tokens.shape)}, {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}"
        )
    if draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64 token ids, got {draft_tokens.dtype}")
    num_accepted, next_token = accept_draft_tokens_batched(
        draft_tokens[None], draft_probs[None], target_probs[None], generator
    )
    return torch.cat([draft_tokens[: int(num_accepted)], next_token])


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """The rule at temperature 0, where p and q are one-hot: keep drafts while they equal the
    target's argmax, then emit the target's own argmax. draft_tokens [k], target_logits
    [k+1, V] -> tokens [n+1] (they are the target's choices, so no gather is needed)."""
    choice = greedy(target_logits)  # [k+1]
    num_accepted = int((choice[:-1] == draft_tokens).cumprod(dim=0).sum())
    return choice[: num_accepted + 1]


# ------------------------------------------------------------------------- the loop's steps
def prefill(model, cache: KVCache, token_ids: list[int]) -> None:
    """Put token_ids into the cache (nothing to do for none)."""
    if token_ids:
        model(torch.tensor([token_ids], device=model.device), kv_cache=cache, last_only=True)


def propose(
    drafter: Drafter,
    cache: KVCache | FeatureDraftSession | None,
    ids: list[int],
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab_size: int,
    device,
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
    x = torch.tensor([ids[cache.seq_len :]], device=device)  # [1, 1 or 2]
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


def verify_with_features(
    target, cache: KVCache, pending: torch.Tensor, draft_tokens: torch.Tensor
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


def speculative_step(
    target,
    draft,
    target_cache: KVCache,
    draft_cache: KVCache,
    ids: list[int],
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    steps: SpeculativeSteps | None = None,
) -> torch.Tensor:
    """One step of speculative decoding with a draft model -> the emitted tokens, LongTensor [n+1].

    ids: the tokens so far; the last one (the pending token) is in neither cache: target_cache
    holds len(ids) - 1 positions, draft_cache len(ids) - 1 or len(ids) - 2. k >= 0 drafts.
    propose: k draft forwards, the first over the 1 or 2 tokens the draft cache lacks, each
        guess d_i drawn from q_i = `probs(draft logits, params)` (after temperature, top-k, top-p);
    verify: ONE target forward over [pending, d_1 .. d_k] -> p_1 .. p_{k+1} = `probs(logits, params)`;
    accept: `accept_draft_tokens`; at temperature 0, where p and q are one-hot, `greedy_accept`
        (the same rule read off the target's argmax);
    rollback: the target cache keeps len(ids) + len(emitted) - 1 positions (= len(ids) + n), the
        text but the new pending token;
        the draft cache min(what it holds, that) (one fewer when all k were accepted: it never
        saw d_k).
    steps: whose propose, verify, accept and rollback to run (None: the library's).
    The loop (`stream_speculative`) runs it for a draft model, with its own `SpeculativeSteps`,
    unless that names another step (`SpeculativeSteps(speculative_step=yours)`).
    """
    steps = steps if steps is not None else LIBRARY_STEPS
    device = target.device
    draft_tokens, draft_probs = steps.propose(
        draft, draft_cache, ids, k, params, generator, target.config.vocab_size, device
    )  # [k], [k, V] or None (greedy)
    target_logits = steps.verify(target, target_cache, torch.tensor(ids[-1:], device=device), draft_tokens)  # [k+1, V]
    if params.greedy:
        emitted = steps.greedy_accept(draft_tokens, target_logits)
    else:
        emitted = steps.accept_draft_tokens(draft_tokens, draft_probs, probs(target_logits, params), generator)
    steps.rollback(target_cache, draft_cache, len(ids) + len(emitted) - 1)  # every token but the new pending one
    return emitted


# ------------------------------------------------------------------------ the pluggable steps
@dataclass(frozen=True)
class SpeculativeSteps:
    """The steps `stream_speculative` runs, the library's by default: pass one with a field
    replaced to run your own (`steps=SpeculativeSteps(speculative_step=my_step)`), as the engine
    takes an `EngineHooks`. Each field has the signature of the function of this module it
    defaults to.

    prefill: the prompt into a cache, before the first step.
    propose: a chain's guesses (a draft model's, a function's, a feature drafter's).
    verify: a chain's target pass (a feature drafter's also returns features:
        `verify_with_features`; a tree's is `decodelab.decoding.draft_tree.verify_candidates`).
    accept_draft_tokens: the acceptance rule when sampling, for every chain;
    greedy_accept: the rule at temperature 0.
    rollback: both caches back to the text but the new pending token.
    speculative_step: the whole step for a draft model. The library's (the default) is run with
        the fields above, so a part swapped in runs inside it too; another runs as it is.
    """

    prefill: Callable = prefill
    propose: Callable = propose
    verify: Callable = verify
    accept_draft_tokens: Callable = accept_draft_tokens
    greedy_accept: Callable = greedy_accept
    rollback: Callable = rollback
    speculative_step: Callable = speculative_step

    def __post_init__(self) -> None:
        for field in fields(self):
            if not callable(getattr(self, field.name)):
                raise TypeError(f"SpeculativeSteps.{field.name} must be a function, got {getattr(self, field.name)!r}")

    def draft_model_step(
        self,
        target,
        draft,
        target_cache: KVCache,
        draft_cache: KVCache,
        ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """The step a draft model runs, `self.speculative_step` (the library's with these steps as
        its parts) -> the emitted tokens, LongTensor [n+1]."""
        if self.speculative_step is speculative_step:
            return speculative_step(target, draft, target_cache, draft_cache, ids, k, params, generator, steps=self)
        return self.speculative_step(target, draft, target_cache, draft_cache, ids, k, params, generator)


LIBRARY_STEPS = SpeculativeSteps()

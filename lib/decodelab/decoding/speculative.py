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

The loop (`stream_speculative`) sees every kind through one protocol, `DraftProposer`
(start / propose / verify / accept / observe / rollback), with one adapter per kind, chosen by
`make_proposer`: `DraftModelProposer`, `FunctionProposer`, `FeatureProposer`, `TreeProposer`.
The feature drafter's modules (`eagle`, `draft_tree`) are imported only when one is used.

Shapes: k drafted tokens, V vocab_size, B independent steps (the batched acceptance rule).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Union

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
    from decodelab.decoding.eagle import FeatureDrafter, FeatureDraftSession

# What a caller passes as `drafter` (module docstring); `make_proposer` wraps it in a `DraftProposer`.
Drafter = Union[nn.Module, "FeatureDrafter", Callable[[list, int], list]]

# The feature drafter's names, from decodelab.decoding.eagle and draft_tree. They are imported on
# first use (`__getattr__` below), so a draft model or a function never loads them, and stay
# attributes of this module, which tests patch (monkeypatch "...speculative.keep_row").
_EAGLE_NAMES = {"FeatureDrafter", "FeatureDraftSession"}
_TREE_NAMES = {"top_candidates", "verify_candidates", "accept_candidate", "path_rows", "keep_row"}


def __getattr__(name: str):
    """Import one of the feature drafter's names on first use (PEP 562), and keep it here."""
    if name in _EAGLE_NAMES:
        from decodelab.decoding import eagle as home
    elif name in _TREE_NAMES:
        from decodelab.decoding import draft_tree as home
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(home, name)
    return value


def _late(name: str):
    """This module's attribute `name`, read at call time: imported on first use if it is one of
    the feature drafter's, and a test's monkeypatch of it takes effect."""
    return getattr(sys.modules[__name__], name)


def _is_eagle_instance(value, class_name: str) -> bool:
    """isinstance(value, decodelab.decoding.eagle.<class_name>), without importing eagle: until
    something has imported it, no instance of its classes can exist."""
    eagle = sys.modules.get("decodelab.decoding.eagle")
    return eagle is not None and isinstance(value, getattr(eagle, class_name))


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
    if _is_eagle_instance(cache, "FeatureDraftSession"):
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


# ------------------------------------------------------------------------------ the drafters
@dataclass
class Draft:
    """One step's proposal.

    tokens: LongTensor [k'], k' <= k: the guesses, in order (a tree: w candidates for ONE position).
    probs: [k', V], the distribution each guess was drawn from (one-hot for a function's); None
        when greedy, where the acceptance rule needs none.
    calls: the drafter's forwards (or function calls) the proposal cost.
    positions: the positions the target judges: k' for a chain, 1 for a tree (0: no candidate).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    calls: int
    positions: int | None = None  # None: one per token (a chain)

    def __post_init__(self) -> None:
        if self.positions is None:
            self.positions = len(self.tokens)


class DraftProposer(Protocol):
    """A drafter as `stream_speculative` drives it through one generation, one adapter per kind
    (`make_proposer`). Between steps, with `ids` the tokens so far, the last one (the pending
    token) is in no cache: the target's KVCache holds len(ids) - 1 positions, the drafter's state
    as many (a draft model's cache may lag by one). Shapes: k' proposed tokens, V vocab_size."""

    context: int  # the longest sequence target and drafter can both hold

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        """Feed prompt_ids[:-1] (all but the pending token) to the target, into target_cache (which
        this proposer keeps), and to the drafter; neither will hold more than max_len positions."""

    def propose(self, ids: list[int], k: int) -> Draft:
        """Up to k guesses for the tokens after ids (none for k = 0): Draft.tokens [k'],
        Draft.probs [k', V] or None (greedy)."""

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        """ONE target pass over [pending, draft.tokens] (pending [1]) -> logits [k'+1, V]; row 0
        is the target's next-token logits after pending, row i after draft token i."""

    def accept(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        """The tokens the step emits, LongTensor [n+1], 1 <= n+1 <= k'+1: the n accepted guesses,
        then one token of the target's (the residual's draw, or the bonus token)."""

    def observe(self, emitted: torch.Tensor) -> None:
        """Let the drafter learn what the step emitted (emitted [n+1], `accept`'s result): a feature
        drafter takes the target's features of the accepted path, kept from `verify`."""

    def rollback(self, length: int) -> None:
        """Forget the rejected guesses: every cache keeps at most `length` positions (all tokens
        but the new pending one)."""


class ChainProposer:
    """What drafters of a chain d_1 .. d_k' share: the target's prefill, a plain verify pass, the
    acceptance rule (greedy, or `accept_draft_tokens`), nothing to observe, and a rollback of the
    target's cache. Subclasses give `propose` and add their own state. The steps are this
    module's functions (`prefill`, `propose`, `verify`, `accept_draft_tokens`, `rollback`), read
    at call time: notebook 08 and the kept-bug tests swap them in the module."""

    def __init__(self, target, params: SamplingParams, generator: torch.Generator | None):
        self.target, self.params, self.generator = target, params, generator
        self.context = target.config.max_position_embeddings
        self.target_cache: KVCache | None = None  # set by `start`

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        self.target_cache = target_cache
        prefill(self.target, target_cache, prompt_ids[:-1])

    def _propose(self, drafter, state, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The module's `propose` (tokens [k'], probs [k', V] or None) for this drafter and state."""
        config = self.target.config
        return propose(drafter, state, ids, k, self.params, self.generator, config.vocab_size, self.target.device)

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        return verify(self.target, self.target_cache, pending, draft.tokens)

    def accept(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:
            return greedy_accept(draft.tokens, target_logits)
        target_probs = probs(target_logits, self.params)  # [k'+1, V]
        return accept_draft_tokens(draft.tokens, draft.probs, target_probs, self.generator)

    def observe(self, emitted: torch.Tensor) -> None:
        pass  # a draft model or a function learns nothing from the target

    def rollback(self, length: int) -> None:
        rollback(self.target_cache, None, length)  # the module's `rollback`, not this method


class DraftModelProposer(ChainProposer):
    """A draft model: any `LlamaForCausalLM` with the target's vocabulary, with its own KVCache;
    k forwards per proposal, each guess drawn from its logits (q_i recorded when sampling)."""

    def __init__(self, target, draft_model: nn.Module, params: SamplingParams, generator):
        super().__init__(target, params, generator)
        vocab = target.config.vocab_size
        if draft_model.config.vocab_size != vocab:
            raise ValueError(f"draft vocabulary ({draft_model.config.vocab_size}) differs from the "
                             f"target's ({vocab})")
        self.draft_model = draft_model
        self.context = min(self.context, draft_model.config.max_position_embeddings)
        self.draft_cache: KVCache | None = None

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        draft = self.draft_model
        self.draft_cache = KVCache(draft.config, 1, max_len, device=self.target.device, dtype=draft.dtype)
        prefill(draft, self.draft_cache, prompt_ids[:-1])
        super().start(target_cache, prompt_ids, max_len)

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.draft_model, self.draft_cache, ids, k), calls=k)

    def rollback(self, length: int) -> None:
        rollback(self.target_cache, self.draft_cache, length)


class FunctionProposer(ChainProposer):
    """A function (token_ids, k) -> up to k guesses, such as prompt lookup: one call per
    proposal, deterministic guesses, so q is one-hot."""

    def __init__(self, target, function: Callable[[list, int], list], params: SamplingParams, generator):
        super().__init__(target, params, generator)
        self.function = function

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.function, None, ids, k), calls=int(k > 0))


class FeatureProposer(ChainProposer):
    """A `decodelab.decoding.eagle.FeatureDrafter`: a `FeatureDraftSession` turns the target's
    features into guesses, so the target's passes return its features too: the prompt's at
    `start`, and the verify pass's, of which `observe` hands the accepted ones to the session."""

    def __init__(self, target, drafter: FeatureDrafter, params: SamplingParams, generator):
        super().__init__(target, params, generator)
        if drafter.target is not target:
            raise ValueError("this FeatureDrafter is attached to another model: drafter.attach(target) first")
        self.drafter = drafter
        self.session: FeatureDraftSession | None = None
        self.features: torch.Tensor | None = None  # [k'+1, E]: the last verify pass's

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        self.target_cache = target_cache
        self.session = _late("FeatureDraftSession")(self.drafter, max_len)
        if len(prompt_ids) > 1:  # the prefill's features: the session's first entries
            prompt = torch.tensor([prompt_ids[:-1]], device=self.target.device)
            self.session.add_features(self.target.features(prompt, kv_cache=target_cache)[0])

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.drafter, self.session, ids, k), calls=k)

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        target_logits, self.features = verify_with_features(self.target, self.target_cache, pending, draft.tokens)
        return target_logits

    def observe(self, emitted: torch.Tensor) -> None:
        self.session.add_features(self.features[:len(emitted)])  # pending's and the accepted drafts'


class TreeProposer(FeatureProposer):
    """A feature drafter's top-`width` candidates for the next token, judged in one tree-masked
    pass (`decodelab.decoding.draft_tree`; greedy, k = 1). Only the accepted candidate's cache
    row and features are kept."""

    def __init__(self, target, drafter: FeatureDrafter, params: SamplingParams, generator, width: int):
        super().__init__(target, drafter, params, generator)
        self.width, self.max_len = width, 0
        self.row = 0  # the accepted candidate's row in the last verify pass (0: none was)

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        super().start(target_cache, prompt_ids, max_len)
        self.max_len = max_len

    def propose(self, ids: list[int], k: int) -> Draft:
        width = min(self.width, self.max_len - len(ids)) if k else 0  # the cache must hold them all
        candidates = _late("top_candidates")(self.session, ids, width)  # [w]
        return Draft(candidates, None, calls=k, positions=min(1, len(candidates)))

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        target_logits, self.features = _late("verify_candidates")(self.target, self.target_cache, pending,
                                                                  draft.tokens)
        return target_logits  # [w+1, V]

    def accept(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        emitted, self.row = _late("accept_candidate")(draft.tokens, target_logits)
        return emitted

    def observe(self, emitted: torch.Tensor) -> None:
        self.session.add_features(self.features[_late("path_rows")(self.row)])  # the accepted path

    def rollback(self, length: int) -> None:
        _late("keep_row")(self.target_cache, self.row, length)


def make_proposer(target, drafter: Drafter, params: SamplingParams, generator: torch.Generator | None,
                  tree_width: int = 1) -> DraftProposer:
    """The adapter for this kind of drafter, checked against the target: a feature drafter (a
    `TreeProposer` when tree_width > 1), a draft model, or a function. tree_width > 1 is only
    for a feature drafter (`stream_speculative` checks it)."""
    if _is_eagle_instance(drafter, "FeatureDrafter"):
        if tree_width > 1:
            return TreeProposer(target, drafter, params, generator, tree_width)
        return FeatureProposer(target, drafter, params, generator)
    if isinstance(drafter, nn.Module):
        return DraftModelProposer(target, drafter, params, generator)
    if callable(drafter):
        return FunctionProposer(target, drafter, params, generator)
    raise ValueError(f"drafter must be a draft model or a function (token_ids, k) -> ids, got {drafter!r}")


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
        num_accepted = num_emitted - 1
        self.proposed += len(draft.tokens)
        self.accepted += num_accepted
        self.rejected += num_accepted < draft.positions
        self.target_calls += 1
        self.draft_calls += draft.calls


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
    k = num_speculative_tokens
    check_int("num_speculative_tokens", k, minimum=1)
    check_int("tree_width", tree_width, minimum=1)
    if tree_width > 1 and not (_is_eagle_instance(drafter, "FeatureDrafter") and params.greedy and k == 1):
        raise ValueError("tree_width > 1 needs a feature drafter, temperature 0 and num_speculative_tokens=1")
    if params.repetition_penalty != 1:
        raise ValueError("speculative decoding does not support repetition_penalty != 1")
    proposer = make_proposer(target, drafter, params, make_generator(params.seed, target.device), tree_width)
    check_prompt(prompt_ids, proposer.context, target.config.vocab_size)
    max_len = len(prompt_ids) + min(params.max_tokens, proposer.context - len(prompt_ids))
    proposer.start(KVCache(target.config, 1, max_len, device=target.device, dtype=target.dtype), prompt_ids, max_len)
    stops = stop_token_set(params, stop_token_ids)
    stats = stats if stats is not None else SpeculativeStats()
    ids, pending = list(prompt_ids), torch.tensor(prompt_ids[-1:], device=target.device)  # pending [1]
    while len(ids) < max_len:
        draft = proposer.propose(ids, min(k, max_len - len(ids) - 1))  # never draft past max_tokens
        target_logits = proposer.verify(pending, draft)  # [k'+1, V]
        emitted = proposer.accept(draft, target_logits)  # [n+1]: n accepted drafts, then the target's token
        proposer.observe(emitted)
        proposer.rollback(len(ids) + len(emitted) - 1)  # every token but the new pending one
        stats.record_step(draft, len(emitted))
        pending = emitted[-1:]
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

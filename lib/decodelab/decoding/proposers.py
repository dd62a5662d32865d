"""The drafters of speculative decoding, as the loop (`decodelab.decoding.speculative.stream_speculative`)
drives them: one protocol, `DraftProposer` (start / propose / verify / accept / observe /
rollback), and one adapter per kind of drafter, chosen by `make_proposer`:

    drafter                                                     adapter
    a draft model: a `LlamaForCausalLM` with the target's vocab  `DraftModelProposer`
    a function (token_ids, k) -> up to k ids, e.g. prompt lookup `FunctionProposer`
    a feature drafter: `decodelab.decoding.eagle.FeatureDrafter` `FeatureProposer`, or `TreeProposer`
                                                                 for tree_width > 1 (both in
                                                                 `decodelab.decoding.feature_proposers`)

The adapters run the loop's steps (`prefill`, `propose`, `verify`, `accept_draft_tokens`,
`rollback`, and for a draft model the whole `speculative_step`) as attributes of the
`speculative` module, looked up at each call: notebook 09 and the kept-bug tests swap a step
there (`mock.patch.object(speculative, "speculative_step", ...)`) and the loop must run theirs.
The feature drafter's adapters, with `eagle` and `draft_tree`, are imported only when a feature
drafter is used.

Shapes: k' proposed tokens, V vocab_size.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Union

import torch
from torch import nn

from decodelab.decoding import speculative
from decodelab.decoding.sampling import probs
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams

if TYPE_CHECKING:
    from decodelab.decoding.eagle import FeatureDrafter
    from decodelab.decoding.speculative import SpeculativeStats

# What a caller passes as `drafter` (the table above); `make_proposer` wraps it in a `DraftProposer`.
Drafter = Union[nn.Module, "FeatureDrafter", Callable[[list, int], list]]


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

    def step(self, ids: list[int], k: int, stats: SpeculativeStats) -> torch.Tensor:
        """One iteration of the loop: propose up to k guesses after ids, verify them in one target
        pass, accept, observe, roll back to len(ids) + n; count it into stats -> the emitted
        tokens [n+1]."""


class ChainProposer:
    """What drafters of a chain d_1 .. d_k' share: the target's prefill, a plain verify pass, the
    acceptance rule (greedy, or `accept_draft_tokens`), nothing to observe, and a rollback of the
    target's cache. Subclasses give `propose` and add their own state. Every step is read from
    the `speculative` module at call time (module docstring)."""

    def __init__(self, target, params: SamplingParams, generator: torch.Generator | None):
        self.target, self.params, self.generator = target, params, generator
        self.context = target.config.max_position_embeddings
        self.target_cache: KVCache | None = None  # set by `start`

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        self.target_cache = target_cache
        speculative.prefill(self.target, target_cache, prompt_ids[:-1])

    def _propose(self, drafter, state, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`speculative.propose` (tokens [k'], probs [k', V] or None) for this drafter and state."""
        config = self.target.config
        return speculative.propose(drafter, state, ids, k, self.params, self.generator, config.vocab_size,
                                   self.target.device)

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        return speculative.verify(self.target, self.target_cache, pending, draft.tokens)

    def accept(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:
            return speculative.greedy_accept(draft.tokens, target_logits)
        target_probs = probs(target_logits, self.params)  # [k'+1, V]
        return speculative.accept_draft_tokens(draft.tokens, draft.probs, target_probs, self.generator)

    def observe(self, emitted: torch.Tensor) -> None:
        pass  # a draft model or a function learns nothing from the target

    def rollback(self, length: int) -> None:
        speculative.rollback(self.target_cache, None, length)

    def step(self, ids: list[int], k: int, stats: SpeculativeStats) -> torch.Tensor:
        draft = self.propose(ids, k)
        pending = torch.tensor(ids[-1:], device=self.target.device)  # [1]: in no cache yet
        target_logits = self.verify(pending, draft)  # [k'+1, V]
        emitted = self.accept(draft, target_logits)  # [n+1]: n accepted guesses, then the target's token
        self.observe(emitted)
        self.rollback(len(ids) + len(emitted) - 1)  # every token but the new pending one
        stats.record_step(draft, len(emitted))
        return emitted


class DraftModelProposer(ChainProposer):
    """A draft model: any `LlamaForCausalLM` with the target's vocabulary, with its own KVCache;
    k forwards per proposal, each guess drawn from its logits (q_i recorded when sampling). Its
    `step` is `speculative.speculative_step` (the whole step as one function, notebook 09's)."""

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
        speculative.prefill(draft, self.draft_cache, prompt_ids[:-1])
        super().start(target_cache, prompt_ids, max_len)

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.draft_model, self.draft_cache, ids, k), calls=k)

    def rollback(self, length: int) -> None:
        speculative.rollback(self.target_cache, self.draft_cache, length)

    def step(self, ids: list[int], k: int, stats: SpeculativeStats) -> torch.Tensor:
        """`speculative.speculative_step`: the same stages as `ChainProposer.step`, as one function."""
        emitted = speculative.speculative_step(self.target, self.draft_model, self.target_cache, self.draft_cache,
                                               ids, k, self.params, self.generator)
        stats.record(k, k, k, len(emitted))  # k guesses for k positions, one draft forward each
        return emitted


class FunctionProposer(ChainProposer):
    """A function (token_ids, k) -> up to k guesses, such as prompt lookup: one call per
    proposal, deterministic guesses, so q is one-hot."""

    def __init__(self, target, function: Callable[[list, int], list], params: SamplingParams, generator):
        super().__init__(target, params, generator)
        self.function = function

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.function, None, ids, k), calls=int(k > 0))


def is_feature_drafter(drafter) -> bool:
    """isinstance(drafter, decodelab.decoding.eagle.FeatureDrafter), without importing eagle: until
    something has imported it, no FeatureDrafter can exist."""
    eagle = sys.modules.get("decodelab.decoding.eagle")
    return eagle is not None and isinstance(drafter, eagle.FeatureDrafter)


def make_proposer(target, drafter: Drafter, params: SamplingParams, generator: torch.Generator | None,
                  tree_width: int = 1) -> DraftProposer:
    """The adapter for this kind of drafter, checked against the target: a feature drafter (a
    `TreeProposer` when tree_width > 1), a draft model, or a function. tree_width > 1 is only
    for a feature drafter (`stream_speculative` checks it)."""
    if is_feature_drafter(drafter):
        from decodelab.decoding.feature_proposers import FeatureProposer, TreeProposer  # eagle is loaded already

        if tree_width > 1:
            return TreeProposer(target, drafter, params, generator, tree_width)
        return FeatureProposer(target, drafter, params, generator)
    if isinstance(drafter, nn.Module):
        return DraftModelProposer(target, drafter, params, generator)
    if callable(drafter):
        return FunctionProposer(target, drafter, params, generator)
    raise ValueError(f"drafter must be a draft model or a function (token_ids, k) -> ids, got {drafter!r}")

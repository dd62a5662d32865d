"""The drafters of a chain, as the loop (`decodelab.decoding.speculative.loop`) drives them:
one protocol, `DraftProposer` (start / propose / verify / accept / observe / rollback / step),
and one adapter per kind of drafter (`make_proposer` in `loop` chooses):

    drafter                                                     adapter
    a draft model: a `LlamaForCausalLM` with the target's vocab  `DraftModelProposer`
    a function (token_ids, k) -> up to k ids, e.g. prompt lookup `FunctionProposer`
    a feature drafter: `decodelab.decoding.eagle.FeatureDrafter` `FeatureProposer` or `TreeProposer`
                                                                 (`feature_proposers`, one layer up)

Every adapter runs the steps of the `SpeculativeSteps` it is given (`steps`, one layer down),
so a step a caller passes to the loop is the one that runs; a draft model's adapter runs the
whole `speculative_step`. Also here: `Draft` (one step's proposal), `SpeculativeStats` (what
the steps proposed, accepted and cost) and `truncated_draft` (an early-exit draft model that
shares the target's weights).

Shapes: k' proposed tokens, V vocab_size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from decodelab.decoding.sampling import probs
from decodelab.decoding.speculative.steps import LIBRARY_STEPS, SpeculativeSteps
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import LlamaForCausalLM
from decodelab.params import SamplingParams
from decodelab.validation import check_int


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
    target's cache. Subclasses give `propose` and add their own state. Every step is the one
    `steps` holds (the library's by default)."""

    def __init__(
        self, target, params: SamplingParams, generator: torch.Generator | None, steps: SpeculativeSteps = LIBRARY_STEPS
    ):
        self.target, self.params, self.generator, self.steps = target, params, generator, steps
        self.context = target.config.max_position_embeddings
        self.target_cache: KVCache | None = None  # set by `start`

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        self.target_cache = target_cache
        self.steps.prefill(self.target, target_cache, prompt_ids[:-1])

    def _propose(self, drafter, state, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`steps.propose` (tokens [k'], probs [k', V] or None) for this drafter and state."""
        config = self.target.config
        return self.steps.propose(
            drafter, state, ids, k, self.params, self.generator, config.vocab_size, self.target.device
        )

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        return self.steps.verify(self.target, self.target_cache, pending, draft.tokens)

    def accept(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:
            return self.steps.greedy_accept(draft.tokens, target_logits)
        target_probs = probs(target_logits, self.params)  # [k'+1, V]
        return self.steps.accept_draft_tokens(draft.tokens, draft.probs, target_probs, self.generator)

    def observe(self, emitted: torch.Tensor) -> None:
        pass  # a draft model or a function learns nothing from the target

    def rollback(self, length: int) -> None:
        self.steps.rollback(self.target_cache, None, length)

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
    `step` is a whole `speculative_step` (`SpeculativeSteps.draft_model_step`: notebook 09 passes
    the learner's)."""

    def __init__(
        self, target, draft_model: nn.Module, params: SamplingParams, generator, steps: SpeculativeSteps = LIBRARY_STEPS
    ):
        super().__init__(target, params, generator, steps)
        vocab = target.config.vocab_size
        if draft_model.config.vocab_size != vocab:
            raise ValueError(f"draft vocabulary ({draft_model.config.vocab_size}) differs from the target's ({vocab})")
        self.draft_model = draft_model
        self.context = min(self.context, draft_model.config.max_position_embeddings)
        self.draft_cache: KVCache | None = None

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        draft = self.draft_model
        self.draft_cache = KVCache(draft.config, 1, max_len, device=self.target.device, dtype=draft.dtype)
        self.steps.prefill(draft, self.draft_cache, prompt_ids[:-1])
        super().start(target_cache, prompt_ids, max_len)

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.draft_model, self.draft_cache, ids, k), calls=k)

    def rollback(self, length: int) -> None:
        self.steps.rollback(self.target_cache, self.draft_cache, length)

    def step(self, ids: list[int], k: int, stats: SpeculativeStats) -> torch.Tensor:
        """A whole `speculative_step`: the same stages as `ChainProposer.step`, as one function."""
        emitted = self.steps.draft_model_step(
            self.target, self.draft_model, self.target_cache, self.draft_cache, ids, k, self.params, self.generator
        )
        stats.record(k, k, k, len(emitted))  # k guesses for k positions, one draft forward each
        return emitted


class FunctionProposer(ChainProposer):
    """A function (token_ids, k) -> up to k guesses, such as prompt lookup: one call per
    proposal, deterministic guesses, so q is one-hot."""

    def __init__(
        self,
        target,
        function: Callable[[list, int], list],
        params: SamplingParams,
        generator,
        steps: SpeculativeSteps = LIBRARY_STEPS,
    ):
        super().__init__(target, params, generator, steps)
        self.function = function

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.function, None, ids, k), calls=int(k > 0))


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

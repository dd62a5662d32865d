"""The feature drafter's adapters to the speculative loop, one layer above the chain's
(`proposers`) and below the loop that chooses them (`loop.make_proposer`):

    FeatureProposer  a chain d_1 .. d_k from a `decodelab.decoding.eagle.FeatureDrafter`, which
                     reads the target's features (last hidden states) as well as its tokens
    TreeProposer     the drafter's top-w candidates for the next token, judged in one
                     tree-masked target pass (`decodelab.decoding.draft_tree`; greedy, k = 1)

The chain's proposal, acceptance and rollback are its `SpeculativeSteps`', as in
`ChainProposer`; its verify pass is `steps.verify_with_features` (the logits and the target's
features). The tree's steps are `draft_tree`'s, named here (the tests patch them in this
module: "decodelab.decoding.speculative.feature_proposers.keep_row").

Shapes: k' proposed tokens, w candidates, V vocab_size, E hidden_size.
"""

from __future__ import annotations

import torch

from decodelab.decoding.draft_tree import accept_candidate, keep_row, path_rows, top_candidates, verify_candidates
from decodelab.decoding.eagle import FeatureDrafter, FeatureDraftSession
from decodelab.decoding.speculative.proposers import ChainProposer, Draft
from decodelab.decoding.speculative.steps import LIBRARY_STEPS, SpeculativeSteps, verify_with_features
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams


class FeatureProposer(ChainProposer):
    """A `FeatureDrafter`: a `FeatureDraftSession` turns the target's features into guesses, so
    the target's passes return its features too: the prompt's at `start`, and the verify pass's,
    of which `observe` hands the accepted ones to the session."""

    def __init__(
        self,
        target,
        drafter: FeatureDrafter,
        params: SamplingParams,
        generator,
        steps: SpeculativeSteps = LIBRARY_STEPS,
    ):
        super().__init__(target, params, generator, steps)
        if drafter.target is not target:
            raise ValueError("this FeatureDrafter is attached to another model: drafter.attach(target) first")
        self.drafter = drafter
        self.session: FeatureDraftSession | None = None
        self.features: torch.Tensor | None = None  # [k'+1, E]: the last verify pass's

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        self.target_cache = target_cache
        self.session = FeatureDraftSession(self.drafter, max_len)
        if len(prompt_ids) > 1:  # the prefill's features: the session's first entries
            prompt = torch.tensor([prompt_ids[:-1]], device=self.target.device)
            self.session.add_features(self.target.features(prompt, kv_cache=target_cache)[0])

    def propose(self, ids: list[int], k: int) -> Draft:
        return Draft(*self._propose(self.drafter, self.session, ids, k), calls=k)

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        target_logits, self.features = verify_with_features(self.target, self.target_cache, pending, draft.tokens)
        return target_logits  # [k'+1, V]

    def observe(self, emitted: torch.Tensor) -> None:
        self.session.add_features(self.features[: len(emitted)])  # pending's and the accepted drafts'


class TreeProposer(FeatureProposer):
    """A feature drafter's top-`width` candidates for the next token, judged in one tree-masked
    pass (greedy, k = 1). Only the accepted candidate's cache row and features are kept."""

    def __init__(
        self,
        target,
        drafter: FeatureDrafter,
        params: SamplingParams,
        generator,
        width: int,
        steps: SpeculativeSteps = LIBRARY_STEPS,
    ):
        super().__init__(target, drafter, params, generator, steps)
        self.width, self.max_len = width, 0
        self.row = 0  # the accepted candidate's row in the last verify pass (0: none was)

    def start(self, target_cache: KVCache, prompt_ids: list[int], max_len: int) -> None:
        super().start(target_cache, prompt_ids, max_len)
        self.max_len = max_len

    def propose(self, ids: list[int], k: int) -> Draft:
        width = min(self.width, self.max_len - len(ids)) if k else 0  # the cache must hold them all
        candidates = top_candidates(self.session, ids, width)  # [w]
        return Draft(candidates, None, calls=k, positions=min(1, len(candidates)))

    def verify(self, pending: torch.Tensor, draft: Draft) -> torch.Tensor:
        target_logits, self.features = verify_candidates(self.target, self.target_cache, pending, draft.tokens)
        return target_logits  # [w+1, V]

    def accept(self, draft: Draft, target_logits: torch.Tensor) -> torch.Tensor:
        emitted, self.row = accept_candidate(draft.tokens, target_logits)
        return emitted

    def observe(self, emitted: torch.Tensor) -> None:
        self.session.add_features(self.features[path_rows(self.row)])  # the accepted path

    def rollback(self, length: int) -> None:
        keep_row(self.target_cache, self.row, length)

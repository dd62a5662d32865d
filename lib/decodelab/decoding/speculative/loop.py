"""The generation loop of speculative decoding: the top layer of `decodelab.decoding.speculative`.

`stream_speculative` (and `speculative_generate`, its whole output) drives any drafter through
one protocol, `proposers.DraftProposer`, with the adapter `make_proposer` chooses for it: a
draft model, a function (token_ids, k) -> up to k guesses such as
`decodelab.decoding.lookup.propose_from_prompt`, or a `decodelab.decoding.eagle.FeatureDrafter`,
which also reads the target's last hidden states (`feature_proposers`). A function's guesses are
deterministic, so q_i is one-hot: d_i is accepted with probability p_i(d_i), and a rejection
draws from p_i with d_i removed. At temperature 0 a feature drafter can also put its top-w
candidates for the next token to the target in one pass (`tree_width=w`,
`decodelab.decoding.draft_tree`).

Each step emits 1 .. k+1 tokens for one target forward. The steps it runs are those of its
`steps=SpeculativeSteps(...)` (`steps`), the library's unless the caller names its own.
"""

from __future__ import annotations

from typing import Iterator

import torch

from decodelab.decoding.eagle import FeatureDrafter
from decodelab.decoding.generate import check_prompt, make_generator, stop_token_set
from decodelab.decoding.speculative.feature_proposers import FeatureProposer, TreeProposer
from decodelab.decoding.speculative.proposers import (
    DraftModelProposer,
    DraftProposer,
    FunctionProposer,
    SpeculativeStats,
)
from decodelab.decoding.speculative.steps import LIBRARY_STEPS, Drafter, SpeculativeSteps
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams
from decodelab.validation import check_int


def make_proposer(
    target,
    drafter: Drafter,
    params: SamplingParams,
    generator: torch.Generator | None,
    tree_width: int = 1,
    steps: SpeculativeSteps = LIBRARY_STEPS,
) -> DraftProposer:
    """The adapter for this kind of drafter, checked against the target and running `steps`: a
    feature drafter (a `TreeProposer` when tree_width > 1), a draft model, or a function.
    tree_width > 1 is only for a feature drafter (`stream_speculative` checks it)."""
    if isinstance(drafter, FeatureDrafter):
        if tree_width > 1:
            return TreeProposer(target, drafter, params, generator, tree_width, steps)
        return FeatureProposer(target, drafter, params, generator, steps)
    if isinstance(drafter, torch.nn.Module):
        return DraftModelProposer(target, drafter, params, generator, steps)
    if callable(drafter):
        return FunctionProposer(target, drafter, params, generator, steps)
    raise ValueError(f"drafter must be a draft model or a function (token_ids, k) -> ids, got {drafter!r}")


@torch.inference_mode()
def stream_speculative(
    target,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    num_speculative_tokens: int = 4,
    stop_token_ids=(),
    stats: SpeculativeStats | None = None,
    tree_width: int = 1,
    *,
    steps: SpeculativeSteps | None = None,
) -> Iterator[int]:
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
    steps: the `SpeculativeSteps` to run (None: the library's), e.g.
    `SpeculativeSteps(speculative_step=yours)` for a draft model's whole step.
    """
    steps = steps if steps is not None else LIBRARY_STEPS
    if not isinstance(steps, SpeculativeSteps):
        raise TypeError(f"steps must be a SpeculativeSteps, got {type(steps).__name__}")
    k = num_speculative_tokens
    check_int("num_speculative_tokens", k, minimum=1)
    check_int("tree_width", tree_width, minimum=1)
    if tree_width > 1 and not (isinstance(drafter, FeatureDrafter) and params.greedy and k == 1):
        raise ValueError("tree_width > 1 needs a feature drafter, temperature 0 and num_speculative_tokens=1")
    if params.repetition_penalty != 1:
        raise ValueError("speculative decoding does not support repetition_penalty != 1")
    proposer = make_proposer(target, drafter, params, make_generator(params.seed, target.device), tree_width, steps)
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


def speculative_generate(
    target,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    num_speculative_tokens: int = 4,
    stop_token_ids=(),
    tree_width: int = 1,
    *,
    steps: SpeculativeSteps | None = None,
) -> tuple[list[int], SpeculativeStats]:
    """The whole output of `stream_speculative` -> (output_ids, stats)."""
    stats = SpeculativeStats()
    output = list(
        stream_speculative(
            target, drafter, prompt_ids, params, num_speculative_tokens, stop_token_ids, stats, tree_width, steps=steps
        )
    )
    return output, stats

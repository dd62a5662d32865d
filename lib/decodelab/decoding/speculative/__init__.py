"""Speculative decoding: a cheap drafter guesses k tokens, the target checks all of them in ONE
forward pass, and a rejection rule keeps the output distributed exactly as the target's
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

The package in layers, each importing only those below it (a contract in pyproject.toml):

    loop               `stream_speculative`, `speculative_generate`, `make_proposer`
    feature_proposers  the feature drafter's adapters, chain and tree
    proposers          the `DraftProposer` protocol, the adapters for a draft model and a function,
                       `Draft`, `SpeculativeStats`, `truncated_draft`
    steps | theory     the acceptance rule, prefill / propose / verify / rollback, `speculative_step`
                       and `SpeculativeSteps`; the expected tokens per call and speed-up

The loop runs the steps it is given, `steps=SpeculativeSteps(...)`, the library's by default:
notebook 09 passes the learner's `speculative_step` and `accept_draft_tokens` there, as the
engine takes an `EngineHooks`. Every public name is importable from here.
"""

from decodelab.decoding.speculative.loop import make_proposer, speculative_generate, stream_speculative
from decodelab.decoding.speculative.proposers import Draft, DraftProposer, SpeculativeStats, truncated_draft
from decodelab.decoding.speculative.steps import (
    Drafter,
    SpeculativeSteps,
    accept_draft_tokens,
    accept_draft_tokens_batched,
    greedy_accept,
    prefill,
    propose,
    rollback,
    speculative_step,
    verify,
    verify_with_features,
)
from decodelab.decoding.speculative.theory import acceptance_rate, expected_speedup, expected_tokens_per_call, tvd

__all__ = [
    "Draft",
    "DraftProposer",
    "Drafter",
    "SpeculativeStats",
    "SpeculativeSteps",
    "accept_draft_tokens",
    "accept_draft_tokens_batched",
    "acceptance_rate",
    "expected_speedup",
    "expected_tokens_per_call",
    "greedy_accept",
    "make_proposer",
    "prefill",
    "propose",
    "rollback",
    "speculative_generate",
    "speculative_step",
    "stream_speculative",
    "truncated_draft",
    "tvd",
    "verify",
    "verify_with_features",
]

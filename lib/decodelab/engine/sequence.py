"""A request in flight: its tokens, its blocks, its sampling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from decodelab.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_index: int  # which prompt of the generate() call
    sample_index: int  # which of its n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_scheduled_tokens: int = 0  # chunked prefill: tokens the next pass feeds (0: all uncomputed ones)
    draft_computed_tokens: int = 0  # the same for the draft model's cache (speculative decoding)
    draft_state: object = None  # a feature drafter's FeatureDraftSession (speculative decoding)
    finish_reason: str | None = None  # "stop", "length", "error" (sampling failed) or "abort" (its call raised)
    error: str | None = None  # with finish_reason "error": what went wrong
    generator: torch.Generator | None = None
    text: str = ""
    decoder: object = None  # a StreamDecoder, set by the engine
    stop_token_ids: frozenset = frozenset()  # ids that end it (`stop_token_set`), set by the engine once
    num_preemptions: int = 0
    siblings: list = field(default_factory=list)  # n > 1: forked from this one after its prefill
    first_token_time: float | None = None
    arrival_time: float = 0.0
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next forward pass must feed (all uncomputed ones)."""
        return len(self) - self.num_computed_tokens

    @property
    def num_tokens_this_step(self) -> int:
        """Tokens the next forward pass feeds: the slice a chunking scheduler chose
        (num_scheduled_tokens), else all uncomputed ones. The sequence samples its next token
        only after a pass that leaves none uncomputed."""
        return self.num_scheduled_tokens or self.num_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
class Request:
    """One prompt of a `LLM.generate` call, from admission to its `RequestOutput`.

    prompt: the prompt's text, or None when it was given as token ids.
    prompt_token_ids: the prompt as token ids (encoded here when it was text).
    seqs: its SamplingParams.n sequences, sample_index 0 .. n-1; the first is scheduled, the
        others are forked from it after its prefill. Empty when the prompt was refused.
    error: why the prompt was refused ("prompt 2: the prompt is empty"), else None.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None

    @property
    def is_done(self) -> bool:
        """Refused, or every one of its sequences finished."""
        return self.error is not None or all(seq.is_finished for seq in self.seqs)

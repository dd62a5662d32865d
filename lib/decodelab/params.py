"""`SamplingParams`: how one request wants its tokens chosen (vLLM's names and defaults)."""
from __future__ import annotations

from dataclasses import dataclass, field

from decodelab.validation import check_int, is_int


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_k 0 or -1 and top_p 1.0 switch those filters off.

    repetition_penalty follows CTRL / Hugging Face: > 1 discourages every token already in
    the prompt or the output. `seed` makes one request's sampling repeatable. `stop` holds
    strings that end generation (not included in the text); `stop_token_ids` extra ids
    that end it (included in token_ids, as the model's own end-of-turn token is).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.validate()

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        check_int("top_k", self.top_k, minimum=-1, allowed="an integer >= 1, or 0 / -1 to disable")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("n", self.n, minimum=1)
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k >= 1

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1

"""`SamplingParams`: how one request wants its tokens chosen (vLLM's names and defaults).

Every value is checked when the object is made (and again when the engine admits it): a value
sampling cannot use is a ValueError naming it and its range, never clamped.

The ranges of temperature and repetition_penalty come from float32, the precision sampling runs
in, whose largest finite value is 3.4e38 (FLOAT32_MAX). Sampling divides every logit by the
temperature, and CTRL's penalty divides a seen token's positive logit by the penalty (or
multiplies a negative one by it). Softmax survives any finite logits but not an infinite one
(inf - inf is nan: "probability tensor contains either inf, nan or element < 0"). At the ends of
both ranges, [1e-8, 1e8] each, a logit x grows to at most |x| / (1e-8 * 1e-8) = |x| * 1e16 (or
|x| * 1e8 / 1e-8), so every logit below LARGEST_SAFE_LOGIT = 1e22 in magnitude stays finite: far
beyond what a model emits (SmolLM2's logits lie within +-50). Temperature 1e-40, by contrast, turns
a logit of 0.01 into 1e38 and one of 1 into inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decodelab.validation import as_integer, check_int, check_real, is_int, is_real

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-8, 1e8
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-8, 1e8
LARGEST_SAFE_LOGIT = 1e22  # every allowed (temperature, repetition_penalty) keeps |logit| below it finite
MAX_SEED = 2**63 - 1  # seeds are 64-bit; sample j of a request draws with seed + j


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_k 0 or -1 and top_p 1.0 switch those filters off.

    repetition_penalty follows CTRL / Hugging Face: > 1 discourages every token already in
    the prompt or the output. `seed` makes one request's sampling repeatable. `stop` holds
    strings that end generation (not included in the text); `stop_token_ids` extra ids
    that end it (included in token_ids, as the model's own end-of-turn token is).

    Ranges (each checked; a value outside is a ValueError): temperature 0 or in [1e-8, 1e8];
    top_k >= 1, or 0 / -1 (off; a k above the vocabulary keeps every token); top_p in (0, 1];
    repetition_penalty in [1e-8, 1e8] (1: off); max_tokens >= 1; n >= 1; seed None or in
    0..2**63-1; stop a string or a list of non-empty strings; stop_token_ids integers >= 0.
    The module's docstring says where the float ranges come from.
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
        # A lone string, a tuple or None become lists; a list of NumPy or tensor integers, ints.
        # Anything else stays as given, for validate() to name.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = [_int_or_as_is(t) for t in self.stop_token_ids]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first value out of its range (see the class docstring)."""
        if not (is_real(self.temperature) and self.temperature == 0):
            check_real(
                "temperature",
                self.temperature,
                MIN_TEMPERATURE,
                MAX_TEMPERATURE,
                allowed=f">= 0: 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
                f"(beyond, float32 sampling overflows)",
            )
        check_int("top_k", self.top_k, minimum=-1, allowed="an integer >= 1, or 0 / -1 to disable")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        check_real(
            "repetition_penalty",
            self.repetition_penalty,
            MIN_REPETITION_PENALTY,
            MAX_REPETITION_PENALTY,
            allowed=f"> 0: a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], 1 for none "
            f"(beyond, float32 sampling overflows)",
        )
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("n", self.n, minimum=1)
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_SEED, allowed="an integer in 0..2**63-1, or None")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k >= 1

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1


def _int_or_as_is(value):
    """An integer of any kind as a Python int; anything else unchanged (for validate to refuse)."""
    integer = as_integer(value)
    return value if integer is None else integer

"""From logits to the next token: temperature, top-k, top-p, repetition penalty, sampling.

Every function takes logits [..., V] (any leading dims, last dim = vocabulary) and returns
a tensor of the same shape; filtered-out entries become -inf so that softmax gives them
probability exactly 0. Within the valid ranges the results equal the Hugging Face logits
processors (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
RepetitionPenaltyLogitsProcessor).
"""
from __future__ import annotations

import torch

from decodelab.params import SamplingParams
from decodelab.validation import check_int


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature. temperature > 0; below 1 sharpens the distribution, above 1 flattens it."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use greedy decoding for 0), got {temperature}")
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (and every logit tied with the k-th); k >= vocabulary keeps all."""
    check_int("k", k, minimum=1)
    k = min(k, logits.shape[-1])
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p.

    Read aloud: sort tokens from most to least likely; keep a token if the tokens before it
    hold less than p of the mass. The most likely token is always kept. 0 < p <= 1.
    """
    if not 0 < p <= 1:
        raise ValueError(f"top-p needs 0 < p <= 1, got {p}")
    if p == 1:  # keeps all; below, float32 rounding can make the mass before a tiny tail exactly 1.0
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., V]: mass of strictly better tokens
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, token_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """The sign-aware repetition penalty (Hugging Face's and vLLM's; CTRL divides every logit) for every
    distinct id in token_ids [..., n] (prompt + output so far): a positive logit is divided by `penalty`,
    a negative one multiplied, once per id.
    penalty > 0; 1 leaves logits unchanged."""
    if not penalty > 0:
        raise ValueError(f"repetition penalty must be > 0, got {penalty}")
    if token_ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must have the leading dims of logits "
                         f"{tuple(logits.shape)}")
    if token_ids.shape[-1] == 0 or penalty == 1:
        return logits
    token_ids = token_ids.long()
    seen = logits.gather(-1, token_ids)
    penalized = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, token_ids, penalized)  # duplicates write the same value: once per id


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (Hugging Face's order). Needs temperature > 0."""
    logits = apply_temperature(logits.float(), params.temperature)
    if params.uses_top_k:
        logits = top_k_filter(logits, params.top_k)
    if params.uses_top_p:
        logits = top_p_filter(logits, params.top_p)
    return logits


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary, the lowest id among exact ties: [..., V] -> [...]."""
    return logits.argmax(dim=-1)


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from, [..., V], float32. Greedy is a one-hot."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).float()
    return filter_logits(logits, params).softmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row: logits [..., V] -> ids [...] (int64). Temperature 0 is greedy.

    Repetition penalty needs the history, so the caller applies it first.
    """
    if params.greedy:
        return greedy(logits)
    distribution = probs(logits, params)
    flat = distribution.reshape(-1, distribution.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(distribution.shape[:-1])


def draw_draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's guess: logits [V] -> (token id [1], the distribution q it was drawn from [V],
    or None when greedy, where q is one-hot and the acceptance rule does not need it)."""
    if params.greedy:
        return greedy(logits)[None], None
    q = probs(logits, params)  # [V]
    return torch.multinomial(q, 1, generator=generator), q


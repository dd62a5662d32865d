"""From logits to the next token: temperature, top-k, top-p, repetition penalty, sampling.

Every function takes logits [..., V] (any leading dims, last dim = vocabulary) and returns
a tensor of the same shape; filtered-out entries become -inf so that softmax gives them
probability exactly 0. Within the valid ranges the results equal the Hugging Face logits
processors (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
RepetitionPenaltyLogitsProcessor).

A batch, each row with its own request's settings (what the engine samples every step):
`process_logits` applies every processor to the whole batch in vLLM's order (repetition penalty,
temperature, top-k, top-p), and `sample_batch` draws each row's token from it with that row's own
generator, so a seeded request gets the same tokens in a batch as alone (`sample`).
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
        raise ValueError(
            f"token_ids {tuple(token_ids.shape)} must have the leading dims of logits {tuple(logits.shape)}"
        )
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


def draw_draft_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's guess: logits [V] -> (token id [1], the distribution q it was drawn from [V],
    or None when greedy, where q is one-hot and the acceptance rule does not need it)."""
    if params.greedy:
        return greedy(logits)[None], None
    q = probs(logits, params)  # [V]
    return torch.multinomial(q, 1, generator=generator), q


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories=None) -> torch.Tensor:
    """Every row's logits processors, with that row's own settings, in vLLM's order.

    A server samples the next token of many requests at once, each with its own `SamplingParams`.
    vLLM's sampler does not loop over the rows: it turns the settings into tensors, one entry per
    row, and applies each processor to the whole batch. Row by row the result equals
    `apply_repetition_penalty` then `filter_logits` (bit for bit).

    logits [B, V]; params: B SamplingParams, row i uses params[i]; histories: None, or B lists
    (or 1-D tensors) of token ids, row i's prompt + output so far, for its repetition penalty.
    Order: repetition penalty, temperature, top-k (if top_k >= 1), top-p (if top_p < 1). A greedy
    row (temperature 0) gets the repetition penalty only (its argmax is taken as it is; it is
    never divided by 0). Returns a new float32 tensor [B, V], removed entries float("-inf"); the
    caller's logits are left as they were. Raises ValueError unless logits is 2-D with one row per
    params entry (and per history).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(
            f"logits must be [B, V] with one row per SamplingParams: got shape {tuple(logits.shape)} "
            f"for {len(params)} params"
        )
    if histories is not None and len(histories) != len(params):
        raise ValueError(f"histories must have one entry per row: got {len(histories)} for {len(params)} rows")
    out = logits.float().clone()  # [B, V]
    for row, (p, history) in enumerate(zip(params, histories if histories is not None else [None] * len(params))):
        if history is not None and len(history) and p.repetition_penalty != 1:
            ids = torch.as_tensor(history, device=out.device).long()
            out[row] = apply_repetition_penalty(out[row], ids, p.repetition_penalty)
    sampled = [not p.greedy for p in params]
    if not any(sampled):
        return out
    vocab = out.shape[-1]
    temperature = torch.tensor([p.temperature if s else 1.0 for p, s in zip(params, sampled)], device=out.device)
    out = out / temperature[:, None]  # greedy rows divide by 1
    if any(s and p.uses_top_k and p.top_k < vocab for p, s in zip(params, sampled)):
        top_k = torch.tensor(
            [min(p.top_k, vocab) if s and p.uses_top_k else vocab for p, s in zip(params, sampled)], device=out.device
        )
        kth_largest = out.sort(dim=-1, descending=True).values.gather(-1, (top_k - 1)[:, None])  # [B, 1]
        out = out.masked_fill(out < kth_largest, float("-inf"))  # ties with the k-th stay
    if any(s and p.uses_top_p for p, s in zip(params, sampled)):
        top_p = torch.tensor([p.top_p if s else 1.0 for p, s in zip(params, sampled)], device=out.device)
        sorted_logits, order = out.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]: mass of the strictly better tokens
        remove_sorted = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]  # p = 1 keeps all, whatever the rounding
        remove_sorted[:, 0] = False  # the most likely token always stays
        out = out.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))
    return out


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators=None, histories=None) -> torch.Tensor:
    """One token per row, each row with its own settings and generator: logits [B, V] -> ids [B] (int64).

    params, histories: as `process_logits` (which runs once for the whole batch); generators: None,
    or B `torch.Generator`s (or None each: torch's global one), row i drawing with generators[i].
    A greedy row takes the argmax of its (penalized) logits; a sampled row one draw from its own
    distribution, so with the same generators the tokens equal `sample` called row by row (after
    `apply_repetition_penalty`). Every sampled row's distribution is checked before any is drawn:
    a RuntimeError for one that holds inf, nan or a negative value (a temperature so small that the
    logits overflow) leaves every generator as it was, so the caller can retry row by row.
    """
    processed = process_logits(logits, params, histories)  # [B, V]
    if generators is not None and len(generators) != len(params):
        raise ValueError(f"generators must have one entry per row: got {len(generators)} for {len(params)} rows")
    tokens = greedy(processed)  # [B]: the greedy rows' answer; the sampled rows' is overwritten below
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    distributions = processed[rows].softmax(dim=-1)  # [S, V]
    finite = torch.isfinite(distributions).all(dim=-1) & (distributions >= 0).all(dim=-1)
    if not bool(finite.all()):
        bad = rows[int((~finite).nonzero()[0, 0])]
        raise RuntimeError(
            f"probability tensor contains either inf, nan or element < 0 (row {bad}, "
            f"temperature={params[bad].temperature})"
        )
    for j, i in enumerate(rows):
        generator = None if generators is None else generators[i]
        tokens[i] = torch.multinomial(distributions[j : j + 1], 1, generator=generator)[0, 0]
    return tokens

"""The logits processors of a whole batch, each row with its own request's settings (notebook 02).

A server samples the next token of many requests at once, and each request brings its own
`SamplingParams`. vLLM's sampler does not loop over the rows: it turns the settings into
tensors, one entry per row, and applies every processor to the whole batch in one order:
the repetition penalty (it needs each row's history), then temperature, then top-k, then
top-p. A greedy row (temperature 0) keeps its logits after the penalty: its argmax is taken
as it is, and dividing by 0 is never done.

Row by row, the result equals the single-request functions of `decodelab.decoding.sampling`
applied in that order; the engine itself calls those (it samples one request at a time).

Shapes: B rows (requests), V vocabulary.
"""
from __future__ import annotations

import torch

from decodelab.decoding.sampling import apply_repetition_penalty
from decodelab.params import SamplingParams


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories=None) -> torch.Tensor:
    """Every row's logits processors, with that row's own settings, in vLLM's order.

    logits [B, V]; params: B SamplingParams, row i uses params[i]; histories: None, or B lists
    (or 1-D tensors) of token ids, row i's prompt + output so far, for its repetition penalty.
    Order: repetition penalty, temperature, top-k (if top_k >= 1), top-p (if top_p < 1). A greedy
    row (temperature 0) gets the repetition penalty only. Returns a new float32 tensor [B, V],
    removed entries float("-inf"); the caller's logits are left as they were. Raises ValueError
    unless logits is 2-D with one row per params entry (and per history).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with one row per SamplingParams: got shape {tuple(logits.shape)} "
                         f"for {len(params)} params")
    if histories is not None and len(histories) != len(params):
        raise ValueError(f"histories must have one entry per row: got {len(histories)} for {len(params)} rows")
    out = logits.float().clone()  # [B, V]
    for row, (p, history) in enumerate(zip(params, histories if histories is not None else [None] * len(params))):
        if history is not None and len(history) and p.repetition_penalty != 1:
            ids = torch.as_tensor(history, device=out.device).long()
            out[row] = apply_repetition_penalty(out[row], ids, p.repetition_penalty)
    sampled = [not p.greedy for p in params]
    vocab = out.shape[-1]
    temperature = torch.tensor([p.temperature if s else 1.0 for p, s in zip(params, sampled)], device=out.device)
    top_k = torch.tensor([min(p.top_k, vocab) if s and p.uses_top_k else vocab for p, s in zip(params, sampled)],
                         device=out.device)
    top_p = torch.tensor([p.top_p if s else 1.0 for p, s in zip(params, sampled)], device=out.device)
    out = out / temperature[:, None]  # greedy rows divide by 1
    sorted_logits = out.sort(dim=-1, descending=True).values  # [B, V]
    kth_largest = sorted_logits.gather(-1, (top_k - 1)[:, None])  # [B, 1]: row i's k-th largest
    out = out.masked_fill(out < kth_largest, float("-inf"))  # ties with the k-th stay
    sorted_logits, order = out.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]: mass of the strictly better tokens
    remove_sorted = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]  # p = 1 keeps all, whatever the rounding
    remove_sorted[:, 0] = False  # the most likely token always stays
    return out.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))


__all__ = ["process_logits"]

"""Several candidates for the next token, judged in ONE target pass: a draft tree of depth 1
(the smallest of the token trees of SpecInfer and EAGLE).

A chain drafter proposes its single best guess, and a wrong guess leaves the step with one
token. Proposing the drafter's top-w tokens instead, all at the same position and each blind
to the others (a tree mask), the target judges w alternatives in a (w + 1)-token pass, which on
a CPU costs about as much as a 2-token one. Greedy only: every emitted token is the target's
own argmax, so the output is target-only greedy decoding's.

The verify pass, for candidates c_1 .. c_w after the pending token p at position n:

    tokens      p    c_1   ...  c_w
    positions   n    n+1   ...  n+1
    cache rows  n    n+1   ...  n+w
    attends to  the prefix, p, and itself

With t the target's choice after p (row 0): if t is some c_i, the step emits c_i and the
target's choice after it (row i), and c_i's cache row moves to row n+1; otherwise it emits t.
Shapes: w candidates, V vocab_size, E hidden_size.
"""

from __future__ import annotations

import torch

from decodelab.decoding.eagle import FeatureDraftSession
from decodelab.decoding.sampling import greedy
from decodelab.model.attention import masked_attention
from decodelab.model.kv_cache import KVCache


class TreeMaskedCache:
    """One verify pass's view of a `KVCache`: the new rows are appended as usual, and new query t
    attends to every row held before the pass and to the new rows that `new_mask[t]` allows."""

    def __init__(self, cache: KVCache, new_mask: torch.Tensor):
        if cache.sliding_window is not None:
            raise ValueError("a candidate tree needs full attention (this model has a sliding window)")
        self.cache, self.new_mask = cache, new_mask  # new_mask: bool [T, T]

    @property
    def seq_len(self) -> int:
        return self.cache.seq_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        held = self.cache.lengths[layer]
        k_all, v_all = self.cache.append(layer, k, v)  # [B, H_kv, held + T, D]
        mask = torch.ones(q.shape[2], k_all.shape[2], dtype=torch.bool, device=q.device)
        mask[:, held:] = self.new_mask
        return masked_attention(q, k_all, v_all, mask)


def candidate_mask(width: int, device=None) -> torch.Tensor:
    """Boolean [w+1, w+1] over (p, c_1 .. c_w): p sees itself, each c_i sees p and itself."""
    mask = torch.eye(width + 1, dtype=torch.bool, device=device)
    mask[:, 0] = True
    return mask


def top_candidates(session: FeatureDraftSession, ids: list[int], width: int) -> torch.Tensor:
    """The feature drafter's `width` most likely next tokens after ids, best first: LongTensor [w]
    (none while the target has produced no feature yet: a one-token prompt's first step)."""
    if len(ids) < 2:
        return torch.empty(0, dtype=torch.long, device=session.unfed.device)
    logits = session.drafter.logits(session.catch_up(ids))[0, -1]  # [V]
    return logits.topk(width).indices


def verify_candidates(
    target, cache: KVCache, pending: torch.Tensor, candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ONE target pass over [pending, c_1 .. c_w] (pending [1], candidates [w]) laid out as the
    module docstring shows -> (logits [w+1, V], features [w+1, E]); row i is the target's
    next-token distribution after c_i (row 0: after pending)."""
    start, width = cache.seq_len, len(candidates)
    tokens = torch.cat([pending, candidates])[None]  # [1, w+1]
    positions = torch.tensor([start] + [start + 1] * width, device=tokens.device)
    view = TreeMaskedCache(cache, candidate_mask(width, tokens.device))
    features = target.features(tokens, positions, kv_cache=view)[0]  # [w+1, E]
    return target.lm_head(features).float(), features


def accept_candidate(candidates: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Greedy judgement of candidates [w] against target_logits [w+1, V] -> (the tokens to emit
    [1] or [2], the accepted candidate's row i in 1..w, or 0 when none was the target's choice)."""
    choice = greedy(target_logits)  # [w+1]
    hits = (candidates == choice[0]).nonzero()
    if len(hits) == 0:
        return choice[:1], 0
    row = int(hits[0]) + 1
    return torch.stack([choice[0], choice[row]]), row


def path_rows(row: int) -> list[int]:
    """The verify pass's rows on the accepted path: pending's, and the accepted candidate's."""
    return [0, row] if row else [0]


def keep_row(cache: KVCache, row: int, length: int) -> None:
    """After a verify pass that began at row `length - 2`: keep `length` rows, the last of them
    the accepted candidate's (cache row length - 2 + row). row 0: nothing accepted, keep `length`."""
    if row > 1:
        source, target = length - 2 + row, length - 1
        cache.keys[:, :, :, target] = cache.keys[:, :, :, source]
        cache.values[:, :, :, target] = cache.values[:, :, :, source]
    cache.truncate(length)

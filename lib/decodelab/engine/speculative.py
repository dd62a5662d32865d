"""Speculative decoding inside the batched, paged engine.

Each decode step, for every running sequence (L tokens, the last not yet in the cache):
  1. reserve slots for k more tokens (no block is named: drafts may be rejected);
  2. draft: catch the draft model's cache up, then k packed decode passes propose
     d_1..d_k per sequence, recording q_i = probs(draft logits);
  3. verify: ONE packed target pass over [token L-1, d_1..d_k] gives p_1..p_{k+1};
  4. accept with `accept_draft_tokens` (the engine hook), append the emitted tokens, and
     shrink the block table: slots of rejected drafts go back to the pool (the paged form of
     `KVCache.truncate`).
The draft model writes to its own `PagedKVStore` through the same block tables, so one
allocator manages both caches. The draft cache may lag the target by one token (the last
accepted draft is never fed to the draft model); step 2 feeds it first.
"""
from __future__ import annotations

import os

import torch

from decodelab.model.registry import load
from decodelab.engine.paged_attention import PagedKVStore
from decodelab.decoding.sampling import probs
from decodelab.engine.sequence import Sequence
from decodelab.decoding.speculative import accept_draft_tokens


class BatchSpeculator:
    def __init__(self, engine, draft, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        from decodelab.decoding.eagle import NAMED_DRAFTERS, FeatureDrafter
        if isinstance(draft, FeatureDrafter) or str(draft) in NAMED_DRAFTERS:
            raise ValueError(f"{draft if isinstance(draft, str) else 'a FeatureDrafter'} is a feature drafter: it runs "
                             "in decodelab.decoding.speculative.speculative_generate (one request); the batched engine takes "
                             "draft models (e.g. 'tiny-draft', or decodelab.decoding.speculative.truncated_draft(model, n))")
        if isinstance(draft, (str, os.PathLike)):
            draft, _ = load(draft, device=engine.device, dtype=engine.model.dtype)
        elif isinstance(draft, tuple):
            draft = draft[0]
        if draft.config.vocab_size != engine.config.vocab_size:
            raise ValueError(f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                             f"({engine.config.vocab_size}): they must share a tokenizer")
        self.engine, self.draft, self.k = engine, draft, num_speculative_tokens
        allocator = engine.allocator
        self.store = PagedKVStore(draft.config, allocator.num_blocks, allocator.block_size, engine.device, draft.dtype)
        self.accept = engine.hooks.accept_draft_tokens or accept_draft_tokens
        self.proposed = self.accepted = self.target_calls = self.draft_calls = 0

    def prefill(self, seqs: list[Sequence], items) -> None:
        """Mirror a target prefill in the draft cache (same tokens, same slots)."""
        self.engine.packed_forward(self.draft, self.store, items)
        self.draft_calls += 1
        for seq in seqs:
            seq.draft_computed_tokens = len(seq)

    def step(self, seqs: list[Sequence]):
        engine, allocator, k = self.engine, self.engine.allocator, self.k
        room = sum(allocator.blocks_needed(len(s) + k) - len(s.block_table) + 1 for s in seqs)
        if room > allocator.num_free or any(s.params.repetition_penalty != 1 for s in seqs):
            return engine.plain_decode(seqs)  # no room for drafts this step: one token each
        for seq in seqs:
            allocator.reserve(seq.block_table, len(seq) + k)
        drafts, draft_probs = self.propose(seqs)  # [B, k], [B, k, V]
        items = [([seq.token_ids[-1]] + drafts[i].tolist(), len(seq) - 1, seq.block_table)
                 for i, seq in enumerate(seqs)]
        target_logits = engine.packed_forward(engine.model, engine.store, items, all_logits=True)
        self.target_calls += 1
        events = []
        for i, seq in enumerate(seqs):
            length = len(seq)
            target_probs = probs(target_logits[i], seq.params)  # [k+1, V]
            emitted = self.accept(drafts[i], draft_probs[i], target_probs, seq.generator).tolist()
            self.proposed += k
            self.accepted += len(emitted) - 1
            for token in emitted:
                events.append(engine.append_token(seq, int(token)))
                if seq.is_finished:
                    break
            if not seq.is_finished:
                seq.num_computed_tokens = len(seq) - 1
                seq.draft_computed_tokens = min(length + k - 1, len(seq) - 1)
                allocator.shrink(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        return events

    def propose(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens per sequence and the distributions they were drawn from."""
        engine = self.engine
        items = [(seq.token_ids[seq.draft_computed_tokens:], seq.draft_computed_tokens, seq.block_table)
                 for seq in seqs]
        tokens, dists = [], []
        for j in range(self.k):
            logits = engine.packed_forward(self.draft, self.store, items)  # list of [V]
            self.draft_calls += 1
            q = torch.stack([probs(row, seq.params) for row, seq in zip(logits, seqs)])  # [B, V]
            chosen = [int(q_row.argmax()) if seq.params.greedy
                      else int(torch.multinomial(q_row, 1, generator=seq.generator)) for q_row, seq in zip(q, seqs)]
            tokens.append(chosen)
            dists.append(q)
            items = [([token], len(seq) + j, seq.block_table) for token, seq in zip(chosen, seqs)]
        return torch.tensor(tokens, device=engine.device).T, torch.stack(dists, dim=1)

    def stats(self) -> dict:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {"proposed": self.proposed, "accepted": self.accepted, "acceptance_rate": rate,
                "target_calls": self.target_calls, "draft_calls": self.draft_calls}


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

from decodelab.decoding.sampling import probs
from decodelab.decoding.speculative import accept_draft_tokens
from decodelab.engine.paged_attention import PagedKVStore
from decodelab.engine.sequence import Sequence
from decodelab.model.registry import load


def drafts_fit(engine, seqs: list[Sequence], k: int) -> bool:
    """May this step draft k tokens for every sequence: room in the pool for their slots, and no
    repetition penalty (which the acceptance rule's p does not model)?"""
    allocator = engine.allocator
    room = sum(allocator.blocks_needed(len(s) + k) - len(s.block_table) + 1 for s in seqs)
    return room <= allocator.num_free and all(s.params.repetition_penalty == 1 for s in seqs)


def emit(engine, seq: Sequence, emitted: list[int]) -> list:
    """Append the accepted drafts and the target's token (up to where the sequence ends), then give
    back the slots of the rejected drafts -> the tokens' StreamEvents."""
    events = []
    for token in emitted:
        events.append(engine.append_token(seq, int(token)))
        if seq.is_finished:
            return events
    seq.num_computed_tokens = len(seq) - 1
    engine.allocator.shrink(seq.block_table, seq.token_ids, seq.num_computed_tokens)
    return events


def make_speculator(engine, draft, num_speculative_tokens: int):
    """The engine's speculator for `draft`: a feature drafter (an attached `FeatureDrafter`, or a
    named one such as "smollm2-eagle") or a draft model (anything `BatchSpeculator` takes)."""
    from decodelab.decoding.eagle import NAMED_DRAFTERS, FeatureDrafter

    if isinstance(draft, FeatureDrafter) or (isinstance(draft, str) and draft in NAMED_DRAFTERS):
        return FeatureBatchSpeculator(engine, draft, num_speculative_tokens)
    return BatchSpeculator(engine, draft, num_speculative_tokens)


class BatchSpeculator:
    """Speculation with a draft model, whose paged cache mirrors the target's."""

    reads_features = False  # the engine's passes give it tokens, not the target's hidden states

    def __init__(self, engine, draft, num_speculative_tokens: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if isinstance(draft, (str, os.PathLike)):
            draft, _ = load(draft, device=engine.device, dtype=engine.model.dtype)
        elif isinstance(draft, tuple):
            draft = draft[0]
        if draft.config.vocab_size != engine.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({engine.config.vocab_size}): they must share a tokenizer"
            )
        self.engine, self.draft, self.k = engine, draft, num_speculative_tokens
        allocator = engine.allocator
        self.store = PagedKVStore(draft.config, allocator.num_blocks, allocator.block_size, engine.device, draft.dtype)
        self.accept = engine.hooks.accept_draft_tokens or accept_draft_tokens
        self.proposed = self.accepted = self.target_calls = self.draft_calls = 0

    def prefill(self, seqs: list[Sequence], items, features=None) -> None:
        """Mirror a target pass in the draft cache (same tokens, same slots)."""
        self.engine.runner.packed_forward(self.draft, self.store, items)
        self.draft_calls += 1
        for seq in seqs:
            seq.draft_computed_tokens = len(seq)

    def fork(self, seq: Sequence, sibling: Sequence) -> None:
        """A sibling shares the parent's blocks, so the draft cache needs nothing."""

    def step(self, seqs: list[Sequence]):
        engine, allocator, k = self.engine, self.engine.allocator, self.k
        if not drafts_fit(engine, seqs, k):
            return engine.plain_decode(seqs)  # no room for drafts this step: one token each
        for seq in seqs:
            allocator.reserve(seq.block_table, len(seq) + k)
        drafts, draft_probs = self.propose(seqs)  # [B, k], [B, k, V]
        items = [
            ([seq.token_ids[-1]] + drafts[i].tolist(), len(seq) - 1, seq.block_table) for i, seq in enumerate(seqs)
        ]
        target_logits = engine.runner.packed_forward(engine.model, engine.store, items, all_logits=True)
        self.target_calls += 1
        events = []
        for i, seq in enumerate(seqs):
            length = len(seq)
            target_probs = probs(target_logits[i], seq.params)  # [k+1, V]
            emitted = self.accept(drafts[i], draft_probs[i], target_probs, seq.generator).tolist()
            self.proposed += k
            self.accepted += len(emitted) - 1
            events += emit(engine, seq, emitted)
            if not seq.is_finished:
                seq.draft_computed_tokens = min(length + k - 1, len(seq) - 1)
        return events

    def propose(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens per sequence and the distributions they were drawn from."""
        engine = self.engine
        items = [
            (seq.token_ids[seq.draft_computed_tokens :], seq.draft_computed_tokens, seq.block_table) for seq in seqs
        ]
        tokens, dists = [], []
        for j in range(self.k):
            logits = engine.runner.packed_forward(self.draft, self.store, items)  # list of [V]
            self.draft_calls += 1
            q = torch.stack([probs(row, seq.params) for row, seq in zip(logits, seqs)])  # [B, V]
            chosen = [
                int(q_row.argmax()) if seq.params.greedy else int(torch.multinomial(q_row, 1, generator=seq.generator))
                for q_row, seq in zip(q, seqs)
            ]
            tokens.append(chosen)
            dists.append(q)
            items = [([token], len(seq) + j, seq.block_table) for token, seq in zip(chosen, seqs)]
        return torch.tensor(tokens, device=engine.device).T, torch.stack(dists, dim=1)

    def stats(self) -> dict:
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": rate,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
        }


class FeatureBatchSpeculator:
    """Speculation with a feature drafter (`decodelab.decoding.eagle`) inside the batched engine.

    The drafter guesses from the target's own features (its last hidden states), so every
    target pass of a speculating engine returns them (`reads_features`): a prefill's or a plain
    decode's go to `prefill`, a verify pass's accepted rows to the sequence's session. Each
    sequence holds one `FeatureDraftSession` (`seq.draft_state`: the drafter's one-layer cache,
    contiguous, small), started where the target's computed tokens start: after a cached prefix
    it never saw, or again from 0 after a preemption. Drafting runs sequence by sequence (the
    drafter is one layer); the verify pass is one packed target pass, as with a draft model.
    Greedy drafts carry one-hot q, so the acceptance rule (the engine hook) is the same.
    """

    reads_features = True
    store = None  # the drafter's caches are per sequence, outside the paged pool

    def __init__(self, engine, draft, num_speculative_tokens: int):
        from decodelab.decoding.eagle import FeatureDrafter, load_drafter

        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if engine.hooks.forward is not None:
            raise ValueError(
                "a feature drafter reads the target's hidden states, and EngineHooks(forward=...) "
                "returns logits only: speculate with a draft model, or drop the forward hook"
            )
        if isinstance(draft, FeatureDrafter):
            if draft.target is not engine.model:
                raise ValueError(
                    "this FeatureDrafter is attached to another model: load_drafter(llm.model, ...) "
                    "or pass its name (e.g. 'smollm2-eagle')"
                )
        else:
            draft = load_drafter(engine.model, draft)
        self.engine, self.drafter, self.k = engine, draft, num_speculative_tokens
        self.accept = engine.hooks.accept_draft_tokens or accept_draft_tokens
        self.proposed = self.accepted = self.target_calls = self.draft_calls = 0

    def prefill(self, seqs: list[Sequence], items, features) -> None:
        """The target computed items' tokens; features: theirs, [T, E] per item. A sequence whose
        session expects them appends them; any other (new, preempted, after a cached prefix)
        starts a session at the first of them."""
        from decodelab.decoding.eagle import FeatureDraftSession

        for seq, (tokens, start, _), rows in zip(seqs, items, features):
            session = seq.draft_state
            if session is None or session.next_position != start:
                seq.draft_state = session = FeatureDraftSession(self.drafter, self.engine.max_model_len, offset=start)
            session.add_features(rows)

    def fork(self, seq: Sequence, sibling: Sequence) -> None:
        sibling.draft_state = seq.draft_state.fork()

    def step(self, seqs: list[Sequence]):
        engine, allocator, k = self.engine, self.engine.allocator, self.k
        if not drafts_fit(engine, seqs, k):
            return engine.plain_decode(seqs)  # one token each; its pass hands the features to `prefill`
        vocab = engine.config.vocab_size
        drafted = []
        for seq in seqs:
            allocator.reserve(seq.block_table, len(seq) + k)
            tokens, q = seq.draft_state.propose(seq.token_ids, k, seq.params, seq.generator)  # [k], [k, V] | None
            drafted.append((tokens, torch.nn.functional.one_hot(tokens, vocab).float() if q is None else q))
        self.draft_calls += k * len(seqs)
        items = [
            ([seq.token_ids[-1]] + tokens.tolist(), len(seq) - 1, seq.block_table)
            for (tokens, _), seq in zip(drafted, seqs)
        ]
        target_logits, features = engine.runner.packed_forward(
            engine.model, engine.store, items, all_logits=True, features=True
        )
        self.target_calls += 1
        events = []
        for seq, (tokens, q), logits, rows in zip(seqs, drafted, target_logits, features):
            emitted = self.accept(tokens, q, probs(logits, seq.params), seq.generator).tolist()
            self.proposed += len(tokens)
            self.accepted += len(emitted) - 1
            seq.draft_state.add_features(rows[: len(emitted)])  # the pending token's and the accepted drafts'
            events += emit(engine, seq, emitted)
        return events

    stats = BatchSpeculator.stats

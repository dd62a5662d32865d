"""`ModelRunner`: the model side of the engine, one packed forward pass per step over the paged KV store.

The engine (`LLM`) decides what runs; the runner runs it. `forward(seqs)` feeds every scheduled
sequence's new tokens for this step (a whole prompt, a slice of one, or one token per decode) laid
end to end in one pass, writing their K/V through the block tables, and returns each one's last
logits. Before every pass it copies the blocks the allocator duplicated (copy-on-write: a sample
of an n > 1 request writing into a prompt block it shared). A speculating engine's draft model runs
through the same `packed_forward` on its own store, and its store follows the copies too.

Hooks it honours (`EngineHooks`, the target model's passes only): `forward` (the model as a function
of its state dict, fed `weights`) and `attention` (each sequence's attention over its paged blocks).
"""

from __future__ import annotations

import torch

from decodelab.engine.block_allocator import slot_of
from decodelab.engine.hooks import EngineHooks
from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice
from decodelab.engine.sequence import Sequence


class ModelRunner:
    """Runs `model` over the paged KV `store` whose blocks `allocator` hands out.

    speculator: None, or the engine's speculator once it has one (`decodelab.engine.speculative`):
    its draft store follows copy-on-write, and every target pass of `forward` is mirrored to it
    (the draft model's cache, or a feature drafter's features).
    """

    def __init__(self, model, store: PagedKVStore, allocator, hooks: EngineHooks):
        self.model, self.store, self.allocator, self.hooks = model, store, allocator, hooks
        self.device = model.device
        # the forward hook reads the weights by their names (the tensors themselves, not copies)
        self.weights = dict(model.state_dict()) if hooks.forward is not None else None
        self.speculator = None

    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed every scheduled sequence's tokens for this step in one pass (all its uncomputed
        ones, or the slice a chunking scheduler chose: `seq.num_tokens_this_step`) -> the logits
        of each one's last fed token [B, V]; each sequence's num_computed_tokens moves past them."""
        items = []
        for seq in seqs:
            start = seq.num_computed_tokens
            items.append((seq.token_ids[start : start + seq.num_tokens_this_step], start, seq.block_table))
        speculator = self.speculator
        if speculator is not None and speculator.reads_features:  # a feature drafter reads them
            logits, features = self.packed_forward(self.model, self.store, items, features=True)
            speculator.prefill(seqs, items, features)
        else:
            logits = self.packed_forward(self.model, self.store, items)
            if speculator is not None:  # the draft model keeps its own cache of the same tokens
                speculator.prefill(seqs, items)
        for seq, (tokens, start, _) in zip(seqs, items):
            seq.num_computed_tokens, seq.num_scheduled_tokens = start + len(tokens), 0
        return torch.stack(logits)

    @torch.inference_mode()
    def packed_forward(self, model, store: PagedKVStore, items, all_logits: bool = False, features: bool = False):
        """One forward pass of `model` over several sequences' new tokens laid end to end.

        items: (new token ids, position of the first, block table) per sequence. Returns per
        item the logits of its last token [V], or of all its new tokens [T, V] (all_logits);
        with `features`, also per item the target's features (last hidden states) of all its new
        tokens [T, E]: (logits list, features list), for a feature drafter.
        """
        self.apply_copy_on_write()
        ids, positions, slots, slices, wanted = [], [], [], [], []
        block_size = store.block_size
        for tokens, start, table in items:
            end = start + len(tokens)
            slices.append(SequenceSlice(len(ids), len(tokens), end, table))
            wanted += range(len(ids), len(ids) + len(tokens)) if all_logits else [len(ids) + len(tokens) - 1]
            ids += tokens
            positions += range(start, end)
            slots += [slot_of(table, p, block_size) for p in range(start, end)]
        device = self.device
        hooked = model is self.model  # the hooks are the target's; a draft model runs as it is
        batch = PagedBatch(
            store,
            slices,
            torch.tensor(slots, device=device),
            model.config.sliding_window,
            attention_fn=self.hooks.attention if hooked else None,
        )
        input_ids, positions = torch.tensor([ids], device=device), torch.tensor(positions, device=device)
        wanted = torch.tensor(wanted, device=device)
        sizes = [len(tokens) for tokens, _, _ in items]
        if features:
            hidden = model.features(input_ids, positions=positions, kv_cache=batch)[0]  # [T_all, E]
            logits = model.lm_head(hidden[wanted]).float()
            rows = list(torch.split(hidden, sizes))
            return (list(torch.split(logits, sizes)) if all_logits else list(logits)), rows
        if hooked and self.hooks.forward is not None:
            logits = self.hooks.forward(self.weights, model.config, input_ids, batch.attend, positions)[0, wanted]
            logits = logits.float()  # [M, V]
        else:
            logits = model(input_ids, positions=positions, kv_cache=batch, logits_indices=wanted)[0]
        return list(torch.split(logits, sizes)) if all_logits else list(logits)

    def apply_copy_on_write(self) -> None:
        """Copy the blocks the allocator duplicated, in every KV store (target and draft)."""
        draft_store = getattr(self.speculator, "store", None)
        for src, dst in self.allocator.copy_on_write_log:
            self.store.copy_block(src, dst)
            if draft_store is not None:
                draft_store.copy_block(src, dst)
        self.allocator.copy_on_write_log.clear()

"""Iteration-level scheduling (continuous batching, as in Orca and vLLM).

Every engine step the scheduler picks which sequences run:
1. If waiting requests fit (a free sequence slot, the token budget, enough free blocks),
   admit them and run their prefill this step.
2. Otherwise run one decode step for every running sequence. If the pool cannot give a
   sequence room for its next token, preempt the most recently admitted sequence: free
   its blocks and put it back at the front of the queue to be recomputed later.
Finished sequences leave at once, so their slots and blocks go to waiting requests at the
next step instead of idling until the whole batch is done (static batching).
"""
from __future__ import annotations

from collections import deque

from .paged import BlockAllocator
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 64, max_num_batched_tokens: int = 4096):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences to run this step, whether it is a prefill step)."""
        admitted = self.admit()
        if admitted:
            return admitted, True
        return self.decode_batch(), False

    def admit(self) -> list[Sequence]:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            over_budget = tokens + len(seq) > self.max_num_batched_tokens
            if (over_budget and admitted) or not self.allocator.can_allocate(seq.token_ids):
                break  # a lone long prompt may exceed the token budget; it runs by itself
            self.waiting.popleft()
            seq.block_table, seq.num_computed_tokens = self.allocator.allocate(seq.token_ids)
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            tokens += seq.num_new_tokens
        return admitted

    def decode_batch(self) -> list[Sequence]:
        batch = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            # The newest token (sampled last step) has no slot yet: it holds len - 1.
            while not self.allocator.can_append(seq.block_table, len(seq) - 1):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.allocator.append_slot(seq.block_table, seq.token_ids)
                batch.append(seq)
        return batch

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV, queue it first; its output so far is kept."""
        self.running.remove(seq)
        self.allocator.free_sequence(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        self.allocator.free_sequence(seq.block_table)

"""Iteration-level scheduling (continuous batching, as in Orca and vLLM).

Every engine step the scheduler picks which sequences run:
1. If waiting requests fit (a free sequence slot, the token budget, enough free blocks),
   admit them and run their prefill this step.
2. Otherwise run one decode step for every running sequence. If the pool cannot give a
   sequence room for its next token, preempt the most recently admitted sequence: free
   its blocks and put it back at the front of the queue to be recomputed later.
Finished sequences leave at once, so their slots and blocks go to waiting requests at the
next step instead of idling until the whole batch is done (static batching). The engine
also mixes the two (`Scheduler.mix_decode_with_prefill`): running sequences keep decoding in
the steps that prefill newcomers.

Chunked prefill (`Scheduler.chunked_prefill`, Sarathi-Serve's idea, vLLM's
`enable_chunked_prefill`): a long prompt no longer makes one step long for everyone. Each step
holds at most `max_num_batched_tokens` tokens: every running sequence decodes first, and what
is left of the budget goes to prompts, a slice at a time, over several steps
(`schedule_chunked`). A sequence samples its first token only in the step that completes its prompt.

The step pieces (`admit`, `decode_batch`, `preempt`, `finish`, `schedule_chunked`) are plain
functions of the scheduler, bound as its methods: notebook 08 has the learner write most of
them, and a subclass with the learner's versions plugs into `EngineHooks(scheduler=...)`.
"""

from __future__ import annotations

from collections import deque

from decodelab.engine.block_allocator import BlockAllocator
from decodelab.engine.sequence import Sequence, Status


def admit(scheduler: Scheduler) -> list[Sequence]:
    """Move waiting sequences into `running`, oldest first, for this step's prefill -> the admitted.

    Stop at the first waiting sequence that does not fit (first come, first served), where
    fitting means all three of:
    * a free sequence slot: len(scheduler.running) < scheduler.max_num_seqs;
    * the token budget: tokens of the sequences admitted so far this step (their
      num_new_tokens) + len(seq) <= scheduler.max_num_batched_tokens; the first sequence of
      a step is exempt, so a lone prompt longer than the budget still runs, by itself;
    * the KV pool: scheduler.allocator.can_allocate(seq.token_ids).
    An admitted sequence leaves the front of `waiting`, gets its blocks
    (seq.block_table, seq.num_computed_tokens = allocator.allocate(seq.token_ids)), becomes
    Status.RUNNING and joins the end of `running`.
    """
    admitted, tokens = [], 0
    while scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        seq = scheduler.waiting[0]
        over_budget = tokens + len(seq) > scheduler.max_num_batched_tokens
        if (over_budget and admitted) or not scheduler.allocator.can_allocate(seq.token_ids):
            break  # a lone long prompt may exceed the token budget; it runs by itself
        scheduler.waiting.popleft()
        seq.block_table, seq.num_computed_tokens = scheduler.allocator.allocate(seq.token_ids)
        seq.status = Status.RUNNING
        scheduler.running.append(seq)
        admitted.append(seq)
        tokens += seq.num_new_tokens
    return admitted


def decode_batch(scheduler: Scheduler) -> list[Sequence]:
    """Give every running sequence a KV slot for its newest token -> the sequences to decode.

    In `running` order. A sequence whose prompt is still being prefilled in slices (chunked
    prefill: more than one token not yet computed, seq.num_new_tokens > 1) does not decode and
    is skipped. The newest token (sampled last step) has no slot yet, so a sequence
    holds len(seq) - 1 tokens: it can grow if allocator.can_append(seq.block_table,
    len(seq) - 1), and then allocator.append_slot(seq.block_table, seq.token_ids) makes the
    room. While it cannot, preempt the most recently admitted running sequence
    (scheduler.preempt(scheduler.running[-1])), which may be this sequence itself: then it
    is not decoded this step. A sequence preempted earlier in the loop is skipped.
    """
    batch = []
    for seq in list(scheduler.running):
        if seq.status is not Status.RUNNING or seq.num_new_tokens > 1:
            continue  # preempted earlier in this loop, or a prompt still being prefilled in slices
        # The newest token (sampled last step) has no slot yet: it holds len - 1.
        while not scheduler.allocator.can_append(seq.block_table, len(seq) - 1):
            victim = scheduler.running[-1]
            scheduler.preempt(victim)
            if victim is seq:
                break
        if seq.status is Status.RUNNING:
            scheduler.allocator.append_slot(seq.block_table, seq.token_ids)
            batch.append(seq)
    return batch


def preempt(scheduler: Scheduler, seq: Sequence) -> None:
    """Recompute-style preemption: drop its KV, queue it first; its output so far is kept.

    The sequence leaves `running`, its blocks go back to the pool
    (allocator.free_sequence(seq.block_table), which empties the table), nothing of it is
    cached any more (seq.num_computed_tokens = 0), it becomes Status.WAITING, both
    seq.num_preemptions and scheduler.num_preemptions grow by one, and it goes to the FRONT
    of `waiting`, so that it is the next to be admitted (and recomputed).
    """
    scheduler.running.remove(seq)
    scheduler.allocator.free_sequence(seq.block_table)
    seq.num_computed_tokens = 0
    seq.status = Status.WAITING
    seq.num_preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.appendleft(seq)


def finish(scheduler: Scheduler, seq: Sequence, reason: str) -> None:
    """Retire a sequence at once: status FINISHED, finish_reason = reason ("stop" or "length"; the
    engine also retires a failed sequence with "error" and an aborted one with "abort"), out of
    `running` (if it is there), its blocks back to the pool (allocator.free_sequence)."""
    seq.status, seq.finish_reason = Status.FINISHED, reason
    if seq in scheduler.running:
        scheduler.running.remove(seq)
    scheduler.allocator.free_sequence(seq.block_table)


def schedule_chunked(scheduler: Scheduler) -> list[Sequence]:
    """One chunked-prefill step -> the sequences to run, each with seq.num_scheduled_tokens set.

    The step feeds at most scheduler.max_num_batched_tokens tokens (the budget), in this order:
    1. decodes first: scheduler.decode_batch() (one token each; it preempts the newest running
       sequences when the pool runs dry);
    2. prompts already running but not complete (seq.num_new_tokens > 1), in `running` order:
       each takes up to min(seq.num_new_tokens, budget left) tokens, one KV slot per token: a
       sequence holding n tokens gets the next slot if allocator.can_append(seq.block_table, n),
       from allocator.append_slot(seq.block_table, seq.token_ids[:n + 1]); it stops at the
       first token without room (a sequence that got none does not run);
    3. if decode_batch preempted nobody this step (a victim would come straight back), waiting
       sequences, front first, while one is waiting, a sequence slot is free and budget is left:
       its first min(len(seq), budget left) tokens must fit (allocator.can_allocate on that
       prefix, else stop: first come, first served); they get their blocks
       (seq.block_table, seq.num_computed_tokens = allocator.allocate(prefix)); it becomes
       Status.RUNNING, joins the end of `running` and feeds the prefix's uncomputed tokens.
    Every sequence in the returned list (decodes, then slices, then newcomers) has
    num_scheduled_tokens >= 1, and their sum is within the budget (unless the decodes alone pass
    it: the n > 1 samples of a prompt may outnumber max_num_seqs; then no slice runs). Only
    allocated slots are ever named in the prefix cache, so a slice that is not computed yet is
    never found by another prompt.
    """
    allocator, budget = scheduler.allocator, scheduler.max_num_batched_tokens
    preemptions = scheduler.num_preemptions
    batch = scheduler.decode_batch()
    for seq in batch:
        seq.num_scheduled_tokens = 1
    budget -= len(batch)
    for seq in [s for s in scheduler.running if s.num_new_tokens > 1]:
        held = end = seq.num_computed_tokens
        tokens = seq.token_ids  # built once: the property joins prompt and output on every call
        while end < held + min(seq.num_new_tokens, budget) and allocator.can_append(seq.block_table, end):
            allocator.append_slot(seq.block_table, tokens[: end + 1])
            end += 1
        if end > held:
            seq.num_scheduled_tokens = end - held
            budget -= end - held
            batch.append(seq)
    while (
        scheduler.num_preemptions == preemptions
        and scheduler.waiting
        and budget > 0
        and len(scheduler.running) < scheduler.max_num_seqs
    ):
        seq = scheduler.waiting[0]
        prefix = seq.token_ids[:budget]
        if not allocator.can_allocate(prefix):
            break
        scheduler.waiting.popleft()
        seq.block_table, seq.num_computed_tokens = allocator.allocate(prefix)
        seq.status = Status.RUNNING
        scheduler.running.append(seq)
        seq.num_scheduled_tokens = len(prefix) - seq.num_computed_tokens
        budget -= seq.num_scheduled_tokens
        batch.append(seq)
    return batch


def scheduler_state(scheduler: Scheduler) -> tuple:
    """What a step that makes progress must change: each waiting or running sequence's id, status
    and number of tokens in the KV cache."""
    return tuple((seq.seq_id, seq.status, seq.num_computed_tokens) for seq in (*scheduler.waiting, *scheduler.running))


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

    # Mixed steps (the engine turns this on): the running sequences decode in the same packed
    # pass that prefills newly admitted ones, instead of waiting a step for them.
    mix_decode_with_prefill = False
    # Chunked prefill (the engine sets it from EngineArgs.chunked_prefill): schedule_chunked runs
    # every step, so a long prompt is prefilled in slices of the token budget, between decodes.
    chunked_prefill = False

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences to run this step, whether any of them is prefilled this step).

        With `chunked_prefill`, the step is `schedule_chunked` (decodes, then slices of prompts
        within the token budget; each sequence's num_scheduled_tokens says how many it feeds).
        Waiting requests that fit are admitted and prefilled; in a step that admits nobody,
        every running sequence decodes one token. With `mix_decode_with_prefill`, the running
        sequences decode first and the admitted ones join the same step (after them in the
        list), so an admission no longer stalls every running sequence for a whole step; in a
        step whose decoding had to preempt, nobody is admitted (the preempted would be
        readmitted at once)."""
        if self.chunked_prefill:
            seqs = self.schedule_chunked()
            # a prompt's slice (its last one may be a single token) or a recompute: not a decode
            return seqs, any(seq.num_new_tokens > 1 or not seq.output_token_ids for seq in seqs)
        if not self.mix_decode_with_prefill:
            admitted = self.admit()
            if admitted:
                return admitted, True
            return self.decode_batch(), False
        preemptions = self.num_preemptions
        decoding = self.decode_batch()
        admitted = self.admit() if self.num_preemptions == preemptions else []
        return decoding + admitted, bool(admitted)

    # The step pieces above, as methods (a subclass may set its own functions here).
    admit = admit
    decode_batch = decode_batch
    preempt = preempt
    finish = finish
    schedule_chunked = schedule_chunked

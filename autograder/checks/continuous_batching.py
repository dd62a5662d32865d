"""Checks for notebook 08, continuous batching: the step pieces of `decodelab.engine.scheduler`
(`decode_batch`, `preempt`, `finish`, and the chunked-prefill step `schedule_chunked`),
and the static batch's padded prefill (`padded_prefill`, `decodelab.lessons.padded_batch`).

Each ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and
returns None or raises ``AssertionError`` naming the situation, the expected and the actual
result.

The state the function starts from is built here directly on a real `BlockAllocator`
(`allocate`, `fork`), never with the functions under test. Expected results come from small
independent models of the rules, written here with plain integers: how many blocks a
sequence of n tokens holds (ceil(n / block_size): the allocator's `blocks_needed`), which
waiting sequences fit (slots, token budget, free blocks, first come first served), which
running sequences a decode step must preempt (the most recently admitted, until the pool has
room), and how a chunked-prefill step splits its token budget (decodes, then slices of running
prompts, then newcomers). They are compared with what the function left behind: the returned list, the queues,
each sequence's status, block table size and counters, the number of free blocks, and the
pool's reference counts (`check_invariants`: no leaked or doubly freed block). Block *ids*
are never compared: which free block a sequence gets is the allocator's business.

`padded_prefill` is graded against its oracle, each prompt run alone through the same model,
on a small random Llama and on the same with scrambled RoPE tables (`model.toy.scramble_rope_`):
RoPE only sees the distance between two tokens, so positions shifted by the pads change the
plain model's logits by float rounding only; on the scrambled one they change them by O(1).
"""

from __future__ import annotations

import random

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.course.exercises import references
from decodelab.engine.block_allocator import BlockAllocator, blocks_needed
from decodelab.engine.scheduler import Scheduler
from decodelab.engine.sequence import Sequence, Status
from decodelab.lessons.measure import CountingModel
from decodelab.model.toy import random_llama, scramble_rope_
from decodelab.params import SamplingParams

# exercise -> the library's reference it is graded against (the course's table of exercises). The library's
# whole-prompt `admit`, no longer an exercise (schedule_chunked admits), is tested by tests/test_scheduler_admit.py.
REFERENCES = references("08_continuous_batching")

__all__ = ["check_decode_batch", "check_preempt", "check_finish", "check_schedule_chunked", "check_padded_prefill"]

RANDOM_CASES = 150


# --------------------------------------------------------------------------- building states


def _seq(seq_id: int, prompt_len: int, output_len: int = 0, prompt=None) -> Sequence:
    tokens = list(prompt) if prompt is not None else [10_000 * (seq_id + 1) + i for i in range(prompt_len)]
    seq = Sequence(seq_id, seq_id, 0, tokens, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    seq.output_token_ids = [3] * output_len
    return seq


def _state(
    block_size: int,
    num_blocks: int,
    running_lens,
    waiting_lens,
    max_num_seqs: int = 8,
    budget: int = 4096,
    decoding: bool = False,
    caching: bool = False,
):
    """A scheduler whose running sequences hold their blocks. running_lens: total tokens of each;
    decoding=True: the newest token of each has no slot yet (it holds len - 1)."""
    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching)
    scheduler = Scheduler(allocator, max_num_seqs, budget)
    next_id = 0
    for n in running_lens:
        seq = _seq(next_id, max(1, n - 1) if decoding else n, 1 if decoding else 0)
        held = seq.token_ids[:-1] if decoding else seq.token_ids
        seq.block_table, _ = allocator.allocate(held)
        seq.num_computed_tokens = len(held)
        seq.status = Status.RUNNING
        scheduler.running.append(seq)
        next_id += 1
    for n in waiting_lens:
        scheduler.add(_seq(next_id, n))
        next_id += 1
    return scheduler


def _ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


def _expect(ok: bool, desc: str, what: str, expected, got) -> None:
    if not ok:
        raise AssertionError(f"{desc}: {what}: expected {expected}, got {got}")


def _expect_waiting_then_pool(desc: str, scheduler, waiting: list, free: int) -> None:
    """Each (seq, label) is WAITING with no blocks; the pool has `free` blocks and is consistent."""
    for seq, label in waiting:
        _expect(
            seq.status is Status.WAITING and not seq.block_table,
            desc,
            label,
            "WAITING, no blocks",
            f"{seq.status.name}, {len(seq.block_table)} blocks",
        )
    _expect(scheduler.allocator.num_free == free, desc, "free blocks afterwards", free, scheduler.allocator.num_free)
    _pool_consistent(desc, scheduler)


def _pool_consistent(desc: str, scheduler, extra_tables=()) -> None:
    tables = [s.block_table for s in scheduler.running] + list(extra_tables)
    try:
        scheduler.allocator.check_invariants(tables)
    except AssertionError as e:
        raise AssertionError(
            f"{desc}: the block pool is inconsistent afterwards (a block leaked or was freed twice): {e}"
        ) from None


# --------------------------------------------------------------------------- decode_batch


def _preempt_newest_until(need: int, i: int, free: int, running: list, held: list, preempted: list) -> int:
    """The rule on integers: while fewer than `need` blocks are free, the newest running index gives
    its blocks back (recorded in `preempted`); stop if sequence i itself was the victim. -> free blocks."""
    while free < need:
        victim = running.pop()
        free, held[victim] = free + held[victim], 0
        preempted.append(victim)
        if victim == i:
            break
    return free


def _expected_decode(lens, free, block_size):
    """(decoded indices in order, preempted indices in order, free blocks afterwards).
    lens: tokens of each running sequence, the newest without a slot."""
    held = [blocks_needed(n - 1, block_size) for n in lens]
    running, batch, preempted = list(range(len(lens))), [], []
    for i in range(len(lens)):
        if i in preempted:
            continue
        need = 1 if (lens[i] - 1) % block_size == 0 else 0
        free = _preempt_newest_until(need, i, free, running, held, preempted)
        if i in running:
            free -= need
            batch.append(i)
    return batch, preempted, free


def _run_decode(fn, desc, block_size, extra_free, lens, waiting=()):
    num_blocks = sum(blocks_needed(n - 1, block_size) for n in lens) + extra_free
    scheduler = _state(block_size, num_blocks, lens, list(waiting), max_num_seqs=64, decoding=True)
    seqs, old_waiting = list(scheduler.running), list(scheduler.waiting)
    batch, preempted, free = _expected_decode(lens, extra_free, block_size)
    got = call(desc, fn, scheduler)
    want = [seqs[i].seq_id for i in batch]
    _expect(
        isinstance(got, list) and _ids(got) == want,
        desc,
        "sequences to decode (seq ids, in order)",
        want,
        _ids(got) if isinstance(got, list) else repr(got),
    )
    _expect(_ids(scheduler.running) == want, desc, "running afterwards", want, _ids(scheduler.running))
    front = [seqs[i].seq_id for i in reversed(preempted)] + _ids(old_waiting)
    _expect(
        _ids(scheduler.waiting) == front,
        desc,
        "waiting afterwards (the last preempted first)",
        front,
        _ids(scheduler.waiting),
    )
    for i in batch:
        need = blocks_needed(lens[i], block_size)
        _expect(
            len(seqs[i].block_table) == need,
            desc,
            f"blocks of seq {seqs[i].seq_id} ({lens[i]} tokens, the newest needs a slot; block size {block_size})",
            need,
            len(seqs[i].block_table),
        )
    for i in preempted:
        seq = seqs[i]
        _expect(
            seq.status is Status.WAITING and not seq.block_table and seq.num_computed_tokens == 0,
            desc,
            f"preempted seq {seq.seq_id}",
            "WAITING, no blocks, 0 computed tokens",
            f"{seq.status.name}, {len(seq.block_table)} blocks, {seq.num_computed_tokens} computed",
        )
    _expect(
        scheduler.num_preemptions == len(preempted),
        desc,
        "scheduler.num_preemptions",
        len(preempted),
        scheduler.num_preemptions,
    )
    _expect(scheduler.allocator.num_free == free, desc, "free blocks afterwards", free, scheduler.allocator.num_free)
    _pool_consistent(desc, scheduler)


def check_decode_batch(decode_batch) -> None:
    _decode_skips_unfinished_prompts(decode_batch)
    cases = [
        # (what, block size, free blocks, running lengths (newest token included), waiting)
        ("room in every last block: block size 4, sequences of 6, 7, 3 tokens", 4, 0, [6, 7, 3], []),
        (
            "a full last block: block size 4, a sequence of 9 tokens (8 stored) needs a new block, 1 free",
            4,
            1,
            [9, 6],
            [],
        ),
        (
            "out of blocks: block size 4, 0 free, the first of 3 sequences (9 tokens) needs a block; the most "
            "recently admitted (the third, 7 tokens, 2 blocks) is preempted",
            4,
            0,
            [9, 6, 7],
            [3],
        ),
        (
            "the newest preempts itself: block size 4, 0 free, only the last sequence (5 tokens) needs a block",
            4,
            0,
            [6, 7, 5],
            [],
        ),
        ("several victims: block size 2, 0 free, sequences of 5, 2, 2, 2 tokens", 2, 0, [5, 2, 2, 2], []),
        ("block size 1: every token needs a block, 2 free for 3 sequences", 1, 2, [3, 4, 5], []),
        ("no running sequence", 4, 3, [], [4]),
    ]
    for desc, block_size, free, lens, waiting in cases:
        _run_decode(decode_batch, f"decode_batch, {desc}", block_size, free, lens, waiting)
    rng = random.Random(11)
    for case in range(RANDOM_CASES):
        block_size = rng.choice([1, 2, 4, 8])
        lens = [rng.randint(2, 30) for _ in range(rng.randint(1, 6))]
        free = rng.randint(0, 3)
        waiting = [rng.randint(1, 9) for _ in range(rng.randint(0, 2))]
        _run_decode(
            decode_batch,
            f"decode_batch, random case {case}: block size {block_size}, {free} free blocks, "
            f"running sequences of {lens} tokens",
            block_size,
            free,
            lens,
            waiting,
        )


# --------------------------------------------------------------------------- preempt


def check_preempt(preempt) -> None:
    scheduler = _state(4, 16, [6, 9, 5], [3, 2])
    a, b, c = scheduler.running
    old_waiting = list(scheduler.waiting)
    b.output_token_ids = [4, 4]  # generated so far: must survive
    b_blocks, free = len(b.block_table), scheduler.allocator.num_free
    desc = (
        "preempt(scheduler, seq 1) with running seqs [0, 1, 2] holding 6, 9, 5 tokens (block size 4), seq 1 "
        "with 2 generated tokens, waiting [3, 4]"
    )
    call(desc, preempt, scheduler, b)
    _expect(_ids(scheduler.running) == [0, 2], desc, "running afterwards", [0, 2], _ids(scheduler.running))
    _expect(
        _ids(scheduler.waiting) == [1] + _ids(old_waiting),
        desc,
        "waiting afterwards (it is next in line)",
        [1] + _ids(old_waiting),
        _ids(scheduler.waiting),
    )
    _expect(b.status is Status.WAITING, desc, "status of seq 1", Status.WAITING, b.status)
    _expect(b.block_table == [], desc, "block table of seq 1", [], b.block_table)
    _expect(
        b.num_computed_tokens == 0,
        desc,
        "num_computed_tokens of seq 1 (its KV is gone: recompute all)",
        0,
        b.num_computed_tokens,
    )
    _expect(
        b.output_token_ids[-2:] == [4, 4],
        desc,
        "output tokens of seq 1 (kept, recomputed later)",
        "... 4, 4",
        b.output_token_ids,
    )
    _expect(
        b.num_preemptions == 1 and scheduler.num_preemptions == 1,
        desc,
        "seq.num_preemptions and scheduler.num_preemptions",
        "1 and 1",
        f"{b.num_preemptions} and {scheduler.num_preemptions}",
    )
    _expect(
        scheduler.allocator.num_free == free + b_blocks,
        desc,
        "free blocks afterwards",
        free + b_blocks,
        scheduler.allocator.num_free,
    )
    _pool_consistent(desc, scheduler)

    desc = "preempt seq 2 then seq 0 (after seq 1)"
    call(desc, preempt, scheduler, c)
    call(desc, preempt, scheduler, a)
    _expect(
        _ids(scheduler.waiting)[:3] == [0, 2, 1],
        desc,
        "the front of waiting (the last preempted first)",
        [0, 2, 1],
        _ids(scheduler.waiting)[:3],
    )
    _expect(
        scheduler.num_preemptions == 3 and scheduler.running == [],
        desc,
        "scheduler.num_preemptions and running",
        "3 and []",
        f"{scheduler.num_preemptions} and {_ids(scheduler.running)}",
    )
    _expect(
        scheduler.allocator.num_free == scheduler.allocator.num_blocks,
        desc,
        "free blocks with nothing running",
        scheduler.allocator.num_blocks,
        scheduler.allocator.num_free,
    )
    _pool_consistent(desc, scheduler)

    # Two samples of one prompt share its blocks: preempting one must leave the other's intact.
    scheduler = _state(4, 16, [10], [])
    first = scheduler.running[0]
    sibling = _seq(1, 10, prompt=first.prompt_token_ids)
    sibling.block_table = scheduler.allocator.fork(first.block_table)
    sibling.status, sibling.num_computed_tokens = Status.RUNNING, 10
    scheduler.running.append(sibling)
    free = scheduler.allocator.num_free
    desc = "preempt one of two samples sharing 3 blocks (a prompt of 10 tokens, block size 4)"
    call(desc, preempt, scheduler, sibling)
    _expect(
        scheduler.allocator.num_free == free,
        desc,
        "free blocks (the shared blocks are still held by the other sample)",
        free,
        scheduler.allocator.num_free,
    )
    _pool_consistent(desc, scheduler)


# --------------------------------------------------------------------------- finish


def check_finish(finish) -> None:
    scheduler = _state(4, 16, [6, 9, 5], [3])
    a, b, c = scheduler.running
    free, b_blocks = scheduler.allocator.num_free, len(b.block_table)
    desc = "finish(scheduler, seq 1, 'stop') with running seqs [0, 1, 2] (6, 9, 5 tokens, block size 4), waiting [3]"
    call(desc, finish, scheduler, b, "stop")
    _expect(b.status is Status.FINISHED, desc, "status of seq 1", Status.FINISHED, b.status)
    _expect(b.finish_reason == "stop", desc, "finish_reason of seq 1", "'stop'", repr(b.finish_reason))
    _expect(_ids(scheduler.running) == [0, 2], desc, "running afterwards", [0, 2], _ids(scheduler.running))
    _expect(_ids(scheduler.waiting) == [3], desc, "waiting afterwards (unchanged)", [3], _ids(scheduler.waiting))
    _expect(b.block_table == [], desc, "block table of seq 1", [], b.block_table)
    _expect(
        scheduler.allocator.num_free == free + b_blocks,
        desc,
        "free blocks afterwards",
        free + b_blocks,
        scheduler.allocator.num_free,
    )
    _expect(
        scheduler.num_preemptions == 0,
        desc,
        "scheduler.num_preemptions (finishing is not preempting)",
        0,
        scheduler.num_preemptions,
    )
    _pool_consistent(desc, scheduler)

    desc = "then finish(scheduler, seq 2, 'length') and finish(scheduler, seq 0, 'length')"
    call(desc, finish, scheduler, c, "length")
    call(desc, finish, scheduler, a, "length")
    _expect(
        c.finish_reason == "length" and a.finish_reason == "length",
        desc,
        "finish reasons",
        "'length', 'length'",
        f"{c.finish_reason!r}, {a.finish_reason!r}",
    )
    _expect(
        scheduler.running == [] and scheduler.allocator.num_free == scheduler.allocator.num_blocks,
        desc,
        "running and free blocks",
        f"[] and {scheduler.allocator.num_blocks}",
        f"{_ids(scheduler.running)} and {scheduler.allocator.num_free}",
    )
    _pool_consistent(desc, scheduler)

    # A sequence that is not in `running` (an engine may retire one before it was scheduled).
    scheduler = _state(4, 8, [5], [])
    loose = _seq(9, 3)
    loose.block_table, _ = scheduler.allocator.allocate(loose.token_ids)
    desc = "finish a sequence that holds a block but is not in running"
    call(desc, finish, scheduler, loose, "length")
    _expect(
        loose.status is Status.FINISHED and loose.block_table == [] and _ids(scheduler.running) == [0],
        desc,
        "status, block table, running",
        "FINISHED, [], [0]",
        f"{loose.status.name}, {loose.block_table}, {_ids(scheduler.running)}",
    )
    _pool_consistent(desc, scheduler)

    # Two samples sharing a prompt's blocks: the one that finishes must not free the other's.
    scheduler = _state(4, 16, [10], [])
    first = scheduler.running[0]
    sibling = _seq(1, 10, prompt=first.prompt_token_ids)
    sibling.block_table = scheduler.allocator.fork(first.block_table)
    sibling.status = Status.RUNNING
    scheduler.running.append(sibling)
    free = scheduler.allocator.num_free
    desc = "finish one of two samples sharing 3 blocks"
    call(desc, finish, scheduler, first, "stop")
    _expect(
        scheduler.allocator.num_free == free,
        desc,
        "free blocks (the other sample still holds them)",
        free,
        scheduler.allocator.num_free,
    )
    _pool_consistent(desc, scheduler)


# --------------------------------------------------------------------------- chunked prefill


def _chunk_state(
    block_size: int,
    num_blocks: int,
    running,
    waiting_lens,
    max_num_seqs: int = 8,
    budget: int = 4096,
    caching: bool = False,
):
    """A scheduler whose running sequences are (total tokens, computed tokens) pairs: computed =
    total - 1 is a decoding sequence (its newest token sampled, no slot yet), fewer is a prompt
    being prefilled in slices; each holds blocks for its computed tokens only."""
    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching)
    scheduler = Scheduler(allocator, max_num_seqs, budget)
    for seq_id, (total, computed) in enumerate(running):
        decoding = computed == total - 1
        seq = _seq(seq_id, total - 1 if decoding else total, 1 if decoding else 0)
        seq.block_table, _ = allocator.allocate(seq.token_ids[:computed])
        seq.num_computed_tokens, seq.status = computed, Status.RUNNING
        scheduler.running.append(seq)
    for offset, n in enumerate(waiting_lens):
        scheduler.add(_seq(len(running) + offset, n))
    return scheduler


def _expected_chunked(
    running, waiting_lens, free: int, block_size: int, max_num_seqs: int, budget: int, decodes_only: bool = False
):
    """The step by the rules, on integers -> (scheduled {index: tokens} in batch order, preempted
    indices in order, running indices afterwards, admitted count, free blocks afterwards).
    Indices: running sequences 0 .. len(running) - 1, then the waiting ones."""
    held = [blocks_needed(computed, block_size) for _, computed in running]
    order, batch, preempted = list(range(len(running))), {}, []
    for i, (total, computed) in enumerate(running):  # 1. decodes, preempting the newest
        if i in preempted or total - computed > 1:
            continue
        need = 1 if computed % block_size == 0 else 0
        free = _preempt_newest_until(need, i, free, order, held, preempted)
        if i in order:
            free, batch[i] = free - need, 1
    if decodes_only:
        return batch, preempted, order, 0, free
    budget -= len(batch)
    for i in [j for j in order if running[j][0] - running[j][1] > 1]:  # 2. slices of running prompts
        total, computed = running[i]
        end = computed
        while end < computed + min(total - computed, budget):
            if end % block_size == 0:
                if free < 1:
                    break
                free -= 1
            end += 1
        if end > computed:
            batch[i], budget = end - computed, budget - (end - computed)
    admitted = 0
    while not preempted and admitted < len(waiting_lens) and budget > 0 and len(order) < max_num_seqs:
        n = min(waiting_lens[admitted], budget)  # 3. newcomers, first come first served
        if blocks_needed(n, block_size) > free:
            break
        index = len(running) + admitted
        free, batch[index], budget = free - blocks_needed(n, block_size), n, budget - n
        order.append(index)
        admitted += 1
    return batch, preempted, order, admitted, free


def _run_chunked(
    fn, desc, block_size, extra_free, running, waiting_lens, max_num_seqs=8, budget=4096, decodes_only=False
):
    num_blocks = sum(blocks_needed(computed, block_size) for _, computed in running) + extra_free
    scheduler = _chunk_state(block_size, max(1, num_blocks), running, waiting_lens, max_num_seqs, budget)
    seqs = list(scheduler.running) + list(scheduler.waiting)
    batch, preempted, order, admitted, free = _expected_chunked(
        running, waiting_lens, scheduler.allocator.num_free, block_size, max_num_seqs, budget, decodes_only
    )
    got = call(desc, fn, scheduler)
    want = [seqs[i].seq_id for i in batch]
    _expect(
        isinstance(got, list) and _ids(got) == want,
        desc,
        "sequences to run (seq ids, in order)",
        want,
        _ids(got) if isinstance(got, list) else repr(got),
    )
    if not decodes_only:
        tokens = {seqs[i].seq_id: n for i, n in batch.items()}
        got_tokens = {s.seq_id: s.num_scheduled_tokens for s in got}
        _expect(
            got_tokens == tokens, desc, "tokens each feeds this step (seq id: num_scheduled_tokens)", tokens, got_tokens
        )
    _expect(
        _ids(scheduler.running) == [seqs[i].seq_id for i in order],
        desc,
        "running afterwards",
        [seqs[i].seq_id for i in order],
        _ids(scheduler.running),
    )
    waiting = [seqs[i].seq_id for i in reversed(preempted)] + [s.seq_id for s in seqs[len(running) + admitted :]]
    _expect(_ids(scheduler.waiting) == waiting, desc, "waiting afterwards", waiting, _ids(scheduler.waiting))
    for i, n in batch.items():
        seq = seqs[i]
        computed = running[i][1] if i < len(running) else 0
        _expect(
            seq.num_computed_tokens == computed,
            desc,
            f"num_computed_tokens of seq {seq.seq_id} (the engine advances it after the pass, not the scheduler)",
            computed,
            seq.num_computed_tokens,
        )
        need = blocks_needed(computed + n, block_size)
        _expect(
            len(seq.block_table) == need,
            desc,
            f"blocks of seq {seq.seq_id} (it holds {computed} computed tokens and feeds {n}; block size {block_size})",
            need,
            len(seq.block_table),
        )
    _expect_waiting_then_pool(desc, scheduler, [(seqs[i], f"preempted seq {seqs[i].seq_id}") for i in preempted], free)


def _decode_skips_unfinished_prompts(decode_batch) -> None:
    cases = [
        (
            "a prompt still being prefilled in slices (seq 1: 20 tokens, 8 computed) is not decoded",
            4,
            2,
            [(9, 8), (20, 8), (6, 5)],
        ),
        ("out of blocks: the unfinished prompt, the newest, is the victim", 4, 0, [(9, 8), (6, 5), (30, 12)]),
    ]
    for desc, block_size, free, running in cases:
        _run_chunked(decode_batch, f"decode_batch, {desc}", block_size, free, running, [], decodes_only=True)


def _advance(seqs) -> None:
    """What the engine does with the step's sequences: computes what each feeds, and a sequence
    with all its tokens computed samples one (a slice of a prompt samples nothing)."""
    for seq in seqs:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        if seq.num_computed_tokens == len(seq):
            seq.output_token_ids.append(5)


def _drive(
    fn, desc, prompt_lens, outputs: int, budget: int, num_blocks: int, block_size: int = 4, max_num_seqs: int = 4
) -> None:
    """Run fn step by step like the engine until every sequence has `outputs` tokens."""
    scheduler = _chunk_state(block_size, num_blocks, [], prompt_lens, max_num_seqs, budget)
    seqs = list(scheduler.waiting)
    for step in range(1, 20 * sum(prompt_lens) + 100):
        ready = [s for s in scheduler.running if s.num_new_tokens == 1]
        preemptions = scheduler.num_preemptions
        got = call(f"{desc}, step {step}", fn, scheduler)
        fed = [s.num_scheduled_tokens for s in got]
        what = f"{desc}, step {step}"
        _expect(
            sum(fed) <= budget, what, f"tokens fed in all (max_num_batched_tokens={budget})", f"<= {budget}", sum(fed)
        )
        for seq in got:
            _expect(
                1 <= seq.num_scheduled_tokens <= seq.num_new_tokens,
                what,
                f"num_scheduled_tokens of seq {seq.seq_id} ({seq.num_new_tokens} tokens not computed yet)",
                f"1..{seq.num_new_tokens}",
                seq.num_scheduled_tokens,
            )
        if scheduler.num_preemptions == preemptions:
            starved = [s.seq_id for s in ready if s not in got]
            _expect(not starved, what, "running sequences with a token to decode left out of the step", [], starved)
        _pool_consistent(what, scheduler)
        _advance(got)
        for seq in [s for s in got if len(s.output_token_ids) >= outputs]:
            scheduler.finish(seq, "length")
        if not scheduler.has_unfinished():
            break
    lens = [len(s.output_token_ids) for s in seqs]
    _expect(
        lens == [outputs] * len(seqs), desc, "output tokens of every sequence at the end", [outputs] * len(seqs), lens
    )
    _expect(
        scheduler.allocator.num_free == num_blocks,
        desc,
        "free blocks at the end",
        num_blocks,
        scheduler.allocator.num_free,
    )


def check_schedule_chunked(schedule_chunked) -> None:
    cases = [
        # (what, block size, free blocks beyond the held ones, running (total, computed), waiting, slots, budget)
        (
            "two decodes and a 20-token newcomer, budget 10: the decodes first, then 8 tokens of the prompt",
            4,
            20,
            [(6, 5), (7, 6)],
            [20],
            8,
            10,
        ),
        (
            "a prompt half done (30 tokens, 12 computed), budget 10, one decode: 9 more tokens of it, nobody admitted",
            4,
            20,
            [(6, 5), (30, 12)],
            [5],
            8,
            10,
        ),
        (
            "the last slice of a prompt (14 tokens, 8 computed) leaves budget for a newcomer",
            4,
            20,
            [(14, 8)],
            [9, 3],
            8,
            12,
        ),
        (
            "a newcomer whose first slice needs more blocks than are free: it waits, and the next may not overtake",
            4,
            1,
            [(6, 5)],
            [12, 2],
            8,
            10,
        ),
        ("every sequence slot taken: budget left, nobody admitted", 4, 20, [(6, 5), (7, 6)], [4], 2, 16),
        (
            "the pool runs dry in the middle of a slice: the slice is cut at the last free slot",
            4,
            1,
            [(40, 10)],
            [],
            8,
            16,
        ),
        (
            "a decode preempts the unfinished prompt, the newest: nobody is admitted in that step (the victim would "
            "come straight back)",
            4,
            0,
            [(9, 8), (30, 12)],
            [3],
            8,
            4,
        ),
        ("budget exactly spent by the decodes", 2, 10, [(3, 2), (4, 3), (5, 4)], [6], 8, 3),
        ("nothing running: a lone prompt longer than the budget starts with a slice", 8, 10, [], [50], 8, 16),
    ]
    for desc, block_size, free, running, waiting, slots, budget in cases:
        _run_chunked(schedule_chunked, f"schedule_chunked, {desc}", block_size, free, running, waiting, slots, budget)

    # Prefix caching: the cached tokens of a newcomer are not fed again.
    scheduler = _chunk_state(4, 16, [], [], budget=10, caching=True)
    old = _seq(0, 12, prompt=range(12))
    old.block_table, _ = scheduler.allocator.allocate(old.token_ids)
    scheduler.allocator.free_sequence(old.block_table)  # its full blocks stay cached
    new = _seq(1, 20, prompt=list(range(8)) + list(range(500, 512)))
    scheduler.add(new)
    desc = (
        "schedule_chunked with prefix caching, block size 4, budget 10: a 20-token newcomer whose first 8 "
        "tokens are cached"
    )
    got = call(desc, schedule_chunked, scheduler)
    _expect(
        _ids(got) == [1] and (new.num_computed_tokens, new.num_scheduled_tokens) == (8, 2),
        desc,
        "(seq ids, its num_computed_tokens, num_scheduled_tokens): the first 10 tokens get blocks, 8 of them cached",
        "([1], 8, 2)",
        f"({_ids(got)}, {new.num_computed_tokens}, {new.num_scheduled_tokens})",
    )
    _pool_consistent(desc, scheduler)

    for desc, prompts, outputs, budget, blocks in [
        ("whole runs: prompts of 30, 5, 17 tokens, 6 tokens each, budget 8, 40 blocks of 4", [30, 5, 17], 6, 8, 40),
        (
            "whole runs with a small pool (preemptions): prompts of 22, 19, 9, 14, budget 6, 12 blocks of 4",
            [22, 19, 9, 14],
            8,
            6,
            12,
        ),
    ]:
        _drive(schedule_chunked, f"schedule_chunked, {desc}", prompts, outputs, budget, blocks)

    rng = random.Random(19)
    for case in range(RANDOM_CASES):
        block_size = rng.choice([1, 2, 4, 8])
        running = []
        for _ in range(rng.randint(0, 4)):
            total = rng.randint(2, 40)
            running.append((total, total - 1 if rng.random() < 0.7 else rng.randint(1, total - 1)))
        waiting = [rng.randint(1, 30) for _ in range(rng.randint(0, 3))]
        slots = rng.randint(max(1, len(running)), 6)
        budget = rng.randint(slots, 40)
        free = rng.randint(0, 8)
        _run_chunked(
            schedule_chunked,
            f"schedule_chunked, random case {case}: block size {block_size}, {free} free "
            f"blocks, running (tokens, computed) {running}, waiting lengths {waiting}, max_num_seqs={slots}, "
            f"max_num_batched_tokens={budget}",
            block_size,
            free,
            running,
            waiting,
            slots,
            budget,
        )


# --------------------------------------------------------------------------- padded_prefill

PADDED_SEED = 8
PADDED_RANDOM_CASES = 6
# The toy's logits are of order 1; a correct padded row differs from its prompt alone by ~1e-6
# (another summation order), a wrong mask or position by 0.1 or more.
PADDED_TOLERANCE = 1e-4


def _padded_models() -> dict[str, torch.nn.Module]:
    """A small random Llama (4 query heads over 2 KV heads), and the same with scrambled RoPE tables."""
    return {
        "a small random Llama": random_llama(PADDED_SEED),
        "a small random Llama whose RoPE tables are scrambled (a token's position matters on its own, not only "
        "distances: each prompt's first real token must be at position 0)": scramble_rope_(
            random_llama(PADDED_SEED), PADDED_SEED
        ),
    }


def _check_padded_case(
    padded_prefill, model, model_name: str, prompts: list[list[int]], pad_id: int, what: str
) -> None:
    lengths = [len(prompt) for prompt in prompts]
    batch, longest = len(prompts), max(lengths)
    desc = f"padded_prefill(model, prompts of {lengths} tokens, pad_id={pad_id}){what} on {model_name}"
    counting = CountingModel(model)
    got = call(desc, padded_prefill, counting, [list(prompt) for prompt in prompts], pad_id)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise AssertionError(f"{desc}: expected a pair (logits [B, V], pad fraction), got {type(got).__name__}")
    logits, fraction = got
    if [tokens for tokens, _ in counting.calls] != [longest]:
        raise AssertionError(
            f"{desc}: expected ONE forward pass over the padded batch of {longest} columns, got "
            f"{len(counting.calls)} calls feeding {counting.tokens_fed()} tokens a row"
        )
    vocab_size = model.config.vocab_size
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (batch, vocab_size):
        shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise AssertionError(f"{desc}: expected logits of shape [{batch}, {vocab_size}], got {shape}")
    for row, prompt in enumerate(prompts):
        alone = model(torch.tensor([prompt]), last_only=True)[0, -1]  # [V]: the oracle
        mine = logits[row].detach().float()
        if not torch.allclose(mine, alone, rtol=0.0, atol=PADDED_TOLERANCE):
            gap = (mine - alone).abs().nan_to_num(float("inf"))
            token = int(gap.argmax())
            raise AssertionError(
                f"{desc}: row {row} (a prompt of {len(prompt)} tokens after {longest - len(prompt)} pads) should equal "
                f"the prompt's own next-token logits, run alone: at token {token} expected {float(alone[token]):.5f}, "
                f"got {float(mine[token]):.5f} (largest difference {float(gap.max()):.3g}, tolerance "
                f"{PADDED_TOLERANCE:g})"
            )
    expected = 1 - sum(lengths) / (batch * longest)
    if not isinstance(fraction, (int, float, torch.Tensor)) or abs(float(fraction) - expected) > 1e-9:
        raise AssertionError(
            f"{desc}: pad fraction expected {expected:.6g} ({batch * longest - sum(lengths)} pad "
            f"slots of {batch} x {longest}), got {fraction!r}"
        )


def _padded_cases(vocab_size: int) -> list[tuple[list[list[int]], int, str]]:
    cases = [
        ([[5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9, 3, 4, 4, 8]], 0, ", three prompts of different lengths"),
        ([[3], [1, 2, 3, 4, 5, 6, 7, 8, 9]], 0, ", a one-token prompt beside a 9-token one"),
        ([[1, 2, 3, 4], [5, 6, 7, 8]], 0, ", prompts of equal length (nothing to pad)"),
        ([[10, 20, 30]], 0, ", one prompt"),
        ([[4, 4, 9], [1, 4, 2, 3, 4, 5]], 4, ", pad_id 4 also a real token of both prompts"),
        ([[vocab_size - 1, 2], [7, 8, 9, 10, 11]], vocab_size - 1, ", pad_id the last id of the vocabulary"),
    ]
    rng = random.Random(PADDED_SEED)
    for case in range(PADDED_RANDOM_CASES):
        prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 24))] for _ in range(rng.randint(1, 5))]
        cases.append((prompts, rng.randrange(vocab_size), f", random case {case + 1}"))
    return cases


def check_padded_prefill(padded_prefill) -> None:
    """Named and random batches on both toy models against each prompt run alone (one pass, the
    pad fraction), then bad input: no prompt, an empty prompt, pad_id outside the vocabulary."""
    with torch.inference_mode():
        models = _padded_models()
        for model_name, model in models.items():
            for prompts, pad_id, what in _padded_cases(model.config.vocab_size):
                _check_padded_case(padded_prefill, model, model_name, prompts, pad_id, what)
        model = next(iter(models.values()))
        vocab_size = model.config.vocab_size
        expect_raises("padded_prefill(model, [], pad_id=0)", ValueError, "no prompt", padded_prefill, model, [], 0)
        expect_raises(
            "padded_prefill(model, [[1, 2], []], pad_id=0)",
            ValueError,
            "a prompt without tokens",
            padded_prefill,
            model,
            [[1, 2], []],
            0,
        )
        expect_raises(
            f"padded_prefill(model, [[1, 2]], pad_id={vocab_size}) with a vocabulary of {vocab_size}",
            ValueError,
            "pad_id outside the vocabulary",
            padded_prefill,
            model,
            [[1, 2]],
            vocab_size,
        )


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_throughput_gain_b32() -> float:
    """Throughput of batch 32 over batch 1 when a step costs 20 ms + 1 ms per sequence."""
    return (32 / (0.020 + 32 * 0.001)) / (1 / (0.020 + 1 * 0.001))


def check_q_throughput_gain_b32(value) -> None:
    """Graded q_throughput_gain_b32 (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_throughput_gain_b32",
        value,
        answer_q_throughput_gain_b32(),
        "(32 / (20 ms + 32 x 1 ms)) / (1 / (20 ms + 1 ms))",
    )


def answer_q_chunked_steps() -> float:
    """Steps until a 2,000-token newcomer is complete: budget 512, 4 decodes first."""
    from decodelab.lessons.chunked_prefill import steps_to_first_token

    return steps_to_first_token(2000, 512, decoding=4)


def check_q_chunked_steps(value) -> None:
    """Graded q_chunked_steps (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_chunked_steps",
        value,
        answer_q_chunked_steps(),
        "steps until a 2,000-token prompt is complete with a budget of 512 and 4 decodes a step (508 "
        "prompt tokens a step)",
    )

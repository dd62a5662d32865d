"""The library's whole-prompt `admit` (decodelab.engine.scheduler), which `Scheduler.schedule` runs when
chunked prefill is off. Notebook 08 no longer grades it (its exercise is `schedule_chunked`), so its
check lives here, built on the states and expectations of notebook 08's graded checks
(autograder/checks/continuous_batching.py): the sequences admitted against a model of the rule on
plain integers (slots, token budget, free blocks, first come first served), the queues, statuses,
block tables and the pool afterwards; and the kept bugs of fixtures/buggy_continuous_batching.py's
`ADMIT_BUGS` fail it with a message that names the case."""

from __future__ import annotations

import random

import pytest
from oracles import load_fixture

from autograder.checks import continuous_batching as states
from autograder.checks.calling import call
from decodelab.engine import scheduler
from decodelab.engine.block_allocator import blocks_needed

buggy = load_fixture("buggy_continuous_batching")


def _expected_admit(waiting_lens, num_running, free, block_size, max_num_seqs, budget):
    """(how many of the waiting sequences are admitted, free blocks afterwards)."""
    count, tokens = 0, 0
    for n in waiting_lens:
        need = blocks_needed(n, block_size)
        if num_running + count >= max_num_seqs or (count and tokens + n > budget) or need > free:
            break
        count, tokens, free = count + 1, tokens + n, free - need
    return count, free


def _run_admit(fn, desc, block_size, num_blocks, running_lens, waiting_lens, max_num_seqs, budget):
    scheduler = states._state(block_size, num_blocks, running_lens, waiting_lens, max_num_seqs, budget)
    old_running, old_waiting = list(scheduler.running), list(scheduler.waiting)
    count, free = _expected_admit(
        waiting_lens, len(running_lens), scheduler.allocator.num_free, block_size, max_num_seqs, budget
    )
    got = call(desc, fn, scheduler)
    expected = old_waiting[:count]
    states._expect(
        isinstance(got, list) and states._ids(got) == states._ids(expected),
        desc,
        "admitted (seq ids, in order)",
        states._ids(expected),
        states._ids(got) if isinstance(got, list) else repr(got),
    )
    states._expect(
        states._ids(scheduler.running) == states._ids(old_running + expected),
        desc,
        "running afterwards",
        states._ids(old_running + expected),
        states._ids(scheduler.running),
    )
    states._expect(
        states._ids(scheduler.waiting) == states._ids(old_waiting[count:]),
        desc,
        "waiting afterwards",
        states._ids(old_waiting[count:]),
        states._ids(scheduler.waiting),
    )
    for seq in expected:
        states._expect(
            seq.status is states.Status.RUNNING,
            desc,
            f"status of admitted seq {seq.seq_id}",
            states.Status.RUNNING,
            seq.status,
        )
        need = blocks_needed(len(seq), block_size)
        states._expect(
            len(seq.block_table) == need,
            desc,
            f"blocks of admitted seq {seq.seq_id} ({len(seq)} tokens, block size {block_size})",
            need,
            len(seq.block_table),
        )
        states._expect(
            seq.num_computed_tokens == 0,
            desc,
            f"num_computed_tokens of seq {seq.seq_id} (nothing cached)",
            0,
            seq.num_computed_tokens,
        )
    states._expect_waiting_then_pool(
        desc,
        scheduler,
        [(seq, f"seq {seq.seq_id}, not admitted: status and blocks") for seq in old_waiting[count:]],
        free,
    )


def check_admit(admit) -> None:
    cases = [
        # (what, block size, pool, running lens, waiting lens, max_num_seqs, budget)
        (
            "a free slot for each: max_num_seqs=3 with 1 running, waiting prompts of 4, 4, 4 tokens",
            4,
            32,
            [5],
            [4, 4, 4],
            3,
            4096,
        ),
        (
            "the token budget: max_num_batched_tokens=10, waiting prompts of 4, 5, 3 tokens (4 + 5 fit, + 3 is 12)",
            4,
            32,
            [],
            [4, 5, 3],
            8,
            10,
        ),
        ("a lone long prompt runs by itself: budget 8, waiting prompts of 12 then 2 tokens", 4, 32, [], [12, 2], 8, 8),
        (
            "the KV pool: 4 free blocks of 4 tokens, waiting prompts of 8, 9, 2 tokens (9 needs 3 blocks; the "
            "2-token prompt must not overtake it)",
            4,
            4,
            [],
            [8, 9, 2],
            8,
            4096,
        ),
        ("nothing waiting", 4, 16, [3, 3], [], 4, 4096),
        ("every slot taken: max_num_seqs=2 with 2 running", 4, 32, [3, 3], [2], 2, 4096),
        ("the pool is full: 3 blocks of 4, one sequence of 12 tokens running", 4, 3, [12], [1], 4, 4096),
        ("exactly enough blocks: 6 free blocks of 2, prompts of 4, 4, 4 tokens", 2, 6, [], [4, 4, 4], 8, 4096),
        ("exactly on the budget: budget 9, prompts of 4 and 5", 16, 32, [], [4, 5, 1], 8, 9),
    ]
    for desc, block_size, num_blocks, running, waiting, max_seqs, budget in cases:
        _run_admit(admit, f"admit, {desc}", block_size, num_blocks, running, waiting, max_seqs, budget)

    # A preempted sequence comes back with its output so far: all of it must get blocks again.
    scheduler = states._state(4, 8, [], [])
    back = states._seq(0, 5, output_len=6)  # 11 tokens: 3 blocks
    scheduler.add(back)
    desc = "admit, a preempted sequence (5 prompt + 6 output tokens, block size 4) coming back"
    got = call(desc, admit, scheduler)
    states._expect(
        states._ids(got) == [0] and len(back.block_table) == 3,
        desc,
        "admitted ids and blocks of the sequence",
        "[0] with 3 blocks (its 11 tokens)",
        f"{states._ids(got)} with {len(back.block_table)} blocks",
    )
    states._pool_consistent(desc, scheduler)

    # Prefix caching: allocate() reports how many tokens are already in the cache.
    scheduler = states._state(4, 16, [], [], caching=True)
    old = states._seq(0, 12, prompt=range(12))
    old.block_table, _ = scheduler.allocator.allocate(old.token_ids)
    scheduler.allocator.free_sequence(old.block_table)  # finished; its full blocks stay cached
    new = states._seq(1, 11, prompt=list(range(8)) + [500, 501, 502])
    scheduler.add(new)
    desc = (
        "admit with prefix caching, block size 4: a new prompt of 11 tokens whose first 8 match a "
        "finished sequence's cached blocks"
    )
    call(desc, admit, scheduler)
    states._expect(
        new.num_computed_tokens == 8,
        desc,
        "num_computed_tokens (the cached tokens allocate() reports)",
        8,
        new.num_computed_tokens,
    )
    states._pool_consistent(desc, scheduler)

    rng = random.Random(7)
    for case in range(states.RANDOM_CASES):
        block_size = rng.choice([1, 2, 4, 8])
        running = [rng.randint(1, 20) for _ in range(rng.randint(0, 3))]
        num_blocks = max(1, sum(blocks_needed(n, block_size) for n in running) + rng.randint(0, 12))
        waiting = [rng.randint(1, 24) for _ in range(rng.randint(0, 6))]
        max_seqs, budget = rng.randint(1, 6), rng.randint(1, 60)
        _run_admit(
            admit,
            f"admit, random case {case}: block size {block_size}, {num_blocks} blocks, running "
            f"lengths {running}, waiting lengths {waiting}, max_num_seqs={max_seqs}, "
            f"max_num_batched_tokens={budget}",
            block_size,
            num_blocks,
            running,
            waiting,
            max_seqs,
            budget,
        )


def test_reference_passes():
    check_admit(scheduler.admit)


@pytest.mark.parametrize("bug", sorted(buggy.ADMIT_BUGS))
def test_bug_is_caught(bug):
    fn, what = buggy.ADMIT_BUGS[bug]
    with pytest.raises(AssertionError) as info:
        check_admit(fn)
    message = str(info.value)
    assert len(message) > 40 and ("expected" in message or "raised" in message), f"{bug} ({what}): {message}"


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match="token budget.*admitted.*expected \\[0, 1\\], got \\[0, 1, 2\\]"):
        check_admit(buggy.admit_ignores_token_budget)

"""Chunked prefill (`LLM(chunked_prefill=True)`, `decodelab.engine.scheduler.schedule_chunked`):
the same tokens as whole-prompt prefill (and, greedy, as one request at a time), every step within
the token budget with every running sequence decoding, and a first token only once the prompt is
complete."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import check_greedy_agreement, last_logits_fn

from decodelab.decoding.generate import encode_prompt, stream_token_ids
from decodelab.engine.args import EngineArgs
from decodelab.engine.llm import LLM, EngineHooks
from decodelab.engine.scheduler import Scheduler
from decodelab.model.registry import load
from decodelab.params import SamplingParams

CHAT_PROMPTS = [
    "What is gravity?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
]


class StepLog(Scheduler):
    """Checks the pool after every step and records (tokens fed per sequence, decodes that had to
    wait): a decode waits when a running sequence with one token to feed is not in the step."""

    def schedule(self):
        ready = [s for s in self.running if s.num_new_tokens == 1]
        preempted = self.num_preemptions
        seqs, is_prefill = super().schedule()
        self.allocator.check_invariants([s.block_table for s in self.running])
        waited = [s for s in ready if s not in seqs] if self.num_preemptions == preempted else []
        self.steps = getattr(self, "steps", []) + [([s.num_tokens_this_step for s in seqs], len(waited))]
        return seqs, is_prefill


@pytest.fixture(scope="module")
def tiny():
    return load("tiny", device="cpu")


def _random_prompts(vocab_size: int, count: int, lengths=(5, 90), seed: int = 0, shared: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(shared)]
    return [system + [rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def test_chunked_greedy_equals_single_request_smollm2(smollm2):
    """Chat prompts of ~40 tokens in slices of at most 16 tokens per step (decodes included), twice:
    the second pass finds the shared system prompt in the prefix cache."""
    model, tokenizer = smollm2
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in CHAT_PROMPTS]
    assert min(len(p) for p in prompts) > 16
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(
        (model, tokenizer),
        kv_block_size=8,
        num_kv_blocks=96,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        chunked_prefill=True,
        hooks=EngineHooks(scheduler=StepLog),
    )
    for _ in range(2):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            alone = list(stream_token_ids(model, prompt, params, tokenizer.stop_token_ids()))
            check_greedy_agreement(prompt, out.outputs[0].token_ids, alone, [last_logits_fn(model)])
    steps = llm.scheduler.steps
    assert all(sum(fed) <= 16 for fed, _ in steps), "a step went over the token budget"
    assert all(waited == 0 for _, waited in steps), "a running sequence did not decode"
    assert any(1 in fed and max(fed) > 1 for fed, _ in steps), "no step mixed decodes with a prompt slice"
    assert llm.allocator.hits > 0 and llm.allocator.num_free == llm.allocator.num_blocks


def test_chunked_under_a_tight_pool_matches_whole_prompt_smollm2(smollm2):
    """SmolLM2, four chat prompts in slices of 16 tokens, a pool of 18 blocks of 8 where the four
    need about 32: preemptions, and still the greedy tokens of a roomy whole-prompt engine."""
    model, tokenizer = smollm2
    conversations = [[{"role": "user", "content": q}] for q in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tight = LLM(
        (model, tokenizer),
        kv_block_size=8,
        num_kv_blocks=18,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        chunked_prefill=True,
        hooks=EngineHooks(scheduler=StepLog),
    )
    replies = tight.chat(conversations, params)
    roomy = LLM((model, tokenizer), kv_block_size=8, num_kv_blocks=128).chat(conversations, params)
    assert tight.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert [r.outputs[0].token_ids for r in replies] == [r.outputs[0].token_ids for r in roomy]
    assert all(sum(fed) <= 16 for fed, _ in tight.scheduler.steps)
    assert tight.allocator.num_free == tight.allocator.num_blocks


@pytest.mark.parametrize(
    "budget, num_blocks, max_num_seqs, prefix_caching",
    [(16, 200, 8, True), (8, 200, 8, False), (16, 40, 8, True), (32, 30, 4, True), (5, 30, 5, False)],
)
def test_chunked_matches_whole_prompt_prefill_tiny(tiny, budget, num_blocks, max_num_seqs, prefix_caching):
    """The tiny model, prompts of 5 to 90 tokens (most longer than a slice), half of them sharing a
    20-token prefix, greedy and seeded sampling with n = 2: chunked prefill gives exactly the tokens
    of whole-prompt prefill, also when a small pool forces preemptions."""
    model, tokenizer = tiny
    prompts = _random_prompts(tokenizer.vocab_size, 8, seed=budget) + _random_prompts(
        tokenizer.vocab_size, 4, (5, 40), seed=budget + 1, shared=20
    )
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 8 + [
        SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=i, ignore_eos=True) for i in range(4)
    ]
    whole = LLM((model, tokenizer), num_kv_blocks=200, kv_block_size=4, enable_prefix_caching=prefix_caching)
    expected = whole.generate(prompts, params, use_tqdm=False)
    llm = LLM(
        (model, tokenizer),
        num_kv_blocks=num_blocks,
        kv_block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunked_prefill=True,
        enable_prefix_caching=prefix_caching,
        hooks=EngineHooks(scheduler=StepLog),
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(expected, got):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(sum(fed) <= budget for fed, _ in llm.scheduler.steps)
    assert all(waited == 0 for _, waited in llm.scheduler.steps), "a running sequence did not decode"
    if num_blocks < 50:
        assert llm.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert llm.allocator.num_free == llm.allocator.num_blocks
    llm.allocator.check_invariants([])


def test_newcomer_samples_only_when_its_prompt_is_complete(tiny):
    """Two requests decode; a 100-token prompt arrives. With a budget of 32 it is fed in slices
    of 30, 30, 30 and 10 tokens (the two decodes take 2 of the 32 each step) and its first token
    comes in the fourth step, while the two running requests get a token in every step."""
    model, tokenizer = tiny
    llm = LLM(
        (model, tokenizer),
        num_kv_blocks=128,
        kv_block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        chunked_prefill=True,
        hooks=EngineHooks(scheduler=StepLog),
    )
    for index, prompt in enumerate([[5, 6, 7], [8, 9]]):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), index=index)
    for _ in range(3):
        llm.step()  # the two short prompts are prefilled together, then they decode
    long_prompt = _random_prompts(tokenizer.vocab_size, 1, (100, 100), seed=5)[0]
    newcomer = llm.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), index=2)
    first_steps = []
    for step in range(4):
        events = llm.step()
        first_steps.append(sorted(e.request_index for e in events))
    assert first_steps == [[0, 1], [0, 1], [0, 1], [0, 1, 2]]
    assert [fed for fed, _ in llm.scheduler.steps[-4:]] == [[1, 1, 30], [1, 1, 30], [1, 1, 30], [1, 1, 10]]
    while llm.scheduler.has_unfinished():
        llm.step()
    alone = LLM((model, tokenizer), num_kv_blocks=128, kv_block_size=8)
    expected = alone.generate(
        [long_prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert newcomer.seqs[0].output_token_ids == expected[0].outputs[0].token_ids


def test_bad_chunked_prefill_settings_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs \\(8\\), got 4"):
        EngineArgs(chunked_prefill=True, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="does not run with a speculative_model"):
        EngineArgs(chunked_prefill=True, speculative_model="tiny-draft")
    with pytest.raises(ValueError, match="needs mix_decode_with_prefill=True"):
        EngineArgs(chunked_prefill=True, mix_decode_with_prefill=False)
    with pytest.raises(ValueError, match="chunked_prefill must be True or False, got 'yes'"):
        EngineArgs(chunked_prefill="yes")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1, got 0"):
        EngineArgs(max_num_batched_tokens=0)

    class Plain:  # a scheduler-like object that cannot chunk
        def __init__(self, allocator, max_num_seqs, max_num_batched_tokens):
            self.allocator = allocator

    with pytest.raises(ValueError, match="needs a scheduler with schedule_chunked; Plain has none"):
        LLM(tiny, chunked_prefill=True, num_kv_blocks=16, hooks=EngineHooks(scheduler=Plain))


def test_stall_measurement_on_the_tiny_model(tiny):
    """compare_stalls: whole-prompt prefill gives the newcomer its first token in the step it is
    admitted, chunked prefill (budget 64, 4 decodes) in ceil(300 / 60) = 5 steps; the running
    requests' gaps are measured after the arrival only; bad set-ups are clear errors."""
    from decodelab.lessons.chunked_prefill import compare_stalls, newcomer_run, percentile

    model, tokenizer = tiny
    running = _random_prompts(tokenizer.vocab_size, 4, (8, 8), seed=2)
    newcomer = _random_prompts(tokenizer.vocab_size, 1, (300, 300), seed=3)[0]

    def engine(**settings):
        return LLM(
            (model, tokenizer),
            max_num_seqs=8,
            num_kv_blocks=64,
            kv_block_size=16,
            enable_prefix_caching=False,
            **settings,
        )

    results = compare_stalls(
        {"whole": engine(), "chunked": engine(chunked_prefill=True, max_num_batched_tokens=64)},
        running,
        newcomer,
        decode_tokens=16,
        arrive_after=3,
        rounds=1,
    )
    whole, chunked = results["whole"], results["chunked"]
    assert (whole.steps_to_first_token, chunked.steps_to_first_token) == (1, 5)
    for result in results.values():
        assert all(len(times) == 16 for times in result.token_times)  # every token of every running request
        assert len(result.gaps) == sum(sum(t > 0 for t in times[1:]) for times in result.token_times)
        assert 0 < result.itl_p50 <= result.itl_p99 == max(result.gaps) and result.ttft > 0
    assert percentile([4, 1, 3, 2], 50) == 2 and percentile([4, 1, 3, 2], 100) == 4
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        compare_stalls({"cached": LLM((model, tokenizer), num_kv_blocks=64)}, running, newcomer)
    with pytest.raises(ValueError, match="the newcomer needs a sequence slot"):
        newcomer_run(LLM((model, tokenizer), max_num_seqs=4, num_kv_blocks=64), running, newcomer, "full")
    with pytest.raises(ValueError, match="raise decode_tokens"):
        newcomer_run(
            engine(chunked_prefill=True, max_num_batched_tokens=16), running, newcomer, "short", decode_tokens=6
        )


def test_simulated_chunked_prefill_keeps_the_budget_and_finishes():
    """The simulator runs the chunked step as the engine does: every step within the budget,
    every request's tokens produced, the long prompts' first tokens after several steps."""
    from decodelab.lessons import continuous_batching as batching_sim

    workload = batching_sim.mixed_workload(12, 5.0, prompt_lens=(4, 60), output_lens=(2, 20), seed=4)
    whole = batching_sim.simulate(workload, "continuous", max_num_seqs=4, num_blocks=40, block_size=4)
    chunked = batching_sim.simulate(
        workload,
        "continuous",
        max_num_seqs=4,
        num_blocks=40,
        block_size=4,
        max_num_batched_tokens=16,
        chunked_prefill=True,
    )
    assert all(step.num_tokens <= 16 for step in chunked.steps)
    assert max(step.num_tokens for step in whole.steps) > 16
    assert chunked.output_tokens == whole.output_tokens == sum(r.output_len for r in workload)
    assert len(chunked.latency) == 12 and len(chunked.steps) > len(whole.steps)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 8), st.integers(1, 2)), min_size=1, max_size=7),
    num_blocks=st.integers(18, 40),
    block_size=st.sampled_from([2, 4, 8]),
    max_num_seqs=st.integers(1, 5),
    extra_budget=st.integers(0, 20),
    prefix_caching=st.booleans(),
)
def test_random_workloads_chunked_match_whole_prompt(
    tiny, lengths, num_blocks, block_size, max_num_seqs, extra_budget, prefix_caching
):
    """Random prompts (some sharing a 12-token prefix), outputs, n, pools, budgets: the pool stays
    consistent after every step, nothing leaks, and the tokens (greedy, and seeded sampling for
    n = 2) are those of a roomy whole-prompt engine. The pool holds the largest request alone."""
    model, tokenizer = tiny
    rng = random.Random(sum(n for n, _, _ in lengths) * 100 + num_blocks)
    shared = [rng.randrange(tokenizer.vocab_size) for _ in range(12)]
    prompts, params = [], []
    for i, (length, max_tokens, n) in enumerate(lengths):
        tail = [rng.randrange(tokenizer.vocab_size) for _ in range(length)]
        prompts.append(shared + tail if rng.random() < 0.5 else tail)
        params.append(
            SamplingParams(temperature=0.0 if n == 1 else 1.0, n=n, seed=i, max_tokens=max_tokens, ignore_eos=True)
        )
    whole = LLM((model, tokenizer), num_kv_blocks=256, kv_block_size=block_size).generate(
        prompts, params, use_tqdm=False
    )
    num_blocks = max(num_blocks, -(-80 // block_size))  # the longest request (72 + 8 tokens) fits alone
    llm = LLM(
        (model, tokenizer),
        num_kv_blocks=num_blocks,
        kv_block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_budget,
        chunked_prefill=True,
        enable_prefix_caching=prefix_caching,
        hooks=EngineHooks(scheduler=StepLog),
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for expected, got in zip(whole, outputs):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected.outputs]
    # n = 2 samples may outnumber max_num_seqs: then their decodes alone may pass the budget
    assert all(
        sum(fed) <= max_num_seqs + extra_budget or set(fed) == {1} for fed, _ in getattr(llm.scheduler, "steps", [])
    )
    assert llm.allocator.num_free == llm.allocator.num_blocks, "blocks leaked"
    llm.allocator.check_invariants([])


def _stall_workload(tokenizer):
    """The draw that once deadlocked the engine: two n = 2 requests of 67 and 59 prompt tokens on 40
    blocks of 2, 2 sequence slots, a budget of 22 tokens. Both long prompts got slices, the pool ran
    dry with each part-way through its prefill, and neither could take a step (no decode to preempt)."""
    rng = random.Random(640)  # as the random-workload test drew it
    lengths = [(55, 7, 2), (59, 5, 2), (22, 7, 1), (27, 5, 1)]
    shared = [rng.randrange(tokenizer.vocab_size) for _ in range(12)]
    prompts = []
    for length, _, _ in lengths:
        tail = [rng.randrange(tokenizer.vocab_size) for _ in range(length)]
        prompts.append(shared + tail if rng.random() < 0.5 else tail)
    params = [
        SamplingParams(temperature=0.0 if n == 1 else 1.0, n=n, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i, (_, max_tokens, n) in enumerate(lengths)
    ]
    return prompts, params


def test_prompts_stalled_mid_prefill_on_a_full_pool_are_preempted_not_deadlocked(tiny):
    """When every running sequence is a prompt part-way through its prefill and the pool is full,
    nothing can be scheduled: the engine preempts the newest (`drop_unschedulable`), the older ones
    go on, and every request gets the tokens a roomy engine gives, with nothing leaked."""
    model, tokenizer = tiny
    prompts, params = _stall_workload(tokenizer)
    llm = LLM(
        (model, tokenizer),
        num_kv_blocks=40,
        kv_block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=22,
        chunked_prefill=True,
        hooks=EngineHooks(scheduler=StepLog),
    )
    requests = [llm.add_request(prompt, sp, index=i) for i, (prompt, sp) in enumerate(zip(prompts, params))]
    stalled_steps = 0
    for _ in range(2_000):  # a bound, so a regression fails here instead of hanging
        if not llm.scheduler.has_unfinished():
            break
        preempted = llm.scheduler.num_preemptions
        llm.step()
        stalled_steps += not llm.scheduler.steps[-1][0] and llm.scheduler.num_preemptions > preempted
    assert not llm.scheduler.has_unfinished(), "the engine did not finish the stalled workload in 2,000 steps"
    assert stalled_steps >= 1, "the workload no longer stalls: it does not test the stall any more"
    roomy = LLM((model, tokenizer), num_kv_blocks=256, kv_block_size=2).generate(prompts, params, use_tqdm=False)
    for i, (request, expected) in enumerate(zip(requests, roomy)):
        assert [seq.output_token_ids for seq in request.seqs] == [c.token_ids for c in expected.outputs], i
        assert all(seq.finish_reason == "length" for seq in request.seqs)
    assert llm.allocator.num_free == llm.allocator.num_blocks, "blocks leaked"


def test_a_request_the_pool_can_never_hold_ends_with_an_error(tiny):
    """An allocator that can never give a prompt its blocks: the request ends with finish_reason
    "error" and a message naming the blocks, instead of the engine spinning; the next call works."""
    from decodelab.engine.block_allocator import BlockAllocator

    class NeverRoom(BlockAllocator):
        def can_allocate(self, token_ids) -> bool:
            return len(token_ids) < 10

    model, tokenizer = tiny
    llm = LLM((model, tokenizer), num_kv_blocks=32, kv_block_size=4, hooks=EngineHooks(allocator=NeverRoom))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    refused, fine = llm.generate([list(range(1, 21)), [1, 2, 3]], params, use_tqdm=False)
    assert refused.outputs[0].finish_reason == "error" and refused.outputs[0].token_ids == []
    assert "its 20 tokens need 5 KV blocks of 4 tokens" in refused.outputs[0].error
    assert fine.outputs[0].finish_reason == "length" and len(fine.outputs[0].token_ids) == 3
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_a_step_that_makes_no_progress_raises_and_frees_the_engine(tiny):
    """A step hook that never schedules anything: `generate` raises RuntimeError at once instead of
    spinning, its requests are aborted, and the engine serves the next call."""
    model, tokenizer = tiny
    stuck = {"on": True, "calls": 0}

    def step(engine):
        if not stuck["on"]:
            return engine_step(engine)
        stuck["calls"] += 1
        assert stuck["calls"] < 50, "generate called a step that does nothing 50 times: it spins"
        return []

    from decodelab.engine.llm import engine_step

    llm = LLM((model, tokenizer), num_kv_blocks=32, hooks=EngineHooks(step=step))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(RuntimeError, match="made no progress"):
        llm.generate(["x = 1"], params, use_tqdm=False)
    assert not llm.scheduler.has_unfinished() and llm.allocator.num_free == llm.allocator.num_blocks
    stuck["on"] = False
    assert len(llm.generate(["x = 1"], params, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_kept_engine_bugs_change_the_tokens(tiny):
    """The engine's kept bugs (tests/fixtures/library/buggy_chunked_prefill.py) give other tokens
    than whole-prompt prefill on prompts longer than a slice."""
    from oracles import load_fixture

    bugs = load_fixture("library/buggy_chunked_prefill").BUGS
    model, tokenizer = tiny
    prompts = _random_prompts(tokenizer.vocab_size, 4, (20, 60), seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM((model, tokenizer), num_kv_blocks=128, kv_block_size=4).generate(prompts, params, use_tqdm=False)
    ]
    for name, (hook, bug, what) in bugs.items():
        llm = LLM(
            (model, tokenizer),
            num_kv_blocks=128,
            kv_block_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            chunked_prefill=True,
            hooks=EngineHooks(**{hook: bug}),
        )
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got != expected, f"{name} ({what}) was not caught"


def test_chunked_prefill_with_the_forward_and_attention_hooks(tiny):
    """Notebook 01's forward pass and attention (EngineHooks forward / attention) run the slices
    too: a slice attends over the sequence's computed context plus itself, as a prefill does."""
    from decodelab.lessons import forward_pass as fp

    model, tokenizer = tiny
    prompts = _random_prompts(tokenizer.vocab_size, 5, (10, 60), seed=11)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM((model, tokenizer), num_kv_blocks=128, kv_block_size=4).generate(prompts, params, use_tqdm=False)
    ]
    for hooks in (
        EngineHooks(forward=fp.forward),
        EngineHooks(attention=fp.attention),
        EngineHooks(forward=fp.forward, attention=fp.attention),
    ):
        llm = LLM(
            (model, tokenizer),
            num_kv_blocks=40,
            kv_block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=12,
            chunked_prefill=True,
            hooks=hooks,
        )
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_steps_to_first_token_counts_the_library_step():
    """Counted by driving the library's chunked step: ceil(prompt / (budget - decodes)), the closed form."""
    import math

    from decodelab.lessons.chunked_prefill import steps_to_first_token

    for prompt, budget, decoding in [
        (2000, 512, 4),
        (960, 128, 4),
        (100, 50, 4),
        (504, 512, 4),
        (1, 8, 0),
        (37, 10, 3),
    ]:
        assert steps_to_first_token(prompt, budget, decoding) == math.ceil(prompt / (budget - decoding)), (
            prompt,
            budget,
            decoding,
        )
    with pytest.raises(ValueError):
        steps_to_first_token(100, 4, decoding=4)

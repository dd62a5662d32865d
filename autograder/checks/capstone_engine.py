"""Checks for notebook 10, the capstone: the engine's loop body, KV-pool sizing, roofline fraction.

Every ``check_*`` takes the function under test and raises ``AssertionError`` naming the case,
the expected and the actual result.

Oracles:
* ``check_engine_step`` plugs the function into the real engine (``EngineHooks(step=fn)``) on
  the course's tiny model and compares, scenario by scenario, every completion's token ids with
  the library's own engine run on the same requests and seeds: greedy batches, n > 1 seeded
  sampling (siblings share the prompt's blocks), a KV pool small enough to force preemption,
  speculative decoding with the tiny draft model (the draft model must actually be used), and
  the stream of events (one per generated token). The loop is driven here with a step cap, so
  a step that makes no progress fails with a message instead of hanging.
* ``check_generate_all`` runs the learner's outer loop on a fresh engine and ``LLM.generate`` (the
  oracle) on another built the same way, scenario by scenario (greedy prompts that finish out of
  order and a refused empty prompt, n=2 seeded samples, stop strings and stop token ids, a KV pool
  that forces preemption, speculative decoding), and compares every output field; the callback must
  see the same events as ``LLM.stream``. An engine whose step never progresses must end in a
  RuntimeError (its step raises after a few calls, so a loop without a cap fails instead of
  hanging), and ``max_steps`` must stop a loop that would need more steps.
* ``check_kv_blocks_for_memory``: the block size written out by hand from the config fields.
* ``check_decode_roofline_fraction``: closed-form cases worked by hand.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.config import ModelConfig
from decodelab.course.exercises import references

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("10_capstone_engine")

__all__ = ["check_engine_step", "check_generate_all", "check_kv_blocks_for_memory", "check_decode_roofline_fraction"]

MAX_STEPS = 2_000  # far above what any scenario below needs


# --------------------------------------------------------------------------- engine_step


@functools.lru_cache(maxsize=None)
def _tiny():
    from decodelab.model.registry import load

    return load("tiny", device="cpu"), load("tiny-draft", device="cpu")[0]


def _engine(step, **kwargs):
    from decodelab.engine.llm import LLM, EngineHooks

    (model, tokenizer), draft = _tiny()
    if kwargs.pop("speculative", False):
        kwargs.update(speculative_model=draft, num_speculative_tokens=3)
    return LLM(model=(model, tokenizer), hooks=EngineHooks(step=step), **kwargs)


def _drive(llm, prompts, params, case: str = ""):
    """Run the engine's loop with a step cap; returns (outputs, events)."""
    requests = llm._add_requests(prompts, params)
    events = []
    for _ in range(MAX_STEPS):
        if not llm.scheduler.has_unfinished():
            break
        produced = call(f"the engine's step with your engine_step{f', {case}' if case else ''}", llm.step)
        assert isinstance(produced, list), (
            f"engine_step must return a list of StreamEvent, got {type(produced).__name__}"
        )
        events += produced
    else:
        raise AssertionError(
            f"the engine did not finish within {MAX_STEPS} steps: does engine_step always "
            "make progress (schedule, forward, append a token to every scheduled sequence)?"
        )
    return [llm._request_output(i, r) for i, r in enumerate(requests)], events


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):", "for i in range(10):"]


def _scenarios():
    from decodelab.params import SamplingParams

    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 12, 3, 9)]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, n=3, seed=11, ignore_eos=True)
    return [
        ("four greedy prompts of different lengths (continuous batching)", {}, PROMPTS, greedy),
        ("n=3 seeded samples of one prompt (siblings share the prompt's blocks)", {}, PROMPTS[:1], [sampled]),
        (
            "a KV pool of 6 blocks of 4 tokens, which forces preemption",
            {"num_kv_blocks": 6, "kv_block_size": 4},
            PROMPTS[:3],
            greedy[:3],
        ),
        (
            "speculative decoding with the tiny draft model (k=3), greedy",
            {"speculative": True},
            PROMPTS[:2],
            [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 2,
        ),
        (
            "chunked prefill, at most 6 tokens a step (prompts fed in slices: no token until a prompt is complete)",
            {"chunked_prefill": True, "max_num_batched_tokens": 6, "max_num_seqs": 4},
            PROMPTS,
            greedy,
        ),
    ]


def check_engine_step(engine_step) -> None:
    from decodelab.engine.llm import engine_step as reference_step

    for case, kwargs, prompts, params in _scenarios():
        expected, expected_events = _drive(_engine(reference_step, **dict(kwargs)), prompts, params)
        llm = _engine(engine_step, **dict(kwargs))
        got, events = _drive(llm, prompts, params, case)
        want, have = _token_ids(expected), _token_ids(got)
        assert have == want, (
            f"engine_step, {case}: expected the completions (token ids per prompt, per sample) {want}, got {have}"
        )
        assert len(events) == len(expected_events), (
            f"engine_step, {case}: expected {len(expected_events)} StreamEvents (one per generated token), "
            f"got {len(events)}: return the events of every token you append, siblings' first tokens included"
        )
        if kwargs.get("speculative"):
            stats = llm.speculator.stats()
            assert stats["target_calls"] > 0, (
                f"engine_step, {case}: the draft model was never used (speculator.stats() = {stats}): decode steps "
                "of an engine with a draft model go to engine.speculator.step(seqs)"
            )
        assert all(block.ref_count == 0 for block in llm.allocator.blocks), (
            f"engine_step, {case}: blocks still referenced after every request finished"
        )


# --------------------------------------------------------------------------- generate_all


def _loop_scenarios():
    from decodelab.params import SamplingParams

    def greedy(*lengths):
        return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]

    stops = SamplingParams(temperature=0, max_tokens=24, stop=["object", "os\nim"], stop_token_ids=[496])
    return [
        (
            "five greedy prompts with 9, 3, 12, 4 and 6 new tokens, the fourth one empty (refused): they finish out "
            "of order",
            {},
            [PROMPTS[0], PROMPTS[1], PROMPTS[2], "", PROMPTS[3]],
            greedy(9, 3, 12, 4, 6),
        ),
        (
            "n=2 seeded samples of two prompts (each sample its own CompletionOutput)",
            {},
            PROMPTS[:2],
            SamplingParams(temperature=0.9, top_p=0.95, max_tokens=7, n=2, seed=5, ignore_eos=True),
        ),
        (
            "stop strings 'object' and 'os\\nim' (it spans three tokens, and cuts text already streamed) and stop "
            "token id 496 ('able'), greedy, up to 24 tokens",
            {},
            PROMPTS,
            stops,
        ),
        (
            "a KV pool of 6 blocks of 4 tokens, which forces preemption",
            {"num_kv_blocks": 6, "kv_block_size": 4},
            PROMPTS[:3],
            greedy(5, 12, 3),
        ),
        (
            "speculative decoding with the tiny draft model (k=3), greedy",
            {"speculative": True},
            PROMPTS[:3],
            greedy(10, 4, 7),
        ),
    ]


def _fields(outputs) -> list:
    return [
        (
            out.request_id,
            out.prompt_token_ids,
            out.error,
            [(c.index, c.token_ids, c.text, c.finish_reason) for c in out.outputs],
        )
        for out in outputs
    ]


def _event_fields(events) -> list:
    return [(e.request_index, e.sample_index, e.token_id, e.text, e.finished) for e in events]


class _StalledStep:
    """A step hook that produces nothing and changes nothing; after `limit` calls it fails the check,
    so that a loop with neither a cap nor a progress test ends instead of hanging."""

    def __init__(self, limit: int = 50):
        self.calls, self.limit = 0, limit

    def __call__(self, engine) -> list:
        self.calls += 1
        if self.calls > self.limit:
            raise AssertionError(
                f"generate_all called engine.step() {self.limit} times on an engine whose step "
                "returns no events and changes nothing: it must stop with a RuntimeError (no "
                "progress), not loop forever"
            )
        return []


def check_generate_all(generate_all) -> None:
    from decodelab.engine.llm import engine_step

    for case, kwargs, prompts, params in _loop_scenarios():
        want_llm = _engine(engine_step, **dict(kwargs))
        expected = _fields(want_llm.generate(prompts, params, use_tqdm=False))
        expected_events = _event_fields(_engine(engine_step, **dict(kwargs)).stream(prompts, params))
        llm = _engine(engine_step, **dict(kwargs))
        events = []
        got = call(f"generate_all, {case}", generate_all, llm, prompts, params, events.append)
        assert isinstance(got, list) and len(got) == len(prompts), (
            f"generate_all, {case}: expected a list of {len(prompts)} RequestOutputs (one per prompt), got {got!r}"
        )
        have = _fields(got)
        for i, (want_one, have_one) in enumerate(zip(expected, have)):
            assert have_one == want_one, (
                f"generate_all, {case}: output {i} should be prompt {i}'s (request_id, prompt ids, error, "
                f"[(sample index, token ids, text, finish_reason)]) as LLM.generate gives it:\n  expected "
                f"{want_one}\n  got      {have_one}"
            )
        assert _event_fields(events) == expected_events, (
            f"generate_all, {case}: the callback should see every StreamEvent once, in the order the engine "
            f"produced them ({len(expected_events)} events, as LLM.stream yields them), got {len(events)}: "
            f"first expected {expected_events[:3]}, first got {_event_fields(events)[:3]}"
        )
        assert not llm.scheduler.has_unfinished(), f"generate_all, {case}: returned with sequences unfinished"

    from decodelab.params import SamplingParams

    stalled = _StalledStep()
    expect_raises(
        "generate_all on an engine whose step returns no events and changes nothing",
        RuntimeError,
        "no progress",
        generate_all,
        _engine(stalled),
        [PROMPTS[0]],
        SamplingParams(temperature=0, max_tokens=4),
        None,
    )
    calls = []

    def counted_step(engine):
        calls.append(1)
        return engine_step(engine)

    expect_raises(
        "generate_all with max_steps=3 on a request of 10 new tokens (10 steps)",
        RuntimeError,
        "3 steps do not finish it",
        generate_all,
        _engine(counted_step),
        [PROMPTS[1]],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        None,
        max_steps=3,
    )
    assert len(calls) == 3, (
        f"generate_all with max_steps=3 called engine.step() {len(calls)} times before giving up: expected exactly 3"
    )


# --------------------------------------------------------------------------- kv_blocks_for_memory


SMOLLM2 = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
)
LLAMA_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
)


def _by_hand(config: ModelConfig, memory: int, block: int, element: int) -> int:
    per_block = 2 * config.num_hidden_layers * block * config.num_key_value_heads * config.head_dim * element
    return memory // per_block


def check_kv_blocks_for_memory(kv_blocks_for_memory) -> None:
    cases = [
        ("SmolLM2, 1 GiB, blocks of 16, fp32", SMOLLM2, 2**30, 16, torch.float32, 4),
        ("SmolLM2, 64 MiB, blocks of 16, bf16", SMOLLM2, 64 * 2**20, 16, torch.bfloat16, 2),
        ("SmolLM2, 64 MiB, blocks of 32, fp32", SMOLLM2, 64 * 2**20, 32, torch.float32, 4),
        ("Llama-3.1-8B, 16 GiB, blocks of 16, fp16 (128 KiB per token)", LLAMA_8B, 16 * 2**30, 16, torch.float16, 2),
        (
            "Llama-3.1-8B, 1,000,000,000 bytes (not a whole number of blocks), blocks of 16, fp16",
            LLAMA_8B,
            10**9,
            16,
            torch.float16,
            2,
        ),
        (
            "a config with 1 KV head, 5,000 bytes, blocks of 2, fp32",
            replace(SMOLLM2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=128),
            5_000,
            2,
            torch.float32,
            4,
        ),
    ]
    for case, config, memory, block, dtype, element in cases:
        expected = _by_hand(config, memory, block, element)
        got = call(f"kv_blocks_for_memory, {case}", kv_blocks_for_memory, config, memory, block, dtype)
        assert isinstance(got, int) and not isinstance(got, bool), (
            f"kv_blocks_for_memory, {case}: expected the integer {expected:,}, got {got!r} ({type(got).__name__})"
        )
        assert got == expected, f"kv_blocks_for_memory, {case}: expected {expected:,} blocks, got {got:,}"
    for case, args in [
        ("memory_bytes = 0", (SMOLLM2, 0, 16, torch.float32)),
        ("block_size = 0", (SMOLLM2, 2**20, 0, torch.float32)),
        ("1,000 bytes, less than one block", (SMOLLM2, 1_000, 16, torch.float32)),
    ]:
        expect_raises(f"kv_blocks_for_memory with {case}", ValueError, "", kv_blocks_for_memory, *args)


# --------------------------------------------------------------------------- decode_roofline_fraction


def check_decode_roofline_fraction(decode_roofline_fraction) -> None:
    cases = [
        # (case, tokens/s, batch, weight bytes, bandwidth, expected)
        ("batch 1, 540 MB of weights, 10 GB/s, 9.26 tokens/s (half the bound of 18.5)", 9.259259, 1, 540e6, 10e9, 0.5),
        (
            "batch 16 reads the weights once for 16 tokens: bound 296.3 tokens/s; 148.1 measured",
            148.148148,
            16,
            540e6,
            10e9,
            0.5,
        ),
        ("70B fp16 on an H100 (3.35 TB/s), batch 1, 20 tokens/s", 20.0, 1, 140e9, 3.35e12, 20 / (3.35e12 / 140e9)),
        ("batch 64, 1 GB, 100 GB/s, 3,200 tokens/s", 3200.0, 64, 1e9, 100e9, 0.5),
        ("nothing generated", 0.0, 8, 1e9, 100e9, 0.0),
    ]
    for case, tokens_per_s, batch, weight_bytes, bandwidth, expected in cases:
        got = call(
            f"decode_roofline_fraction({tokens_per_s}, {batch}, {weight_bytes:g}, {bandwidth:g}), {case}",
            decode_roofline_fraction,
            tokens_per_s,
            batch,
            weight_bytes,
            bandwidth,
        )
        assert isinstance(got, (int, float)) and math.isclose(float(got), expected, rel_tol=1e-5, abs_tol=1e-9), (
            f"decode_roofline_fraction({tokens_per_s}, {batch}, {weight_bytes:g}, {bandwidth:g}), {case}: "
            f"expected {expected:.5f}, got {got!r}"
        )
    for case, args in [
        ("batch_size = 0", (10.0, 0, 1e9, 1e11)),
        ("weight_bytes = 0", (10.0, 1, 0, 1e11)),
        ("bandwidth = 0", (10.0, 1, 1e9, 0)),
        ("tokens_per_s < 0", (-1.0, 1, 1e9, 1e11)),
    ]:
        expect_raises(f"decode_roofline_fraction with {case}", ValueError, "", decode_roofline_fraction, *args)


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_llama_blocks_in_40_gib() -> float:
    """Whole KV blocks of 16 tokens, Llama-3.1-8B in fp16, in 40 GiB."""
    from decodelab.lessons.kv_size import kv_bytes

    expected = 40 * 2**30 // kv_bytes("Llama-3.1-8B", 16, 1, "fp16")  # one block: 16 tokens of every layer
    return expected


def check_q_llama_blocks_in_40_gib(value) -> None:
    """Graded q_llama_blocks_in_40_gib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_llama_blocks_in_40_gib",
        value,
        answer_q_llama_blocks_in_40_gib(),
        "blocks of 16 tokens for Llama-3.1-8B in fp16 (2 x 32 layers x 16 x 8 KV heads x 128 x 2 bytes = "
        "2 MiB each) in 40 GiB",
    )


def answer_q_memory_roof_tokens_per_s() -> float:
    """The memory roof b * B / W for 64 sequences, 3,350 GB/s and 270 MB of weights."""
    from decodelab.lessons.measure import decode_roofline_fraction

    expected = 1.0 / decode_roofline_fraction(1.0, 64, 270e6, 3350e9)  # the speed whose fraction is 1
    return expected


def check_q_memory_roof_tokens_per_s(value) -> None:
    """Graded q_memory_roof_tokens_per_s (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_memory_roof_tokens_per_s",
        value,
        answer_q_memory_roof_tokens_per_s(),
        "tokens/s at the memory roof, batch 64, 3,350 GB/s, 270 MB of weights (b x B / W)",
    )

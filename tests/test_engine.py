"""The serving engine: batched, paged, prefix-cached output equals single-request output,
and the block pool stays consistent under random workloads."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import check_greedy_agreement, last_logits_fn, random_model

from decodelab.decoding.generate import encode_prompt, stream_token_ids
from decodelab.engine.llm import LLM, EngineHooks
from decodelab.engine.scheduler import Scheduler
from decodelab.params import SamplingParams

CHAT_PROMPTS = [
    "What is gravity?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Explain photosynthesis to a child in two sentences.",
]


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2):
    _, tokenizer = smollm2
    return [encode_prompt(tokenizer, p, chat=True) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def small_model(smollm2):
    """A random 2-layer model with SmolLM2's tokenizer: fast enough for many workloads."""
    _, tokenizer = smollm2
    return random_model(seed=3, vocab_size=tokenizer.vocab_size, max_position_embeddings=256), tokenizer


def single_greedy(model, tokenizer, prompt_ids, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return list(stream_token_ids(model, prompt_ids, params, tokenizer.stop_token_ids()))


@pytest.fixture(scope="module")
def smollm2_single_greedy(smollm2, smollm2_prompts):
    model, tokenizer = smollm2
    return [single_greedy(model, tokenizer, p, 16) for p in smollm2_prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batch_greedy_equals_single_request_smollm2(smollm2, smollm2_prompts, smollm2_single_greedy, prefix_caching):
    model, tokenizer = smollm2
    llm = LLM((model, tokenizer), enable_prefix_caching=prefix_caching, kv_block_size=16, num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=16)
    # Run twice: the second pass hits the prefix cache (shared system prompt blocks).
    for _ in range(2):
        outputs = llm.generate(smollm2_prompts, params, use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == smollm2_prompts  # prompt order kept
        for prompt_ids, out, ref in zip(smollm2_prompts, outputs, smollm2_single_greedy):
            check_greedy_agreement(prompt_ids, out.outputs[0].token_ids, ref, [last_logits_fn(model)])
    if prefix_caching:
        assert llm.allocator.hits > 0, "the second pass should reuse cached prompt blocks"
    assert llm.allocator.num_free == llm.allocator.num_blocks


class MixRecorder(Scheduler):
    """Records, for every step, how many sequences decode and how many are prefilled."""

    def schedule(self):
        seqs, is_prefill = super().schedule()
        prefilled = sum(s.num_new_tokens > 1 or not s.output_token_ids for s in seqs)
        self.steps = getattr(self, "steps", []) + [(len(seqs) - prefilled, prefilled)]
        return seqs, is_prefill


def test_mixed_prefill_and_decode_steps_match_single_request_smollm2(smollm2, smollm2_prompts, smollm2_single_greedy):
    """Two slots for five prompts: each admission shares its step with a running decode."""
    model, tokenizer = smollm2
    llm = LLM(
        (model, tokenizer),
        max_num_seqs=2,
        kv_block_size=16,
        num_kv_blocks=128,
        hooks=EngineHooks(scheduler=MixRecorder),
    )
    outputs = llm.generate(smollm2_prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert any(decoding and prefilled for decoding, prefilled in llm.scheduler.steps), "no mixed step ran"
    for prompt_ids, out, ref in zip(smollm2_prompts, outputs, smollm2_single_greedy):
        check_greedy_agreement(prompt_ids, out.outputs[0].token_ids, ref, [last_logits_fn(model)])
    unmixed = LLM(
        (model, tokenizer), max_num_seqs=2, mix_decode_with_prefill=False, hooks=EngineHooks(scheduler=MixRecorder)
    )
    unmixed.generate(smollm2_prompts[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert not any(decoding and prefilled for decoding, prefilled in unmixed.scheduler.steps)


def test_tight_pool_preempts_and_still_matches(small_model):
    """A pool too small for the batch forces preemption (recompute); greedy output must not change."""
    model, tokenizer = small_model
    rng = random.Random(0)
    prompts = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(5, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM((model, tokenizer), num_kv_blocks=200, kv_block_size=4).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM((model, tokenizer), num_kv_blocks=24, kv_block_size=4)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    for p, a, b in zip(prompts, roomy, tight):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        check_greedy_agreement(
            p, b.outputs[0].token_ids, single_greedy(model, tokenizer, p, 24), [last_logits_fn(model)]
        )
    assert tight_llm.allocator.num_free == tight_llm.allocator.num_blocks


def test_n_samples_share_prompt_blocks_copy_on_write(small_model):
    model, tokenizer = small_model
    llm = LLM((model, tokenizer), num_kv_blocks=64, kv_block_size=4, enable_prefix_caching=False)
    prompt = list(range(100, 110))  # 10 tokens: the last block (2 of 4 slots) is shared, then copied
    out = llm.generate(
        [prompt], SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    # Each sample must equal the same sample drawn alone with its own seed (seed + index).
    for c in out.outputs:
        alone = list(
            stream_token_ids(
                model, prompt, SamplingParams(temperature=1.0, seed=7 + c.index, max_tokens=6, ignore_eos=True)
            )
        )
        assert c.token_ids == alone
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_seeded_sampling_repeats(small_model):
    model, tokenizer = small_model
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2, 3)]
    first = LLM((model, tokenizer)).generate(prompts, params, use_tqdm=False)
    second = LLM((model, tokenizer)).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def test_request_that_cannot_fit_fails_alone(small_model):
    model, tokenizer = small_model
    llm = LLM((model, tokenizer), kv_block_size=4)
    too_long = list(range(1, 300))  # context is 256
    outputs = llm.generate([[1, 2, 3], too_long, [4, 5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert outputs[1].error and "prompt 1" in outputs[1].error and "256" in outputs[1].error
    assert outputs[1].outputs[0].finish_reason == "error"
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) > 0
    assert outputs[2].error is None and len(outputs[2].outputs[0].token_ids) > 0


def test_stop_strings_and_stop_token_ids(smollm2, smollm2_prompts):
    model, tokenizer = smollm2
    llm = LLM((model, tokenizer), num_kv_blocks=64)
    base = llm.generate(smollm2_prompts[:1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    text = base.outputs[0].text
    word = text.split()[2]
    cut = llm.generate(smollm2_prompts[:1], SamplingParams(temperature=0, max_tokens=12, stop=[word]), use_tqdm=False)[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(word)]
    third = base.outputs[0].token_ids[2]
    by_id = llm.generate(
        smollm2_prompts[:1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[third]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids == base.outputs[0].token_ids[:3] and by_id.finish_reason == "stop"


def test_sampling_hook_is_used(small_model):
    model, tokenizer = small_model
    calls = []

    def always_seven(logits, params, generator):
        calls.append(logits.shape)
        return 7

    llm = LLM((model, tokenizer), hooks=EngineHooks(sample=always_seven))
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [7, 7, 7] and calls[0] == (tokenizer.vocab_size,)


def test_stream_yields_every_token(small_model):
    model, tokenizer = small_model
    llm = LLM((model, tokenizer))
    events = list(llm.stream([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert sorted((e.request_index, e.sample_index) for e in events) == [(0, 0)] * 5 + [(1, 0)] * 5
    assert sum(e.finished for e in events) == 2


class CheckingScheduler(Scheduler):
    """Checks the pool's invariants after every scheduling decision."""

    def schedule(self):
        result = super().schedule()
        self.allocator.check_invariants([s.block_table for s in self.running])
        return result


workloads = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(1, 3), st.sampled_from([0.0, 1.0])),
    min_size=1,
    max_size=8,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    workload=workloads,
    num_blocks=st.integers(10, 40),
    block_size=st.sampled_from([2, 4, 8]),
    max_num_seqs=st.integers(1, 5),
    prefix_caching=st.booleans(),
)
def test_random_workloads_keep_the_pool_consistent(
    small_model, workload, num_blocks, block_size, max_num_seqs, prefix_caching
):
    model, tokenizer = small_model
    rng = random.Random(len(workload) * 1000 + num_blocks)
    shared = [rng.randrange(tokenizer.vocab_size) for _ in range(8)]  # some prompts share a prefix
    prompts, params = [], []
    for length, max_tokens, n, temperature in workload:
        tail = [rng.randrange(tokenizer.vocab_size) for _ in range(length)]
        prompts.append(shared + tail if rng.random() < 0.5 else tail)
        params.append(SamplingParams(temperature=temperature, n=n, max_tokens=max_tokens, seed=length))
    llm = LLM(
        (model, tokenizer),
        num_kv_blocks=num_blocks,
        kv_block_size=block_size,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        hooks=EngineHooks(scheduler=CheckingScheduler),
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for out, p in zip(outputs, params):
        assert out.error is None or "does not fit" in out.error
        if out.error is None:
            assert len(out.outputs) == p.n
            assert all(
                c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= p.max_tokens for c in out.outputs
            )
    assert llm.allocator.num_free == llm.allocator.num_blocks, "blocks leaked"
    llm.allocator.check_invariants([])


def test_thousand_request_stress_run(small_model):
    """1,000 short requests through a small pool: everything finishes, every block is free or cached."""
    model, tokenizer = small_model
    rng = random.Random(1)
    system = [rng.randrange(tokenizer.vocab_size) for _ in range(12)]
    prompts = [system + [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 6))] for _ in range(1000)]
    params = [
        SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 4), seed=i, ignore_eos=True)
        for i in range(1000)
    ]
    llm = LLM((model, tokenizer), num_kv_blocks=64, kv_block_size=4, max_num_seqs=32)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outputs, params))
    assert llm.allocator.num_free == llm.allocator.num_blocks
    assert llm.allocator.hits > 0, "the shared system prompt should be found in the prefix cache"


def test_speculative_engine_greedy_identity_and_no_leaks(small_model):
    """Greedy speculative decoding in the batched engine gives the target's own greedy tokens,
    for every k, with a tight pool (preemption and fallback steps included)."""
    model, tokenizer = small_model
    draft = random_model(seed=11, vocab_size=tokenizer.vocab_size, max_position_embeddings=256, num_hidden_layers=1)
    # A draft that often agrees with the target: the target itself, so acceptance is ~1.
    rng = random.Random(2)
    prompts = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = LLM((model, tokenizer), num_kv_blocks=200, kv_block_size=4).generate(prompts, params, use_tqdm=False)
    for drafter, k, blocks in [(draft, 1, 200), (draft, 3, 40), (model, 4, 200), (model, 2, 30)]:
        llm = LLM(
            (model, tokenizer),
            num_kv_blocks=blocks,
            kv_block_size=4,
            speculative_model=drafter,
            num_speculative_tokens=k,
            hooks=EngineHooks(scheduler=CheckingScheduler),
        )
        got = llm.generate(prompts, params, use_tqdm=False)
        for p, a, b in zip(prompts, expected, got):
            check_greedy_agreement(p, b.outputs[0].token_ids, a.outputs[0].token_ids, [last_logits_fn(model)])
        assert llm.allocator.num_free == llm.allocator.num_blocks, "blocks leaked"
        stats = llm.speculator.stats()
        assert stats["target_calls"] > 0
        if drafter is model:
            assert stats["acceptance_rate"] > 0.9, stats


def test_speculative_engine_sampling_runs_with_n(small_model):
    model, tokenizer = small_model
    llm = LLM((model, tokenizer), num_kv_blocks=64, kv_block_size=4, speculative_model=model, num_speculative_tokens=3)
    out = llm.generate(
        [[1, 2, 3, 4, 5]], SamplingParams(temperature=1.0, n=2, seed=1, max_tokens=9, ignore_eos=True), use_tqdm=False
    )[0]
    assert [len(c.token_ids) for c in out.outputs] == [9, 9]
    assert llm.allocator.num_free == llm.allocator.num_blocks


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engine_matches_quantized_single_request(quantization):
    """quantization= swaps the linear layers; the batched engine must still equal the same
    quantized model decoding one request at a time."""
    from decodelab.model.quantization import quantize_model
    from decodelab.model.registry import load

    llm = LLM("tiny", quantization=quantization, num_kv_blocks=64)
    reference, tokenizer = load("tiny")
    quantize_model(reference, bits=8 if quantization == "int8" else 4)
    prompts = [tokenizer.encode(t) for t in ("def fibonacci(n):", "import os\n", "class Stack:")]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for p, out in zip(prompts, outputs):
        ref = single_greedy(reference, tokenizer, p, 12)
        check_greedy_agreement(p, out.outputs[0].token_ids, ref, [last_logits_fn(reference)])


def test_linear_hook_builds_the_quantized_layers():
    """EngineHooks(linear=factory): with quantization set, every decoder-layer linear is the factory's
    (the lm_head and embedding stay float), and Int8Linear's engine writes the tokens of
    LLM(quantization="int8") (the same levels and scales; the scale applied after the sum)."""
    from decodelab.model.quantization import Int8Linear, QuantizedLinear

    built = []

    def factory(linear):
        built.append(linear)
        return Int8Linear.from_linear(linear)

    llm = LLM("tiny", quantization="int8", num_kv_blocks=64, hooks=EngineHooks(linear=factory))
    library = LLM("tiny", quantization="int8", num_kv_blocks=64)
    layers = llm.model.model.layers
    assert len(built) == 7 * len(layers)
    assert not any(isinstance(m, (torch.nn.Linear, QuantizedLinear)) for m in layers.modules())
    assert isinstance(llm.model.lm_head, torch.nn.Linear)
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    prompts = [llm.tokenizer.encode(t) for t in ("def fibonacci(n):", "import os\n", "class Stack:")]
    params = SamplingParams(temperature=0, max_tokens=12)
    for p, ours, theirs in zip(
        prompts, llm.generate(prompts, params, use_tqdm=False), library.generate(prompts, params, use_tqdm=False)
    ):
        check_greedy_agreement(
            p, ours.outputs[0].token_ids, theirs.outputs[0].token_ids, [last_logits_fn(library.model)]
        )
    with pytest.raises(ValueError, match="needs quantization='int8'"):
        LLM((library.model, library.tokenizer), hooks=EngineHooks(linear=factory))
    assert EngineHooks().linear is None


def test_bad_engine_arguments_are_clear_errors(small_model):
    model, tokenizer = small_model
    with pytest.raises(ValueError, match="quantization"):
        LLM((model, tokenizer), quantization="int3")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM((model, tokenizer), speculative_model=model, num_speculative_tokens=0)
    llm = LLM((model, tokenizer), num_kv_blocks=16)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[1]], [{"temperature": 0}], use_tqdm=False)


def test_engine_args_are_llms_keywords_and_build_the_same_engine(small_model):
    """EngineArgs holds LLM's keyword arguments, same names and defaults (written twice: in LLM's
    signature for the reader, in EngineArgs for the object), checks them the same way, and
    LLM.from_args(args) builds the engine LLM(**fields) builds."""
    import dataclasses
    import inspect

    from decodelab import EngineArgs

    signature = inspect.signature(LLM.__init__).parameters
    keywords = {name: p.default for name, p in signature.items() if name != "self"}
    assert keywords == {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    with pytest.raises(ValueError, match="quantization must be None, 'int8', 'int4' or 'q4', got 'int3'"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        EngineArgs(speculative_model="tiny-draft", num_speculative_tokens=0)
    EngineArgs(num_speculative_tokens=0)  # unused without a speculative_model: accepted, as LLM always did
    model, tokenizer = small_model
    args = EngineArgs(model=(model, tokenizer), num_kv_blocks=24, kv_block_size=4, max_num_seqs=2)
    built, direct = LLM.from_args(args), LLM((model, tokenizer), num_kv_blocks=24, kv_block_size=4, max_num_seqs=2)
    assert built.args == args == direct.args
    assert (built.allocator.num_blocks, built.max_seq_len) == (direct.allocator.num_blocks, direct.max_seq_len)
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8]]
    assert [o.outputs[0].token_ids for o in built.generate(prompts, params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in direct.generate(prompts, params, use_tqdm=False)
    ]

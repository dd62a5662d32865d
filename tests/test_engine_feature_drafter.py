"""A feature drafter (`decodelab.decoding.eagle`) inside the batched engine
(`decodelab.engine.speculative.FeatureBatchSpeculator`): the target's own greedy tokens whatever
the drafter guesses, through prefix caching, preemption, siblings and the plain-decode fallback;
and with SmolLM2's trained drafter, as many accepted drafts as the one-request loop."""

from __future__ import annotations

import random

import pytest

from decodelab import LLM, SamplingParams
from decodelab.decoding.eagle import load_drafter
from decodelab.decoding.generate import encode_prompt
from decodelab.decoding.speculative import speculative_generate
from decodelab.engine.llm import EngineHooks
from decodelab.engine.speculative import FeatureBatchSpeculator


def tiny_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(vocab_size) for _ in range(20)]  # a prefix the cache shares
    return [shared + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(4)] + [
        [rng.randrange(vocab_size) for _ in range(rng.randint(2, 25))] for _ in range(3)
    ]


@pytest.mark.parametrize("blocks, k", [(200, 3), (40, 2)])  # roomy; tight: preemption and fallback steps
def test_greedy_tokens_are_the_targets_whatever_the_drafter_guesses(tiny_pair, blocks, k):
    target, drafter, tokenizer = tiny_pair
    prompts = tiny_prompts(tokenizer.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = LLM((target, tokenizer), num_kv_blocks=200, kv_block_size=4).generate(prompts, params, use_tqdm=False)
    llm = LLM(
        (target, tokenizer), num_kv_blocks=blocks, kv_block_size=4, speculative_model=drafter, num_speculative_tokens=k
    )
    assert isinstance(llm.speculator, FeatureBatchSpeculator)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.allocator.num_free == llm.allocator.num_blocks, "blocks leaked"
    assert llm.allocator.hits > 0, "the shared prefix was meant to be cached: sessions start after it"
    stats = llm.speculator.stats()
    assert stats["target_calls"] > 0 and stats["proposed"] > 0
    if blocks == 40:
        assert llm.scheduler.num_preemptions > 0, "the pool was meant to be too small"


def test_siblings_sampling_and_the_penalty_fallback_run(tiny_pair):
    target, drafter, tokenizer = tiny_pair
    prompts = tiny_prompts(tokenizer.vocab_size)[:3]
    llm = LLM(
        (target, tokenizer), num_kv_blocks=120, kv_block_size=4, speculative_model=drafter, num_speculative_tokens=3
    )
    sampled = llm.generate(
        prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, n=2, seed=5, ignore_eos=True), use_tqdm=False
    )
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 16 for c in o.outputs) for o in sampled)
    calls = llm.speculator.stats()["target_calls"]
    penalised = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True), use_tqdm=False
    )
    plain = LLM((target, tokenizer), num_kv_blocks=120, kv_block_size=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in penalised] == [o.outputs[0].token_ids for o in plain]
    assert llm.speculator.stats()["target_calls"] == calls, "a penalty decodes plainly: no verify pass"
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_bad_combinations_are_refused(tiny_pair):
    target, drafter, tokenizer = tiny_pair
    from decodelab.model.registry import load

    other, _ = load("tiny", device="cpu")
    with pytest.raises(ValueError, match="attached to another model"):
        LLM((other, tokenizer), num_kv_blocks=16, speculative_model=drafter)
    with pytest.raises(ValueError, match="hidden_size"):
        LLM((target, tokenizer), num_kv_blocks=16, speculative_model="smollm2-eagle")  # trained for SmolLM2
    with pytest.raises(ValueError, match="hidden states"):
        LLM(
            (target, tokenizer),
            num_kv_blocks=16,
            speculative_model=drafter,
            hooks=EngineHooks(forward=lambda *args: None),
        )


def test_smollm2_drafter_in_the_engine_accepts_as_in_one_request(smollm2):
    """Same greedy tokens as the plain engine, and (prefix caching off, so each session sees its
    whole prompt) the accepted drafts of the one-request loop, give or take the last step's."""
    model, tokenizer = smollm2
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in ("What is gravity?", "List three colors.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM((model, tokenizer), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(
        (model, tokenizer),
        num_kv_blocks=64,
        speculative_model="smollm2-eagle",
        num_speculative_tokens=3,
        enable_prefix_caching=False,
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    drafter = load_drafter(model, "smollm2-eagle")
    single = 0
    for ids, out in zip(prompts, plain):
        output, stats = speculative_generate(model, drafter, ids, params, 3, tokenizer.stop_token_ids())
        assert output == out.outputs[0].token_ids
        single += stats.accepted
    accepted = llm.speculator.stats()["accepted"]
    assert single > 10 and abs(accepted - single) <= 3 * len(prompts), (accepted, single)

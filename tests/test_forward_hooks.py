"""The engine runs notebook 01's forward pass: `EngineHooks(forward=..., attention=...)` put the
decoder written as functions of the state dict, and attention written against a contiguous
cache, inside the batched engine over paged blocks, with the library's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from oracles import check_greedy_agreement, last_logits_fn

from decodelab.decoding.generate import encode_prompt, stream_token_ids
from decodelab.engine.llm import LLM, EngineHooks
from decodelab.lessons import forward_pass as fp
from decodelab.model.toy import random_llama
from decodelab.params import SamplingParams

QUESTIONS = ["What is gravity?", "Name three colours.", "Write a haiku about the sea."]


class Tokens:
    """What the engine asks of a tokenizer when the prompts are token ids: stop ids, and decode."""

    def stop_token_ids(self):
        return []

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def single_greedy(model, tokenizer, prompt_ids, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return list(stream_token_ids(model, prompt_ids, params, tokenizer.stop_token_ids()))


def attention_of_new_tokens_only(cache, layer_index, q, k, v):
    """A kept bug: stores k, v but attends over this step's tokens alone (forgets the cache)."""
    cache.append(layer_index, k, v)
    return fp.group_query_attention(q, k, v, q_offset=0)


@pytest.mark.slow
def test_lesson_forward_and_attention_serve_smollm2_with_the_library_tokens(smollm2):
    """float32 SmolLM2, three chat prompts in one batch (prefill mixed with decode, a shared
    template prefix in the cache): every combination of the two hooks writes the greedy tokens of
    one request at a time through the library's model."""
    model, tokenizer = smollm2
    prompts = [encode_prompt(tokenizer, q, chat=True) for q in QUESTIONS]
    expected = [single_greedy(model, tokenizer, p, 12) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=12)
    for hooks in (
        EngineHooks(forward=fp.forward),
        EngineHooks(attention=fp.attention),
        EngineHooks(forward=fp.forward, attention=fp.attention),
    ):
        llm = LLM((model, tokenizer), num_kv_blocks=64, hooks=hooks)
        for _ in range(2):  # the second round reads the template's blocks from the prefix cache
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for p, out, ref in zip(prompts, outputs, expected):
                check_greedy_agreement(p, out.outputs[0].token_ids, ref, [last_logits_fn(model)])
        assert llm.allocator.hits > 0 and llm.allocator.num_free == llm.allocator.num_blocks


def test_the_attention_hook_gets_each_sequences_whole_context():
    """The cache handed to the hook appends a sequence's new K/V and returns its whole context; a
    hook that forgets the held tokens writes other tokens, so the comparison above can fail."""
    model = random_llama(5, num_hidden_layers=2, max_position_embeddings=128).eval()
    seen = []

    def recording(cache, layer_index, q, k, v):
        held = cache.seq_len
        out = fp.attention(cache, layer_index, q, k, v)
        seen.append((layer_index, held, q.shape[2]))
        return out

    prompts = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    library = LLM((model, Tokens()), num_kv_blocks=32, kv_block_size=4).generate(prompts, params, use_tqdm=False)
    hooked = LLM((model, Tokens()), num_kv_blocks=32, kv_block_size=4, hooks=EngineHooks(attention=recording)).generate(
        prompts, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in hooked] == [o.outputs[0].token_ids for o in library]
    # layer 0 of the first step prefills the three prompts: nothing held, all their tokens new
    assert seen[:3] == [(0, 0, 5), (0, 0, 3), (0, 0, 7)]
    assert (0, 5 + 5, 1) in seen  # a decode step late in the first prompt: its 10 tokens held, one new

    forgetful = LLM(
        (model, Tokens()), num_kv_blocks=32, kv_block_size=4, hooks=EngineHooks(attention=attention_of_new_tokens_only)
    ).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in forgetful] != [o.outputs[0].token_ids for o in library]


def test_forward_hook_refuses_what_it_cannot_read():
    model = random_llama(0)
    with pytest.raises(ValueError, match="reads the float weights by name"):
        LLM((model, Tokens()), quantization="int8", hooks=EngineHooks(forward=fp.forward))
    with pytest.raises(ValueError, match="prepack_weights=True"):
        LLM((model, Tokens()), prepack_weights=True, hooks=EngineHooks(forward=fp.forward))
    windowed = random_llama(0, sliding_window=4)
    llm = LLM((windowed, Tokens()), num_kv_blocks=8, kv_block_size=4, hooks=EngineHooks(attention=fp.attention))
    with pytest.raises(ValueError, match="sliding window of 4"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)


def test_repetition_penalty_hook_is_called_with_the_history():
    model = random_llama(1).eval()
    calls = []

    def penalty(logits, token_ids, value):
        calls.append((token_ids.tolist(), value))
        return logits

    LLM((model, Tokens()), num_kv_blocks=8, kv_block_size=4, hooks=EngineHooks(repetition_penalty=penalty)).generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.3), use_tqdm=False
    )
    assert [len(ids) for ids, _ in calls] == [3, 4, 5] and {v for _, v in calls} == {1.3}
    assert calls[0][0] == [1, 2, 3]
    assert torch.equal(torch.tensor(calls[-1][0][:3]), torch.tensor([1, 2, 3]))

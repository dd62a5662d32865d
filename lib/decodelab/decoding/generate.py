"""Autoregressive generation for one request: prefill the prompt into a KV cache, then
decode one token at a time until a stop token, a stop string or max_tokens.

This is the single-request path that the early notebooks build; the batched, paged
serving engine (`decodelab.LLM`) generalizes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from decodelab.decoding.sampling import apply_repetition_penalty, sample
from decodelab.model.kv_cache import KVCache
from decodelab.model.tokenizer import StreamDecoder, Tokenizer
from decodelab.params import SamplingParams
from decodelab.validation import check_int


class PromptTooLongError(ValueError):
    """A prompt that does not fit in the model's context."""


def check_prompt(prompt_ids: list[int], context_length: int, vocab_size: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= context_length:
        raise PromptTooLongError(
            f"prompt of {len(prompt_ids)} tokens does not fit the model's context "
            f"of {context_length} tokens (at least one must be left to generate)"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _check_greedy_request(model, prompt_ids: list[int], max_new_tokens: int) -> None:
    check_prompt(prompt_ids, model.config.max_position_embeddings, model.config.vocab_size)
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    if len(prompt_ids) + max_new_tokens > model.config.max_position_embeddings:
        raise PromptTooLongError(
            f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed the model's "
            f"context of {model.config.max_position_embeddings} tokens"
        )


def decode_state_class(model, cache_class=None):
    """What the decode loop carries: cache_class if given, else the model's own `state_class`
    (a state-space model's fixed-size state), else `KVCache`. Built as
    `cls(config, 1, max_seq_len, device=..., dtype=...)` and passed as `model(..., kv_cache=)`."""
    return cache_class or getattr(model, "state_class", KVCache)


@torch.inference_mode()
def generate_without_cache(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation that recomputes the whole sequence at every step (no KV cache).

    Each step runs the model on prompt + all tokens generated so far, [1, n], and appends
    the argmax of the last position's logits. Returns the max_new_tokens new ids (no stop
    token: it always generates max_new_tokens). The model's K/V work is 1 + 2 + ... + n rows.
    """
    _check_greedy_request(model, prompt_ids, max_new_tokens)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids], device=model.device), last_only=True)  # [1, 1, V]
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@torch.inference_mode()
def generate_with_cache(model, prompt_ids: list[int], max_new_tokens: int, cache_class=None) -> list[int]:
    """Greedy generation with a KV cache: the same ids as `generate_without_cache`.

    Prefill feeds the whole prompt once, [1, P], into `cache_class(model.config, 1,
    P + max_new_tokens, device=model.device, dtype=model.dtype)`; each later step feeds only
    the newest token, [1, 1], whose K/V the cache appends. K/V work: n rows in all.
    """
    _check_greedy_request(model, prompt_ids, max_new_tokens)
    cache = decode_state_class(model, cache_class)(
        model.config, 1, len(prompt_ids) + max_new_tokens, device=model.device, dtype=model.dtype
    )
    inputs, new_ids = torch.tensor([prompt_ids], device=model.device), []
    for _ in range(max_new_tokens):
        logits = model(inputs, kv_cache=cache, last_only=True)  # [1, 1, V]
        new_ids.append(int(logits[0, -1].argmax()))
        inputs = torch.tensor([[new_ids[-1]]], device=model.device)
    return new_ids


@torch.inference_mode()
def stream_token_ids(
    model, prompt_ids: list[int], params: SamplingParams, stop_token_ids: list[int] = (), cache_class=None
) -> Iterator[int]:
    """Yield generated ids one by one (a stop token is yielded, then generation ends).

    Ends early at the context's end. Prefill runs the whole prompt in one forward pass;
    each later step feeds only the newest token, its K/V appended to the cache (a
    `cache_class(config, 1, max_seq_len, device=..., dtype=...)`, by default the model's `decode_state_class`).
    """
    config = model.config
    check_prompt(prompt_ids, config.max_position_embeddings, config.vocab_size)
    budget = min(params.max_tokens, config.max_position_embeddings - len(prompt_ids))
    stops = stop_token_set(params, stop_token_ids)
    device = model.device
    cache = decode_state_class(model, cache_class)(
        config, 1, len(prompt_ids) + budget, device=device, dtype=model.dtype
    )
    generator = make_generator(params.seed, device)
    history = torch.tensor([prompt_ids], device=device)  # [1, n] for the repetition penalty
    inputs = history
    for _ in range(budget):
        logits = model(inputs, kv_cache=cache, last_only=True)[:, -1]  # [1, V]
        if params.repetition_penalty != 1:
            logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
        token = sample(logits, params, generator)  # [1]
        token_id = int(token)
        yield token_id
        if token_id in stops:
            return
        inputs = token[:, None]
        if params.repetition_penalty != 1:
            history = torch.cat([history, inputs], dim=1)


@dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (stop token or string) or "length"


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """Token ids for a plain prompt, or for a conversation rendered by the chat template.

    With chat=True a string prompt becomes one user message (instruct models expect it).
    """
    if isinstance(prompt, list):
        return tokenizer.encode(tokenizer.apply_chat_template(prompt))
    if chat and tokenizer.chat_template:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    return tokenizer.encode(prompt)


def stream_text(
    model,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    completion: Completion | None = None,
    cache_class=None,
) -> Iterator[str]:
    """Yield text pieces as tokens arrive; fills `completion` (ids, text, finish_reason).

    A stop string ends generation and is left out of the text, as in vLLM; text that could
    still become the start of a stop string is held back until it cannot.
    """
    completion = completion if completion is not None else Completion(list(prompt_ids))
    decoder = StreamDecoder(tokenizer)
    stop_ids = stop_token_set(params, tokenizer.stop_token_ids())
    hold = max((len(s) for s in params.stop), default=1) - 1
    text, emitted = "", 0
    completion.finish_reason = "length"
    for token_id in stream_token_ids(model, prompt_ids, params, tokenizer.stop_token_ids(), cache_class):
        completion.output_ids.append(token_id)
        if token_id in stop_ids:
            completion.finish_reason = "stop"
        text += decoder.push(token_id)
        cut = first_stop_string(text, params.stop)
        if cut is not None:
            text, completion.finish_reason = text[:cut], "stop"
            break
        if len(text) - hold > emitted:
            yield text[emitted : len(text) - hold]
            emitted = len(text) - hold
    else:
        text += decoder.flush()
        cut = first_stop_string(text, params.stop)
        if cut is not None:
            text, completion.finish_reason = text[:cut], "stop"
    completion.text = text
    if len(text) > emitted:
        yield text[emitted:]


def stop_token_set(params: SamplingParams, eos_token_ids=()) -> set[int]:
    """The token ids that end generation: params.stop_token_ids, and the model's own
    end-of-sequence ids (`Tokenizer.stop_token_ids()`) unless params.ignore_eos."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def first_stop_string(text: str, stop: list[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def generate(
    model,
    tokenizer: Tokenizer,
    prompt: str | list[dict],
    params: SamplingParams | None = None,
    chat: bool = True,
    cache_class=None,
) -> Completion:
    """Generate a whole completion for one prompt (see `stream_text` for the streaming form).

    cache_class: the KV cache to generate with (notebook 03 passes the learner's own)."""
    params = params or SamplingParams()
    completion = Completion(encode_prompt(tokenizer, prompt, chat))
    for _ in stream_text(model, tokenizer, completion.prompt_ids, params, completion, cache_class):
        pass
    return completion

"""Prefill: the prompt in one forward pass, and what that buys (notebook 04).

Feeding a T-token prompt one token at a time runs T forward passes, each a batch of
matrix-vector products that reads every weight once for one token. Prefill runs the same
causal computation as a single pass of matrix-matrix products: every weight is read once
for all T tokens, so the arithmetic per byte (the arithmetic intensity) grows with T and
the GPU/CPU does useful work instead of waiting for memory. The K/V it leaves in the cache,
and the logits, are the same either way (up to float rounding).

A prompt prefix shared by many requests (a system prompt, a few-shot header) can be
prefilled once; each request then starts from a copy of that cache and only prefills its
own suffix.

Shapes: B batch, T prompt tokens, V vocab_size.
"""

from __future__ import annotations

import copy
import time

import torch

from decodelab.lessons.kv_size import bytes_per_value, config_fields, kv_bytes, parameter_count
from decodelab.lessons.measure import synchronize
from decodelab.model.kv_cache import KVCache
from decodelab.validation import check_int


def as_batch(model, token_ids) -> torch.Tensor:
    """token ids (a list, a [T] or a [B, T] tensor) -> a [B, T] long tensor on the model's device."""
    ids = torch.as_tensor(token_ids, device=model.device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"token ids must be a non-empty list, [T] or [B, T] tensor, got shape {tuple(ids.shape)}")
    return ids.long()


@torch.inference_mode()
def prefill(model, prompt_ids, cache: KVCache) -> torch.Tensor:
    """One forward pass over the whole prompt; fills `cache`, returns the last logits [B, V]."""
    ids = as_batch(model, prompt_ids)
    return model(ids, kv_cache=cache, last_only=True)[:, -1]


@torch.inference_mode()
def feed_one_by_one(model, prompt_ids, cache: KVCache) -> torch.Tensor:
    """T forward passes of one token each; fills `cache` like `prefill`, returns the last logits [B, V]."""
    ids = as_batch(model, prompt_ids)
    for t in range(ids.shape[1]):
        logits = model(ids[:, t : t + 1], kv_cache=cache)[:, -1]
    return logits


def clone_cache(cache: KVCache) -> KVCache:
    """An independent copy of a cache (its own K/V storage): appending to one leaves the other as it was."""
    snapshot = copy.copy(cache)
    snapshot.keys, snapshot.values = cache.keys.clone(), cache.values.clone()
    snapshot.lengths = list(cache.lengths)
    return snapshot


@torch.inference_mode()
def reuse_prefix(model, prefix_ids, suffix_ids) -> list[torch.Tensor]:
    """Prefill a shared prefix once, then each suffix on a copy of its cache.

    prefix_ids: a list of token ids. suffix_ids: a list of suffixes, each a list of ids (a
    single flat list counts as one suffix). Returns, per suffix, the logits after its last
    token [1, V]: the same as prefilling prefix + suffix from scratch.
    """
    prefix = as_batch(model, prefix_ids)
    if prefix.shape[0] != 1:
        raise ValueError(f"the prefix must be one sequence, got a batch of {prefix.shape[0]}")
    if torch.is_tensor(suffix_ids):
        suffix_ids = [suffix_ids] if suffix_ids.dim() == 1 else list(suffix_ids)
    elif len(suffix_ids) and isinstance(suffix_ids[0], int):
        suffix_ids = [suffix_ids]
    suffixes = [as_batch(model, s) for s in suffix_ids]
    longest = max((s.shape[1] for s in suffixes), default=0)
    cache = KVCache(model.config, 1, prefix.shape[1] + longest, device=model.device, dtype=model.dtype)
    prefill(model, prefix, cache)
    return [prefill(model, suffix, clone_cache(cache)) for suffix in suffixes]


def arithmetic_intensity(config, num_tokens: int, kv_len: int = 0, bytes_per_param="fp16") -> float:
    """FLOPs per byte moved by one forward pass over num_tokens new tokens after kv_len cached ones.

    The approximation (Kaplan et al. 2020's 2N FLOPs per token):
      FLOPs ~ 2 x parameters x num_tokens  (one multiply-add per weight per token; the
              attention scores' own 4 x layers x heads x head_dim x kv_len FLOPs per token
              and the element-wise work are left out; the embedding lookup is counted too)
      bytes ~ every weight read once + the K/V of kv_len + num_tokens positions (read or
              written once), all at bytes_per_param; activations are not counted.
    Decode (num_tokens = 1) in fp16 lands near 1 FLOP/byte; a prefill of T tokens near T.
    """
    check_int("num_tokens", num_tokens, minimum=1)
    check_int("kv_len", kv_len, minimum=0)
    fields = config_fields(config)
    params = parameter_count(fields)
    flops = 2 * params * num_tokens
    moved = params * bytes_per_value(bytes_per_param) + kv_bytes(fields, kv_len + num_tokens, dtype=bytes_per_param)
    return flops / moved


def latencies_from_timestamps(start_s: float, token_times_s: list[float]) -> dict:
    """The latencies of one request from its clock readings, as serving benchmarks report them.

    start_s: when the request was sent; token_times_s: when each generated token arrived, in
    order, on the same clock (seconds). Returns {"ttft_s": first token time - start_s,
    "itl_s": the len(token_times_s) - 1 gaps between consecutive tokens, a list,
    "tpot_s": the time per output token after the first, their mean (None for one token),
    "e2e_s": last token time - start_s}.
    Raises ValueError if there is no token or a reading goes back in time (a token before
    the start, or before the token ahead of it).
    """
    times = [float(t) for t in token_times_s]
    if not times:
        raise ValueError("token_times_s is empty: a request needs at least one token to have a TTFT")
    for i, (earlier, later) in enumerate(zip([float(start_s)] + times, times)):
        if later < earlier:
            what = "the start" if i == 0 else f"token {i - 1}"
            raise ValueError(
                f"token {i} arrived at {later} s, before {what} at {earlier} s: the times must not decrease"
            )
    itl = [later - earlier for earlier, later in zip(times, times[1:])]
    return {
        "ttft_s": times[0] - float(start_s),
        "itl_s": itl,
        "tpot_s": (times[-1] - times[0]) / len(itl) if itl else None,
        "e2e_s": times[-1] - float(start_s),
    }


@torch.inference_mode()
def timed_generate(
    model, prompt_ids, max_new_tokens: int, cache: KVCache, stop_token_ids=(), clock=time.perf_counter
) -> dict:
    """Greedy generation of one request in its two phases, reading the clock as a user sees tokens arrive.

    The prefill (one pass over the prompt, `prefill`) gives the first token; each decode step feeds
    the last token alone, [1, 1], with the cache, and takes the argmax of its logits [1, V]. Stops
    after max_new_tokens tokens or once a token in stop_token_ids was produced (it is kept); the last
    token is never fed back. `clock()` is read once before the prefill and once after each token,
    each time after `synchronize(model.device)`, so that an asynchronous GPU is timed honestly.
    Returns {"token_ids": the new ids, "start_s": the first reading, "token_times_s": one reading
    per token}. Raises ValueError if max_new_tokens is not an integer >= 1.
    """
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    synchronize(model.device)
    start_s = clock()
    logits = prefill(model, prompt_ids, cache)  # [1, V]
    token_ids, token_times_s = [], []
    while True:
        token = logits.argmax(dim=-1)  # [1]
        token_ids.append(int(token))
        synchronize(model.device)
        token_times_s.append(clock())
        if token_ids[-1] in stop_token_ids or len(token_ids) == max_new_tokens:
            break
        logits = model(token[:, None], kv_cache=cache)[:, -1]  # [1, V]: one new token, after all the cached ones
    return {"token_ids": token_ids, "start_s": start_s, "token_times_s": token_times_s}


def token_timestamps(model, prompt_ids, n: int) -> tuple[float, list[float], list[int]]:
    """Greedy-generate n tokens (no stop token) with `timed_generate` on a fresh cache.

    Returns (start_s, token_times_s, token_ids): time.perf_counter() when the request starts,
    then right after each token is produced (n readings).
    """
    check_int("n", n, minimum=1)
    prompt = [int(t) for t in prompt_ids]
    cache = KVCache(model.config, 1, len(prompt) + n, device=model.device, dtype=model.dtype)
    run = timed_generate(model, prompt, n, cache)
    return run["start_s"], run["token_times_s"], run["token_ids"]


def measure_latency(model, prompt_ids, n: int) -> dict:
    """Greedy-generate n tokens and time them as a user sees them.

    Returns {"ttft_s": time to first token (prefill + first sample), "itl_s": the n - 1
    inter-token latencies, "token_ids": the n tokens}. The device is synchronized at
    every token so asynchronous GPUs are timed honestly.
    """
    start, stamps, token_ids = token_timestamps(model, prompt_ids, n)
    return {**latencies_from_timestamps(start, stamps), "token_ids": token_ids}


@torch.inference_mode()
def decode_greedy(model, cache: KVCache, logits: torch.Tensor, max_tokens: int, stop_token_ids=()) -> list[int]:
    """The decode phase after a prefill: greedy tokens, one forward pass of one token each.

    cache: the KV cache the prefill filled (it grows by one position per step); logits [1, V]:
    what the prefill returned. Stops after max_tokens or once a token in stop_token_ids has
    been produced (it is included). Returns the generated ids.
    """
    check_int("max_tokens", max_tokens, minimum=1)
    token_ids = []
    for _ in range(max_tokens):
        token = logits.argmax(dim=-1)  # [1]
        token_ids.append(int(token))
        if token_ids[-1] in stop_token_ids or len(token_ids) == max_tokens:
            break
        logits = model(token[:, None], kv_cache=cache)[:, -1]  # [1, V]
    return token_ids


__all__ = [
    "prefill",
    "feed_one_by_one",
    "clone_cache",
    "reuse_prefix",
    "arithmetic_intensity",
    "latencies_from_timestamps",
    "timed_generate",
    "token_timestamps",
    "measure_latency",
    "decode_greedy",
]

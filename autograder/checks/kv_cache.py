"""Checks for notebook 03, the KV cache: generation without a cache, a KV cache class, generation
with it, the KV bytes formula, and the sliding-window ring cache.

Every ``check_*`` takes the function (or class) under test: the library's reference in CI, a
kept buggy version in CI's negative tests (tests/fixtures/buggy_kv_cache.py), the learner's
own in the notebook's hidden-test cell. It returns None or raises ``AssertionError`` naming the
input, what was expected and what came back.

Oracles, never snapshots:

* generation: a plain greedy loop written here that runs the model on the whole sequence at
  every step (float64 random models, so no argmax is decided by rounding), and the list of
  calls the function made to the model (how many tokens each call fed, with or without cache);
* the cache: the model without any cache (one causal forward pass over the whole sequence) in
  float64, with grouped-query heads, a sliding window and a batch of two; and the rows appended,
  which views must return exactly;
* the ring: the rows appended (what it returns and holds must be exactly the right positions, in
  position order), `causal_attention` with ``sliding_window=W`` over the full K/V for queries at
  every position, the model with that window and no cache, and the bytes behind the tensors it
  holds (at most W slots per layer, whatever the length);
* bytes: the formula written out here layer by layer from the published config.json values
  (Llama-3.1-8B, Qwen3-8B, gpt-oss-20b, GPT-3), and the seed's figures (128 KiB per token...).
"""

from __future__ import annotations

import math

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises, failure
from decodelab.config import ModelConfig
from decodelab.course.checking import describe, expect_int
from decodelab.course.exercises import references
from decodelab.lessons import kv_size
from decodelab.lessons.kv_size import tensor_bytes_held
from decodelab.lessons.measure import CountingModel
from decodelab.model.attention import causal_attention
from decodelab.model.kv_cache import KVCache as _ReferenceCache
from decodelab.model.toy import tiny_model

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("03_kv_cache")

__all__ = [
    "check_generate_without_cache",
    "check_kv_cache_class",
    "check_generate_with_cache",
    "check_kv_cache_bytes",
    "check_sliding_window_kv_cache",
]

CASES = [  # (model seed, sliding window, prompt, new tokens)
    (1, None, [5], 6),
    (2, None, [3, 14, 15, 9, 2, 6], 9),
    (3, 4, [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], 7),
    (4, None, [11, 22, 33], 1),
    (5, None, [40, 41], 0),
]


def _model(seed: int, window: int | None):
    return tiny_model(seed, sliding_window=window, dtype=torch.float64)


@torch.no_grad()
def _greedy_oracle(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _as_ids(got, what: str) -> list[int]:
    if isinstance(got, torch.Tensor) and got.dim() == 1 and not got.is_floating_point():
        return [int(t) for t in got]
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
        raise AssertionError(f"{what}: expected a list of int token ids, got {type(got).__name__} {describe(got)}")
    return list(got)


def _check_generation(fn, name: str, extra_kwargs=lambda: {}, structure=None) -> None:
    for seed, window, prompt, n in CASES:
        model = _model(seed, window)
        counting = CountingModel(model)
        given = list(prompt)  # the caller's list, which must come back unchanged
        kwargs = extra_kwargs()
        what = (
            f"{name}(model, prompt_ids={prompt}, max_new_tokens={n}) on a random 2-layer model (seed {seed}"
            f"{f', sliding window {window}' if window else ''})"
        )
        got = _as_ids(call(what, fn, counting, given, n, **kwargs), what)
        if given != prompt:
            raise AssertionError(
                f"{what} changed the caller's prompt_ids list to {describe(given)}; "
                "copy it (ids = list(prompt_ids)) before appending"
            )
        if structure is not None:
            structure(what, prompt, n, counting.calls, kwargs)
        expected = _greedy_oracle(model, prompt, n)
        if got != expected:
            hint = (
                " (return only the new tokens, not the prompt)" if got[: len(prompt)] == prompt and len(got) > n else ""
            )
            raise AssertionError(f"{what}: expected the greedy tokens {expected}, got {got}{hint}")


def check_generate_without_cache(fn) -> None:
    """Greedy tokens of a plain loop; every step runs the model on the whole sequence, no cache."""

    def structure(what, prompt, n, calls, _):
        fed = [length for length, _ in calls]
        expected = [len(prompt) + i for i in range(n)]
        if any(cached for _, cached in calls):
            raise AssertionError(f"{what} passed a kv_cache to the model; this version must not use one")
        if fed != expected:
            raise AssertionError(
                f"{what}: each step must feed the whole sequence so far; expected calls with "
                f"{expected} tokens, got {fed}"
            )

    _check_generation(fn, "generate_without_cache", structure=structure)


class _RecordingCache(_ReferenceCache):
    """The library's cache, remembering that it was made (generate_with_cache must use cache_class)."""

    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _RecordingCache.made.append(self)


def check_generate_with_cache(fn) -> None:
    """Greedy tokens equal to the plain loop; the prompt goes in once, then one token per step,
    always into the cache made from cache_class."""

    def kwargs():
        _RecordingCache.made = []
        return {"cache_class": _RecordingCache}

    def structure(what, prompt, n, calls, _):
        if n == 0:
            return
        if len(_RecordingCache.made) != 1:
            raise AssertionError(
                f"{what}: expected one cache made with cache_class(model.config, 1, ...), "
                f"{len(_RecordingCache.made)} were made (use the cache_class argument)"
            )
        fed = [length for length, _ in calls]
        if not all(cached for _, cached in calls):
            raise AssertionError(f"{what}: every call must pass kv_cache=the cache; calls (tokens, cache?): {calls}")
        if fed[:1] != [len(prompt)] or any(length != 1 for length in fed[1:]) or len(fed) not in (n, n + 1):
            raise AssertionError(
                f"{what}: expected the prompt once ({len(prompt)} tokens) then one token per step, "
                f"calls with {[len(prompt)] + [1] * (n - 1)} tokens; got {fed}"
            )

    _check_generation(fn, "generate_with_cache", extra_kwargs=kwargs, structure=structure)


def _same(got, expected: torch.Tensor, what: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {list(expected.shape)}, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: expected shape {list(expected.shape)}, got {list(got.shape)}")
    if not torch.equal(got.cpu().to(expected.dtype), expected):
        diff = (got.cpu().to(expected.dtype) - expected).abs()
        where = [int(i) for i in (diff == diff.max()).nonzero()[0]]
        raise AssertionError(
            f"{what}: the held rows differ from the rows appended (largest difference "
            f"{diff.max().item():.3g} at index {where}, index 2 is the position)"
        )


def _pair(got, what: str):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise AssertionError(f"{what}: expected a pair (keys, values), got {type(got).__name__} {describe(got)}")
    return got


def _seq_len(cache, when: str):
    return call(f"your cache's seq_len {when}", getattr, cache, "seq_len")


def _cache_bookkeeping(cls) -> None:
    config = ModelConfig(
        vocab_size=10,
        hidden_size=12,
        intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=64,
    )
    gen = torch.Generator().manual_seed(0)
    rows = lambda t: torch.randn(2, 1, t, 4, generator=gen, dtype=torch.float64)  # noqa: E731 [B, H_kv, T, D]
    made = "KVCache(config with 3 layers, 1 KV head of dim 4, batch_size=2, max_seq_len=8, dtype=torch.float64)"
    cache = call(made, cls, config, 2, 8, dtype=torch.float64)
    seq_len = call(f"{made}.seq_len", getattr, cache, "seq_len")
    expect_int(seq_len, 0, f"seq_len of a new {made}")
    held_k, held_v = [], []
    for step, t in enumerate((3, 2)):
        for layer in range(3):
            k, v = rows(t), rows(t)
            what = f"append(layer={layer}, k, v) of {t} rows after {sum((3, 2)[:step])} held"
            got_k, got_v = _pair(call(what, cache.append, layer, k, v), what)
            if step == 0:
                held_k.append(k), held_v.append(v)
            else:
                held_k[layer], held_v[layer] = torch.cat([held_k[layer], k], 2), torch.cat([held_v[layer], v], 2)
            _same(got_k, held_k[layer], f"the keys {what} returned")
            _same(got_v, held_v[layer], f"the values {what} returned")
        when = f"after appending {(3, 5)[step]} rows to every layer"
        expect_int(_seq_len(cache, when), 3 + 2 * step, f"seq_len {when}")
    for layer in range(3):
        what = f"view(layer={layer}) with 5 rows held"
        got_k, got_v = _pair(call(what, cache.view, layer), what)
        _same(got_k, held_k[layer], f"the keys of {what}")
        _same(got_v, held_v[layer], f"the values of {what}")
    call("truncate(2) with 5 rows held", cache.truncate, 2)
    expect_int(_seq_len(cache, "after truncate(2)"), 2, "seq_len after truncate(2)")
    for layer in range(3):
        k, v = rows(1), rows(1)
        what = f"append(layer={layer}, one row) after truncate(2)"
        got_k, got_v = _pair(call(what, cache.append, layer, k, v), what)
        _same(
            got_k,
            torch.cat([held_k[layer][:, :, :2], k], 2),
            f"the keys {what} returned (2 kept rows, then the new one)",
        )
        _same(
            got_v,
            torch.cat([held_v[layer][:, :, :2], v], 2),
            f"the values {what} returned (2 kept rows, then the new one)",
        )
        what = f"view(layer={layer}) after truncate(2) and one append"
        _same(_pair(call(what, cache.view, layer), what)[0], torch.cat([held_k[layer][:, :, :2], k], 2), what)
    when = "after truncate(2) and one more row per layer"
    expect_int(_seq_len(cache, when), 3, f"seq_len {when}")
    expect_raises(
        "truncate(4) with 3 rows held", ValueError, "it cannot keep more rows than it holds", cache.truncate, 4
    )
    expect_raises("truncate(-1)", ValueError, "a length is >= 0", cache.truncate, -1)
    expect_raises(
        "append(layer=0, 6 rows) with 3 held and max_seq_len=8",
        ValueError,
        "3 + 6 rows exceed max_seq_len=8",
        cache.append,
        0,
        rows(6),
        rows(6),
    )


@torch.no_grad()
def _cache_in_model(cls) -> None:
    for seed, window in ((11, None), (12, 3)):
        model = _model(seed, window)
        ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(seed))
        full = model(ids)  # [2, 12, V]: the oracle, no cache at all
        label = f"a random 2-layer model (seed {seed}{f', sliding window {window}' if window else ''}), batch of 2"
        cache = call(
            f"KVCache(config, 2, 12, dtype=torch.float64) for {label}", cls, model.config, 2, 12, dtype=torch.float64
        )
        pieces = [(0, 5), *[(i, i + 1) for i in range(5, 12)]]
        got = torch.cat(
            [
                call(f"model(tokens {s}..{e - 1}, kv_cache=your cache) on {label}", model, ids[:, s:e], kv_cache=cache)
                for s, e in pieces
            ],
            1,
        )
        err = (got - full).abs().max().item()
        if not err < 1e-9:
            bad = int((got - full).abs().amax(dim=(0, 2)).argmax())
            raise AssertionError(
                f"prefill of 5 tokens then 7 single tokens through your cache on {label}: the logits "
                f"must equal one forward pass without a cache; they differ by {err:.3g} "
                f"(first bad position {bad})"
            )
        when = f"after feeding 12 tokens on {label}"
        expect_int(_seq_len(cache, when), 12, f"seq_len {when}")
        # speculative-decoding style: feed 3 guesses, take them back, feed the true continuation
        cache = call(
            f"KVCache(config, 2, 12, dtype=torch.float64) for {label}", cls, model.config, 2, 12, dtype=torch.float64
        )
        call(f"model(tokens 0..5, kv_cache=your cache) on {label}", model, ids[:, :6], kv_cache=cache)
        guesses = torch.randint(0, 61, (2, 3), generator=torch.Generator().manual_seed(99))
        call(f"model(3 guessed tokens, kv_cache=your cache) on {label}", model, guesses, kv_cache=cache)
        call("truncate(6) after 9 tokens", cache.truncate, 6)
        got = call(f"model(tokens 6..11, kv_cache=...) after truncate(6) on {label}", model, ids[:, 6:], kv_cache=cache)
        err = (got - full[:, 6:]).abs().max().item()
        if not err < 1e-9:
            raise AssertionError(
                f"6 tokens, then 3 wrong guesses, truncate(6), then the true tokens 6..11 on {label}: "
                f"logits must equal a forward pass that never saw the guesses; they differ by {err:.3g}"
            )


def check_kv_cache_class(cls) -> None:
    """append / view / seq_len / truncate bookkeeping, the errors, and exact logits inside the model."""
    _cache_bookkeeping(cls)
    _cache_in_model(cls)


# --------------------------------------------------------------------------- bytes

# The published config.json values this check relies on, typed in again here (not read from
# decodelab.lessons.kv_size): layers, KV heads, head_dim, per-layer window (None = full attention).
_CONFIGS = {
    "Llama-3.1-8B": dict(layers=32, kv_heads=8, head_dim=128, windows=[None] * 32),
    "Qwen3-8B": dict(layers=36, kv_heads=8, head_dim=128, windows=[None] * 36),
    "gpt-oss-20b": dict(layers=24, kv_heads=8, head_dim=64, windows=[128, None] * 12),
    "GPT-3-175B": dict(layers=96, kv_heads=96, head_dim=128, windows=[None] * 96),
    "SmolLM2-135M": dict(layers=30, kv_heads=3, head_dim=64, windows=[None] * 30),
}
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int4": 0.5, torch.float32: 4, torch.bfloat16: 2}


def _expected_bytes(name: str, seq_len: int, batch: int, dtype) -> int:
    c = _CONFIGS[name]
    positions = sum(seq_len if w is None else min(seq_len, w) for w in c["windows"])
    return math.ceil(2 * batch * positions * c["kv_heads"] * c["head_dim"] * _BYTES[dtype])


def check_kv_cache_bytes(fn) -> None:
    """Presets, dict configs and a ModelConfig; GQA, sliding windows, batch and dtype; an int result."""
    KiB, MiB, GiB = 2**10, 2**20, 2**30
    seed_figures = [  # (config, seq_len, batch, dtype, expected, what the seed says)
        ("Llama-3.1-8B", 1, 1, "fp16", 128 * KiB, "128 KiB per token"),
        ("Llama-3.1-8B", 4096, 1, "fp16", 512 * MiB, "512 MiB at 4,096 tokens"),
        ("Llama-3.1-8B", 131072, 1, "bf16", 16 * GiB, "16 GiB at 131,072 tokens"),
        ("Llama-3.1-8B", 4096, 32, "fp16", 16 * GiB, "16 GiB for 32 users of 4,096 tokens"),
        ("Qwen3-8B", 1, 1, "bf16", 144 * KiB, "144 KiB per token"),
        ("Qwen3-8B", 32768, 16, "bf16", 72 * GiB, "72 GiB for 16 sequences of 32,768 tokens"),
        ("GPT-3-175B", 2048, 1, "fp16", 9_663_676_416, "9.66 GB per request of 2,048 tokens"),
    ]
    for name, seq_len, batch, dtype, expected, said in seed_figures:
        assert expected == _expected_bytes(name, seq_len, batch, dtype)
        what = f"kv_bytes({name!r}, seq_len={seq_len}, batch={batch}, dtype={dtype!r}) ({said})"
        expect_int(call(what, fn, name, seq_len, batch, dtype), expected, what)
    cases = [  # sliding windows, dtypes, small and odd sizes
        ("gpt-oss-20b", 100, 1, "bf16", "below the window of 128 every layer holds all 100 positions"),
        ("gpt-oss-20b", 131072, 1, "bf16", "12 sliding layers hold 128 positions, 12 full layers 131,072"),
        ("gpt-oss-20b", 5000, 3, "fp8", "sliding layers cap at 128 positions"),
        ("SmolLM2-135M", 777, 2, "fp32", "3 KV heads for 9 query heads"),
        ("SmolLM2-135M", 333, 1, "int4", "half a byte per value: return an int"),
        ("Llama-3.1-8B", 1000, 2, torch.float32, "a torch.dtype works like its name"),
        ("Qwen3-8B", 0, 4, "bf16", "an empty sequence holds nothing"),
    ]
    for name, seq_len, batch, dtype, why in cases:
        what = f"kv_bytes({name!r}, seq_len={seq_len}, batch={batch}, dtype={describe(dtype)}) ({why})"
        expect_int(call(what, fn, name, seq_len, batch, dtype), _expected_bytes(name, seq_len, batch, dtype), what)
    # the same configs given as config.json dicts and as a ModelConfig
    gpt_oss_like = dict(
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=256,
        head_dim=32,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    what = "kv_bytes(a config.json dict: 4 layers alternating sliding (window 16) and full, 2 KV heads of 32, seq_len=50, batch=1, 'fp16')"
    expect_int(call(what, fn, gpt_oss_like, 50, 1, "fp16"), 2 * (16 + 50 + 16 + 50) * 2 * 32 * 2, what)
    no_head_dim = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)  # MHA, head_dim 16
    what = "kv_bytes(a dict without head_dim or num_key_value_heads: 2 layers, 4 heads, hidden 64, seq_len=10, batch=3, 'fp32')"
    expect_int(call(what, fn, no_head_dim, 10, 3, "fp32"), 2 * 3 * 10 * 2 * 4 * 16 * 4, what)
    config = ModelConfig(
        vocab_size=10,
        hidden_size=48,
        intermediate_size=8,
        num_hidden_layers=5,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    what = "kv_bytes(ModelConfig(5 layers, 6 heads, 2 KV heads, hidden 48), seq_len=7, batch=2, 'bf16')"
    expect_int(call(what, fn, config, 7, 2, "bf16"), 2 * 2 * 7 * 5 * 2 * 8 * 2, what)


# --------------------------------------------------------------------------- the sliding-window ring

_RING_CONFIG = dict(
    vocab_size=10,
    hidden_size=16,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=2,
    max_position_embeddings=64,
)


def _ring_bookkeeping(cls, window: int, chunks: list[int]) -> None:
    """Append chunks of random rows to both layers; every return, view and seq_len must be exact."""
    config = ModelConfig(**_RING_CONFIG, sliding_window=window)
    made = f"SlidingWindowKVCache(config with sliding_window={window}, 2 layers, batch_size=2, max_seq_len=64, float64)"
    cache = call(made, cls, config, 2, 64, dtype=torch.float64)
    gen = torch.Generator().manual_seed(window)
    total = sum(chunks)
    rows = [torch.randn(2, 2, total, 2, generator=gen, dtype=torch.float64) for _ in range(4)]  # K, V of 2 layers
    start = 0
    for t in chunks:
        end = start + t
        for layer in range(2):
            keys, values = rows[2 * layer], rows[2 * layer + 1]
            seen = f"after positions 0..{start - 1}" if start else "on a new cache"
            what = f"append(layer={layer}, positions {start}..{end - 1}) {seen}, window {window}"
            got_k, got_v = _pair(call(what, cache.append, layer, keys[:, :, start:end], values[:, :, start:end]), what)
            first = max(0, start - window)  # held before: the last min(start, W) positions
            held = f"the held positions {first}..{start - 1} then " if start else "nothing held yet, so just "
            why = (
                f"{held}the new {start}..{end - 1}, in position order: the chunk's first queries still need "
                "keys its own later rows overwrite"
            )
            _ring_same(got_k, keys, first, end, f"the keys {what} returned", why)
            _ring_same(got_v, values, first, end, f"the values {what} returned", why)
            what = f"view(layer={layer}) after positions 0..{end - 1}, window {window}"
            held_k, held_v = _pair(call(what, cache.view, layer), what)
            why = f"the last {min(end, window)} positions, {max(0, end - window)}..{end - 1}, in position order"
            _ring_same(held_k, keys, max(0, end - window), end, f"the keys of {what}", why)
            _ring_same(held_v, values, max(0, end - window), end, f"the values of {what}", why)
        when = f"after positions 0..{end - 1} reached both layers"
        expect_int(
            _seq_len(cache, when),
            end,
            f"seq_len {when} (every position seen, not only the {window} held: "
            "the model reads the next position from it)",
        )
        start = end
    held = tensor_bytes_held(cache)
    allowed = 2 * 2 * 2 * 2 * window * 2 * 8  # K and V, 2 layers, batch 2, 2 KV heads, W slots, dim 2, float64
    if held > allowed:
        raise AssertionError(
            f"{made} holds tensors of {held:,} bytes after {total} positions; W={window} slots per "
            f"layer take {allowed:,} bytes (keep a ring of W slots, not max_seq_len or every position)"
        )


def _ring_same(got, rows: torch.Tensor, first: int, end: int, what: str, why: str) -> None:
    """got must be rows[:, :, first:end] exactly; a wrong row is named by the position it holds."""
    expected = rows[:, :, first:end]
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor of shape {list(expected.shape)} ({why}), got {describe(got)}")
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: expected shape {list(expected.shape)} ({why}), got {list(got.shape)}")
    got = got.detach().cpu().to(rows.dtype)
    if not torch.equal(got, expected):
        held = []
        for row in range(expected.shape[2]):
            match = [p for p in range(rows.shape[2]) if torch.equal(got[:, :, row], rows[:, :, p])]
            held.append(f"position {match[0]}" if match else "no position's values")
        raise AssertionError(f"{what}: expected {why}; the rows held, in order: {', '.join(held)}")


def _ring_call(what: str, start: int, window: int, fn, *args, **kwargs):
    """`call` for a step of the ring (attend, or the model through it) whose chunk starts at position `start`:
    once the ring is full (start > W) it holds fewer positions than it has seen, and a ValueError there, such as
    causal_attention's "attention got ... keys for ... queries at offset ...", is named by its usual cause."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        if start <= window:
            raise failure(what, exc) from None
        raise AssertionError(
            f"{what} raised ValueError: {exc}. If causal_attention raised it, check attend's q_offset: the queries "
            f"come right after the keys append returned before the new rows, so q_offset is how many those are, "
            f"min(S, W) = {window} here, not seq_len (the {start} positions seen)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - any other exception of the code under test fails the check
        raise failure(what, exc) from None


@torch.no_grad()
def _ring_attention(cls, window: int, chunks: list[int]) -> None:
    """attend chunk by chunk equals causal_attention with the window over the full K/V."""
    config = ModelConfig(**_RING_CONFIG, sliding_window=window)
    gen = torch.Generator().manual_seed(100 + window)
    total = sum(chunks)
    q = torch.randn(2, 4, total, 2, generator=gen, dtype=torch.float64)  # [B, H, S, D]
    k, v = (torch.randn(2, 2, total, 2, generator=gen, dtype=torch.float64) for _ in range(2))  # [B, H_kv, S, D]
    expected = causal_attention(q, k, v, sliding_window=window)  # [B, H, S, D]
    made = f"SlidingWindowKVCache(config with sliding_window={window}, batch_size=2, float64)"
    cache = call(made, cls, config, 2, 64, dtype=torch.float64)
    start = 0
    for t in chunks:
        end = start + t
        for layer in range(2):
            what = (
                f"{made}: attend(layer={layer}, queries and K/V of positions {start}..{end - 1}) in chunks of "
                f"{chunks} positions"
            )
            got = _ring_call(
                what, start, window, cache.attend, layer, q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            )
            want = expected[:, :, start:end]
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                raise AssertionError(f"{what}: expected a tensor of shape {list(want.shape)}, got {describe(got)}")
            err = (got - want).abs().amax(dim=(0, 1, 3))
            if not err.max().item() < 1e-9:
                bad = [start + i for i in range(t) if err[i] >= 1e-9]
                raise AssertionError(
                    f"{what}: the outputs of the queries at positions {bad} differ from "
                    f"causal_attention(q, all K, all V, sliding_window={window}) by up to "
                    f"{err.max().item():.3g}; each query must see exactly its last {window} positions"
                )
        start = end


@torch.no_grad()
def _ring_in_model(cls, seed: int, window: int, chunks: list[int], window_argument: bool) -> None:
    """The model's logits through the ring equal the windowed model without any cache."""
    model = _model(seed, window)
    total = sum(chunks)
    ids = torch.randint(0, 61, (2, total), generator=torch.Generator().manual_seed(seed))
    full = model(ids)  # [2, S, V]: the oracle, the window as a mask over the whole sequence
    if window_argument:  # the cache's own window on a model whose config has none (how the notebook runs SmolLM2)
        model = _model(seed, None)
        label = (
            f"a random 2-layer model without a window (seed {seed}), batch of 2, the cache made with window={window}"
        )
        cache = call(
            f"SlidingWindowKVCache(config, 2, {total}, dtype=torch.float64, window={window})",
            cls,
            model.config,
            2,
            total,
            dtype=torch.float64,
            window=window,
        )
    else:
        label = f"a random 2-layer model with sliding window {window} (seed {seed}), batch of 2"
        cache = call(
            f"SlidingWindowKVCache(config, 2, {total}, dtype=torch.float64) for {label}",
            cls,
            model.config,
            2,
            total,
            dtype=torch.float64,
        )
    pieces, start = [], 0
    for t in chunks:
        pieces.append((start, start + t))
        start += t
    got = torch.cat(
        [
            _ring_call(
                f"model(tokens {s}..{e - 1}, kv_cache=your cache) on {label}",
                s,
                window,
                model,
                ids[:, s:e],
                kv_cache=cache,
            )
            for s, e in pieces
        ],
        1,
    )
    err = (got - full).abs().amax(dim=(0, 2))
    if not err.max().item() < 1e-9:
        bad = [i for i in range(total) if err[i] >= 1e-9]
        raise AssertionError(
            f"chunks of {chunks} tokens through your cache on {label}: the logits must equal one "
            f"forward pass with the window and no cache; they differ by {err.max().item():.3g} at "
            f"positions {bad[:8]}{'...' if len(bad) > 8 else ''}"
        )


def check_sliding_window_kv_cache(cls) -> None:
    """Returns, views, seq_len and bytes held; attention and model logits equal the full K/V under the window
    mask, with chunks longer than the window and chunks that wrap around the ring; the errors."""
    _ring_bookkeeping(cls, 4, [3, 3, 1, 1, 6, 2, 4])  # fills, wraps mid-chunk, decodes, a chunk longer than W
    _ring_bookkeeping(cls, 3, [10, 1, 2])  # a prefill that overwrites itself twice
    _ring_attention(cls, 5, [7, 4, 1, 1, 1, 2, 5, 1])
    _ring_in_model(cls, 21, 4, [6, 3, 1, 1, 1, 5, 1, 1], window_argument=False)
    _ring_in_model(cls, 22, 3, [2, 1, 1, 4, 1, 1], window_argument=True)
    config = ModelConfig(**_RING_CONFIG)
    expect_raises(
        "SlidingWindowKVCache(a config without sliding_window, no window argument)",
        ValueError,
        "a ring needs a window W",
        cls,
        config,
        1,
        8,
    )
    expect_raises(
        "SlidingWindowKVCache(config, window=0)",
        ValueError,
        "a window holds at least 1 position",
        cls,
        config,
        1,
        8,
        window=0,
    )
    cache = call("SlidingWindowKVCache(config, 2, 8, window=3) (2 KV heads of dim 2)", cls, config, 2, 8, window=3)
    expect_raises(
        "append(0, k and v with 1 KV head) on a cache of 2 KV heads",
        ValueError,
        "k and v must have the cache's shape [B, H_kv, T, D]",
        cache.append,
        0,
        torch.zeros(2, 1, 3, 2),
        torch.zeros(2, 1, 3, 2),
    )
    expect_raises(
        "append(0, k of 3 rows, v of 2 rows)",
        ValueError,
        "k and v must have the same shape",
        cache.append,
        0,
        torch.zeros(2, 2, 3, 2),
        torch.zeros(2, 2, 2, 2),
    )


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_rows_without_cache() -> float:
    """K/V rows one layer computes to generate 30 tokens after a 20-token prompt, without a cache."""
    expected = sum(20 + step for step in range(30))  # step i feeds the prompt and the i tokens made so far
    return expected


def check_q_rows_without_cache(value) -> None:
    """Graded q_rows_without_cache (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_rows_without_cache",
        value,
        answer_q_rows_without_cache(),
        "K/V rows per layer for 30 new tokens after a 20-token prompt, no cache (20 + 21 + ... + 49)",
    )


def answer_q_qwen3_kv_gib() -> float:
    """GiB of K/V for Qwen3-8B, 16 sequences of 32,768 tokens, bf16."""
    return kv_size.kv_bytes("Qwen3-8B", 32768, 16, "bf16") / 2**30


def check_q_qwen3_kv_gib(value) -> None:
    """Graded q_qwen3_kv_gib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_qwen3_kv_gib",
        value,
        answer_q_qwen3_kv_gib(),
        "Qwen3-8B's KV cache in GiB for 16 sequences of 32,768 tokens in bf16 (2 x 36 layers x 8 KV heads "
        "x 128 x 2 bytes per token)",
    )

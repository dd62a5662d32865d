"""Checks for notebook 04, prefill and decode: the prompt in one forward pass, TTFT and
inter-token latency, streaming text one token at a time, arithmetic intensity, and reusing a
shared prefix's KV cache.

Each ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and
returns None or raises ``AssertionError`` naming the input, the expected and the actual result.

Oracles, never snapshots:
* logits: the same weights in float64, run over the whole sequence without any cache (the
  plain causal forward pass that prefill and prefix reuse must reproduce);
* "one forward pass" and "the prefix is computed once": counted with forward hooks on the model;
* generation: the greedy tokens of the float64 model without a cache, recomputed step by step; the
  clock readings: a clock that returns how many forward passes have run, so each reading shows
  where in the loop it was taken;
* latencies: differences of clock readings, by hand;
* the streaming detokenizer: the real tokenizer's decode of all the ids (SmolLM2's byte-level BPE,
  and a SentencePiece-style one with Llama 2's decoder), and of the ids so far, which says what text
  is final after each push; its work: the ids each push hands to a counting tokenizer;
* arithmetic intensity: 2 FLOPs per parameter per token over the bytes of every weight plus
  K/V (2 x layers x KV heads x head_dim x positions x bytes), with the parameters counted by
  building the model for real (small configs) or the total `transformers` reports (Llama-3.1-8B).
"""

from __future__ import annotations

import copy
import math
import numbers
import random

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.course.exercises import references
from decodelab.model.toy import random_llama

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("04_prefill_decode")

__all__ = [
    "check_timed_generate",
    "check_latencies_from_timestamps",
    "check_arithmetic_intensity",
    "check_reuse_prefix",
    "check_incremental_detokenizer",
    "check_q_kv_share_percent",
    "check_q_prefill_tokens_to_ridge",
]

VOCAB = 97
LLAMA_31_8B_PARAMETERS = 8_030_261_248  # what transformers reports for meta-llama/Llama-3.1-8B
# The random Llama the prefill and prefix checks run (`random_llama`: O(1) logits, so that a 1e-4
# tolerance proves something): 3 layers, 8 query heads over 2 KV heads of 16.
MODEL = dict(vocab_size=VOCAB, num_hidden_layers=3, num_attention_heads=8, head_dim=16)


@torch.inference_mode()
def _oracle_last_logits(model, rows: list[list[int]]) -> torch.Tensor:
    """The last position's logits [B, V] of each whole sequence, float64 weights, no cache."""
    exact = copy.deepcopy(model).double()
    return exact(torch.tensor(rows))[:, -1].double()


class _Counter:
    """Counts the model's forward calls and the tokens they process."""

    def __init__(self, model):
        self.calls, self.tokens = 0, 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        self.calls += 1
        self.tokens += int(ids.shape[-1]) if torch.is_tensor(ids) else 0

    def remove(self):
        self._handle.remove()


def _expect_logits(got, want: torch.Tensor, what: str, atol: float = 1e-4) -> None:
    if not torch.is_tensor(got):
        raise AssertionError(
            f"{what}: expected a tensor of logits of shape {list(want.shape)}, got {type(got).__name__}"
        )
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(
            f"{what}: expected logits of shape {list(want.shape)} (the last position only), got shape {list(got.shape)}"
        )
    err = (got.detach().double().cpu() - want).abs().max().item()
    if not err < atol:
        raise AssertionError(
            f"{what}: the logits differ from the whole sequence's forward pass without a cache "
            f"(float64) by up to {err:.3g} (allowed {atol:g})"
        )


# --------------------------------------------------------------------------- prefill


def _greedy_oracle(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of the float64 model, each from a pass over the whole sequence without a cache."""
    exact, ids = copy.deepcopy(model).double(), list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(exact(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _timed_run(fn, model, prompt: list[int], max_new: int, stop=(), desc: str = ""):
    """Run fn with a fresh cache and a clock that reads the number of forward passes so far;
    return (its result, the tokens each forward pass was fed, the cache)."""
    from decodelab.model.kv_cache import KVCache

    fed: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _m, args, kwargs: fed.append(int((args[0] if args else kwargs["input_ids"]).shape[-1])), with_kwargs=True
    )
    cache = KVCache(model.config, 1, len(prompt) + max_new + 1)
    try:
        got = call(desc, fn, model, prompt, max_new, cache, stop, lambda: float(len(fed)))
    finally:
        handle.remove()
    if not isinstance(got, dict) or not {"token_ids", "start_s", "token_times_s"} <= set(got):
        raise AssertionError(
            f"{desc} returned {type(got).__name__} {str(got)[:80]}; expected a dict with the keys "
            f"'token_ids', 'start_s' and 'token_times_s'"
        )
    return got, fed, cache


def check_timed_generate(fn) -> None:
    """fn(model, prompt_ids, max_new_tokens, cache, stop_token_ids, clock) -> {token_ids, start_s, token_times_s}."""
    model = random_llama(32, **MODEL)
    prompt = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(32)).tolist()
    want = _greedy_oracle(model, prompt, 6)
    desc = "timed_generate(model, an 11-token prompt, max_new_tokens=6, an empty cache, no stop token, clock)"
    got, fed, cache = _timed_run(fn, model, prompt, 6, (), desc)
    if [int(t) for t in got["token_ids"]] != want:
        raise AssertionError(
            f"{desc}: token_ids {list(got['token_ids'])}, expected the greedy tokens {want} (the "
            f"argmax at every step, from the float64 model run without a cache)"
        )
    if fed != [11, 1, 1, 1, 1, 1]:
        why = (
            "the prompt went in one token at a time: a prefill is one pass over all 11"
            if fed[:11] == [1] * 11
            else "the decode steps must feed only the newest token, with the cache"
            if len(fed) > 1 and fed[1] > 1
            else "the last token needs no pass: nothing comes after it"
            if len(fed) > 6
            else "one prefill pass, then one pass per token after the first"
        )
        raise AssertionError(f"{desc}: the model was fed {fed} tokens per pass, expected [11, 1, 1, 1, 1, 1] ({why})")
    if cache.seq_len != 16:
        raise AssertionError(
            f"{desc}: the cache holds {cache.seq_len} positions afterwards, expected 16 (the prompt "
            f"and the 5 tokens fed back): pass the cache to every forward pass"
        )
    if float(got["start_s"]) != 0.0:
        raise AssertionError(
            f"{desc}: start_s was read after {got['start_s']:g} forward passes (the clock given "
            f"counts them); read the clock once before the prefill"
        )
    stamps = [float(t) for t in got["token_times_s"]]
    if stamps != [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]:
        raise AssertionError(
            f"{desc}: token_times_s {stamps} with a clock that returns the number of forward passes "
            f"so far; expected [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]: one reading right after each token "
            f"(the first after the prefill), using the clock you are given"
        )

    stop = want[3] if want[3] not in want[:3] else want[0]
    cut = want[: want.index(stop) + 1]
    desc = f"timed_generate(model, the same prompt, max_new_tokens=6, a fresh cache, stop_token_ids=({stop},), clock)"
    got, fed, _ = _timed_run(fn, model, prompt, 6, (stop,), desc)
    if [int(t) for t in got["token_ids"]] != cut or len(got["token_times_s"]) != len(cut):
        raise AssertionError(
            f"{desc}: token_ids {list(got['token_ids'])} with {len(got['token_times_s'])} readings; "
            f"expected {cut}: stop right after the stop token, which is kept"
        )
    desc = "timed_generate(model, the same prompt, max_new_tokens=1, a fresh cache, no stop token, clock)"
    got, fed, _ = _timed_run(fn, model, prompt, 1, (), desc)
    if [int(t) for t in got["token_ids"]] != want[:1] or fed != [11]:
        raise AssertionError(
            f"{desc}: token_ids {list(got['token_ids'])} after passes fed {fed}; expected "
            f"{want[:1]} from the prefill alone ([11])"
        )
    from decodelab.model.kv_cache import KVCache

    for bad in (0, -1):
        expect_raises(
            f"timed_generate(model, prompt, max_new_tokens={bad}, cache)",
            ValueError,
            "max_new_tokens must be an integer >= 1",
            fn,
            model,
            prompt,
            bad,
            KVCache(model.config, 1, 16),
        )


# --------------------------------------------------------------------------- latency


def _expect_number(got, want: float, what: str) -> None:
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise AssertionError(f"{what}: expected the number {want:.6g}, got {type(got).__name__} {got!r}")
    if not math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-9):
        raise AssertionError(f"{what}: expected {want:.6g} s, got {float(got):.6g} s")


def _expect_latencies(fn, start: float, times: list[float], name: str) -> None:
    desc = f"latencies_from_timestamps({start!r}, {name})"
    got = call(desc, fn, start, list(times))
    keys = {"ttft_s", "itl_s", "tpot_s", "e2e_s"}
    if not isinstance(got, dict) or not keys <= set(got):
        raise AssertionError(
            f"{desc}: expected a dict with the keys 'ttft_s', 'itl_s', 'tpot_s' and 'e2e_s', got {got!r}"
        )
    _expect_number(got["ttft_s"], times[0] - start, f"{desc}['ttft_s'] (first token - start)")
    want = [b - a for a, b in zip(times, times[1:])]
    itl = got["itl_s"]
    itl = itl.tolist() if torch.is_tensor(itl) else itl
    if not isinstance(itl, (list, tuple)) or len(itl) != len(want):
        raise AssertionError(
            f"{desc}['itl_s']: expected {len(want)} gaps (one between each pair of consecutive "
            f"tokens of {len(times)}), got {itl!r}"
        )
    for i, (g, w) in enumerate(zip(itl, want)):
        _expect_number(g, w, f"{desc}['itl_s'][{i}] (token {i + 1} - token {i})")
    if len(times) == 1:
        if got["tpot_s"] is not None:
            raise AssertionError(
                f"{desc}['tpot_s']: a one-token reply has no time per output token after the first; "
                f"expected None, got {got['tpot_s']!r}"
            )
    else:
        _expect_number(
            got["tpot_s"],
            (times[-1] - times[0]) / (len(times) - 1),
            f"{desc}['tpot_s'] (last token - first token, over the {len(times) - 1} tokens after the "
            f"first: the prefill's wait is TTFT's, not TPOT's)",
        )
    _expect_number(got["e2e_s"], times[-1] - start, f"{desc}['e2e_s'] (last token - start)")


def _expect_value_error(fn, start, times, what: str, why: str) -> None:
    expect_raises(what, ValueError, why, fn, start, times)


def check_latencies_from_timestamps(fn) -> None:
    _expect_latencies(fn, 100.0, [100.5, 100.625, 100.75, 101.0], "[100.5, 100.625, 100.75, 101.0]")
    _expect_latencies(fn, 2.0, [2.25], "[2.25] (a single token)")
    _expect_latencies(fn, 0.0, [0.0, 0.0, 0.125], "[0.0, 0.0, 0.125] (two tokens in the same tick)")
    rng = random.Random(3)
    for case in range(5):
        start = rng.uniform(0, 1000)
        times = [start + rng.uniform(0.01, 2)]
        for _ in range(rng.randint(1, 20)):
            times.append(times[-1] + rng.uniform(0.001, 0.2))
        _expect_latencies(fn, start, times, f"random case {case}: {len(times)} increasing times")
    _expect_value_error(fn, 1.0, [], "latencies_from_timestamps(1.0, [])", "no token: there is no first token")
    _expect_value_error(
        fn, 1.0, [1.5, 1.25, 2.0], "latencies_from_timestamps(1.0, [1.5, 1.25, 2.0])", "token 1 arrived before token 0"
    )
    _expect_value_error(
        fn,
        5.0,
        [4.0, 6.0],
        "latencies_from_timestamps(5.0, [4.0, 6.0])",
        "the first token arrived before the request started",
    )


# --------------------------------------------------------------------------- arithmetic intensity


def _small_configs():
    from decodelab.config import ModelConfig

    base = dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3, max_position_embeddings=4096)
    return {
        "a small MHA config (6 heads, tied embeddings)": ModelConfig(
            **base, num_attention_heads=6, num_key_value_heads=6
        ),
        "a small GQA config (8 query heads over 2 KV heads, head_dim 12, untied)": ModelConfig(
            **{**base, "num_hidden_layers": 2},
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=12,
            tie_word_embeddings=False,
        ),
    }


def _intensity(
    params: int, layers: int, kv_heads: int, head_dim: int, tokens: int, kv_len: int, nbytes: float
) -> float:
    flops = 2 * params * tokens
    moved = params * nbytes + 2 * layers * kv_heads * head_dim * (kv_len + tokens) * nbytes
    return flops / moved


def check_arithmetic_intensity(fn) -> None:
    from decodelab.model.llama import LlamaForCausalLM

    def expect(config, desc, tokens, kv_len, dtype, want):
        got = call(
            f"arithmetic_intensity({desc}, num_tokens={tokens}, kv_len={kv_len}, bytes_per_param={dtype!r})",
            fn,
            config,
            tokens,
            kv_len,
            dtype,
        )
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            raise AssertionError(
                f"arithmetic_intensity({desc}, {tokens}, {kv_len}, {dtype!r}): expected a number "
                f"(FLOPs per byte), got {type(got).__name__} {got!r}"
            )
        if not math.isclose(float(got), want, rel_tol=1e-6):
            raise AssertionError(
                f"arithmetic_intensity({desc}, num_tokens={tokens}, kv_len={kv_len}, "
                f"bytes_per_param={dtype!r}): expected {want:.6g} FLOPs per byte, got {float(got):.6g}"
            )

    # Llama-3.1-8B: 32 layers, 8 KV heads of 128; its parameter total as transformers reports it
    for tokens, kv_len, dtype, nbytes in (
        (1, 4096, "fp16", 2),
        (1, 0, "fp16", 2),
        (512, 0, "fp16", 2),
        (64, 1000, "fp32", 4),
        (8, 128, "int8", 1),
        (1, 100_000, "bf16", 2),
    ):
        expect(
            "Llama-3.1-8B",
            "'Llama-3.1-8B'",
            tokens,
            kv_len,
            dtype,
            _intensity(LLAMA_31_8B_PARAMETERS, 32, 8, 128, tokens, kv_len, nbytes),
        )
    for desc, config in _small_configs().items():
        params = LlamaForCausalLM(config).num_parameters()
        for tokens, kv_len, dtype, nbytes in (
            (1, 0, "fp32", 4),
            (1, 2000, "fp16", 2),
            (37, 11, 4, 4),
            (300, 0, "bf16", 2),
        ):
            expect(
                config,
                desc,
                tokens,
                kv_len,
                dtype,
                _intensity(
                    params,
                    config.num_hidden_layers,
                    config.num_key_value_heads,
                    config.head_dim,
                    tokens,
                    kv_len,
                    nbytes,
                ),
            )
    for tokens, kv_len, why in (
        (0, 0, "num_tokens=0: a forward pass over no token"),
        (1, -1, "kv_len=-1: a negative number of cached tokens"),
    ):
        expect_raises(
            f"arithmetic_intensity('Llama-3.1-8B', {tokens}, {kv_len}, 'fp16')",
            ValueError,
            why,
            fn,
            "Llama-3.1-8B",
            tokens,
            kv_len,
            "fp16",
        )


# --------------------------------------------------------------------------- prefix reuse


def check_reuse_prefix(fn) -> None:
    model = random_llama(41, **MODEL)
    gen = torch.Generator().manual_seed(41)
    prefix = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
    suffixes = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 5, 9)]
    want = [_oracle_last_logits(model, [prefix + s]) for s in suffixes]

    counter = _Counter(model)
    try:
        got = call("reuse_prefix(model, a 20-token prefix, suffixes of 1, 5 and 9 tokens)", fn, model, prefix, suffixes)
    finally:
        counter.remove()
    if not isinstance(got, (list, tuple)) or len(got) != 3:
        raise AssertionError(
            f"reuse_prefix with 3 suffixes: expected a list of 3 logits tensors, got {type(got).__name__}"
            + (f" of length {len(got)}" if isinstance(got, (list, tuple)) else "")
        )
    for n, g, w in zip((1, 5, 9), got, want):
        _expect_logits(g, w, f"reuse_prefix(model, a 20-token prefix, three suffixes): the {n}-token suffix's result")
    expected_tokens = 20 + 1 + 5 + 9
    if counter.tokens != expected_tokens:
        raise AssertionError(
            f"reuse_prefix with a 20-token prefix and suffixes of 1, 5 and 9 tokens fed "
            f"{counter.tokens} tokens through the model; computing the prefix once and each suffix "
            f"once is {expected_tokens}"
        )

    again = call("reuse_prefix with the same suffixes in reverse order", fn, model, prefix, suffixes[::-1])
    for n, g, w in zip((9, 5, 1), again, want[::-1]):
        _expect_logits(
            g,
            w,
            f"reuse_prefix with the suffixes reversed: the {n}-token suffix (each suffix must "
            f"start from its own copy of the prefix's cache)",
        )

    one = call("reuse_prefix(model, prefix, one flat list of 5 ids)", fn, model, prefix, suffixes[1])
    if not isinstance(one, (list, tuple)) or len(one) != 1:
        raise AssertionError(
            f"reuse_prefix(model, prefix, a flat list of 5 ids): a flat list is one suffix, expected "
            f"a list of 1 logits tensor, got {type(one).__name__}"
            + (f" of length {len(one)}" if isinstance(one, (list, tuple)) else "")
        )
    _expect_logits(one[0], want[1], "reuse_prefix(model, prefix, a flat list of 5 ids)")


# --------------------------------------------------------------------------- predictions

H100_FLOPS, H100_BANDWIDTH = 990e12, 3.35e12  # the seed's H100 figures, stated in the questions


def answer_q_kv_share_percent() -> float:
    """Percent of the bytes one Llama-3.1-8B decode step moves (fp16, 32,768 cached tokens) that are K/V."""
    from decodelab.lessons.kv_size import kv_bytes, parameter_count

    kv = kv_bytes("Llama-3.1-8B", 32768 + 1, dtype="fp16")
    return 100 * kv / (2 * parameter_count("Llama-3.1-8B") + kv)


def check_q_kv_share_percent(value) -> None:
    """Graded q_kv_share_percent (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_kv_share_percent",
        value,
        answer_q_kv_share_percent(),
        "K/V of 32,769 positions (128 KiB each) over that plus 8,030,261,248 weights x 2 bytes, one "
        "Llama-3.1-8B decode step in fp16",
    )


def answer_q_prefill_tokens_to_ridge() -> float:
    """The shortest Llama-3.1-8B fp16 prefill whose arithmetic intensity reaches the H100's ridge."""
    from decodelab.lessons.prefill_decode import arithmetic_intensity

    ridge = H100_FLOPS / H100_BANDWIDTH
    return next(t for t in range(1, 10_000) if arithmetic_intensity("Llama-3.1-8B", t, 0, "fp16") >= ridge)


def check_q_prefill_tokens_to_ridge(value) -> None:
    """Graded q_prefill_tokens_to_ridge (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_prefill_tokens_to_ridge",
        value,
        answer_q_prefill_tokens_to_ridge(),
        "prompt tokens for a Llama-3.1-8B prefill in fp16 to reach 990e12 / 3.35e12 = 296 FLOPs per byte",
    )


# --------------------------------------------------------------------------- streaming detokenizer

# Texts whose ids SmolLM2's byte-level BPE splits in every way the check cares about: a Japanese
# character or an emoji over 2 to 4 tokens, digits one by one, code with runs of spaces.
STREAM_TEXTS = {
    "English prose": "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun.",
    "Python code": "def mean(xs):\n    if not xs:\n        raise ValueError('empty')\n    return sum(xs) / len(xs)\n",
    "Japanese": "東京は日本の首都です。桜の季節には、多くの人が公園を訪れます。",
    "emoji": "Good luck 🍀🦙 on the trip 👩‍💻🇯🇵, see you soon! 😀🫠",
    "numbers": "In 2024, 3.14159 × 10^6 ≈ 3,141,590 and ½ + ¾ = 1¼.",
    "many scripts": "naïve café, Zürich, São Paulo, Ελληνικά, русский, 한국어, 中文, हिन्दी",
}
MAX_IDS_PER_PUSH = 32  # a window of a few ids; re-decoding a 1,000-token text decodes up to 1,000


def _smollm2_tokenizer():
    from decodelab.model.registry import resolve_model
    from decodelab.model.tokenizer import Tokenizer

    return Tokenizer.from_folder(resolve_model("smollm2"))


def _stream(cls, tokenizer, ids: list[int], skip: bool, desc: str, counter=None) -> list[int]:
    """Push ids one by one into cls(tokenizer, skip_special_tokens=skip), then flush; every piece
    must be final (the text so far a prefix of the whole decode, and all of it once the ids decoded
    so far end on a whole character) and the pieces must join into the whole decode. Returns the
    ids decoded during each push (with a CountingTokenizer)."""
    want = tokenizer.decode(ids, skip)
    made = f"{cls.__name__}(tokenizer, skip_special_tokens={skip})"
    detokenizer = call(f"{made} for {desc}", cls, counter or tokenizer, skip_special_tokens=skip)
    sent, work = "", []
    for k, token_id in enumerate(ids, 1):
        mark = counter.mark() if counter else 0
        piece = call(f"push(id {k} of {len(ids)}) for {desc}", detokenizer.push, token_id)
        work.append(counter.since(mark) if counter else 0)
        if not isinstance(piece, str):
            raise AssertionError(f"{desc}: push(id {k}) returned {type(piece).__name__} {piece!r}; expected a str")
        sent += piece
        if not want.startswith(sent):
            at = next(i for i, (a, b) in enumerate(zip(sent, want + "\0" * len(sent))) if a != b)
            why = (
                " (U+FFFD: part of a character was sent before its last byte arrived; hold back text that ends "
                "in U+FFFD)"
                if "\ufffd" in piece
                else " (a token decoded without its context reads differently)"
            )
            raise AssertionError(
                f"{desc}, skip_special_tokens={skip}: after push(id {k}) returned {piece!r}, the text "
                f"sent so far differs from tokenizer.decode(all ids) at character {at}: sent "
                f"{sent[max(0, at - 12) : at + 4]!r}, expected {want[max(0, at - 12) : at + 4]!r}{why}"
            )
        so_far = tokenizer.decode(ids[:k], skip)
        if not so_far.endswith("\ufffd") and sent != so_far:
            raise AssertionError(
                f"{desc}, skip_special_tokens={skip}: after push(id {k}) the ids so far decode to "
                f"...{so_far[-24:]!r}, which ends on a whole character, but the pieces sent so far "
                f"end ...{sent[-24:]!r}: push must return all the text that is final, not hold it"
            )
    tail = call(f"flush() for {desc}", detokenizer.flush)
    if not isinstance(tail, str) or sent + tail != want:
        raise AssertionError(
            f"{desc}, skip_special_tokens={skip}: the pushes sent ...{sent[-24:]!r} and flush() "
            f"returned {tail!r}; expected flush to return {want[len(sent) :]!r}, the rest of "
            f"tokenizer.decode(all ids) = ...{want[-24:]!r}"
        )
    return work


def check_incremental_detokenizer(cls) -> None:
    """cls(tokenizer, skip_special_tokens=True) with push(token_id) -> str and flush() -> str."""
    from decodelab.lessons.detokenize import CountingTokenizer, sentencepiece_style_tokenizer

    smol = _smollm2_tokenizer()
    for name, text in STREAM_TEXTS.items():
        _stream(cls, smol, smol.encode(text), True, f"SmolLM2's ids of {name} ({text[:24]!r}...)")
    chat = smol.encode(
        smol.apply_chat_template(
            [
                {"role": "user", "content": STREAM_TEXTS["emoji"]},
                {"role": "assistant", "content": STREAM_TEXTS["Japanese"]},
            ],
            add_generation_prompt=False,
        )
    )
    for skip in (True, False):
        _stream(
            cls,
            smol,
            chat,
            skip,
            "SmolLM2's chat template around emoji and Japanese (special tokens <|im_start|> and <|im_end|>)",
        )
    japanese = smol.encode(STREAM_TEXTS["Japanese"])
    cut = next(k for k in range(2, len(japanese)) if smol.decode(japanese[:k]).endswith("\ufffd"))
    _stream(
        cls,
        smol,
        japanese[:cut],
        True,
        f"SmolLM2's Japanese ids cut after {cut}, inside a character (flush must return the unfinished tail)",
    )
    broken = japanese[: cut - 1] + japanese[cut:]  # a byte of one character lost: a real U+FFFD inside the text
    _stream(
        cls,
        smol,
        broken,
        True,
        "SmolLM2's Japanese ids with one id taken out of a character (the ids really decode to a U+FFFD there)",
    )

    sentencepiece = sentencepiece_style_tokenizer()
    text = "Hello world, say good morning in Japanese: おはようございます 🦙 one token at a time!"
    ids = [sentencepiece.bos_token_id] + sentencepiece.encode(text) + [sentencepiece.eos_token_id]
    for skip in (True, False):
        _stream(
            cls,
            sentencepiece,
            ids,
            skip,
            "a SentencePiece-style tokenizer (Llama 2's decoder: a token decoded first loses its leading space)",
        )

    long_ids = smol.encode(" ".join(STREAM_TEXTS.values()) * 4)
    counter = CountingTokenizer(smol)
    work = _stream(cls, smol, long_ids, True, f"SmolLM2's {len(long_ids)} ids of all the texts 4 times over", counter)
    worst = max(range(len(work)), key=work.__getitem__)
    if work[worst] > MAX_IDS_PER_PUSH:
        raise AssertionError(
            f"streaming {len(long_ids)} ids: push(id {worst + 1}) decoded {work[worst]} ids in all "
            f"(the most of any push; the first pushes decoded {work[:5]}), expected at most "
            f"{MAX_IDS_PER_PUSH}: decode only a window of recent ids, not the whole text again "
            f"(that costs O(n) per token, O(n^2) in all)"
        )

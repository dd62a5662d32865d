"""Checks for notebook 00, meet the model: byte-level BPE on one word, counting parameters from
a config, and the memory-bandwidth bound on batch-1 decode speed.

Each ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and
returns None or raises ``AssertionError`` naming the input, the expected and the actual result.

Expected BPE tokens come from Hugging Face's Rust `tokenizers`, never from a Python BPE written here:
* the real tokenizers (SmolLM2's, 48,900 merges; the tiny model's, 767): the library's
  `Tokenizer.encode` on words and whole texts, against the learner's function applied to the
  same pre-tokenized words with the same merge table (`decodelab.lessons.bpe.ByteLevelBPE`);
* random merge tables built the way BPE training builds them: `tokenizers.models.BPE` made from
  the same table.

Expected parameter counts never come from a formula written here:
* SmolLM2-135M-Instruct: the tensors in the real checkpoint (its safetensors header: shapes
  only, nothing is loaded); the tied lm_head is stored once.
* Published checkpoints: the totals `transformers` reports for Llama-3.1-8B (untied, GQA 32/8)
  and Qwen2.5-0.5B (tied, GQA 14/2, q/k/v biases).
* Random small configs: `decodelab.model.llama.LlamaForCausalLM(config).num_parameters()`, the
  model the course runs, built for real on the CPU (each is a few hundred thousand numbers).
"""

from __future__ import annotations

import math
import numbers
import random

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.course.exercises import references

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("00_meet_the_model")

__all__ = [
    "check_bpe_encode",
    "check_count_parameters",
    "check_decode_tokens_per_second_bound",
    "check_q_embedding_share_percent",
    "check_q_llama8b_tokens_per_s",
]

# The config.json fields of two published checkpoints and the totals transformers reports for them.
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": (
        dict(
            model_type="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
        8_030_261_248,
    ),
    "Qwen/Qwen2.5-0.5B": (
        dict(
            model_type="qwen2",
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        494_032_768,
    ),
}


# Words and texts for the real tokenizers: every kind of piece SmolLM2's pre-tokenizer makes
# (a word with its leading space, digits one by one, punctuation runs, whitespace runs, code,
# accented letters, CJK and an emoji, several bytes per character).
BPE_WORDS = [
    "What",
    " is",
    " gravity",
    "?",
    " gravitational",
    " tokenization",
    " Hello",
    " antidisestablishment",
    "ness",
    " the",
    " The",
    "!!!",
    "...",
    "   ",
    "\n\n",
    "\t",
    " café",
    " naïve",
    " 日本語",
    " 🤖",
    " über",
    " Привет",
    " 1",
    " supercalifragilistic",
    " self",
    " __init__",
    " {",
    "}}",
    " x",
    " y",
]
BPE_TEXTS = [
    "What is gravity? Gravity is the force by which a planet or other body draws objects toward its centre.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "In 1687, Newton published the Principia: F = G * m1 * m2 / r^2 (about 6.674e-11 N m^2 kg^-2).",
    "Déjà vu, naïve café, straße, 東京は日本の首都です, and an emoji or two: 🚀🤖!  Done.\n\n\tIndented.",
    "aaaaaaaaaaaa bbbbbbbb        eeeeeee\r\n----====****",
]


def _pieces_text(pieces) -> str:
    return "[" + ", ".join(repr(p) for p in pieces) + "]" if isinstance(pieces, list) else repr(pieces)


def _expect_pieces(desc: str, word: bytes, got, expected: list[bytes], merges: dict) -> None:
    """got must equal expected; the message says what kind of mistake it looks like."""
    if isinstance(got, tuple):
        got = list(got)
    if not isinstance(got, list) or not all(isinstance(p, bytes) for p in got):
        kinds = sorted({type(p).__name__ for p in got}) if isinstance(got, list) else []
        raise AssertionError(
            f"{desc} returned {type(got).__name__} {_pieces_text(got)[:200]}"
            + (f" of {', '.join(kinds)}" if kinds else "")
            + f"; expected a list of bytes {_pieces_text(expected)}"
        )
    if got == expected:
        return
    unmade = [p for p in got if len(p) > 1 and p not in {a + b for a, b in merges}]
    if b"".join(got) != word:
        why = (
            f" The pieces join to {b''.join(got)!r}, not the word: each byte belongs to exactly one piece "
            f"(after merging a pair, step past both of its pieces)"
        )
    elif unmade:
        why = (
            f" No merge makes the piece {unmade[0]!r}: start from the word's single bytes (a character may "
            f"take several UTF-8 bytes), then only merges join them"
        )
    else:
        left = [(merges[pair], pair) for pair in zip(got, got[1:]) if pair in merges]
        if left:
            rank, pair = min(left)
            why = (
                f" The pieces {pair[0]!r} and {pair[1]!r} still form a pair with a merge (rank {rank}): "
                f"keep merging until no adjacent pair has one"
            )
        else:
            why = (
                " No pair is left to merge, but different merges were made: always merge the pair with the "
                "lowest rank (learned first) among all adjacent pairs, not the first one found or the highest"
            )
    raise AssertionError(f"{desc} returned {_pieces_text(got)}; expected {_pieces_text(expected)}.{why}")


def _trained_merges(rng: random.Random, alphabet: bytes, count: int) -> dict[tuple[bytes, bytes], int]:
    """A merge table shaped like a trained one: each merge joins two tokens that already exist and
    makes a new one, so a token is only ever built from earlier merges."""
    tokens, merges = [bytes([b]) for b in alphabet], {}
    while len(merges) < count:
        left, right = rng.choice(tokens[-6:] + tokens), rng.choice(tokens[-6:] + tokens)
        if len(left + right) <= 6 and left + right not in tokens:
            merges[(left, right)] = len(merges)
            tokens.append(left + right)
    return merges


def _oracle_bpe(merges: dict[tuple[bytes, bytes], int]):
    """word bytes -> pieces, by Hugging Face tokenizers' BPE built from `merges`."""
    from tokenizers.models import BPE

    from decodelab.lessons.bpe import byte_to_unicode, tokenizers_pieces

    alphabet = byte_to_unicode()

    def text(piece: bytes) -> str:
        return "".join(alphabet[b] for b in piece)

    pairs = sorted(merges, key=merges.get)
    tokens = [bytes([b]) for b in range(256)] + [left + right for left, right in pairs]
    model = BPE(
        vocab={text(t): i for i, t in enumerate(dict.fromkeys(tokens))},
        merges=[(text(left), text(right)) for left, right in pairs],
    )
    return lambda word: tokenizers_pieces(model, word)


def _real_tables():
    """(name, ByteLevelBPE) of the real tokenizers: SmolLM2's and the tiny model's."""
    from decodelab.lessons.bpe import ByteLevelBPE
    from decodelab.model.registry import resolve_model
    from decodelab.model.tokenizer import Tokenizer

    return [
        (name, ByteLevelBPE.from_tokenizer(Tokenizer.from_folder(resolve_model(key))))
        for name, key in (("SmolLM2's tokenizer", "smollm2"), ("the tiny model's tokenizer", "tiny"))
    ]


def check_bpe_encode(fn) -> None:
    """fn(word_bytes: bytes, merges: {(left, right): rank}) -> list[bytes], the BPE tokens of one word."""
    rng = random.Random(0)
    hand = {(b"b", b"c"): 0, (b"a", b"b"): 1, (b"a", b"a"): 2, (b"a", b"bc"): 3, (b"abc", b"d"): 4, (b"aa", b"aa"): 5}
    words = [b"", b"a", b"abc", b"abcd", b"aaa", b"aaaaa", b"aaaaaaa", b"abab", b"dcba", b"xyz", b"abcdabcd"]
    tables = [("a hand-made table " + repr(hand), hand, words)]
    for size in (8, 20, 40):
        merges = _trained_merges(rng, b"abc", size)
        random_words = [bytes(rng.choice(b"abc") for _ in range(rng.randrange(1, 14))) for _ in range(40)]
        tables.append((f"a random trained-like table of {size} merges over b'abc'", merges, random_words))
    for name, merges, table_words in tables:
        oracle = _oracle_bpe(merges)
        for word in table_words:
            desc = f"bpe_encode({word!r}, merges) with {name}"
            _expect_pieces(desc, word, call(desc, fn, word, merges), oracle(word), merges)
    for name, bpe in _real_tables():
        named = f"{name}'s {len(bpe.merges):,} merges"
        for word in [w.encode() for w in BPE_WORDS] + [w for text in BPE_TEXTS for w in bpe.words(text)]:
            desc = f"bpe_encode({word!r}, merges) with {named}"
            _expect_pieces(desc, word, call(desc, fn, word, bpe.merges), bpe.pieces(word), bpe.merges)
        for text in BPE_TEXTS:  # end to end: pre-tokenizer, the learner's BPE, the vocabulary
            expected = bpe.tokenizer.encode(text)
            got = call(f"encoding {text[:40]!r}... word by word with bpe_encode", bpe.encode, text, fn)
            if got != expected:
                raise AssertionError(
                    f"{name} encodes {text!r} as {len(expected)} tokens {expected[:16]}...; "
                    f"word by word with bpe_encode it became {len(got)} tokens {got[:16]}..."
                )


def _describe_config(config) -> str:
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "has_qkv_bias",
    )
    return "ModelConfig(" + ", ".join(f"{f}={getattr(config, f)}" for f in fields) + ")"


def _smollm2_checkpoint():
    """(config, number of parameters stored in the real checkpoint), or None if it is not prepared."""
    from decodelab.config import ModelConfig
    from decodelab.model.registry import SMOLLM2_DIR_NAME
    from decodelab.paths import cache_dir

    folder = cache_dir() / SMOLLM2_DIR_NAME
    if not (folder / "model.safetensors").exists():
        return None
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        total = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return ModelConfig.from_file(folder / "config.json"), total


def _random_configs(seed: int = 0):
    """Small Llama-family configs covering tied/untied, MHA/GQA/MQA, biases, explicit head_dim."""
    from decodelab.config import ModelConfig

    rng = random.Random(seed)
    cases = [
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),  # MHA, tied
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),  # MHA, untied
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),  # GQA
        dict(num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=True),  # MQA
        dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True),  # llama with biases
        dict(num_attention_heads=4, num_key_value_heads=2, model_type="qwen2"),  # qwen2: biases always
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24),  # head_dim != hidden / heads
    ]
    for case in cases:
        heads = case["num_attention_heads"]
        yield ModelConfig(
            vocab_size=rng.randrange(50, 400),
            hidden_size=heads * rng.choice([8, 12, 16]),
            intermediate_size=rng.randrange(20, 120),
            num_hidden_layers=rng.randrange(1, 4),
            **case,
        )


def _expect_count(desc: str, got, expected: int, hint: str = "") -> None:
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        extra = " (use // rather than / so that the count stays an int)" if isinstance(got, float) else ""
        raise AssertionError(f"{desc} returned {type(got).__name__} {got!r}; expected the integer {expected:,}{extra}")
    if int(got) != expected:
        diff = int(got) - expected
        raise AssertionError(
            f"{desc} returned {int(got):,}; the model has {expected:,} parameters "
            f"({'+' if diff > 0 else '-'}{abs(diff):,}){hint}"
        )


def check_count_parameters(fn) -> None:
    """fn(config: ModelConfig) -> int, the number of distinct parameters of the Llama-family model."""
    from decodelab.config import ModelConfig
    from decodelab.model.llama import LlamaForCausalLM

    real = _smollm2_checkpoint()
    if real is not None:
        config, total = real
        _expect_count(
            f"count_parameters on SmolLM2-135M-Instruct's config.json {_describe_config(config)}",
            call("count_parameters(SmolLM2's config)", fn, config),
            total,
            "; the real checkpoint stores these tensors (its lm_head is tied to the embeddings)",
        )
    for name, (fields, total) in PUBLISHED.items():
        config = ModelConfig(**fields)
        _expect_count(
            f"count_parameters on {name}'s config {_describe_config(config)}",
            call(f"count_parameters({name})", fn, config),
            total,
            f"; transformers reports {total:,} for {name}",
        )
    for config in _random_configs():
        expected = LlamaForCausalLM(config).num_parameters()
        hints = []
        if config.tie_word_embeddings:
            hints.append("the lm_head is tied to the embeddings: count that matrix once")
        if config.num_key_value_heads != config.num_attention_heads:
            hints.append(
                f"k_proj and v_proj have {config.num_key_value_heads} KV heads, not {config.num_attention_heads}"
            )
        if config.has_qkv_bias:
            hints.append("q_proj, k_proj and v_proj have biases")
        if config.head_dim * config.num_attention_heads != config.hidden_size:
            hints.append(
                f"head_dim x heads = {config.head_dim * config.num_attention_heads} "
                f"differs from hidden_size {config.hidden_size}"
            )
        _expect_count(
            f"count_parameters on {_describe_config(config)}",
            call(f"count_parameters({_describe_config(config)})", fn, config),
            expected,
            " (LlamaForCausalLM(config).num_parameters())" + (f"; note: {'; '.join(hints)}" if hints else ""),
        )


def check_decode_tokens_per_second_bound(fn) -> None:
    """fn(num_params, bytes_per_param, bandwidth_bytes_per_s) -> tokens/s = bandwidth / (params x bytes)."""
    cases = [
        (70e9, 2, 3.35e12, 23.9285714, "70B fp16 on 3.35 TB/s (an H100): 140 GB per token, ~42 ms, ~24 tokens/s"),
        (70e9, 2, 2e12, 14.2857143, "70B fp16 on 2 TB/s: 0.07 s per token, ~14 tokens/s"),
        (70e9, 0.5, 3.35e12, 95.7142857, "int4 weights (half a byte each) read 4x fewer bytes than fp16"),
        (134_515_008, 4, 20e9, 37.1705, "SmolLM2-135M in fp32 on 20 GB/s"),
        (8_030_261_248, 1, 1e12, 124.5290, "Llama-3.1-8B in int8 on 1 TB/s"),
        (1, 1, 1, 1.0, "one parameter of one byte at one byte per second"),
    ]
    for num_params, bytes_per_param, bandwidth, expected, note in cases:
        desc = f"decode_tokens_per_second_bound({num_params:g}, {bytes_per_param:g}, {bandwidth:g})"
        got = call(desc, fn, num_params, bytes_per_param, bandwidth)
        try:
            value = float(got)
        except (TypeError, ValueError):
            raise AssertionError(
                f"{desc} returned {type(got).__name__} {got!r}; expected a number (tokens per second)"
            ) from None
        if not math.isclose(value, expected, rel_tol=1e-4):
            ratio = value / expected if expected else float("nan")
            why = ""
            if math.isclose(value, 1 / expected, rel_tol=1e-4):
                why = " (that is seconds per token; the bound asks for tokens per second)"
            elif math.isclose(ratio, 1 / 8, rel_tol=1e-3) or math.isclose(ratio, 8, rel_tol=1e-3):
                why = " (off by 8: bytes, not bits)"
            raise AssertionError(
                f"{desc} returned {value:.6g}; expected {expected:.6g} tokens/s = bandwidth / "
                f"(num_params x bytes_per_param){why}. Case: {note}"
            )
    for args, bad in (
        ((0, 2, 1e12), "num_params"),
        ((-5e9, 2, 1e12), "num_params"),
        ((7e9, 0, 1e12), "bytes_per_param"),
        ((7e9, -2, 1e12), "bytes_per_param"),
        ((7e9, 2, 0), "bandwidth_bytes_per_s"),
        ((7e9, 2, -1e12), "bandwidth_bytes_per_s"),
    ):
        expect_raises(f"decode_tokens_per_second_bound{args}", ValueError, f"{bad} must be > 0", fn, *args)


def answer_q_embedding_share_percent() -> float:
    """Percent of SmolLM2-135M's parameters in its (tied) token embedding table."""
    from decodelab.lessons import kv_size

    fields = kv_size.config_fields("SmolLM2-135M")
    return 100 * fields["vocab_size"] * fields["hidden_size"] / kv_size.parameter_count(fields)


def check_q_embedding_share_percent(value) -> None:
    """Graded q_embedding_share_percent (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_embedding_share_percent",
        value,
        answer_q_embedding_share_percent(),
        "SmolLM2-135M's embedding table (49,152 x 576, stored once) as a percentage of its 134,515,008 parameters",
    )


def answer_q_llama8b_tokens_per_s() -> float:
    """The batch-1 decode bound of Llama-3.1-8B in bf16 on 3.35 TB/s, in tokens per second."""
    from decodelab.lessons import kv_size, measure

    return measure.decode_tokens_per_second_bound(kv_size.parameter_count("Llama-3.1-8B"), 2, 3.35e12)


def check_q_llama8b_tokens_per_s(value) -> None:
    """Graded q_llama8b_tokens_per_s (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_llama8b_tokens_per_s",
        value,
        answer_q_llama8b_tokens_per_s(),
        "3.35e12 bytes/s over (8,030,261,248 parameters x 2 bytes) for Llama-3.1-8B in bf16 on an H100",
    )

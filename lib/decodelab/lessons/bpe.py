"""Byte-level BPE written out in Python: how a GPT-2-style tokenizer turns one word into tokens.

The library's `Tokenizer` runs the same BPE in Hugging Face's Rust `tokenizers`; this module reads
that tokenizer's own tables (its merge ranks and vocabulary, its pre-tokenizer) so that the
Python version below can be set beside it token for token (notebook 00).

The algorithm, for one pre-tokenized word (its UTF-8 bytes):
1. start from single bytes;
2. among the adjacent pairs, find the one whose merge was learned earliest (lowest rank);
3. join every occurrence of that pair, left to right;
4. repeat until no adjacent pair has a merge.

`tokenizer.json` writes bytes in GPT-2's printable alphabet (`byte_to_unicode`: a space is "Ġ");
the tables here are in plain bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from decodelab.model.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte 0..255 to a printable character (used by tokenizer.json).

    Printable Latin-1 bytes map to themselves; the other 68 (control characters, the space, ...)
    take the characters from U+0100 on, in byte order: a space (32) is "Ġ" (U+0120).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def unicode_to_bytes(text: str) -> bytes:
    """The bytes a token string of tokenizer.json stands for (the inverse of `byte_to_unicode`)."""
    inverse = {c: b for b, c in byte_to_unicode().items()}
    try:
        return bytes(inverse[c] for c in text)
    except KeyError as exc:
        raise ValueError(f"{text!r} is not written in the byte-level alphabet (character {exc.args[0]!r})") from None


def tokenizers_pieces(model, word_bytes: bytes) -> list[bytes]:
    """The pieces a Hugging Face `tokenizers` BPE model (Rust) makes of one pre-tokenized word.

    The model reads and writes the byte-level alphabet, as tokenizer.json does; this converts both ways.
    """
    alphabet = byte_to_unicode()
    return [unicode_to_bytes(token.value) for token in model.tokenize("".join(alphabet[b] for b in word_bytes))]


def bpe_merge_steps(word_bytes: bytes, merges: dict[tuple[bytes, bytes], int]) -> list[list[bytes]]:
    """The pieces of `word_bytes` before and after each merge: [single bytes, ..., final tokens].

    merges: (left piece, right piece) -> rank; the lowest rank is merged first, every occurrence
    of it left to right, until no adjacent pair has a rank.
    """
    if not isinstance(word_bytes, (bytes, bytearray)):
        raise TypeError(f"word_bytes must be bytes, got {type(word_bytes).__name__}")
    pieces = [bytes([b]) for b in word_bytes]
    steps = [pieces]
    while len(pieces) > 1:
        ranked = [(merges[pair], pair) for pair in zip(pieces, pieces[1:]) if pair in merges]
        if not ranked:
            break
        best = min(ranked)[1]
        merged, i = [], 0
        while i < len(pieces):
            if i + 1 < len(pieces) and (pieces[i], pieces[i + 1]) == best:
                merged.append(pieces[i] + pieces[i + 1])
                i += 2
            else:
                merged.append(pieces[i])
                i += 1
        pieces = merged
        steps.append(pieces)
    return steps


def bpe_encode(word_bytes: bytes, merges: dict[tuple[bytes, bytes], int]) -> list[bytes]:
    """The tokens (as bytes) BPE makes of one pre-tokenized word: the last of `bpe_merge_steps`."""
    return bpe_merge_steps(word_bytes, merges)[-1]


@dataclass(frozen=True)
class ByteLevelBPE:
    """A byte-level BPE tokenizer's tables in plain bytes, read from a library `Tokenizer`.

    merges: (left, right) -> rank (its line in tokenizer.json's merge list, 0 first);
    vocab: token bytes -> token id.
    """

    tokenizer: Tokenizer
    merges: dict[tuple[bytes, bytes], int]
    vocab: dict[bytes, int]

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> "ByteLevelBPE":
        model = json.loads(tokenizer.backend.to_str())["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"the tokenizer's model is {model.get('type')!r}, not a BPE")
        merges = {}
        for rank, merge in enumerate(model["merges"]):
            left, right = merge.split(" ") if isinstance(merge, str) else merge  # older files: "a b"
            merges[(unicode_to_bytes(left), unicode_to_bytes(right))] = rank
        vocab = {unicode_to_bytes(token): i for token, i in model["vocab"].items()}
        return cls(tokenizer, merges, vocab)

    def words(self, text: str) -> list[bytes]:
        """The pre-tokenizer's pieces of `text` (a space joins the word after it; SmolLM2 also splits
        digits one by one), as bytes; BPE never merges across two of them."""
        pieces = self.tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)
        return [unicode_to_bytes(piece) for piece, _ in pieces]

    def pieces(self, word_bytes: bytes) -> list[bytes]:
        """The pieces the library tokenizer's own (Rust) BPE makes of one pre-tokenized word."""
        return tokenizers_pieces(self.tokenizer.backend.model, word_bytes)

    def encode(self, text: str, encode_word=bpe_encode) -> list[int]:
        """Token ids of plain `text` (no special tokens): pre-tokenize, `encode_word` each word with
        this table's merges, look each token up in the vocabulary."""
        ids = []
        for word in self.words(text):
            for token in encode_word(word, self.merges):
                if token not in self.vocab:
                    raise ValueError(f"the word {word!r} became the piece {token!r}, which is not in the vocabulary")
                ids.append(self.vocab[token])
        return ids

"""Streaming detokenization, measured (notebook 04): what a detokenizer costs and the second
kind of tokenizer it must handle.

The detokenizer itself is the library's `decodelab.model.tokenizer.StreamDecoder`, which the
engine streams with. This module holds what the lesson needs around it:
* `CountingTokenizer` wraps a tokenizer and records how many ids each `decode` call was given,
  so the work of a push is counted, not timed;
* `sentencepiece_style_tokenizer` builds a small tokenizer with Llama 2's normalizer and decoder
  (spaces written as "▁", bytes as <0xNN> tokens, the leading space of a decoded sequence
  dropped): a token decoded alone there reads differently than in context, which SmolLM2's
  byte-level BPE never shows.
"""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

from decodelab.model.tokenizer import Tokenizer

# The whole words of the SentencePiece-style vocabulary; anything else is spelled with letters,
# digits and punctuation, and the rest of Unicode with byte tokens <0x00> ... <0xFF>.
WORDS = (
    "▁the",
    "▁Hello",
    "▁world",
    "▁is",
    "▁round",
    "▁and",
    "▁say",
    "▁hi",
    "▁in",
    "▁Japanese",
    "▁to",
    "▁a",
    "▁of",
    "▁you",
    "▁good",
    "▁morning",
    "▁stream",
    "▁text",
    "▁token",
    "▁one",
    "▁at",
    "▁time",
    "▁",
)
SPECIAL = ("<unk>", "<s>", "</s>")


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A small Unigram tokenizer with Llama 2's normalizer and decoder, as `tokenizers` runs them.

    Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS, special), then 256 byte tokens, then WORDS, then single
    characters. Decoding replaces "▁" by a space, turns byte tokens into UTF-8 (U+FFFD where a
    character is unfinished) and strips one leading space, so `decode([id of "▁world"])` is
    "world" while the same id after "▁Hello" reads " world".
    """
    characters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"()-"
    vocab = (
        [(token, 0.0) for token in SPECIAL]
        + [(f"<0x{b:02X}>", -20.0) for b in range(256)]
        + [(word, -5.0) for word in WORDS]
        + [(c, -10.0) for c in characters]
    )
    backend = BackendTokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(list(SPECIAL))
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


class CountingTokenizer:
    """A tokenizer that records the number of ids of every `decode` call, and offers nothing else.

    `decoded` is the list of those lengths; `mark()` and `since(mark)` give the ids decoded in
    between, the work of one push. Any other attribute is an AttributeError that says so, so a
    detokenizer cannot reach the tokenizer around the count.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        self.decoded.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens)

    def mark(self) -> int:
        return len(self.decoded)

    def since(self, mark: int) -> int:
        """Ids decoded by the calls after `mark`."""
        return sum(self.decoded[mark:])

    def __getattr__(self, name: str):
        raise AttributeError(f"this counting tokenizer offers only decode(ids, skip_special_tokens), not {name!r}")


__all__ = ["CountingTokenizer", "sentencepiece_style_tokenizer", "WORDS"]

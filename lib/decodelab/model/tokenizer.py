"""Text <-> token ids with a Hugging Face `tokenizers` BPE, plus the model's chat template.

A model folder holds ``tokenizer.json`` (the BPE itself) and ``tokenizer_config.json``
(special tokens, whether a BOS is prepended, the Jinja chat template), as in HF layout.
"""

from __future__ import annotations

import json
import operator
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer


class TokenizerError(ValueError):
    """A tokenizer.json or tokenizer_config.json that cannot be read."""


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, config: dict | None = None):
        self.backend = backend
        self.config = config or {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self.bos_token_id = self._id_of(self.config.get("bos_token"))
        self.eos_token_id = self._id_of(self.config.get("eos_token"))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """The tokenizer of an HF-layout folder. Raises FileNotFoundError without tokenizer.json,
        TokenizerError naming the file when tokenizer.json or tokenizer_config.json is corrupt."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        config_path = folder / "tokenizer_config.json"
        config = _read_json_object(config_path) if config_path.exists() else {}
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a bad file
            raise TokenizerError(f"{path} is not a readable tokenizer file ({exc})") from None
        return cls(backend, config)

    def _id_of(self, token) -> int | None:
        if isinstance(token, dict):  # HF sometimes stores an AddedToken as a dict
            token = token.get("content")
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_end|>) stay whole."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids) -> list[str]:
        """How each id reads on its own, for tables of top candidates."""
        return [self.backend.decode([int(i)]) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation [{"role": ..., "content": ...}] with the model's Jinja template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        special = {k: self.config.get(k) for k in ("bos_token", "eos_token")}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)

    def stop_token_ids(self) -> list[int]:
        return [] if self.eos_token_id is None else [self.eos_token_id]


def _read_json_object(path: Path) -> dict:
    """A JSON file that holds one object -> that dict; TokenizerError naming the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise TokenizerError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got a {type(value).__name__}")
    return value


class StreamDecoder:
    """Text for ids that arrive one at a time, in pieces that are final: a streaming detokenizer.

    push(token_id) adds one id and returns the text it completes; flush() ends the stream and
    returns what is still held back. Joined, the pieces are tokenizer.decode(all the ids,
    skip_special_tokens), however the ids split the text. Three problems, and the standard answer
    (vLLM's detokenizer):
    * a byte-level BPE may spread one character over several tokens (a Japanese character, many
      emoji): until its last byte arrives the decoded text ends in U+FFFD, so such a tail is held
      back until the character is complete;
    * a token decoded alone may read differently than in context (a SentencePiece decoder drops
      the leading space of the first token it decodes), so each new piece is decoded after a few ids
      of context and the context's own text is cut off its front;
    * decoding all the ids again for every token costs O(n) per token, O(n^2) in all; so only a
      window is decoded: the context ids[prefix_offset:read_offset], whose text was already
      returned, and the window ids[prefix_offset:]. Once a piece is returned the window moves up
      (prefix_offset takes read_offset, read_offset the number of ids), so a push decodes a few
      ids however long the text is.
    Uses the tokenizer only through tokenizer.decode(ids, skip_special_tokens).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: the context, its text already returned
        self.read_offset = 0  # the text of every id before it has been returned

    def _decode_window(self) -> tuple[str, str]:
        """(the text of the context ids, the text of the context and every id after it)."""
        context = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        window = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        return context, window

    def push(self, token_id: int) -> str:
        """Add one id; return the text that is now final ("" while a character is unfinished).
        Raises TypeError if token_id is not an integer, ValueError if it is negative."""
        token_id = operator.index(token_id)  # an int, a NumPy integer or a 0-d integer tensor
        if token_id < 0:
            raise ValueError(f"token ids are >= 0, got {token_id}")
        self.ids.append(token_id)
        context, window = self._decode_window()
        if window.endswith("\ufffd") or len(window) <= len(context):
            return ""  # an unfinished character, or no text yet (a skipped special token): wait
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(context) :]

    def flush(self) -> str:
        """End of the stream: the text held back (an unfinished last character reads U+FFFD)."""
        context, window = self._decode_window()
        self.prefix_offset = self.read_offset = len(self.ids)
        return window[len(context) :]

"""Text <-> token ids with a Hugging Face `tokenizers` BPE, plus the model's chat template.

A model folder holds ``tokenizer.json`` (the BPE itself) and ``tokenizer_config.json``
(special tokens, whether a BOS is prepended, the Jinja chat template), as in HF layout.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer


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
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(BackendTokenizer.from_file(str(path)), config)

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


class StreamDecoder:
    """Turns ids arriving one at a time into text pieces, never splitting a UTF-8 character.

    A byte-level BPE may spread one character over several tokens; until it is complete the
    decoded text ends with U+FFFD, so such a tail is held back until the next token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already returned

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        piece, self.emitted = text[self.emitted:], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        piece, self.emitted = text[self.emitted:], len(text)
        return piece

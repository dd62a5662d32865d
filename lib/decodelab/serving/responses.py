"""The OpenAI API's response side: whole responses, streamed chunks and server-sent events.

Both endpoints answer with the same parts in two shapes:

    /v1/completions       {"object": "text_completion", "choices": [{"index", "text", "logprobs", "finish_reason"}]}
    /v1/chat/completions  {"object": "chat.completion",
                           "choices": [{"index", "message": {"role", "content"}, "logprobs", "finish_reason"}]}

and, streamed, one `data: {chunk}` event per piece of text ("text_completion" chunks, or
"chat.completion.chunk" ones whose first delta of each choice carries the role), a last event
with the usage when the client asked (stream_options.include_usage), then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """completion_tokens counts every choice's tokens (OpenAI's rule for n > 1)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def server_sent_event(data: dict | str) -> str:
    """One event: `data: <json>` and a blank line (`data: [DONE]` for the end)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class ResponseShape:
    """How one endpoint shapes its answers. `chat` picks the chat form; id and created are shared
    by the response and every chunk of it."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    # ------------------------------------------------------------------ a whole response
    def response(self, texts: list[str], finish_reasons: list[str], prompt_tokens: int, completion_tokens: int) -> dict:
        """The answer to a call without stream: choice i holds texts[i]."""
        if self.chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, (text, reason) in enumerate(zip(texts, finish_reasons))
            ]
        else:
            choices = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                for i, (text, reason) in enumerate(zip(texts, finish_reasons))
            ]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    # ------------------------------------------------------------------ streamed chunks
    def chunk(self, index: int, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed piece of choice `index`; the chat form's first one also names the role."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope(
            "text_completion", [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        )

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

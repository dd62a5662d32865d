"""The OpenAI API's request side: a JSON body in, the engine's prompts and `SamplingParams` out.

    POST /v1/completions       {"model", "prompt": str | [str] | [int] | [[int]], ...}
    POST /v1/chat/completions  {"model", "messages": [{"role", "content"}], ...}

OpenAI's parameters and what they become (`SAMPLING_FIELDS`):
    max_tokens, max_completion_tokens -> max_tokens   (completions default 16, chat: up to the context)
    temperature, top_p, n, seed, stop -> the same SamplingParams fields, judged by SamplingParams
    top_k, repetition_penalty, stop_token_ids, ignore_eos -> the same (vLLM's extra fields)
Refused with a 400 that says why (`UNSUPPORTED`): presence_penalty and frequency_penalty other than
0 (OpenAI's penalties subtract from a token's logit by how often it appeared in the output so far;
CTRL's repetition_penalty, which the engine has, divides the logit of every token seen in the prompt
or the output: a different rule, so one is never passed off as the other), log-probabilities,
echo, suffix, best_of, logit_bias, tools. An unknown parameter is refused too, by name.

Every problem is an `ApiError`: its status and OpenAI's error body,
    {"error": {"message", "type": "invalid_request_error", "param", "code"}}
with SamplingParams' own message for a value out of its range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from decodelab.decoding.generate import check_prompt, encode_prompt
from decodelab.params import SamplingParams
from decodelab.validation import is_int

# OpenAI's name -> SamplingParams field
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "seed": "seed",
    "stop": "stop",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}
# parameter -> (the values that ask for nothing, why any other is refused)
UNSUPPORTED = {
    "presence_penalty": (
        (0,),
        "OpenAI's presence penalty (subtract from the logit of every token already in "
        "the output) is not the engine's repetition_penalty (CTRL's, over prompt and "
        "output), and the engine has no other; use repetition_penalty",
    ),
    "frequency_penalty": (
        (0,),
        "OpenAI's frequency penalty (subtract from a token's logit by its count in the "
        "output) is not the engine's repetition_penalty (CTRL's, over prompt and "
        "output), and the engine has no other; use repetition_penalty",
    ),
    "logprobs": ((None, False, 0), "the engine does not return log-probabilities"),
    "top_logprobs": ((None, 0), "the engine does not return log-probabilities"),
    "echo": ((None, False), "the engine does not echo the prompt"),
    "suffix": ((None, ""), "the engine does not insert text before a suffix"),
    "best_of": ((None,), "ranking samples needs their log-probabilities; use n"),
    "logit_bias": ((None, {}), "the engine has no logit bias"),
    "tools": ((None, []), "the engine does not call tools"),
    "tool_choice": ((None, "none"), "the engine does not call tools"),
    "functions": ((None, []), "the engine does not call functions"),
    "function_call": ((None, "none"), "the engine does not call functions"),
    "response_format": ((None, {"type": "text"}), "the engine writes plain text only"),
}
IGNORED = {"user"}  # the caller's end-user id: metadata, no effect on the text
COMMON_FIELDS = {"model", "stream", "stream_options", *SAMPLING_FIELDS, *UNSUPPORTED, *IGNORED}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default (vLLM's too)


class ApiError(Exception):
    """A request the server answers with an error: HTTP `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass
class ServedModel:
    """What the front end needs of the engine's model: its name in the API, its tokenizer and limits.

    context_length: the longest sequence (prompt + output) the engine holds (`LLM.max_seq_len`)."""

    name: str
    tokenizer: object
    context_length: int
    vocab_size: int

    @classmethod
    def of(cls, llm, name: str) -> "ServedModel":
        return cls(name, llm.tokenizer, llm.max_seq_len, llm.config.vocab_size)


@dataclass
class GenerationRequest:
    """One API call, ready for the engine: its prompts as token ids (a completions call may send
    several; choice i * n + j is sample j of prompt i), one SamplingParams for all, how to answer."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)


# --------------------------------------------------------------------------- the body


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object, else a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def completion_request(body: dict, model: ServedModel) -> GenerationRequest:
    """POST /v1/completions: the prompt(s) tokenized as they are (no chat template)."""
    check_fields(body, {"prompt"})
    prompts = prompt_token_ids(body.get("prompt"), model.tokenizer)
    prompts = [
        checked_ids(ids, model, "prompt" if len(prompts) == 1 else f"prompt {i}") for i, ids in enumerate(prompts)
    ]
    return finished_request(body, model, prompts, default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)


def chat_request(body: dict, model: ServedModel) -> GenerationRequest:
    """POST /v1/chat/completions: the conversation rendered by the model's chat template (the
    engine's own `encode_prompt`, as `LLM.chat` does), then tokenized."""
    check_fields(body, {"messages"})
    messages = plain_messages(body.get("messages"))
    if not getattr(model.tokenizer, "chat_template", None):
        raise invalid(
            f"the model {model.name} has no chat template: use /v1/completions, or start the server "
            f"with --chat-template FILE",
            "messages",
        )
    try:
        ids = encode_prompt(model.tokenizer, messages, chat=True)
    except ValueError as exc:  # the template's own raise_exception, or a message it cannot render
        raise invalid(f"messages: {exc}", "messages") from None
    ids = checked_ids(ids, model, "messages")
    return finished_request(body, model, [ids], default_max_tokens=model.context_length - len(ids))


def check_fields(body: dict, own: set[str]) -> None:
    """Refuse a parameter this endpoint does not know, or an unsupported one set to something."""
    for name, value in body.items():
        if name not in COMMON_FIELDS | own:
            raise invalid(f"unknown parameter {name!r}", name)
        if name in UNSUPPORTED:
            neutral, why = UNSUPPORTED[name]
            if value not in neutral:
                raise invalid(f"{name}={value!r} is not supported: {why}", name)


def finished_request(
    body: dict, model: ServedModel, prompts: list[list[int]], default_max_tokens: int
) -> GenerationRequest:
    """The rest of a request, for either endpoint: its model, sampling and streaming."""
    check_model(body.get("model"), model)
    params = sampling_params(body, default_max_tokens)
    for i, ids in enumerate(prompts):
        if len(ids) + params.max_tokens > model.context_length:
            where = "in the messages" if "messages" in body else "in the prompt" + (f" {i}" if len(prompts) > 1 else "")
            raise invalid(
                f"the model's context is {model.context_length} tokens, but {len(ids) + params.max_tokens} "
                f"were asked for ({len(ids)} {where}, {params.max_tokens} for the completion): shorten "
                f"the prompt or lower max_tokens",
                "max_tokens",
            )
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid(f"stream must be true or false, got {stream!r}", "stream")
    return GenerationRequest(prompts, params, stream, include_usage(body.get("stream_options"), stream))


def check_model(name, model: ServedModel) -> None:
    if name is not None and name != model.name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist: this server serves {model.name!r}",
            "model",
            code="model_not_found",
        )


def include_usage(options, stream: bool) -> bool:
    """stream_options: {"include_usage": bool}, only with stream=true (as OpenAI has it)."""
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid(f"stream_options must be an object with include_usage, got {options!r}", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid(f"stream_options.include_usage must be true or false, got {usage!r}", "stream_options")
    return usage


# --------------------------------------------------------------------------- sampling


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from OpenAI's fields (`SAMPLING_FIELDS`); a null field takes its default.
    Each value is judged alone by SamplingParams itself, so its message names the parameter as sent."""
    given = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if (
        "max_tokens" in given
        and "max_completion_tokens" in given
        and given["max_tokens"] != given["max_completion_tokens"]
    ):
        raise invalid(
            f"max_tokens ({given['max_tokens']!r}) and max_completion_tokens "
            f"({given['max_completion_tokens']!r}) disagree: send one",
            "max_completion_tokens",
        )
    fields = {"max_tokens": default_max_tokens}
    for name, value in given.items():
        field = SAMPLING_FIELDS[name]
        try:
            SamplingParams(**{field: value})
        except (ValueError, TypeError) as exc:
            message = str(exc)
            raise invalid(
                name + message[len(field) :] if message.startswith(field) else f"{name}: {message}", name
            ) from None
        fields[field] = value
    return SamplingParams(**fields)


# --------------------------------------------------------------------------- prompts


def prompt_token_ids(prompt, tokenizer) -> list[list[int]]:
    """A completions prompt in any of OpenAI's forms -> one list of token ids per prompt:
    a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise invalid(
        f"prompt must be a string, a list of strings, a list of token ids or a list of lists of "
        f"token ids, got {shorten(prompt)}",
        "prompt",
    )


def checked_ids(ids: list[int], model: ServedModel, what: str) -> list[int]:
    """ids, if the engine can run them (not empty, fits the context, inside the vocabulary)."""
    try:
        check_prompt(ids, model.context_length, model.vocab_size)
    except ValueError as exc:
        raise invalid(f"{what}: {exc}", what.split()[0]) from None
    return ids


def plain_messages(messages) -> list[dict]:
    """OpenAI's messages -> [{"role", "content"}] with text content, as the chat template reads them.
    A content given as parts keeps only text parts ({"type": "text", "text": ...}), joined."""
    if not isinstance(messages, list) or not messages:
        raise invalid(
            f"messages must be a non-empty list of {{'role', 'content'}} objects, got {shorten(messages)}", "messages"
        )
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string role, got {shorten(message)}", "messages")
        plain.append({"role": message["role"], "content": text_content(message.get("content"), i)})
    return plain


def text_content(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(
        f"messages[{index}].content must be a string or a list of text parts "
        f"({{'type': 'text', 'text': ...}}), got {shorten(content)}",
        "messages",
    )


def shorten(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""The server's pieces without a server: OpenAI's request fields mapped to SamplingParams and prompts
(`serving.protocol`), and the Prometheus histogram (`serving.metrics`). The tiny model's tokenizer;
no model, no HTTP."""

from __future__ import annotations

import pytest

from decodelab.model.tokenizer import Tokenizer
from decodelab.params import SamplingParams
from decodelab.paths import PACKAGE_DATA
from decodelab.serving.metrics import Histogram
from decodelab.serving.protocol import ApiError, ServedModel, chat_request, completion_request, parse_json_object

CONTEXT = 64
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_folder(PACKAGE_DATA / "tiny")


@pytest.fixture
def model(tokenizer):
    tokenizer.chat_template = TEMPLATE
    yield ServedModel("tiny", tokenizer, CONTEXT, tokenizer.vocab_size)
    tokenizer.chat_template = None


def refused(parse, body, model) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, model)
    return caught.value


def test_openais_fields_become_sampling_params(model):
    job = completion_request(
        {
            "model": "tiny",
            "prompt": "x = 1",
            "max_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "n": 2,
            "seed": 3,
            "stop": "\n",
            "top_k": 7,
            "repetition_penalty": 1.2,
            "stop_token_ids": [4],
            "ignore_eos": True,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logprobs": None,
            "echo": False,
            "user": "ada",
        },
        model,
    )
    assert job.params == SamplingParams(
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        n=2,
        seed=3,
        stop=["\n"],
        top_k=7,
        repetition_penalty=1.2,
        stop_token_ids=[4],
        ignore_eos=True,
    )
    assert job.prompts == [model.tokenizer.encode("x = 1")] and job.num_choices == 2 and not job.stream


def test_defaults_nulls_and_max_completion_tokens(model):
    job = completion_request({"prompt": "x", "temperature": None, "max_tokens": None}, model)
    assert job.params == SamplingParams(max_tokens=16)  # OpenAI's (and vLLM's) completions default
    chat = chat_request({"messages": [{"role": "user", "content": "hi"}]}, model)
    assert chat.params.max_tokens == CONTEXT - len(chat.prompts[0])  # chat: up to the context
    assert (
        chat_request(
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}, model
        ).params.max_tokens
        == 3
    )
    error = refused(
        chat_request,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 4},
        model,
    )
    assert error.param == "max_completion_tokens" and "disagree" in error.message


def test_prompt_forms(model, tokenizer):
    ids = tokenizer.encode("def f():")
    assert completion_request({"prompt": ids}, model).prompts == [ids]
    assert completion_request({"prompt": [ids, ids[:2]]}, model).prompts == [ids, ids[:2]]
    assert completion_request({"prompt": ["a", "b"]}, model).prompts == [tokenizer.encode("a"), tokenizer.encode("b")]
    for bad in ([True, 2], [[1], "a"], 7, None):
        assert refused(completion_request, {"prompt": bad}, model).param == "prompt"
    error = refused(completion_request, {"prompt": ["a", [model.vocab_size]]}, model)
    assert error.message.startswith("prompt must be")  # mixed forms
    error = refused(completion_request, {"prompt": [[1, 2], [model.vocab_size + 5]]}, model)
    assert error.message.startswith("prompt 1: prompt holds token ids outside the vocabulary")


def test_the_chat_template_renders_the_conversation(model, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    job = chat_request({"messages": messages}, model)
    assert job.prompts == [tokenizer.encode("system: Be brief.\nuser: Hello there\nassistant:")]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert (
        "messages[0].content must be a string or a list of text parts"
        in refused(chat_request, {"messages": image}, model).message
    )


def test_a_model_without_a_chat_template_says_what_to_do(model):
    model.tokenizer.chat_template = None
    error = refused(chat_request, {"messages": [{"role": "user", "content": "hi"}]}, model)
    assert (
        error.status == 400
        and "has no chat template: use /v1/completions, or start the server with --chat-template FILE" in error.message
    )


def test_a_template_that_raises_is_a_400(model):
    model.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    error = refused(chat_request, {"messages": [{"role": "user", "content": "hi"}]}, model)
    assert (error.status, error.param, error.message) == (400, "messages", "messages: roles must alternate")


@pytest.mark.parametrize(
    "body, param, phrase",
    [
        ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format", "plain text only"),
        ({"prompt": "x", "best_of": 2}, "best_of", "use n"),
        ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias", "no logit bias"),
        ({"prompt": "x", "echo": True}, "echo", "does not echo"),
        ({"prompt": "x", "stream": "yes"}, "stream", "stream must be true or false, got 'yes'"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options", "true or false"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", "unknown parameter 'messages'"),
        ({"prompt": "x", "temperature": True}, "temperature", "got True"),
        ({"prompt": "x", "n": 2.5}, "n", "n must be an integer >= 1, got 2.5"),
    ],
)
def test_refusals_name_the_parameter(model, body, param, phrase):
    error = refused(completion_request, body, model)
    assert (error.status, error.param) == (400, param) and phrase in error.message
    assert error.body() == {
        "error": {"message": error.message, "type": "invalid_request_error", "param": param, "code": None}
    }


def test_a_body_must_be_a_json_object():
    assert parse_json_object(b'{"a": 1}') == {"a": 1}
    for raw, phrase in [(b"", "not valid JSON"), (b"\xff", "not valid JSON"), (b"null", "got NoneType")]:
        with pytest.raises(ApiError, match=phrase):
            parse_json_object(raw)


def test_histogram_buckets_are_cumulative():
    histogram = Histogram("h", "a histogram", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    assert histogram.lines()[2:] == [
        'h_bucket{le="0.1"} 2',
        'h_bucket{le="1"} 3',
        'h_bucket{le="+Inf"} 4',
        "h_sum 3.65",
        "h_count 4",
    ]

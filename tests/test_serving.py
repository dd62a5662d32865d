"""The OpenAI-compatible server (`decodelab.serving`) as the official `openai` client sees it: one
server on the tiny model for the module, every answer set beside what a second engine on the same
weights gives through `LLM.generate` / `LLM.chat` (the oracle), token for token."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servers import TINY_CHAT_TEMPLATE, get, metric, served, wait_for  # noqa: E402

from decodelab import SamplingParams  # noqa: E402
from decodelab.serving.app import build_app  # noqa: E402
from decodelab.serving.server import ServeSettings, load_engine  # noqa: E402

PROMPT = "def fibonacci(n):\n    "
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
TINY = ServeSettings(model="tiny", chat_template=TINY_CHAT_TEMPLATE, engine=dict(device="cpu"))


@pytest.fixture(scope="module")
def server():
    llm = load_engine(TINY)
    app = build_app(llm, "tiny", max_queue=128)
    with served(app) as url:
        yield SimpleNamespace(url=url, app=app, llm=llm)


@pytest.fixture(scope="module")
def reference():
    """A second engine on the tiny model (its own copy: the server's runs on the server's thread)."""
    return load_engine(TINY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@dataclass
class Answer:
    texts: list[str]  # by choice index
    finish_reasons: list[str]
    usage: object


def ask(client, endpoint: str, stream: bool, **kwargs) -> Answer:
    """One call to /v1/completions or /v1/chat/completions, whole or streamed (then put together)."""
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    if not stream:
        response = create(model="tiny", **kwargs)
        choices = sorted(response.choices, key=lambda c: c.index)
        texts = [c.text if endpoint == "completions" else c.message.content for c in choices]
        return Answer(texts, [c.finish_reason for c in choices], response.usage)
    texts, reasons, roles, usage = {}, {}, {}, None
    for chunk in create(model="tiny", stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if endpoint == "completions":
                piece = choice.text
            else:
                piece = choice.delta.content or ""
                if choice.delta.role:
                    roles[choice.index] = roles.get(choice.index, "") + choice.delta.role
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                assert choice.index not in reasons, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    if endpoint == "chat":
        assert roles == {i: "assistant" for i in texts}, "each chat choice names its role once, first"
    assert sorted(texts) == sorted(reasons) == list(range(len(texts)))
    return Answer([texts[i] for i in range(len(texts))], [reasons[i] for i in range(len(texts))], usage)


def expect_answer(answer: Answer, expected) -> None:
    """The server's answer is the engine's RequestOutput: texts, finish reasons, token counts."""
    assert answer.texts == [sample.text for sample in expected.outputs]
    assert answer.finish_reasons == [sample.finish_reason for sample in expected.outputs]
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert answer.usage.completion_tokens == sum(len(sample.token_ids) for sample in expected.outputs)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def finished_total(url: str, reason: str) -> float:
    _, _, text = get(f"{url}/metrics")
    return float(re.search(rf'^decodelab_request_finished_total{{finish_reason="{reason}"}} (\S+)$', text, re.M)[1])


def wait_until_idle(url: str) -> None:
    wait_for(
        lambda: metric(url, "decodelab_kv_blocks_used") == 0 and metric(url, "decodelab_num_requests_running") == 0,
        what="every KV block back in the pool",
    )


# --------------------------------------------------------------------------- answers
def test_models_and_health(server, client):
    assert [model.id for model in client.models.list()] == ["tiny"]
    status, _, body = get(f"{server.url}/health")
    assert (status, body) == (200, '{"status":"ok"}')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_completion_is_llm_generate(client, reference, stream):
    expected = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    expect_answer(ask(client, "completions", stream, prompt=PROMPT, max_tokens=24, temperature=0), expected)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_chat_is_llm_chat(client, reference, stream):
    expected = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=20))[0]
    expect_answer(ask(client, "chat", stream, messages=MESSAGES, max_tokens=20, temperature=0), expected)


@pytest.mark.parametrize("endpoint, stream", [("completions", False), ("completions", True), ("chat", True)])
def test_n_seeded_samples(client, reference, endpoint, stream):
    """n = 3 at temperature 0.8 with a seed: sample j draws with seed + j, as in the engine."""
    params = dict(n=3, temperature=0.8, top_p=0.95, seed=7, max_tokens=12)
    if endpoint == "completions":
        expected = reference.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0]
        answer = ask(client, endpoint, stream, prompt=PROMPT, **params)
    else:
        expected = reference.chat(MESSAGES, SamplingParams(**params))[0]
        answer = ask(client, endpoint, stream, messages=MESSAGES, **params)
    expect_answer(answer, expected)
    assert len(set(answer.texts)) > 1, "three seeded samples, all alike: the seeds are not per sample"


def test_a_batch_of_prompts_is_one_choice_per_prompt_and_sample(client, reference):
    prompts = [PROMPT, "class Stack:\n    "]
    expected = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=8, n=2), use_tqdm=False)
    answer = ask(client, "completions", False, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert answer.texts == [sample.text for out in expected for sample in out.outputs]  # choice i * n + j
    assert answer.usage.completion_tokens == sum(len(s.token_ids) for out in expected for s in out.outputs)


def stop_across_a_token_boundary(reference) -> str:
    """Four characters of the greedy text that straddle the boundary between its 5th and 6th tokens,
    so that a streamed answer must hold back the first half until the second arrives."""
    out = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    boundary = len(reference.tokenizer.decode(out.token_ids[:5]))
    return out.text[boundary - 2 : boundary + 2]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings(client, reference, stream):
    stop = stop_across_a_token_boundary(reference)
    expected = reference.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop, "@@@"]), use_tqdm=False
    )[0]
    assert expected.outputs[0].finish_reason == "stop" and stop not in expected.outputs[0].text
    expect_answer(
        ask(client, "completions", stream, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@"]), expected
    )
    alone = ask(client, "completions", stream, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert alone.texts == [expected.outputs[0].text]  # a lone string, as OpenAI allows


def test_max_tokens_and_max_completion_tokens(client):
    answer = ask(
        client, "completions", False, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (answer.usage.completion_tokens, answer.finish_reasons) == (3, ["length"])
    answer = ask(
        client, "chat", True, messages=MESSAGES, max_completion_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (answer.usage.completion_tokens, answer.finish_reasons) == (2, ["length"])


def test_repetition_penalty_and_top_k_as_extra_fields(client, reference):
    params = dict(temperature=0.7, top_k=5, repetition_penalty=1.3, seed=3, max_tokens=16)
    expected = reference.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0]
    answer = ask(
        client,
        "completions",
        False,
        prompt=PROMPT,
        temperature=0.7,
        seed=3,
        max_tokens=16,
        extra_body={"top_k": 5, "repetition_penalty": 1.3},
    )
    expect_answer(answer, expected)


# --------------------------------------------------------------------------- clients that go away
def test_a_stream_closed_after_two_chunks_frees_its_blocks(server, client):
    aborted = finished_total(server.url, "abort")
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=500, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    received = iter(stream)
    chunks = [next(received), next(received)]
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks)
    assert metric(server.url, "decodelab_kv_blocks_used") > 0
    stream.close()
    wait_until_idle(server.url)
    assert finished_total(server.url, "abort") == aborted + 1
    server.llm.allocator.check_invariants([])


def test_a_client_that_hangs_up_on_a_whole_answer_is_aborted(server):
    aborted = finished_total(server.url, "abort")
    body = b'{"prompt": "def f(x):", "max_tokens": 800, "temperature": 0, "ignore_eos": true}'
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: metric(server.url, "decodelab_kv_blocks_used") > 0, what="the request running")
    wait_until_idle(server.url)
    assert finished_total(server.url, "abort") == aborted + 1


# --------------------------------------------------------------------------- many at once
CONCURRENT_PROMPTS = [f"def function_{i}(value):" if i % 2 else f"# step {i}: read the file and" for i in range(64)]


def test_64_concurrent_streams_each_get_their_own_tokens(server, reference):
    """64 streams at once (AsyncOpenAI): each stream's text and token count are what its prompt gets
    alone from the engine, so no token was lost or crossed into another stream."""
    params = SamplingParams(temperature=0, max_tokens=12)
    alone = [reference.generate(prompt, params, use_tqdm=False)[0] for prompt in CONCURRENT_PROMPTS]

    async def one_stream(client, prompt):
        text, usage = "", None
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            text += "".join(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def watch_running(done: asyncio.Event) -> int:
        most = 0
        while not done.is_set():
            most = max(most, await asyncio.to_thread(metric, server.url, "decodelab_num_requests_running"))
            await asyncio.sleep(0.01)
        return most

    async def all_streams():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_running(done))
        results = await asyncio.gather(*(one_stream(client, prompt) for prompt in CONCURRENT_PROMPTS))
        done.set()
        await client.close()
        return results, await watcher

    started = time.perf_counter()
    results, most_running = asyncio.run(all_streams())
    elapsed = time.perf_counter() - started
    assert [text for text, _ in results] == [out.outputs[0].text for out in alone]
    assert [tokens for _, tokens in results] == [len(out.outputs[0].token_ids) for out in alone]
    assert most_running > 1, "the requests never ran together"
    print(f"64 streams of 12 tokens in {elapsed:.2f} s, at most {most_running:.0f} requests running at once")
    wait_until_idle(server.url)


# --------------------------------------------------------------------------- errors
BAD_PARAMS = [
    ("completions", dict(temperature=-1), "temperature", r"temperature must be >= 0: .*got -1"),
    ("completions", dict(top_p=1.5), "top_p", r"top_p must be in \(0, 1\], got 1.5"),
    ("completions", dict(n=0), "n", r"n must be an integer >= 1, got 0"),
    ("completions", dict(max_tokens=0), "max_tokens", r"max_tokens must be an integer >= 1, got 0"),
    (
        "chat",
        dict(max_completion_tokens=-5),
        "max_completion_tokens",
        r"max_completion_tokens must be an integer >= 1, got -5",
    ),
    ("completions", dict(seed=-1), "seed", r"seed must be an integer in 0..2\*\*63-1, or None, got -1"),
    ("completions", dict(stop=[""]), "stop", r"stop must be a string or a list of non-empty strings"),
    (
        "completions",
        dict(presence_penalty=0.5),
        "presence_penalty",
        r"presence_penalty=0.5 is not supported: OpenAI's presence penalty .* use repetition_penalty",
    ),
    ("chat", dict(frequency_penalty=1.0), "frequency_penalty", r"frequency_penalty=1.0 is not supported"),
    ("completions", dict(logprobs=2), "logprobs", r"logprobs=2 is not supported: .*log-probabilities"),
    (
        "completions",
        dict(extra_body={"repetition_penalty": 0}),
        "repetition_penalty",
        r"repetition_penalty must be > 0.*got 0",
    ),
    ("completions", dict(extra_body={"mystery": 1}), "mystery", r"unknown parameter 'mystery'"),
    ("completions", dict(prompt=[]), "prompt", r"prompt must be a string, a list of strings"),
    (
        "completions",
        dict(prompt="x " * 1500),
        "prompt",
        r"prompt: prompt of \d+ tokens does not fit the model's "
        r"context of 1024 tokens",
    ),
    (
        "completions",
        dict(max_tokens=1020),
        "max_tokens",
        r"the model's context is 1024 tokens, but 10\d\d were asked for \(\d+ in the prompt, 1020 for the completion\)",
    ),
    ("chat", dict(messages=[{"role": "user"}]), "messages", r"messages\[0\]\.content must be a string"),
    (
        "completions",
        dict(stream=False, stream_options={"include_usage": True}),
        "stream_options",
        r"stream_options is only allowed with stream=true",
    ),
]


@pytest.mark.parametrize("endpoint, kwargs, param, phrase", BAD_PARAMS, ids=[f"{e}-{p}" for e, _, p, _ in BAD_PARAMS])
def test_bad_params_are_400_in_openais_shape(client, endpoint, kwargs, param, phrase):
    base = dict(prompt=PROMPT) if endpoint == "completions" else dict(messages=MESSAGES)
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as caught:
        create(model="tiny", **{**base, **kwargs})
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"}
    assert (caught.value.status_code, error["type"], error["param"], error["code"]) == (
        400,
        "invalid_request_error",
        param,
        None,
    )
    assert re.search(phrase, error["message"]), error["message"]


@pytest.mark.parametrize(
    "body, phrase",
    [
        (b"{not json", "the request body is not valid JSON"),
        (b"[1, 2]", "the request body must be a JSON object, got list"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_400(server, body, phrase):
    import urllib.request

    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert phrase in caught.value.read().decode()


def test_another_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert caught.value.body["code"] == "model_not_found" and "'tiny'" in caught.value.body["message"]


def test_metrics_are_prometheus_text(server, client):
    parser = pytest.importorskip("prometheus_client.parser")
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    status, headers, text = get(f"{server.url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {family.name: family for family in parser.text_string_to_metric_families(text)}
    for name in (
        "decodelab_num_requests_running",
        "decodelab_num_requests_waiting",
        "decodelab_kv_blocks_used",
        "decodelab_kv_blocks_total",
    ):
        assert families[name].type == "gauge"
    assert families["decodelab_kv_blocks_total"].samples[0].value == server.llm.allocator.num_blocks
    for name in ("decodelab_time_to_first_token_seconds", "decodelab_inter_token_latency_seconds"):
        assert families[name].type == "histogram"
        count = next(s.value for s in families[name].samples if s.name == f"{name}_count")
        assert count >= 1
    finished = {
        s.labels["finish_reason"]: s.value
        for s in families["decodelab_request_finished"].samples
        if s.name == "decodelab_request_finished_total"
    }
    assert set(finished) == {"stop", "length", "error", "abort"} and finished["length"] >= 1

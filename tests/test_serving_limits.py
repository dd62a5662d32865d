"""The server's limits, as a client meets them: an API key (401 without it), a bounded queue (503 with
Retry-After when it is full), and an engine step that fails (each request in flight gets the error,
the next ones are served). One server on the tiny model, `--api-key` and `--max-queue 2`."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servers import get, metric, served, wait_for  # noqa: E402

from decodelab import SamplingParams  # noqa: E402
from decodelab.serving.app import build_app  # noqa: E402
from decodelab.serving.engine_loop import EngineLoop, EngineUnavailableError, Submission  # noqa: E402
from decodelab.serving.server import ServeSettings, load_engine  # noqa: E402

KEY = "sesame-1234"
MAX_QUEUE = 2
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def server():
    llm = load_engine(ServeSettings(model="tiny", engine=dict(device="cpu")))
    app = build_app(llm, "tiny", api_key=KEY, max_queue=MAX_QUEUE)
    with served(app) as url:
        yield SimpleNamespace(url=url, app=app, llm=llm, engine_loop=app.state.engine_loop)


def client_with(server, key: str):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


# --------------------------------------------------------------------------- the API key
@pytest.mark.parametrize("key", ["wrong-key", KEY + "x"])  # none at all: the next test
def test_a_wrong_key_is_401(server, key):
    with pytest.raises(openai.AuthenticationError) as caught:
        client_with(server, key).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key" and caught.value.body["type"] == "invalid_request_error"


def test_every_v1_route_wants_the_key_and_health_does_not(server):
    status, headers, body = get(f"{server.url}/v1/models")
    assert (status, headers["www-authenticate"]) == (401, "Bearer") and "missing API key" in body
    assert get(f"{server.url}/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert get(f"{server.url}/health")[0] == 200 and get(f"{server.url}/metrics")[0] == 200
    answer = client_with(server, KEY).completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert answer.usage.completion_tokens == 2


# --------------------------------------------------------------------------- the queue
def test_a_full_queue_is_503_with_retry_after(server):
    """With the engine thread paused, MAX_QUEUE requests wait; the next is refused at once with 503
    and Retry-After, and the waiting ones are served once the engine resumes."""
    client = client_with(server, KEY)
    rejected = metric(server.url, 'decodelab_requests_rejected_total{reason="queue_full"}')
    answers = []

    def ask():
        answers.append(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0))

    server.engine_loop.pause()
    try:
        waiting = [threading.Thread(target=ask, daemon=True) for _ in range(MAX_QUEUE)]
        for thread in waiting:
            thread.start()
        wait_for(
            lambda: metric(server.url, "decodelab_num_requests_waiting") == MAX_QUEUE,
            what=f"{MAX_QUEUE} requests waiting",
        )
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    finally:
        server.engine_loop.resume()
    error = caught.value
    assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
    assert error.body["code"] == "queue_full" and f"--max-queue {MAX_QUEUE}" in error.body["message"]
    for thread in waiting:
        thread.join(30)
    assert [answer.usage.completion_tokens for answer in answers] == [3] * MAX_QUEUE
    assert metric(server.url, 'decodelab_requests_rejected_total{reason="queue_full"}') == rejected + 1
    assert metric(server.url, "decodelab_num_requests_waiting") == 0


# --------------------------------------------------------------------------- a failing engine
def test_a_failing_step_fails_the_requests_in_flight_and_the_next_are_served(server, monkeypatch):
    client = client_with(server, KEY)
    step = server.llm.step

    def failing_step():
        monkeypatch.setattr(server.llm, "step", step)  # only once
        raise RuntimeError("the accelerator fell over")

    monkeypatch.setattr(server.llm, "step", failing_step)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    assert caught.value.status_code == 500
    assert caught.value.body["message"] == "the engine failed: RuntimeError: the accelerator fell over"
    assert caught.value.body["type"] == "server_error"
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    assert metric(server.url, "decodelab_kv_blocks_used") == 0
    assert get(f"{server.url}/health")[0] == 200


def test_a_stopped_engine_loop_refuses_submissions(server):
    """Nobody would answer them: refused at once (the route turns it into a 503), never left hanging."""
    idle = EngineLoop(server.llm)
    with pytest.raises(EngineUnavailableError, match="the engine loop is not running"):
        idle.submit(Submission([[1, 2]], SamplingParams(), deliver=print))
    assert idle.num_waiting == 0

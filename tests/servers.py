"""A server for a test module: the app served by uvicorn on a background thread, on 127.0.0.1 and a
free port (the same binding and uvicorn settings as `python -m decodelab serve`)."""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from decodelab.serving.server import LOOPBACK, bind, bound_address, make_server

# A chat template for the tiny model, which has none (`serve --chat-template`)
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@contextmanager
def served(app, timeout: float = 30.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 until the block ends -> its base URL (http://127.0.0.1:PORT)."""
    sock = bind(LOOPBACK, 0)
    server = make_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield bound_address(sock)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def get(url: str, headers: dict | None = None) -> tuple[int, dict, str]:
    """GET url -> (status, headers, body text), errors included."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def metric(base_url: str, name: str) -> float:
    """One unlabelled sample of /metrics (a gauge or a counter)."""
    _, _, text = get(f"{base_url}/metrics")
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} is not in /metrics:\n{text}"
    return float(found.group(1))


def wait_for(condition, timeout: float = 20.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.05)

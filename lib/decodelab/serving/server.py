"""`python -m decodelab serve`: load the engine, bind the address, run the app under uvicorn.

    python -m decodelab serve --model tiny --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "def fib(n):", "max_tokens": 16, "temperature": 0}'

The socket is bound here, before uvicorn starts, so an address in use is one clear error (and port 0
picks a free port, which `bound_address` reports). SIGTERM (and Ctrl-C) stop the server gracefully:
uvicorn finishes, the app's lifespan stops the engine thread, and the process exits with 0.
"""

from __future__ import annotations

import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"


@dataclass
class ServeSettings:
    """The `serve` command's settings (its flags); `engine` holds the LLM keyword arguments."""

    model: str = "smollm2"
    host: str = LOOPBACK
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256
    chat_template: str | None = None  # a file, or the template itself
    engine: dict | None = None


def read_chat_template(value: str) -> str:
    """--chat-template: a Jinja file's path, or the template text itself (as vLLM takes it)."""
    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def load_engine(settings: ServeSettings):
    """The LLM the server runs, with the chat template the settings give (if any)."""
    from decodelab.engine.llm import LLM

    template = None if settings.chat_template is None else read_chat_template(settings.chat_template)
    llm = LLM(model=settings.model, **(settings.engine or {}))
    if template is not None:
        llm.tokenizer.chat_template = template
    return llm


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one). OSError if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    return sock


def bound_address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def make_server(app):
    """A uvicorn Server for `app`, quiet (warnings and errors only); `server.run(sockets=[sock])` runs it."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))


def serve(settings: ServeSettings) -> int:
    """Run the server until SIGTERM or Ctrl-C -> exit status 0."""
    from decodelab.serving.app import build_app

    sock = bind(settings.host, settings.port)  # first: a taken port fails before the model loads
    try:
        llm = load_engine(settings)
    except BaseException:
        sock.close()
        raise
    app = build_app(llm, settings.model, api_key=settings.api_key, max_queue=settings.max_queue)
    server = make_server(app)
    print(
        f"decodelab: serving {settings.model} at {bound_address(sock)}/v1 ({llm.args.quantization or 'float'} "
        f"weights; SIGTERM or Ctrl-C stops it)",
        file=sys.stderr,
        flush=True,
    )
    if settings.host not in (LOOPBACK, "localhost", "::1") and settings.api_key is None:
        print(
            f"decodelab: warning: listening on {settings.host} without --api-key: anyone who can reach this "
            f"machine can use the server",
            file=sys.stderr,
            flush=True,
        )
    # uvicorn catches SIGTERM and SIGINT, shuts down, then raises the signal again for the handler it
    # found: a quiet one here, so a requested stop ends the process with 0 instead of killing it.
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, lambda signum, frame: None)
    server.run(sockets=[sock])
    return 0

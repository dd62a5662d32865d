"""The servers bench/serving_load.py loads, each started in a subprocess on 127.0.0.1 and stopped after:
ours (`python -m decodelab serve`) and llama.cpp's OpenAI-compatible server on the GGUF of SmolLM2 we
ship, `server` (llama.cpp's own llama-server, --parallel N slots with continuous batching; `make
bench-deps` builds it from the llama.cpp that llama-cpp-python's sdist vendors) or `python`
(llama-cpp-python's `python -m llama_cpp.server`, one request at a time behind a lock).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / "bench" / ".llama-cpp" / "build" / "bin" / "llama-server"  # `make bench-deps`
LLAMA_CPP_KINDS = ("server", "python")


@dataclass
class Server:
    """A running server: what the client needs and what the JSON records."""

    url: str
    command: str | None
    slots: int | None = None
    extra_body: dict | None = None  # how this server is asked to ignore EOS; more is added per request


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def our_server(model: str, extra: list[str]):
    """`python -m decodelab serve --model MODEL --port 0` in a subprocess -> a `Server`."""
    command = [sys.executable, "-m", "decodelab", "serve", "--model", model, "--port", "0", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        found = re.search(r"serving \S+ at (http://\S+/v1)", line)
        if not found:
            raise RuntimeError(f"the server did not start: {line}{process.stderr.read()}")
        yield Server(found.group(1), " ".join(["python", *command[1:]]))
    finally:
        process.terminate()
        process.wait(30)


def llama_cpp_missing(kind: str, binary: Path = LLAMA_SERVER) -> str | None:
    """Why llama.cpp's server of this kind cannot start here, in one line; None when it can."""
    if kind == "server" and not binary.is_file():
        return f"llama.cpp's llama-server is not built (no {binary}): `make bench-deps` builds it"
    if kind == "python":
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sse_starlette") is None:
            return "llama-cpp-python's server is not installed: `make bench-deps` installs llama-cpp-python[server]"
    return None


def llama_cpp_command(kind: str, port: int, slots: int, threads: int, binary: Path = LLAMA_SERVER) -> list[str]:
    """The command line of llama.cpp's OpenAI-compatible server on SmolLM2's GGUF (module docstring)."""
    from decodelab.model.registry import smollm2_gguf_path

    gguf, host = str(smollm2_gguf_path()), ["--host", "127.0.0.1", "--port", str(port)]
    if kind == "server":  # 1024 tokens of context a slot: a prompt of <= ~300 tokens and <= 256 new ones
        return [
            str(binary), "-m", gguf, "--alias", "smollm2", *host, "--parallel", str(slots), "--cont-batching",
            "--ctx-size", str(1024 * slots), "--threads", str(threads), "--threads-batch", str(threads),
            "--no-webui",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2", *host,
        "--n_ctx", "1024", "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--interrupt_requests", "False",  # else a waiting request cuts the streaming one short
    ]  # fmt: skip


@contextmanager
def llama_cpp_server(kind: str, slots: int, threads: int, binary: Path = LLAMA_SERVER):
    """llama.cpp's server in a subprocess on 127.0.0.1, once its /v1/models answers -> a `Server`."""
    import urllib.request

    command = llama_cpp_command(kind, _free_port(), slots, threads, binary)
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"llama.cpp's server did not start: {log.read()[-2000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.25)
        # llama-cpp-python's server: no EOS stop via min_tokens, and its default repeat_penalty (1.1) off
        extra = {"min_tokens": 0, "repeat_penalty": 1.0} if kind == "python" else {"ignore_eos": True}
        yield Server(f"{url}/v1", " ".join(["python", *command[1:]] if kind == "python" else command), slots, extra)
    finally:
        process.terminate()
        process.wait(30)
        log.close()

"""`python -m decodelab serve` as the README gives it: the command and the curl call are read out of
README.md (so the two cannot drift), run on a free port in one subprocess, and stopped with SIGTERM.
Then the command line's own errors: one line, exit status 2."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")

from notebooks import ROOT  # noqa: E402

from decodelab import cli  # noqa: E402


def readme_serve_block() -> tuple[list[str], list[str]]:
    """(the serve command, the curl command) from README.md's "Serve it" code block, as argv lists."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"### Serve it\n.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no `### Serve it` section with a bash block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    serve = next(shlex.split(line) for line in lines if " -m decodelab serve " in line)
    curl = next(shlex.split(line) for line in lines if line.startswith("curl "))
    return serve, curl


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_port(argv: list[str], port: int) -> list[str]:
    """argv with every 127.0.0.1:8000 and `--port 8000` moved to `port`."""
    argv = [arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for arg in argv]
    return [str(port) if i and argv[i - 1] == "--port" else arg for i, arg in enumerate(argv)]


def curl_as_request(curl: list[str]) -> urllib.request.Request:
    """The README's curl call (URL, -H headers, -d body) as the same request for urllib."""
    url, headers, data = None, {}, None
    args = iter(curl[1:])
    for arg in args:
        if arg == "-H":
            name, _, value = next(args).partition(":")
            headers[name.strip()] = value.strip()
        elif arg == "-d":
            data = next(args).encode()
        elif arg.startswith("http"):
            url = arg
        else:
            raise AssertionError(f"the README's curl call has an option this test does not read: {arg}")
    return urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")


def wait_for_health(base_url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {process.stderr.read()}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise AssertionError(f"no answer from {base_url}/health within {timeout} s")


def test_the_readmes_serve_command_answers_its_curl_call():
    serve, curl = readme_serve_block()
    assert serve[0].endswith("python") and serve[1:4] == ["-m", "decodelab", "serve"], serve
    port = free_port()
    command = [sys.executable, *with_port(serve, port)[1:]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), str(ROOT)]))
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", process)
        request = curl_as_request(with_port(curl, port))
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        sent = json.loads(request.data)
        assert answer["object"] == "text_completion" and answer["model"] == sent["model"]
        assert answer["choices"][0]["finish_reason"] in {"stop", "length"} and answer["choices"][0]["text"]
        assert 1 <= answer["usage"]["completion_tokens"] <= sent["max_tokens"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, stderr
    assert f"serving tiny at http://127.0.0.1:{port}/v1" in stderr
    assert "Traceback" not in stderr and stdout == ""


def occupied_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "70000"], "argument --port: must be a port number in 0..65535 (0: any free port), got '70000'"),
        (["--max-queue", "0"], "argument --max-queue: must be an integer >= 1, got '0'"),
        (["--model", "nope", "--port", "0"], "unknown model 'nope': use one of smollm2, tiny"),
        (
            ["--model", "tiny", "--port", "0", "--chat-template", "nonsense"],
            "--chat-template 'nonsense' is neither a file nor a Jinja template",
        ),
        (["--port", "{taken}"], "cannot listen on 127.0.0.1:{taken}: Address already in use"),
        (["--quantization", "fp8"], "argument --quantization: invalid choice: 'fp8'"),
        (
            ["--model", "tiny", "--port", "0", "--quantization", "q4"],
            "quantization='q4' reads the Q4_1 blocks of the GGUF a model comes from",
        ),
    ],
    ids=["port", "max_queue", "model", "chat_template", "port_taken", "quantization", "q4_needs_the_gguf"],
)
def test_serve_errors_are_one_line(capsys, args, message):
    with occupied_port() as taken:
        port = taken.getsockname()[1]
        code = cli.main(["serve", *[arg.format(taken=port) for arg in args], "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("decodelab: error: ") and message.format(taken=port) in err


def test_serve_quantization_names_every_engine_weight_format():
    from decodelab.engine.args import QUANTIZATIONS

    assert cli.SERVE_QUANTIZATIONS == tuple(name for name in QUANTIZATIONS if name is not None)


def test_serve_quantization_reaches_the_engine(monkeypatch):
    """--quantization int8 builds the served LLM with int8 linears (the settings go through load_engine)."""
    from decodelab.model.quantization import QuantizedLinear
    from decodelab.serving import server

    engines = []
    monkeypatch.setattr(server, "serve", lambda settings: engines.append(server.load_engine(settings)) or 0)
    assert cli.main(["serve", "--model", "tiny", "--quantization", "int8", "--device", "cpu"]) == 0
    (llm,) = engines
    assert llm.args.quantization == "int8"
    assert any(isinstance(module, QuantizedLinear) and module.bits == 8 for module in llm.model.modules())


@pytest.mark.parametrize(
    "args, quantization",
    [
        ([], "q4"),  # SmolLM2 on a CPU in float32: its GGUF's own blocks, the same weights (q4_linear.q4_pays)
        (["--quantization", "none"], None),
        (["--quantization", "int8"], "int8"),
        (["--model", "tiny"], None),
        (["--dtype", "bfloat16"], None),
    ],
)
def test_serve_weights_by_default(monkeypatch, args, quantization):
    from decodelab.model.q4_kernel import kernel_loads
    from decodelab.serving import server

    if quantization == "q4" and not kernel_loads():
        pytest.skip("the Q4_1 kernels do not load here: SmolLM2 is served on its float weights")
    settings = []
    monkeypatch.setattr(server, "serve", lambda given: settings.append(given) or 0)
    assert cli.main(["serve", *args, "--device", "cpu"]) == 0
    assert settings[0].engine["quantization"] == quantization

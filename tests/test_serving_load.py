"""bench/serving_load.py's llama.cpp comparison without llama.cpp (CI never builds it): the option refuses
in one line when the server is not there, each server is asked to generate exactly max_tokens in its
own words, and a request given fewer tokens than it asked for is counted."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from notebooks import ROOT

SCRIPT = ROOT / "bench" / "serving_load.py"


def _bench():
    spec = importlib.util.spec_from_file_location("serving_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serving_load"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_llama_cpp_refuses_in_one_line_when_its_server_is_not_built(tmp_path):
    missing = tmp_path / "llama-server"
    argv = [sys.executable, str(SCRIPT), "--serve", "smollm2", "--llama-cpp", "server", "--llama-server", str(missing)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        f"serving_load.py: llama.cpp's llama-server is not built (no {missing}): `make bench-deps` builds it"
    ]


def test_llama_cpp_needs_our_server_on_the_same_gguf():
    argv = [sys.executable, str(SCRIPT), "--serve", "tiny", "--llama-cpp", "server"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.strip() == (
        "serving_load.py: --llama-cpp compares with our server on the same GGUF: give --serve smollm2"
    )


def test_each_server_is_asked_for_exactly_max_tokens():
    bench = _bench()
    request = bench.PlannedRequest(send_at=0.0, prompt="a b c", max_tokens=37)
    ours = bench.Server("http://127.0.0.1:1/v1", "ours")
    llama_cpp_python = bench.Server("http://127.0.0.1:2/v1", "python", 1, {"min_tokens": 0, "repeat_penalty": 1.0})
    assert bench.request_body(ours, request) == {"ignore_eos": True}
    assert bench.request_body(llama_cpp_python, request) == {"min_tokens": 37, "repeat_penalty": 1.0}
    assert llama_cpp_python.extra_body["min_tokens"] == 0, "the server's own fields are not changed"


def test_summary_counts_requests_not_given_their_max_tokens():
    bench = _bench()
    requests = [bench.PlannedRequest(0.0, "x", n) for n in (10, 20, 30)]
    outcomes = [
        bench.Outcome(ok=True, ttft=0.1, latency=1.0, output_tokens=10, counted_from_usage=True),
        bench.Outcome(ok=True, ttft=0.2, latency=2.0, output_tokens=12, counted_from_usage=True),  # stopped early
        bench.Outcome(ok=False, error="ConnectionError: gone"),
    ]
    row = bench.summarize(1.0, outcomes, 4.0, ttft_slo=1.0, tpot_slo=0.1, requests=requests)
    assert row["output_tokens_asked"] == 60
    assert row["output_tokens"] == 22
    assert row["requests_not_given_max_tokens"] == 1  # the failed one is counted under "failed"
    assert row["failed"] == 1
    assert row["output_tokens_counted_from"] == ["usage"]


def test_shorter_outputs_keep_the_same_prompts_and_arrivals():
    bench = _bench()
    default = bench.plan(20, 2.0, seed=0)
    short = bench.plan(20, 2.0, seed=0, output_mean=24, output_max=64)
    assert [(r.send_at, r.prompt) for r in short] == [(r.send_at, r.prompt) for r in default]
    assert all(8 <= r.max_tokens <= 64 for r in short)
    assert sum(r.max_tokens for r in short) < sum(r.max_tokens for r in default)

"""Serving under load: Poisson arrivals against an OpenAI-compatible server, at one or more rates.

    .venv/bin/python bench/serving_load.py --serve tiny --rates 2,8 [--requests 120] [--seed 0]
    .venv/bin/python bench/serving_load.py --base-url http://127.0.0.1:8000/v1 --rates 4   # a server already up

With --serve MODEL the script starts `python -m decodelab serve --model MODEL --port 0` itself (on
127.0.0.1) and stops it at the end; with --base-url it loads any OpenAI-compatible server (ours, vLLM,
llama.cpp's). Every rate runs the same requests, one after the other, on the same server.

The requests (fixed by --seed): arrival gaps drawn from an exponential distribution of mean 1/rate
(a Poisson process); prompts of long-tailed length, a lognormal number of words (median 24, at most
200) from the held-out English text; outputs of long-tailed length, 8 + an exponential draw of mean
56 tokens, at most 256 (bench/serving.py's long-tail workload), generated to the end (`ignore_eos`,
vLLM's extra field, which our server takes too), greedy, streamed.

Per request: TTFT (sent -> first streamed text) and TPOT (time per output token after the first:
(latency - TTFT) / (tokens - 1)). Per rate: their p50 and p99, output-token throughput, and goodput:
requests per second that met the SLO, TTFT <= --ttft-slo (1 s) and TPOT <= --tpot-slo (0.1 s), as
DistServe defines it. Prints the command and the figures; writes bench/results/serving_load_MODEL.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))

from decodelab.lessons.perplexity import heldout_text  # noqa: E402


@dataclass
class PlannedRequest:
    send_at: float  # seconds after the start
    prompt: str
    max_tokens: int


@dataclass
class Outcome:
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def plan(num_requests: int, rate: float, seed: int) -> list[PlannedRequest]:
    """The workload (module docstring): the same prompts and lengths at every rate, arrivals scaled."""
    rng = random.Random(seed)
    words = heldout_text("en").split()
    requests, clock = [], 0.0
    for _ in range(num_requests):
        clock += rng.expovariate(1.0)  # gaps of mean 1; divided by the rate below
        length = min(200, max(4, round(rng.lognormvariate(math.log(24), 0.8))))
        start = rng.randrange(len(words) - length)
        max_tokens = min(256, 8 + round(-56 * math.log(1 - rng.random())))
        requests.append(PlannedRequest(clock, " ".join(words[start : start + length]), max_tokens))
    for request in requests:
        request.send_at /= rate
    return requests


async def send(client, model: str, request: PlannedRequest) -> Outcome:
    """One streamed completion; its TTFT, latency and token counts (from the usage chunk)."""
    started = time.perf_counter()
    outcome = Outcome(ok=False)
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if outcome.ttft is None and any(choice.text for choice in chunk.choices):
                outcome.ttft = time.perf_counter() - started
            if chunk.usage is not None:
                outcome.output_tokens, outcome.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        outcome.latency = time.perf_counter() - started
        outcome.ok = outcome.ttft is not None
    except Exception as exc:  # noqa: BLE001 - counted and reported per rate
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def run_rate(base_url: str, model: str, requests: list[PlannedRequest]) -> tuple[list[Outcome], float]:
    """Send every request at its time -> (outcomes, seconds from the first send to the last answer)."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0, timeout=600
    )
    start = time.perf_counter()

    async def at_its_time(request):
        await asyncio.sleep(max(0.0, start + request.send_at - time.perf_counter()))
        return await send(client, model, request)

    outcomes = await asyncio.gather(*(at_its_time(request) for request in requests))
    duration = time.perf_counter() - start
    await client.close()
    return list(outcomes), duration


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(rate: float, outcomes: list[Outcome], duration: float, ttft_slo: float, tpot_slo: float) -> dict:
    done = [o for o in outcomes if o.ok]
    ttfts, tpots = [o.ttft for o in done], [o.tpot for o in done if o.tpot is not None]
    good = [o for o in done if o.ttft <= ttft_slo and (o.tpot is None or o.tpot <= tpot_slo)]
    output_tokens = sum(o.output_tokens for o in done)
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        "rate_req_s": rate,
        "requests": len(outcomes),
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "errors": errors[:3],
        "duration_s": round(duration, 2),
        "prompt_tokens": sum(o.prompt_tokens for o in done),
        "output_tokens": output_tokens,
        "throughput_tok_s": round(output_tokens / duration, 1),
        "request_throughput_req_s": round(len(done) / duration, 3),
        "goodput_req_s": round(len(good) / duration, 3),
        "slo_attainment": round(len(good) / len(outcomes), 3),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "latency_p50_s": percentile([o.latency for o in done], 50),
        "latency_p99_s": percentile([o.latency for o in done], 99),
    }


@contextmanager
def our_server(model: str, extra: list[str]):
    """`python -m decodelab serve --model MODEL --port 0` in a subprocess -> (its base URL, its command)."""
    command = [sys.executable, "-m", "decodelab", "serve", "--model", model, "--port", "0", *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        found = re.search(r"serving \S+ at (http://\S+/v1)", line)
        if not found:
            raise RuntimeError(f"the server did not start: {line}{process.stderr.read()}")
        yield found.group(1), " ".join(["python", *command[1:]])
    finally:
        process.terminate()
        process.wait(30)


def print_table(rows: list[dict]) -> None:
    def ms(value):
        return "-" if value is None else f"{value * 1000:7.0f}"

    print(
        f"{'rate':>6} {'done':>5} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'tok/s':>7} "
        f"{'goodput':>8} {'in SLO':>7}   (ms; goodput in req/s)"
    )
    for r in rows:
        print(
            f"{r['rate_req_s']:6g} {r['completed']:5d} {ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>7} "
            f"{ms(r['tpot_p50_s']):>9} {ms(r['tpot_p99_s']):>7} {r['throughput_tok_s']:7.1f} "
            f"{r['goodput_req_s']:8.2f} {r['slo_attainment']:7.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="an OpenAI-compatible server's /v1 URL")
    where.add_argument("--serve", metavar="MODEL", help="start `python -m decodelab serve --model MODEL` for the run")
    parser.add_argument("--serve-args", default="", help="more flags for --serve, e.g. '--max-num-seqs 32'")
    parser.add_argument("--model", default=None, help="the model name to ask for (default: the server's first)")
    parser.add_argument("--rates", default="2,8", help="requests per second, comma-separated (default 2,8)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default 1)")
    parser.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (default 0.1)")
    parser.add_argument("--out", default=None, help="the JSON file (default bench/results/serving_load_MODEL.json)")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    command = "python bench/serving_load.py " + " ".join(sys.argv[1:])
    print(command, flush=True)
    load_before = _load_average()

    with our_server(args.serve, args.serve_args.split()) if args.serve else _given(args.base_url) as (url, server):
        model = args.model or _first_model(url)
        rows = []
        for rate in rates:
            requests = plan(args.requests, rate, args.seed)
            outcomes, duration = asyncio.run(run_rate(url, model, requests))
            rows.append(summarize(rate, outcomes, duration, args.ttft_slo, args.tpot_slo))
            print_table(rows[-1:])
    print()
    print_table(rows)
    result = {
        "command": command,
        "server": server,
        "base_url": url,
        "model": model,
        "requests": args.requests,
        "seed": args.seed,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "workload": "Poisson arrivals; prompts lognormal words (median 24, <= 200) of held-out English; "
        "outputs 8 + exponential(mean 56) tokens, <= 256, ignore_eos, greedy, streamed",
        "client": "the openai package's AsyncOpenAI, on the same machine as the server (it takes CPU too)",
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "rates": rows,
    }
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"serving_load_{model}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


@contextmanager
def _given(url: str):
    yield url, None


def _first_model(url: str) -> str:
    import urllib.request

    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if "OPENAI_API_KEY" in os.environ else {}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/models", headers=headers), timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


if __name__ == "__main__":
    main()

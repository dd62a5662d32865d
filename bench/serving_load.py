"""Serving under load: Poisson arrivals against an OpenAI-compatible server, at one or more rates.

    .venv/bin/python bench/serving_load.py --serve tiny --rates 2,8 [--requests 120] [--seed 0]
    .venv/bin/python bench/serving_load.py --base-url http://127.0.0.1:8000/v1 --rates 4   # a server already up
    .venv/bin/python bench/serving_load.py --serve smollm2 --llama-cpp server --slots 4 --rates 0.25,0.5,1,2 \
        --requests 32 --output-mean 24 --output-max 64                       # ours beside llama.cpp

With --serve MODEL the script starts `python -m decodelab serve --model MODEL --port 0` itself (on
127.0.0.1) and stops it at the end; with --base-url it loads any OpenAI-compatible server (ours, vLLM,
llama.cpp's). Every rate runs the same requests, one after the other, on the same server.

With --llama-cpp it starts llama.cpp's OpenAI-compatible server on the GGUF of SmolLM2 we ship, on
127.0.0.1: `server` is llama.cpp's own `llama-server` (`make bench-deps` builds it from the llama.cpp
that llama-cpp-python's sdist vendors), --parallel SLOTS with continuous batching; `python` is
llama-cpp-python's `python -m llama_cpp.server`, which answers one request at a time (a lock around
its one model), so it needs --slots 1. Given with --serve smollm2, the two are compared interleaved:
for each rate a fresh server of each (cold, so that neither reuses the KV cache of an earlier rate's
prompts), one after the other in alternating order, the same requests, the same number of slots (ours
gets --max-num-seqs SLOTS), each warmed by one short request first, both with as many threads as this
machine has CPUs. Writes bench/results/serving_load_smollm2_vs_llama_cpp_KIND.json and a plot beside it
(.png: goodput, TTFT p99 and TPOT p99 against the rate, both servers; matplotlib, `make bench-deps`).

The requests (fixed by --seed): arrival gaps drawn from an exponential distribution of mean 1/rate
(a Poisson process); prompts of long-tailed length, a lognormal number of words (median 24, at most
200) from the held-out English text; outputs of long-tailed length, 8 + an exponential draw of mean
--output-mean (56) tokens, at most --output-max (256) (bench/serving.py's long-tail workload),
generated to the end, greedy, streamed: `ignore_eos` (vLLM's extra field, which our server and
llama-server take) or, for llama-cpp-python, which has no such field, `min_tokens` = max_tokens (it
masks EOS until then). Each request's output tokens are counted against its max_tokens.

Per request: TTFT (sent -> first streamed text) and TPOT (time per output token after the first:
(latency - TTFT) / (tokens - 1)). Per rate: their p50 and p99, output-token throughput, and goodput:
requests per second that met the SLO, TTFT <= --ttft-slo (1 s) and TPOT <= --tpot-slo (0.1 s), as
DistServe defines it. Prints the command and the figures; writes bench/results/serving_load_MODEL.json.
`--replot FILE.json` redraws a comparison's plot from its JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))

from decodelab.lessons.perplexity import heldout_text  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from omp_settings import omp_settings, spin_prefix  # noqa: E402  (bench/omp_settings.py)
from serving_report import Outcome, PlannedRequest, plot, print_table, summarize  # noqa: E402
from serving_servers import (  # noqa: E402  (bench/serving_servers.py)
    LLAMA_CPP_KINDS,
    LLAMA_SERVER,
    Server,
    llama_cpp_missing,
    llama_cpp_server,
    our_server,
)


def plan(
    num_requests: int, rate: float, seed: int, output_mean: float = 56, output_max: int = 256
) -> list[PlannedRequest]:
    """The workload (module docstring): the same prompts and lengths at every rate, arrivals scaled."""
    rng = random.Random(seed)
    words = heldout_text("en").split()
    requests, clock = [], 0.0
    for _ in range(num_requests):
        clock += rng.expovariate(1.0)  # gaps of mean 1; divided by the rate below
        length = min(200, max(4, round(rng.lognormvariate(math.log(24), 0.8))))
        start = rng.randrange(len(words) - length)
        max_tokens = min(output_max, 8 + round(-output_mean * math.log(1 - rng.random())))
        requests.append(PlannedRequest(clock, " ".join(words[start : start + length]), max_tokens))
    for request in requests:
        request.send_at /= rate
    return requests


def request_body(server: Server, request: PlannedRequest) -> dict:
    """The extra fields that make `server` generate exactly max_tokens (no EOS stop)."""
    body = dict(server.extra_body or {"ignore_eos": True})
    if "min_tokens" in body:  # llama-cpp-python: EOS masked until max_tokens
        body["min_tokens"] = request.max_tokens
    return body


async def send(client, model: str, request: PlannedRequest, extra_body: dict) -> Outcome:
    """One streamed completion; its TTFT, latency and token counts (from the usage chunk, where sent)."""
    started = time.perf_counter()
    outcome, chunks_with_text = Outcome(ok=False), 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        )
        async for chunk in stream:
            if any(choice.text for choice in chunk.choices):
                chunks_with_text += 1
                if outcome.ttft is None:
                    outcome.ttft = time.perf_counter() - started
            if chunk.usage is not None:
                outcome.output_tokens, outcome.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                outcome.counted_from_usage = True
        outcome.latency = time.perf_counter() - started
        if not outcome.counted_from_usage:
            outcome.output_tokens = chunks_with_text
        outcome.ok = outcome.ttft is not None
    except Exception as exc:  # noqa: BLE001 - counted and reported per rate
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def run_rate(server: Server, model: str, requests: list[PlannedRequest]) -> tuple[list[Outcome], float]:
    """Send every request at its time -> (outcomes, seconds from the first send to the last answer)."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=server.url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0, timeout=600
    )
    start = time.perf_counter()

    async def at_its_time(request):
        await asyncio.sleep(max(0.0, start + request.send_at - time.perf_counter()))
        return await send(client, model, request, request_body(server, request))

    outcomes = await asyncio.gather(*(at_its_time(request) for request in requests))
    duration = time.perf_counter() - start
    await client.close()
    return list(outcomes), duration


def warm_up(server: Server, model: str) -> None:
    """One short request, untimed: first-call costs (allocations, kernels) out of the first rate."""
    asyncio.run(run_rate(server, model, [PlannedRequest(0.0, "The weather today is", 4)]))


def compare(args, rates: list[float]) -> dict:
    """Ours and llama.cpp's server, interleaved rate by rate (module docstring) -> the JSON's fields."""
    threads = os.cpu_count()
    servers = {
        "decodelab": lambda: our_server(args.serve, [*args.serve_args.split(), "--max-num-seqs", str(args.slots)]),
        "llama.cpp": lambda: llama_cpp_server(args.llama_cpp, args.slots, threads, Path(args.llama_server)),
    }
    commands, rows = {}, []
    for index, rate in enumerate(rates):
        requests = plan(args.requests, rate, args.seed, args.output_mean, args.output_max)
        order = list(servers) if index % 2 == 0 else list(servers)[::-1]
        row = {"rate_req_s": rate, "order": order}
        for name in order:
            with servers[name]() as server:
                model = _first_model(server.url)
                warm_up(server, model)
                outcomes, duration = asyncio.run(run_rate(server, model, requests))
            commands[name] = server.command
            row[name] = summarize(rate, outcomes, duration, args.ttft_slo, args.tpot_slo, requests)
            print_table([row[name]], label=f"{name:>10} ")
        rows.append(row)
    print()
    for name in servers:
        print_table([row[name] for row in rows], label=f"{name:>10} ")
    return {
        "servers": {
            "decodelab": {
                "command": commands["decodelab"],
                "slots": args.slots,
                "weights": our_weights(args.serve, args.serve_args),
                "eos": "ignore_eos",
            },
            "llama.cpp": {
                "command": commands["llama.cpp"],
                "kind": args.llama_cpp,
                "slots": args.slots,
                "threads": threads,
                "weights": "the GGUF's Q4_1 blocks as they are",
                "eos": "ignore_eos" if args.llama_cpp == "server" else "min_tokens = max_tokens (no ignore_eos)",
            },
        },
        "interleaving": "for each rate a fresh server of each, one after the other, in alternating order, "
        "each warmed by one 4-token request first; the same requests for both",
        "rates": rows,
        "max_rate_with_90_percent_in_slo": {
            name: max((row["rate_req_s"] for row in rows if row[name]["slo_attainment"] >= 0.9), default=None)
            for name in servers
        },
    }


def our_weights(model: str, serve_args: str) -> str:
    """What our server's weights are, from its flags (`serve --quantization`, else serve's default)."""
    from decodelab.model.q4_linear import q4_pays

    flags = shlex.split(serve_args)

    def flag(name: str) -> str | None:
        return flags[flags.index(name) + 1] if name in flags[:-1] else None

    quantization = flag("--quantization")
    if quantization is None:  # serve's default: q4 where it pays
        quantization = "q4" if q4_pays(model, flag("--device") or "cpu", flag("--dtype")) else None
    if quantization == "none":
        quantization = None
    if quantization == "q4":
        return "the GGUF's own Q4_1 blocks (linears) and Q8_0 blocks (lm_head), through decodelab's C kernels"
    if quantization is not None:
        return f"the GGUF's Q4_1 dequantized to float32, then quantized to the library's {quantization}"
    return "the GGUF's Q4_1 dequantized to float32 (`decodelab prepare`), torch's CPU threads"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="an OpenAI-compatible server's /v1 URL")
    where.add_argument("--serve", metavar="MODEL", help="start `python -m decodelab serve --model MODEL` for the run")
    where.add_argument("--replot", metavar="JSON", help="redraw the plot of a comparison's JSON, and stop")
    parser.add_argument("--serve-args", default="", help="more flags for --serve, e.g. '--dtype bf16'")
    parser.add_argument(
        "--llama-cpp",
        choices=LLAMA_CPP_KINDS,
        help="also start llama.cpp's server on SmolLM2's GGUF and compare (with --serve smollm2): "
        "`server`, llama-server with --slots parallel slots; `python`, llama-cpp-python's (one slot)",
    )
    parser.add_argument("--llama-server", default=str(LLAMA_SERVER), help="the llama-server binary")
    parser.add_argument(
        "--slots", type=int, default=None, help="sequences at once, both servers (ours: --max-num-seqs)"
    )
    parser.add_argument("--model", default=None, help="the model name to ask for (default: the server's first)")
    parser.add_argument("--rates", default="2,8", help="requests per second, comma-separated (default 2,8)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-mean", type=float, default=56, help="mean of the exponential output draw")
    parser.add_argument("--output-max", type=int, default=256, help="the longest output, tokens")
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default 1)")
    parser.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (default 0.1)")
    parser.add_argument("--out", default=None, help="the JSON file (default bench/results/serving_load_MODEL.json)")
    args = parser.parse_args(argv)
    if args.llama_cpp is not None:
        problem = (
            "--llama-cpp compares with our server on the same GGUF: give --serve smollm2"
            if args.serve != "smollm2"
            else "--slots sets --max-num-seqs for both servers; leave it out of --serve-args"
            if "--max-num-seqs" in args.serve_args
            else "llama-cpp-python's server answers one request at a time: --llama-cpp python needs --slots 1"
            if args.llama_cpp == "python" and args.slots not in (None, 1)
            else llama_cpp_missing(args.llama_cpp, Path(args.llama_server))
        )
        if problem:
            sys.exit(f"serving_load.py: {problem}")
        args.slots = args.slots or (1 if args.llama_cpp == "python" else 4)
    elif args.slots is not None:
        if "--max-num-seqs" in args.serve_args or not args.serve:
            sys.exit("serving_load.py: --slots is for --serve (it gives ours --max-num-seqs)")
        args.serve_args += f" --max-num-seqs {args.slots}"
    return args


def main() -> None:
    args = parse_args()
    if args.replot:
        plotted = plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        if plotted:
            print(f"wrote {plotted}")
        return
    rates = [float(r) for r in args.rates.split(",")]
    command = spin_prefix() + "python bench/serving_load.py " + shlex.join(sys.argv[1:])
    print(command, flush=True)
    load_before = _load_average()
    result = {
        "command": command,
        "model": args.serve,
        "requests": args.requests,
        "seed": args.seed,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
        "workload": "Poisson arrivals; prompts lognormal words (median 24, <= 200) of held-out English; "
        f"outputs 8 + exponential(mean {args.output_mean:g}) tokens, <= {args.output_max}, no EOS stop, greedy, "
        "streamed; the same requests at every rate",
        "client": "the openai package's AsyncOpenAI, on the same machine as the server (it takes CPU too)",
        "cpus": os.cpu_count(),
        **omp_settings(),  # the servers inherit them (decodelab sets PASSIVE)
        "load_average_before": load_before,
    }
    if args.llama_cpp:
        result.update(compare(args, rates))
        result["load_average_after"] = _load_average()
        name = f"serving_load_{args.serve}_vs_llama_cpp_{args.llama_cpp}"
        out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"{name}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
        plotted = plot(result, out.with_suffix(".png"))
        if plotted:
            print(f"wrote {plotted}")
        return

    with our_server(args.serve, args.serve_args.split()) if args.serve else _given(args.base_url) as server:
        model = args.model or _first_model(server.url)
        rows = []
        for rate in rates:
            requests = plan(args.requests, rate, args.seed, args.output_mean, args.output_max)
            outcomes, duration = asyncio.run(run_rate(server, model, requests))
            rows.append(summarize(rate, outcomes, duration, args.ttft_slo, args.tpot_slo, requests))
            print_table(rows[-1:])
    print()
    print_table(rows)
    result.update(server=server.command, base_url=server.url, model=model, rates=rows)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"serving_load_{model}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


@contextmanager
def _given(url: str):
    yield Server(url, None)


def _first_model(url: str) -> str:
    import urllib.request

    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if "OPENAI_API_KEY" in os.environ else {}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/models", headers=headers), timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


if __name__ == "__main__":
    main()

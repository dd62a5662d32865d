"""Batch-1 greedy decode speed: decodelab's paths beside transformers and llama.cpp on the same
weights, against this machine's bandwidth roofline (every weight byte is read once per token;
the read bandwidth is probed once per round, between the engines, and its median taken).

    .venv/bin/python bench/decode_speed.py [--model smollm2] [--tokens 64] [--rounds 3]
        [--no-transformers] [--no-compile] [--no-llama-cpp]

Contenders, all run interleaved in one process so machine noise hits them alike:
* `decodelab`: the single-request generator, eager, float32 (`stream_token_ids`);
* `compiled`: the same with the decode step compiled (`decodelab.decoding.compiled`);
* `compiled int8`: compiled, every linear (lm_head too) int8 with the dequantization fused
  into the matrix-vector product (`decodelab.model.fused_int8`);
* `transformers`: its `generate`, float32;
* `llama.cpp`: llama-cpp-python on the GGUF file we ship (SmolLM2 only; `make bench-deps`
  installs it), with as many threads as torch.
Per-token decode time is the median gap between two tokens' arrivals, over every round
(the first token, which waits for prefill, starts the first gap): robust to the spikes of a
shared machine. The compile time (first call minus a compiled call of the same length; from
inductor's on-disk cache when it holds the graph, cold with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1)
is reported apart, as is the number of graphs compiled over all runs (1 means no recompiles as
the context grows). Writes bench/results/decode_speed_<model>_<device>.json, with the load average.

    .venv/bin/python bench/decode_speed.py --end-to-end [--model smollm2] [--rounds 2] [--no-cli]

`--end-to-end` measures what a user calling the public API gets instead, for every contender side by
side in one run (interleaved, best of the rounds): tokens/s = 64 / (t(72 new) - t(8 new)), each t the
wall time of one whole call (prefill, sampling, stop checks, detokenizing, the cache included; for
the CLI a fresh process each, so loading cancels out), beside the median gap between token arrivals
of the same path's streaming form (`stream_text` for `generate`, `LLM.stream` for `LLM.generate`,
stdout chunks for the CLI). Contenders: `generate` float32 and over
`CompiledDecoder(quantize_for_decode(model))` (torch.compile) and `PackagedDecoder` over the same
(the AOT-compiled step `python -m decodelab prepare` builds, when built), and (SmolLM2) `generate q4`
over `use_gguf_q4_weights` (the GGUF's own Q4_1 blocks, a fused C kernel); `LLM.generate` float32,
int8 eager, int8 with `compile_decode=True` and (SmolLM2) q4; `python -m decodelab generate --float`,
`... generate` with its default weights (q4 for SmolLM2 on a CPU where the kernel loads: `q4_pays`;
`... --q4` besides where q4 is not the default), `... --int8 --no-compile`
(eager), `... --int8` with no prepared package (torch.compile in every process: a cache folder without
one) and `... --int8` with it; llama.cpp when llama-cpp-python is installed. Besides the best of the
rounds, the JSON holds each round's tokens/s (median, min-max) and the wall time of a whole short call
(8 new tokens; for the CLI a whole fresh process: import, load, quantize, compile or package load).
`--only packaged,int8` keeps the contenders whose names hold one of the words (and `generate`, the
reference). Writes bench/results/decode_speed_<model>_<device>_end_to_end.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

# What `import decodelab` sets, here before torch starts its OpenMP threads (the imports below
# are sorted: torch comes first), so the figures are those a user of the library gets.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from omp_settings import cpu_name, omp_settings, spin_prefix  # noqa: E402  (bench/omp_settings.py)

from decodelab.decoding.compiled import CompiledDecoder  # noqa: E402
from decodelab.decoding.generate import stream_token_ids  # noqa: E402
from decodelab.lessons.measure import Roofline, matmul_flops, memory_bandwidth, parameter_bytes  # noqa: E402
from decodelab.model.fused_int8 import quantize_for_decode  # noqa: E402
from decodelab.model.q4_linear import use_gguf_q4_weights  # noqa: E402
from decodelab.model.registry import load, resolve_model, smollm2_gguf_path  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402

BASE_TOKENS = 16  # the warm-up run's length


def bytes_read_per_token(model) -> int:
    """`parameter_bytes`, less an embedding table that no matmul reads (a lookup reads one row):
    the case once the lm_head is quantized and no longer shares it."""
    embedding = model.model.embed_tokens.weight
    shared = getattr(model.lm_head, "weight", None) is embedding
    return parameter_bytes(model) - (0 if shared else embedding.nbytes)


def arrival_times(tokens) -> tuple[list[float], list[int]]:
    """Drain a token iterator; (perf_counter time at which each token arrived, the tokens)."""
    times, out = [], []
    for token in tokens:
        times.append(time.perf_counter())
        out.append(int(token))
    return times, out


def time_ours(model, prompt_ids, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return arrival_times(stream_token_ids(model, prompt_ids, params))


class ArrivalStreamer:
    """A `transformers` streamer that notes when each generated token arrives."""

    def __init__(self):
        self.times, self.tokens, self.seen_prompt = [], [], False

    def put(self, value):
        if not self.seen_prompt:  # generate hands the prompt over first
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self):
        pass


def time_transformers(hf_model, prompt_ids, n):
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    streamer = ArrivalStreamer()
    with torch.inference_mode():
        hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    return streamer.times, streamer.tokens


def time_llama_cpp(llm, prompt_ids, n):
    """Greedy (top_k=1) from llama.cpp, prefill included, EOS ignored: the same work as ours."""
    llm.reset()  # no reuse of the previous run's prompt: it prefills again, as ours does

    def tokens():
        for count, token in enumerate(
            llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0), start=1
        ):
            yield token
            if count == n:
                return

    return arrival_times(tokens())


def load_llama_cpp(threads: int):
    """llama-cpp-python on the shipped GGUF, or None when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(
        model_path=str(smollm2_gguf_path()),
        n_ctx=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )


def agreement(tokens: list[int], reference: list[int]) -> int:
    """Tokens identical before the first difference."""
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument(
        "--end-to-end",
        action="store_true",
        help="time whole calls of the public API (t(72) - t(8)) / 64, every contender",
    )
    parser.add_argument("--no-cli", action="store_true", help="with --end-to-end: leave out the CLI's processes")
    parser.add_argument(
        "--only",
        default=None,
        metavar="WORDS",
        help="with --end-to-end: only the contenders whose name holds one of these comma-separated words",
    )
    args = parser.parse_args()
    if args.end_to_end:
        return end_to_end(args)

    device = torch.device(args.device)
    load_average_before = os.getloadavg()
    model, tokenizer = load(args.model, device=device, dtype="float32")
    prompt = "What is gravity?"
    prompt_ids = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if tokenizer.chat_template else prompt
    )
    engines = {"decodelab": lambda n: time_ours(model, prompt_ids, n)}
    weight_bytes = {"decodelab": bytes_read_per_token(model)}
    decoders = {}
    if not args.no_compile:
        decoders["compiled"] = CompiledDecoder(model)
        int8_model = quantize_for_decode(copy.deepcopy(model))
        decoders["compiled int8"] = CompiledDecoder(int8_model)
        weight_bytes["compiled"] = weight_bytes["decodelab"]
        weight_bytes["compiled int8"] = bytes_read_per_token(int8_model)
        for name, decoder in decoders.items():
            engines[name] = lambda n, decoder=decoder: time_ours(decoder, prompt_ids, n)
    if not args.no_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
        hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32)
        hf = hf.to(device).eval()
        engines["transformers"] = lambda n: time_transformers(hf, prompt_ids, n)
        weight_bytes["transformers"] = weight_bytes["decodelab"]
    llm = (
        None
        if args.no_llama_cpp or args.model != "smollm2" or device.type != "cpu"
        else load_llama_cpp(torch.get_num_threads())
    )
    if llm is not None:
        engines["llama.cpp"] = lambda n: time_llama_cpp(llm, prompt_ids, n)
        weight_bytes["llama.cpp"] = smollm2_gguf_path().stat().st_size  # Q4_1 blocks (its metadata too)

    compile_seconds = {}
    for name, run in engines.items():  # warm-up; for a compiled path the first call compiles
        start = time.perf_counter()
        run(BASE_TOKENS)
        first = time.perf_counter() - start
        if name in decoders:
            start = time.perf_counter()
            run(BASE_TOKENS)
            compile_seconds[name] = first - (time.perf_counter() - start)
    intervals = {name: [] for name in engines}
    outputs, bandwidths = {}, []
    for _ in range(args.rounds):
        bandwidths.append(memory_bandwidth(device))  # probed in every round: the same load as the engines
        for name, run in engines.items():  # interleaved: same noise for all
            times, outputs[name] = run(args.tokens)
            intervals[name] += [b - a for a, b in zip(times, times[1:])]  # from the 2nd token: no prefill
    tokens_per_s = {name: 1 / statistics.median(v) for name, v in intervals.items()}
    bandwidth = statistics.median(bandwidths)
    roof = Roofline(bandwidth, matmul_flops(device))
    roofline = {name: roof.decode_tokens_per_second(weight_bytes[name]) for name in engines}
    result = {
        "command": spin_prefix() + "python bench/decode_speed.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "device": str(device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        **omp_settings(),
        "load_average_1_5_15_min": {"before": load_average_before, "after": os.getloadavg()},
        "cpu_count": os.cpu_count(),
        "bandwidth_GBps": bandwidth / 1e9,
        "bandwidth_GBps_per_round": [b / 1e9 for b in bandwidths],
        "matmul_GFLOPs": roof.peak_flops / 1e9,
        "weight_bytes_per_token": weight_bytes,
        "roofline_tokens_per_s": roofline,
        "tokens_per_s": tokens_per_s,
        "ms_per_token_quartiles": {
            name: [1e3 * q for q in statistics.quantiles(v, n=4)] for name, v in intervals.items()
        },
        "fraction_of_roofline": {name: tokens_per_s[name] / roofline[name] for name in engines},
        "speedup_vs_decodelab_eager": {name: tokens_per_s[name] / tokens_per_s["decodelab"] for name in engines},
        "greedy_tokens_same_as_decodelab_eager": {
            name: agreement(outputs[name], outputs["decodelab"]) for name in engines if name != "decodelab"
        },
        "greedy_tokens_compared": args.tokens,
        "compile_seconds": compile_seconds,  # from inductor's on-disk cache when it holds the graph
        "inductor_caches_disabled": os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1",
        "graphs_compiled": {name: decoder.compiles for name, decoder in decoders.items()},
    }
    if "transformers" in engines:
        result["speedup_vs_transformers"] = tokens_per_s["decodelab"] / tokens_per_s["transformers"]
    if "llama.cpp" in engines:
        result["llama_cpp"] = {
            "gguf": smollm2_gguf_path().name,
            "threads": torch.get_num_threads(),
            "version": __import__("llama_cpp").__version__,
            "loaded_from": str(Path(__import__("llama_cpp").__file__).parent),
        }
        result["slowdown_vs_llama_cpp"] = {
            name: tokens_per_s["llama.cpp"] / tokens_per_s[name] for name in engines if name != "llama.cpp"
        }
    out = Path(__file__).parent / "results" / f"decode_speed_{args.model}_{device.type}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"read bandwidth (GEMV) {bandwidth / 1e9:.1f} GB/s; load average {result['load_average_1_5_15_min']}")
    for name, tps in tokens_per_s.items():
        same = result["greedy_tokens_same_as_decodelab_eager"].get(name, args.tokens)
        print(
            f"{name:>14}: {tps:6.1f} tok/s  {weight_bytes[name] / 1e6:4.0f} MB/token  "
            f"({100 * result['fraction_of_roofline'][name]:3.0f}% of its roofline "
            f"{roofline[name]:5.1f} tok/s)  x{result['speedup_vs_decodelab_eager'][name]:.2f} eager  "
            f"greedy tokens same as eager: {same}/{args.tokens}"
        )
    for name, seconds in compile_seconds.items():
        print(f"{name}: compile {seconds:.1f} s, graphs compiled {decoders[name].compiles}")
    for name, ratio in result.get("slowdown_vs_llama_cpp", {}).items():
        print(f"llama.cpp / {name} = {ratio:.2f}x")
    print(f"wrote {out}")


# --------------------------------------------------------------------------- end to end
SHORT, LONG = 8, 72
E2E_PROMPT = "Explain in detail how gravity keeps the planets in orbit around the sun."


def e2e_generate(model, tokenizer, prompt_ids):
    """`decoding.generate.generate` (timed) and `stream_text`, its streaming form (gaps)."""
    from decodelab.decoding.generate import Completion, generate, stream_text

    def whole(n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        out = generate(model, tokenizer, E2E_PROMPT, params)  # chat=True: the same prompt_ids
        return time.perf_counter() - start, out.output_ids

    def stream(n):
        completion = Completion(list(prompt_ids))
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        times, _ = arrival_times(0 for _ in stream_text(model, tokenizer, prompt_ids, params, completion))
        return times

    return whole, stream


def e2e_llm(llm, prompt_ids):
    """`LLM.generate` (timed) and `LLM.stream` (gaps)."""

    def whole(n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        [out] = llm.generate([prompt_ids], params, use_tqdm=False)
        return time.perf_counter() - start, out.outputs[0].token_ids

    def stream(n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        times, _ = arrival_times(event.token_id for event in llm.stream([prompt_ids], params))
        return times

    return whole, stream


def e2e_cli(model_name, extra, env):
    """`python -m decodelab generate` in a fresh process: (wall time, output ids) of a --json run, and
    the arrival times of a text run's stdout chunks (the text streams token by token). The CLI has no
    ignore-EOS switch: the prompt asks for a long answer, and the ids it returned are counted."""
    import subprocess

    def stream(n):
        argv = [
            sys.executable,
            "-m",
            "decodelab",
            "generate",
            E2E_PROMPT,
            "--model",
            model_name,
            "--device",
            "cpu",
            "--max-new-tokens",
            str(n),
            *extra,
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        times = []
        while os.read(proc.stdout.fileno(), 65536):
            times.append(time.perf_counter())
        if proc.wait() != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}")
        return times

    def whole(n):
        start = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "decodelab",
                "generate",
                E2E_PROMPT,
                "--model",
                model_name,
                "--device",
                "cpu",
                "--max-new-tokens",
                str(n),
                "--json",
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"the CLI failed: {proc.stderr[-500:]}")
        return elapsed, json.loads(proc.stdout)["output_ids"]

    return whole, stream


def e2e_llama_cpp(llm, prompt_ids):
    def whole(n):
        start = time.perf_counter()
        _, tokens = time_llama_cpp(llm, prompt_ids, n)
        return time.perf_counter() - start, tokens

    def stream(n):
        return time_llama_cpp(llm, prompt_ids, n)[0]

    return whole, stream


def packaged_or_none(model):
    """`PackagedDecoder(model)` when `python -m decodelab prepare` built its package, else None."""
    from decodelab.decoding.packaged import PackagedDecoder

    try:
        return PackagedDecoder(model)
    except FileNotFoundError:
        return None


def unpackaged_cache() -> dict[str, str]:
    """Environment for a CLI whose cache holds the converted models but no prepared decode package
    (links to the real cache's model folders in a temporary folder), so `--int8` compiles."""
    import tempfile

    from decodelab.paths import cache_dir

    folder = Path(tempfile.mkdtemp(prefix="decodelab-unpackaged-"))
    for entry in cache_dir().iterdir():
        if entry.name != "aoti":
            (folder / entry.name).symlink_to(entry)
    return {"DECODELAB_CACHE": str(folder)}


def end_to_end(args):
    from decodelab.decoding.generate import encode_prompt
    from decodelab.engine.llm import LLM

    device = torch.device(args.device)
    load_average_before = os.getloadavg()
    model, tokenizer = load(args.model, device=device, dtype="float32")
    prompt_ids = encode_prompt(tokenizer, E2E_PROMPT, chat=True)
    int8_model = quantize_for_decode(copy.deepcopy(model))
    int8_decoder = CompiledDecoder(int8_model)
    contenders = {
        "generate": e2e_generate(model, tokenizer, prompt_ids),
        "generate int8 compiled": e2e_generate(int8_decoder, tokenizer, prompt_ids),
        "LLM.generate": e2e_llm(LLM((model, tokenizer)), prompt_ids),
        "LLM.generate int8 eager": e2e_llm(
            LLM(args.model, device=device, quantization="int8", compile_decode=False), prompt_ids
        ),
        "LLM.generate int8 compiled": e2e_llm(
            LLM(args.model, device=device, quantization="int8", compile_decode=True), prompt_ids
        ),
    }
    if args.model == "smollm2":  # the GGUF's own Q4_1 blocks, the fused C kernel (decodelab.model.q4_linear)
        q4_model = use_gguf_q4_weights(copy.deepcopy(model), smollm2_gguf_path())
        contenders["generate q4"] = e2e_generate(q4_model, tokenizer, prompt_ids)
        contenders["LLM.generate q4"] = e2e_llm(LLM(args.model, device=device, quantization="q4"), prompt_ids)
    if not args.no_cli and device.type == "cpu":
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [str(Path(__file__).resolve().parents[1] / "lib"), os.environ.get("PYTHONPATH", "")]
            ),
        )
        env.pop("DECODELAB_COMPILE", None)
        from decodelab.model.q4_linear import q4_pays

        default_weights = "q4" if q4_pays(args.model, device) else "float"
        contenders["CLI generate --float"] = e2e_cli(args.model, ["--float"], env)
        contenders[f"CLI generate (default: {default_weights})"] = e2e_cli(args.model, [], env)
        contenders["CLI generate --int8 --no-compile"] = e2e_cli(args.model, ["--int8", "--no-compile"], env)
        # torch.compile in every process: a cache with the converted model but no prepared package
        contenders["CLI generate --int8 compiled"] = e2e_cli(args.model, ["--int8"], dict(env, **unpackaged_cache()))
        contenders["CLI generate --int8 packaged"] = e2e_cli(args.model, ["--int8"], env)
        if args.model == "smollm2" and default_weights != "q4":
            contenders["CLI generate --q4"] = e2e_cli(args.model, ["--q4"], env)
    llama = (
        None
        if args.no_llama_cpp or args.model != "smollm2" or device.type != "cpu"
        else load_llama_cpp(torch.get_num_threads())
    )
    if llama is not None:
        contenders["llama.cpp"] = e2e_llama_cpp(llama, prompt_ids)
    packaged = packaged_or_none(int8_model)  # None until `python -m decodelab prepare` built it
    if packaged is not None:
        contenders["generate int8 packaged"] = e2e_generate(packaged, tokenizer, prompt_ids)
    if args.only:
        words = args.only.split(",")
        contenders = {name: c for name, c in contenders.items() if name == "generate" or any(w in name for w in words)}
    skipped = {} if llama is not None or args.no_llama_cpp else {"llama.cpp": "llama-cpp-python is not installed"}

    warm_up = {}
    for name, (whole, _) in contenders.items():  # a compiled path compiles here (or reads inductor's cache)
        start = time.perf_counter()
        whole(SHORT)
        warm_up[name] = time.perf_counter() - start
    best = {name: {SHORT: float("inf"), LONG: float("inf")} for name in contenders}
    calls = {name: {SHORT: [], LONG: []} for name in contenders}  # every round's seconds
    gaps, tokens = {name: [] for name in contenders}, {}
    for _ in range(args.rounds):
        for name, (whole, stream) in contenders.items():  # interleaved: the same noise for all
            for n in (SHORT, LONG):
                seconds, ids = whole(n)
                best[name][n] = min(best[name][n], seconds)
                calls[name][n].append(seconds)
                if n == LONG:
                    tokens[name] = ids
            times = stream(LONG)
            gaps[name] += [b - a for a, b in zip(times, times[1:])]
    per_token = {name: (t[LONG] - t[SHORT]) / (LONG - SHORT) for name, t in best.items()}
    tokens_per_s = {name: 1 / s for name, s in per_token.items()}
    gap_tokens_per_s = {name: 1 / statistics.median(g) for name, g in gaps.items() if g}
    reference = tokens["generate"]
    # per round: 1 / ((t(LONG) - t(SHORT)) / 64); its median and spread over the rounds
    round_tps = {
        name: sorted((LONG - SHORT) / (b - a) for a, b in zip(t[SHORT], t[LONG]) if b > a) for name, t in calls.items()
    }
    result = {
        "command": spin_prefix() + "python bench/decode_speed.py " + " ".join(sys.argv[1:]),
        "what": "end to end through the public API: tokens/s = (LONG - SHORT) / (t(LONG new) - t(SHORT new)), "
        "each t the best over the rounds of one whole call; beside it 1 / the median gap between token "
        "arrivals of the same path's streaming form",
        "model": args.model,
        "device": str(device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        **omp_settings(),
        "load_average_1_5_15_min": {"before": load_average_before, "after": os.getloadavg()},
        "prompt": E2E_PROMPT,
        "prompt_tokens": len(prompt_ids),
        "short_long_new_tokens": [SHORT, LONG],
        "rounds": args.rounds,
        "end_to_end_tokens_per_s": tokens_per_s,
        "median_gap_tokens_per_s": gap_tokens_per_s,
        "best_call_seconds": {name: {str(n): s for n, s in t.items()} for name, t in best.items()},
        "first_call_seconds (compile or cache read included)": warm_up,
        "median_round_tokens_per_s": {name: statistics.median(v) for name, v in round_tps.items() if v},
        "round_tokens_per_s_min_max": {name: [v[0], v[-1]] for name, v in round_tps.items() if v},
        "short_call_seconds_median_min_max (whole call of 8 new tokens; a fresh process for the CLI)": {
            name: [statistics.median(t[SHORT]), min(t[SHORT]), max(t[SHORT])] for name, t in calls.items()
        },
        "end_to_end_vs_generate": {name: tps / tokens_per_s["generate"] for name, tps in tokens_per_s.items()},
        "new_tokens_returned": {name: len(ids) for name, ids in tokens.items()},
        "greedy_tokens_same_as_generate_float32": {name: agreement(ids, reference) for name, ids in tokens.items()},
        "skipped": skipped,
    }
    if "llama.cpp" in tokens_per_s:
        result["end_to_end_vs_llama_cpp"] = {
            name: tps / tokens_per_s["llama.cpp"] for name, tps in tokens_per_s.items()
        }
    out = Path(__file__).parent / "results" / f"decode_speed_{args.model}_{device.type}_end_to_end.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average {result['load_average_1_5_15_min']}; {args.rounds} rounds, best of each")
    print(
        f"{'contender':>36}  end-to-end tok/s  median (min-max) of rounds  median-gap tok/s  "
        f"short call s (median)  x generate  same greedy tokens"
    )
    for name, tps in tokens_per_s.items():
        spread = round_tps[name]
        print(
            f"{name:>36}  {tps:16.1f}  {statistics.median(spread):8.1f} ({spread[0]:.1f}-{spread[-1]:.1f})  "
            f"{gap_tokens_per_s.get(name, float('nan')):16.1f}  {statistics.median(calls[name][SHORT]):21.2f}  "
            f"{result['end_to_end_vs_generate'][name]:10.2f}  "
            f"{result['greedy_tokens_same_as_generate_float32'][name]}/{len(tokens[name])}"
        )
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

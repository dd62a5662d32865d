"""Serving throughput on SmolLM2: continuous batching vs static batching vs one request at
a time vs a `transformers` batch-1 generate loop, on the same weights, in one run.
Then prefix caching: time to first token with a shared 384-token system prompt.

    .venv/bin/python bench/serving.py [--requests 64] [--max-num-seqs 16,32] [--workload long-tail]
                                      [--engine-dtypes float32,bfloat16] [--unmixed] [--unpacked] [--rounds 1]
                                      [--skip-slow]

Every request generates a fixed number of tokens (ignore_eos), so every mode does exactly
the same work. Two workloads:
  uniform    chat questions; output lengths uniform in 16..128
  long-tail  chat questions, 30% of them with a passage of 100..400 tokens to summarize
             first; output lengths 8 + an exponential draw of mean 56, at most 256 (chat
             answers are long-tailed: most are short, a few are long)
Static batching admits the next group only when the whole current group has finished
(request-level scheduling); continuous batching refills a slot the step after it frees
(iteration-level scheduling), and its running sequences keep decoding in the steps that
prefill newcomers (--unmixed also runs it without that). The engine runs in each of
--engine-dtypes (the same checkpoint; bfloat16 matmuls use the CPU's AMX/AVX-512 units where
present, on weights prepacked for oneDNN: --unpacked also runs it on plain ones) at each of
--max-num-seqs; the batch-1 baselines run in float32, their fastest
setting on CPU (a bfloat16 matrix-vector product is slower there: `transformers` generated
17.4 tok/s in float32 and 14.8 in bfloat16 here).
torch is imported before decodelab, so OpenMP keeps its default spin-waiting, the fastest
setting for every mode on an idle machine: run it on a quiet one. On a shared machine whose
speed drifts, --rounds N runs every engine mode N times, in alternating order, and reports the
median (the two batch-1 baselines, minutes each, run once, in the first round).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodelab.engine.llm import LLM  # noqa: E402
from decodelab.lessons.measure import timed  # noqa: E402
from decodelab.model.registry import resolve_model  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is gravity?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Explain photosynthesis simply.",
    "Give me a tip for learning Python.",
    "What is a prime number?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "Suggest a name for a dog.",
    "What does a CPU do?",
    "Summarize the plot of Cinderella.",
]


def workload(tokenizer, n: int, seed: int, kind: str = "uniform"):
    """(prompts as token ids, SamplingParams) for n requests (module docstring)."""
    from decodelab.lessons.perplexity import heldout_text

    rng = random.Random(seed)
    passage_ids = tokenizer.encode(heldout_text("en"))
    prompts, params = [], []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)] + (" Please be brief." if rng.random() < 0.5 else "")
        if kind == "long-tail" and rng.random() < 0.3:
            start, length = rng.randrange(len(passage_ids) - 400), rng.randint(100, 400)
            question = "Summarize this passage:\n" + tokenizer.decode(passage_ids[start : start + length])
        messages = [{"role": "user", "content": question}]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages)))
        if kind == "uniform":
            max_tokens = rng.randint(16, 128)
        else:
            max_tokens = min(256, 8 + round(-56 * math.log(1 - rng.random())))
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return prompts, params


def run_static(llm, prompts, params, group):
    outs = []
    for i in range(0, len(prompts), group):
        outs += llm.generate(prompts[i : i + group], params[i : i + group], use_tqdm=False)
    return outs


def run_transformers(folder, prompts, params):
    import transformers

    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        for ids, p in zip(prompts, params):
            x = torch.tensor([ids])
            hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=p.max_tokens,
                min_new_tokens=p.max_tokens,
                pad_token_id=0,
            )


def prefix_caching(llm_factory, system_len: int, n: int):
    """TTFT per request (prefill + first token), one at a time, with and without the cache."""
    result = {}
    for enabled in (False, True):
        llm = llm_factory(enabled)
        tok = llm.tokenizer
        system = "You are a careful assistant. " * 200
        system_ids = tok.encode(system)[:system_len]
        ttfts = []
        for i in range(n):
            ids = system_ids + tok.encode(f"\nQuestion {i}: " + QUESTIONS[i % len(QUESTIONS)])
            out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            ttfts.append(out.metrics["ttft_s"])
        key = "cached" if enabled else "uncached"
        result[key] = {
            "ttft_ms_median_after_first": 1e3 * sorted(ttfts[1:])[len(ttfts[1:]) // 2],
            "ttft_ms_first": 1e3 * ttfts[0],
        }
        if enabled:
            result["hit_rate"] = llm.allocator.hits / max(1, llm.allocator.queries)
    result["speedup"] = (
        result["uncached"]["ttft_ms_median_after_first"] / result["cached"]["ttft_ms_median_after_first"]
    )
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--max-num-seqs", default="16", help="comma-separated batch widths the engine runs at (continuous and static)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=["uniform", "long-tail"], default="long-tail")
    parser.add_argument(
        "--engine-dtypes",
        default="float32,bfloat16",
        help="comma-separated dtypes the engine runs in (continuous and static)",
    )
    parser.add_argument(
        "--unmixed", action="store_true", help="also run continuous batching without mixing decodes into prefill steps"
    )
    parser.add_argument(
        "--unpacked", action="store_true", help="also run continuous batching in bfloat16 without prepacked weights"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every engine mode, interleaved; the median is reported"
    )
    parser.add_argument("--skip-slow", action="store_true", help="skip one-at-a-time, transformers, prefix caching")
    args = parser.parse_args()

    dtypes, widths = args.engine_dtypes.split(","), [int(w) for w in args.max_num_seqs.split(",")]
    variants = (
        [("", {})]
        + ([(" unmixed", {"mix_decode_with_prefill": False})] if args.unmixed else [])
        + ([(" unpacked", {"prepack_weights": False})] if args.unpacked else [])
    )
    engines = {
        (dtype, width, label): LLM(args.model, device="cpu", dtype=getattr(torch, dtype), max_num_seqs=width, **options)
        for dtype in dtypes
        for width in widths
        for label, options in variants
        if label != " unpacked" or dtype == "bfloat16"
    }  # only bfloat16 weights are packed
    tokenizer = next(iter(engines.values())).tokenizer
    prompts, params = workload(tokenizer, args.requests, args.seed, args.workload)
    total_tokens = sum(p.max_tokens for p in params)
    print(
        f"{args.requests} requests ({args.workload}): prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens, outputs {min(p.max_tokens for p in params)}-{max(p.max_tokens for p in params)} "
        f"(mean {total_tokens / len(params):.0f}), {total_tokens} tokens in all; max_num_seqs {args.max_num_seqs}",
        flush=True,
    )
    modes = {}
    for (dtype, width, label), llm in engines.items():
        llm.generate(prompts[:2], [SamplingParams(temperature=0, max_tokens=4)] * 2, use_tqdm=False)  # warm-up
        modes[f"continuous {dtype} x{width}{label}"] = lambda llm=llm: llm.generate(prompts, params, use_tqdm=False)
        if not label:
            modes[f"static {dtype} x{width}"] = lambda llm=llm, width=width: run_static(llm, prompts, params, width)
    if not args.skip_slow:
        fp32 = engines.get(("float32", widths[0], "")) or LLM(args.model, device="cpu", dtype=torch.float32)
        modes["one at a time float32"] = lambda: [
            fp32.generate([p], [sp], use_tqdm=False) for p, sp in zip(prompts, params)
        ]
        modes["transformers batch-1 loop float32"] = lambda: run_transformers(
            resolve_model(args.model), prompts, params
        )
    runs = {name: [] for name in modes}
    for round_index in range(args.rounds):
        order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
        for name in order:
            if runs[name] and not name.startswith(("continuous", "static")):
                continue  # a batch-1 baseline: once
            runs[name].append(timed(modes[name])[0])
            print(
                f"{name:>40}: {total_tokens / runs[name][-1]:7.1f} tok/s ({runs[name][-1]:.1f} s)"
                + (f", round {round_index + 1}" if args.rounds > 1 else ""),
                flush=True,
            )
    seconds = {name: statistics.median(times) for name, times in runs.items()}
    if args.rounds > 1:
        for name, s in seconds.items():
            print(f"{name:>40}: {total_tokens / s:7.1f} tok/s median of {len(runs[name])}", flush=True)
    throughput = {name: total_tokens / s for name, s in seconds.items()}
    ratios = {}
    for dtype in dtypes:
        for width in widths:
            continuous = f"continuous {dtype} x{width}"
            for name, t in throughput.items():  # against its own static run and every baseline
                if name == f"static {dtype} x{width}" or not name.startswith(("continuous", "static")):
                    ratios[f"{continuous} / {name}"] = throughput[continuous] / t
            for label in (" unmixed", " unpacked"):
                if continuous + label in throughput:
                    ratios[f"{continuous} /{label}"] = throughput[continuous] / throughput[continuous + label]
    for name, r in ratios.items():
        print(f"{name:>66}: {r:.2f}x")
    result = {
        "command": "python bench/serving.py " + " ".join(sys.argv[1:]),
        "workload": args.workload,
        "requests": args.requests,
        "max_num_seqs": widths,
        "generated_tokens": total_tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "rounds": args.rounds,
        "seconds_each_run": runs,
        "seconds": seconds,
        "tokens_per_s": throughput,
        "ratios": ratios,
        "goals": {"continuous / static": 1.5, "continuous / transformers batch-1 loop": 10},
        "load_average": os.getloadavg(),
    }
    if not args.skip_slow:
        prefix = prefix_caching(
            lambda on: LLM(args.model, device="cpu", enable_prefix_caching=on, num_kv_blocks=256), 384, 6
        )
        print(
            f"prefix caching, 384-token shared system prompt: TTFT "
            f"{prefix['uncached']['ttft_ms_median_after_first']:.1f} ms -> "
            f"{prefix['cached']['ttft_ms_median_after_first']:.1f} ms ({prefix['speedup']:.1f}x), "
            f"hit rate {100 * prefix['hit_rate']:.0f}% (seed: 96.8 ms recompute vs 13.4 ms reuse)"
        )
        result["prefix_caching"] = prefix
    out = Path(__file__).parent / "results" / f"serving_{args.workload}{'_fast' if args.skip_slow else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

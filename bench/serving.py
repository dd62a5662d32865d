"""Serving throughput on SmolLM2: continuous batching vs static batching vs one request at
a time vs a `transformers` batch-1 generate loop, on the same weights, in one run.
Then prefix caching: time to first token with a shared 384-token system prompt.

    .venv/bin/python bench/serving.py [--requests 64] [--max-num-seqs 16] [--skip-slow]

Every request generates a fixed number of tokens (ignore_eos), mixed between 16 and 128,
so every mode does exactly the same work. Static batching admits the next group only when
the whole current group has finished (request-level scheduling); continuous batching
refills a slot the step after it frees (iteration-level scheduling).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodelab.engine import LLM  # noqa: E402
from decodelab.models import resolve_model  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402

QUESTIONS = ["What is gravity?", "Name three colours.", "Write a haiku about the sea.", "What is 2+2?",
             "Explain photosynthesis simply.", "Give me a tip for learning Python.", "What is a prime number?",
             "Describe a cat in one sentence.", "Why is the sky blue?", "Suggest a name for a dog.",
             "What does a CPU do?", "Summarize the plot of Cinderella."]


def workload(llm, n: int, seed: int):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)] + (" Please be brief." if rng.random() < 0.5 else "")
        messages = [{"role": "user", "content": question}]
        prompts.append(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages)))
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(16, 128), ignore_eos=True))
    return prompts, params


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_static(llm, prompts, params, group):
    outs = []
    for i in range(0, len(prompts), group):
        outs += llm.generate(prompts[i:i + group], params[i:i + group], use_tqdm=False)
    return outs


def run_transformers(folder, prompts, params):
    import transformers
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        for ids, p in zip(prompts, params):
            x = torch.tensor([ids])
            hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=p.max_tokens,
                        min_new_tokens=p.max_tokens, pad_token_id=0)


def prefix_caching(llm_factory, system_len: int, n: int):
    """TTFT per request (prefill + first token), one at a time, with and without the cache."""
    result = {}
    for enabled in (False, True):
        llm = llm_factory(enabled)
        tok = llm.tokenizer
        system = ("You are a careful assistant. " * 200)
        system_ids = tok.encode(system)[:system_len]
        ttfts = []
        for i in range(n):
            ids = system_ids + tok.encode(f"\nQuestion {i}: " + QUESTIONS[i % len(QUESTIONS)])
            out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
            ttfts.append(out.metrics["ttft_s"])
        key = "cached" if enabled else "uncached"
        result[key] = {"ttft_ms_median_after_first": 1e3 * sorted(ttfts[1:])[len(ttfts[1:]) // 2],
                       "ttft_ms_first": 1e3 * ttfts[0]}
        if enabled:
            result["hit_rate"] = llm.allocator.hits / max(1, llm.allocator.queries)
    result["speedup"] = result["uncached"]["ttft_ms_median_after_first"] / result["cached"]["ttft_ms_median_after_first"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="engine weights: float32 or bfloat16 (transformers: float32)")
    parser.add_argument("--skip-slow", action="store_true", help="skip one-at-a-time and transformers")
    args = parser.parse_args()

    llm = LLM(args.model, device="cpu", dtype=getattr(torch, args.dtype), max_num_seqs=args.max_num_seqs)
    prompts, params = workload(llm, args.requests, args.seed)
    total_tokens = sum(p.max_tokens for p in params)
    llm.generate(prompts[:2], [SamplingParams(temperature=0, max_tokens=4)] * 2, use_tqdm=False)  # warm-up
    modes = {"continuous": lambda: llm.generate(prompts, params, use_tqdm=False),
             "static": lambda: run_static(llm, prompts, params, args.max_num_seqs)}
    if not args.skip_slow:
        modes["one at a time"] = lambda: [llm.generate([p], [sp], use_tqdm=False) for p, sp in zip(prompts, params)]
        modes["transformers batch-1 loop"] = lambda: run_transformers(resolve_model(args.model), prompts, params)
    seconds = {}
    for name, fn in modes.items():
        seconds[name], _ = timed(fn)
        print(f"{name:>26}: {total_tokens / seconds[name]:7.1f} tok/s ({seconds[name]:.1f} s)", flush=True)
    throughput = {name: total_tokens / s for name, s in seconds.items()}
    ratios = {f"continuous / {name}": throughput["continuous"] / t for name, t in throughput.items()
              if name != "continuous"}
    for name, r in ratios.items():
        print(f"{name:>40}: {r:.2f}x")
    prefix = prefix_caching(lambda on: LLM(args.model, device="cpu", enable_prefix_caching=on, num_kv_blocks=256),
                            384, 6)
    print(f"prefix caching, 384-token shared system prompt: TTFT {prefix['uncached']['ttft_ms_median_after_first']:.1f}"
          f" ms -> {prefix['cached']['ttft_ms_median_after_first']:.1f} ms ({prefix['speedup']:.1f}x), "
          f"hit rate {100 * prefix['hit_rate']:.0f}% (seed: 96.8 ms recompute vs 13.4 ms reuse)")
    result = {"command": "python bench/serving.py " + " ".join(sys.argv[1:]), "requests": args.requests,
              "max_num_seqs": args.max_num_seqs, "generated_tokens": total_tokens, "seconds": seconds,
              "tokens_per_s": throughput, "ratios": ratios, "prefix_caching": prefix,
              "goals": {"continuous / static": 1.5, "continuous / transformers batch-1 loop": 10}}
    out = Path(__file__).parent / "results" / "serving.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

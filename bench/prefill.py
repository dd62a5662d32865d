"""Prefill vs feeding the prompt one token at a time, shared-prefix reuse, and TTFT.

    .venv/bin/python bench/prefill.py [--models tiny,smollm2] [--lengths 64,256] [--prefix 384]
                                      [--suffix 64] [--rounds 5] [--device cpu]

1. A prompt of T tokens (64, 256) prefilled in one forward pass vs fed in T passes of one
   token (`decodelab.lessons.prefill_decode.prefill` / `feed_one_by_one`); both fill a KV cache.
2. A shared prefix of 384 tokens + a 64-token suffix: recomputed from scratch (448 tokens)
   vs the prefix's cache copied (`clone_cache`) and only the suffix prefilled.
3. Time to first token and inter-token latency (`measure_latency`) for each prompt length.

Variants are timed interleaved within each round (the machine is shared and noisy);
medians over rounds. Text: held-out Python source. Writes bench/results/prefill_<model>_<device>.json.
Seed figures (notebook 04 draft): prefill ~4.1x faster than one by one; 384 + 64 tokens:
96.8 ms recompute vs 13.4 ms reuse.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning threads thrash a shared machine

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodelab.lessons.measure import timed  # noqa: E402
from decodelab.lessons.perplexity import heldout_text  # noqa: E402
from decodelab.lessons.prefill_decode import clone_cache, feed_one_by_one, measure_latency, prefill  # noqa: E402
from decodelab.model.kv_cache import KVCache  # noqa: E402
from decodelab.model.registry import load  # noqa: E402
from decodelab.paths import PACKAGE_DATA  # noqa: E402

SEED = {"prefill_speedup": 4.1, "recompute_ms": 96.8, "reuse_ms": 13.4}


def run_interleaved(variants: dict, rounds: int, device) -> dict:
    """Median seconds per variant; each round runs every variant once, order alternating."""
    times = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(timed(variants[name], device)[0])
    return {name: statistics.median(v) for name, v in times.items()} | {"all_s": times}


def bench_model(name: str, device, args) -> dict:
    model, tokenizer = load(name, device=device, dtype="float32")
    config = model.config
    need = max(max(args.lengths), args.prefix + args.suffix)
    ids = tokenizer.encode(heldout_text("code"))[:need]
    if len(ids) < need:
        raise SystemExit(f"held-out text has only {len(ids)} tokens for {name}")
    new_cache = lambda n: KVCache(config, 1, n, device=device, dtype=model.dtype)  # noqa: E731

    prompt_rows = []
    for T in args.lengths:
        prompt = ids[:T]
        t = run_interleaved(
            {
                "prefill": lambda: prefill(model, prompt, new_cache(T)),
                "one_by_one": lambda: feed_one_by_one(model, prompt, new_cache(T)),
            },
            args.rounds,
            device,
        )
        prompt_rows.append(
            {
                "T": T,
                "prefill_ms": 1e3 * t["prefill"],
                "one_by_one_ms": 1e3 * t["one_by_one"],
                "speedup": t["one_by_one"] / t["prefill"],
                "all_s": t["all_s"],
            }
        )

    prefix, suffix = ids[: args.prefix], ids[args.prefix : args.prefix + args.suffix]
    total = args.prefix + args.suffix
    prefix_cache = new_cache(total)
    prefix_ms = 1e3 * timed(lambda: prefill(model, prefix, prefix_cache), device)[0]  # paid once, shared
    t = run_interleaved(
        {
            "recompute": lambda: prefill(model, prefix + suffix, new_cache(total)),
            "reuse": lambda: prefill(model, suffix, clone_cache(prefix_cache)),
        },
        args.rounds,
        device,
    )
    with torch.inference_mode():
        same = (
            (prefill(model, prefix + suffix, new_cache(total)) - prefill(model, suffix, clone_cache(prefix_cache)))
            .abs()
            .max()
            .item()
        )
    reuse = {
        "prefix": args.prefix,
        "suffix": args.suffix,
        "recompute_ms": 1e3 * t["recompute"],
        "reuse_ms": 1e3 * t["reuse"],
        "speedup": t["recompute"] / t["reuse"],
        "prefix_prefill_once_ms": prefix_ms,
        "max_logit_diff": same,
        "all_s": t["all_s"],
    }

    latency_rows = []
    for T in args.lengths:
        runs = [measure_latency(model, ids[:T], args.latency_tokens) for _ in range(args.rounds)]
        latency_rows.append(
            {
                "T": T,
                "ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in runs),
                "itl_ms": 1e3 * statistics.median(x for r in runs for x in r["itl_s"]),
                "tokens": args.latency_tokens,
            }
        )
    return {"model": name, "prompt": prompt_rows, "prefix_reuse": reuse, "latency": latency_rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--lengths", default="64,256")
    parser.add_argument("--prefix", type=int, default=384)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    command = "python bench/prefill.py " + " ".join(sys.argv[1:])
    device = torch.device(args.device)

    for name in args.models.split(","):
        if name == "tiny" and not (PACKAGE_DATA / "tiny" / "config.json").exists():
            print(f"skipping {name}: not trained yet")
            continue
        result = bench_model(name, device, args)
        result.update(
            command=command,
            device=str(device),
            torch=torch.__version__,
            torch_threads=torch.get_num_threads(),
            cpu=platform.processor() or platform.machine(),
            rounds=args.rounds,
            text="decodelab.lessons.perplexity.heldout_text('code')",
            seed=SEED,
        )
        out = Path(__file__).parent / "results" / f"prefill_{name}_{device.type}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

        print(f"\n{name} on {device} ({torch.get_num_threads()} threads), median of {args.rounds} rounds")
        print(f"$ {command}")
        print(f"{'prompt':>7} {'prefill ms':>11} {'1-by-1 ms':>10} {'speedup':>8} {'seed':>6}")
        for row in result["prompt"]:
            print(
                f"{row['T']:>7} {row['prefill_ms']:>11.1f} {row['one_by_one_ms']:>10.1f} "
                f"{row['speedup']:>7.1f}x {SEED['prefill_speedup']:>5.1f}x"
            )
        r = result["prefix_reuse"]
        print(
            f"prefix {r['prefix']} + suffix {r['suffix']}: recompute {r['recompute_ms']:.1f} ms "
            f"(seed {SEED['recompute_ms']}), reuse {r['reuse_ms']:.1f} ms (seed {SEED['reuse_ms']}) "
            f"-> {r['speedup']:.1f}x (seed {SEED['recompute_ms'] / SEED['reuse_ms']:.1f}x); "
            f"prefix prefilled once in {r['prefix_prefill_once_ms']:.1f} ms; "
            f"max logit diff {r['max_logit_diff']:.2g}"
        )
        for row in result["latency"]:
            print(
                f"TTFT at {row['T']} prompt tokens: {row['ttft_ms']:.1f} ms; "
                f"median inter-token latency {row['itl_ms']:.1f} ms ({row['tokens']} tokens)"
            )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

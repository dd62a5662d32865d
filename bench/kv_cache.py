"""What the KV cache buys: time per generated token at sequence lengths 16 .. 511, without a
cache (a forward pass over all T tokens) and with one (a forward pass over the newest token,
attending to T - 1 cached positions), on the same model and the same held-out Python source.

    .venv/bin/python bench/kv_cache.py [--models tiny,smollm2] [--positions 16,32,64,128,256,511]
                                       [--rounds 5] [--gen 32] [--device cpu]

Both variants are timed interleaved, position by position, in one process (the machine is
shared and noisy) and the median over rounds is reported. Also: greedy generation with and
without the cache (same tokens? largest logit difference?) and the K/V rows each computes.
Writes bench/results/kv_cache_<model>_<device>.json. Seed figures (notebook 04 draft):
4.2x faster at T=16 up to 92x at T=511; same tokens, max logit diff ~3e-6.
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
from decodelab.model.kv_cache import KVCache  # noqa: E402
from decodelab.model.registry import load  # noqa: E402
from decodelab.paths import PACKAGE_DATA  # noqa: E402

SEED_SPEEDUP = {16: 4.2, 511: 92.0}
SEED_MAX_LOGIT_DIFF = 3e-6


@torch.inference_mode()
def per_token_times(model, ids: torch.Tensor, positions: list[int], rounds: int) -> dict:
    """Median seconds to get the next-token logits of a T-token sequence, per T, both ways."""
    device, top = model.device, max(positions)
    cache = KVCache(model.config, 1, top, device=device, dtype=model.dtype)
    times = {T: {"no_cache": [], "cache": []} for T in positions}
    model(ids[:, : positions[0]])  # warm-up
    for r in range(rounds):
        cache.truncate(0)
        for T in positions:
            if cache.seq_len < T - 1:  # bring the cache to T - 1 tokens (untimed)
                model(ids[:, cache.seq_len : T - 1], kv_cache=cache)
            cache.truncate(T - 1)
            no_cache = lambda: model(ids[:, :T], last_only=True)  # noqa: E731
            with_cache = lambda: model(ids[:, T - 1 : T], kv_cache=cache)  # noqa: E731
            order = [("no_cache", no_cache), ("cache", with_cache)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                if name == "cache":
                    cache.truncate(T - 1)
                times[T][name].append(timed(fn, device)[0])
    return {T: {name: statistics.median(v) for name, v in d.items()} | {"all": d} for T, d in times.items()}


@torch.inference_mode()
def greedy_both_ways(model, prompt: torch.Tensor, n: int) -> dict:
    """Greedy-generate n tokens with the cache and by full recomputation; compare."""
    cache = KVCache(model.config, 1, prompt.shape[1] + n, device=model.device, dtype=model.dtype)
    seq, logits_cached, logits_full = prompt, [], []
    inputs = prompt
    for _ in range(n):
        step = model(inputs, kv_cache=cache, last_only=True)[0, -1]
        full = model(seq, last_only=True)[0, -1]
        logits_cached.append(step)
        logits_full.append(full)
        inputs = step.argmax().view(1, 1)
        seq = torch.cat([seq, inputs], dim=1)
    tokens_cached = [int(x.argmax()) for x in logits_cached]
    tokens_full = [int(x.argmax()) for x in logits_full]
    diff = max(float((a - b).abs().max()) for a, b in zip(logits_cached, logits_full))
    return {"same_tokens": tokens_cached == tokens_full, "max_logit_diff": diff, "tokens": n}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--positions", default="16,32,64,128,256,511")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    positions = sorted(int(p) for p in args.positions.split(","))
    command = "python bench/kv_cache.py " + " ".join(sys.argv[1:])
    device = torch.device(args.device)

    for name in args.models.split(","):
        if name == "tiny" and not (PACKAGE_DATA / "tiny" / "config.json").exists():
            print(f"skipping {name}: not trained yet")
            continue
        model, tokenizer = load(name, device=device, dtype="float32")
        ids = torch.tensor([tokenizer.encode(heldout_text("code"))[: max(positions)]], device=device)
        if ids.shape[1] < max(positions):
            raise SystemExit(f"held-out text has only {ids.shape[1]} tokens for {name}")
        times = per_token_times(model, ids, positions, args.rounds)
        check = greedy_both_ways(model, ids[:, :16], args.gen)
        rows = []
        for T in positions:
            rows.append(
                {
                    "T": T,
                    "no_cache_ms": 1e3 * times[T]["no_cache"],
                    "cache_ms": 1e3 * times[T]["cache"],
                    "speedup": times[T]["no_cache"] / times[T]["cache"],
                    "seed_speedup": SEED_SPEEDUP.get(T),
                    "kv_rows_no_cache": T * (T + 1) // 2,
                    "kv_rows_cache": T,
                    "all_ms": {k: [1e3 * t for t in v] for k, v in times[T]["all"].items()},
                }
            )
        result = {
            "command": command,
            "model": name,
            "device": str(device),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "rounds": args.rounds,
            "text": "decodelab.lessons.perplexity.heldout_text('code')",
            "per_token": rows,
            "greedy_check": check,
            "seed": {"speedup": SEED_SPEEDUP, "max_logit_diff": SEED_MAX_LOGIT_DIFF},
        }
        out = Path(__file__).parent / "results" / f"kv_cache_{name}_{device.type}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

        print(f"\n{name} on {device} ({torch.get_num_threads()} threads), median of {args.rounds} rounds")
        print(f"$ {command}")
        print(
            f"{'T':>5} {'no cache ms':>12} {'cache ms':>9} {'speedup':>8} {'seed':>6}   "
            f"K/V rows to generate T tokens: 1+..+T vs T"
        )
        for row in rows:
            seed = f"{row['seed_speedup']:.1f}x" if row["seed_speedup"] else "-"
            print(
                f"{row['T']:>5} {row['no_cache_ms']:>12.2f} {row['cache_ms']:>9.2f} {row['speedup']:>7.1f}x "
                f"{seed:>6}   {row['kv_rows_no_cache']:>7,} vs {row['kv_rows_cache']:,} "
                f"({row['kv_rows_no_cache'] / row['kv_rows_cache']:.0f}x)"
            )
        print(
            f"greedy {check['tokens']} tokens with vs without cache: same tokens {check['same_tokens']}, "
            f"max logit diff {check['max_logit_diff']:.2g} (seed: same, ~{SEED_MAX_LOGIT_DIFF:.0e})"
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

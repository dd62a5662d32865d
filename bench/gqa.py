"""Fewer KV heads: a smaller cache and a faster decode step — and what pooling costs in quality.

    .venv/bin/python bench/gqa.py [--heads 8,2,1] [--seq-len 2048] [--rounds 20]
                                  [--tiny-heads 8,4,2,1] [--ppl-tokens 4096] [--device cpu]

1. A random-weight model shaped so that its cache dominates a decode step, as in the seed:
   4 layers, 8 query heads of head_dim 64, hidden 128, SwiGLU 256, vocab 1024, fp32. At
   2,048 positions its KV cache is 2 x 4 layers x 8 heads x 64 x 2048 x 4 bytes = 32 MiB, the
   seed's "32 MB" (the seed's 32 -> 8 -> 4 are MiB; in SI units 33.6 -> 8.4 -> 4.2 MB).
   Its K/V heads are mean-pooled (`pool_model_kv_heads`) to 2 and 1; we time one decode step
   with 2,047 positions cached.
2. The trained `tiny` model (8 KV heads) pooled 8 -> 4 -> 2 -> 1 without uptraining: cache
   size and decode step at its full context (1,024), and perplexity on held-out Python.

Variants are timed interleaved within each round (the machine is shared and noisy);
medians over rounds. Writes bench/results/gqa_<device>.json.
Seed figures (notebook 05 draft): 8 -> 2 -> 1 KV heads: 32 -> 8 -> 4 MB, 5.95 -> 2.06 -> 1.18 ms.
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

from decodelab.config import ModelConfig  # noqa: E402
from decodelab.lessons.gqa import attention_kind, pool_model_kv_heads  # noqa: E402
from decodelab.lessons.kv_size import kv_bytes, parameter_count  # noqa: E402
from decodelab.lessons.measure import parameter_bytes, timed  # noqa: E402
from decodelab.model.kv_cache import KVCache  # noqa: E402
from decodelab.model.llama import LlamaForCausalLM  # noqa: E402
from decodelab.model.registry import load  # noqa: E402
from decodelab.paths import PACKAGE_DATA  # noqa: E402

SEED = {8: {"cache_MB": 32, "step_ms": 5.95}, 2: {"cache_MB": 8, "step_ms": 2.06}, 1: {"cache_MB": 4, "step_ms": 1.18}}
SEED_SHAPE = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
)


@torch.inference_mode()
def decode_step_times(models: dict, ids: torch.Tensor, rounds: int, device) -> dict:
    """Median seconds of one decode step with ids[:, :-1] cached, per model, interleaved."""
    caches = {}
    for name, model in models.items():
        caches[name] = KVCache(model.config, 1, ids.shape[1], device=device, dtype=model.dtype)
        model(ids[:, :-1], kv_cache=caches[name])  # fill the cache (untimed)
    held = ids.shape[1] - 1
    times = {name: [] for name in models}
    names = list(models)
    for r in range(rounds + 1):  # round 0 is a warm-up
        for name in names if r % 2 == 0 else names[::-1]:
            caches[name].truncate(held)
            t = timed(lambda: models[name](ids[:, -1:], kv_cache=caches[name]), device)[0]
            if r:
                times[name].append(t)
    return {
        name: {"step_s": statistics.median(v), "cache_bytes": caches[name].nbytes(), "all_s": v}
        for name, v in times.items()
    }


def seed_shaped(args, device) -> dict:
    config = ModelConfig(**SEED_SHAPE, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(device).eval().requires_grad_(False)
    models = {h: pool_model_kv_heads(base, h) for h in args.heads}
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len), device=device)
    steps = decode_step_times(models, ids, args.rounds, device)
    rows = []
    for h, model in models.items():
        rows.append(
            {
                "kv_heads": h,
                "kind": attention_kind(8, h),
                "step_ms": 1e3 * steps[h]["step_s"],
                "cache_bytes": steps[h]["cache_bytes"],
                "cache_bytes_calculated": kv_bytes(model.config, args.seq_len, dtype="fp32"),
                "weight_bytes": parameter_bytes(model),
                "seed": SEED.get(h),
                "all_ms": [1e3 * t for t in steps[h]["all_s"]],
            }
        )
    return {
        "shape": {
            **SEED_SHAPE,
            "seq_len": args.seq_len,
            "dtype": "float32",
            "parameters_at_8_kv_heads": parameter_count(config),
        },
        "rows": rows,
    }


def tiny_pooled(args, device) -> dict | None:
    if not (PACKAGE_DATA / "tiny" / "config.json").exists():
        return None
    from decodelab.lessons.perplexity import heldout_text, perplexity

    base, tokenizer = load("tiny", device=device, dtype="float32")
    models = {h: pool_model_kv_heads(base, h) for h in args.tiny_heads}
    ids = tokenizer.encode(heldout_text("code"))
    context = base.config.max_position_embeddings
    steps = decode_step_times(models, torch.tensor([ids[:context]], device=device), args.rounds, device)
    rows = []
    for h, model in models.items():
        ppl = perplexity(model, ids[: args.ppl_tokens])
        rows.append(
            {
                "kv_heads": h,
                "kind": attention_kind(base.config.num_attention_heads, h),
                "step_ms": 1e3 * steps[h]["step_s"],
                "cache_bytes": steps[h]["cache_bytes"],
                "perplexity": ppl,
                "all_ms": [1e3 * t for t in steps[h]["all_s"]],
            }
        )
    return {
        "context": context,
        "ppl_tokens": min(args.ppl_tokens, len(ids)),
        "text": "decodelab.lessons.perplexity.heldout_text('code')",
        "rows": rows,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="8,2,1")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tiny-heads", default="8,4,2,1")
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    args.heads = [int(h) for h in args.heads.split(",")]
    args.tiny_heads = [int(h) for h in args.tiny_heads.split(",")]
    command = "python bench/gqa.py " + " ".join(sys.argv[1:])
    device = torch.device(args.device)

    seed_part = seed_shaped(args, device)
    tiny_part = tiny_pooled(args, device)
    result = {
        "command": command,
        "device": str(device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "rounds": args.rounds,
        "seed_shaped": seed_part,
        "tiny_pooled": tiny_part,
        "seed": SEED,
    }
    out = Path(__file__).parent / "results" / f"gqa_{device.type}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    shape = seed_part["shape"]
    print(f"$ {command}")
    print(
        f"seed-shaped random model: {shape['num_hidden_layers']} layers, 8 query heads x head_dim "
        f"{shape['head_dim']}, hidden {shape['hidden_size']}, {shape['parameters_at_8_kv_heads']:,} parameters "
        f"at 8 KV heads, fp32, {args.seq_len} positions; {device}, {torch.get_num_threads()} threads, "
        f"median of {args.rounds}"
    )
    print(f"{'KV heads':>9} {'kind':>4} {'cache MiB':>10} {'(MB)':>6} {'seed MB':>8} {'step ms':>8} {'seed ms':>8}")
    for row in seed_part["rows"]:
        seed = row["seed"] or {}
        print(
            f"{row['kv_heads']:>9} {row['kind']:>4} {row['cache_bytes'] / 2**20:>10.1f} "
            f"{row['cache_bytes'] / 1e6:>6.1f} "
            f"{seed.get('cache_MB', '-'):>8} {row['step_ms']:>8.2f} {seed.get('step_ms', '-'):>8}"
        )
    if tiny_part is None:
        print("tiny: not trained yet, skipped")
    else:
        print(
            f"\ntiny pooled without uptraining: decode step at {tiny_part['context']} positions, "
            f"perplexity on {tiny_part['ppl_tokens']:,} held-out Python tokens"
        )
        print(f"{'KV heads':>9} {'kind':>4} {'cache MiB':>10} {'step ms':>8} {'perplexity':>11}")
        for row in tiny_part["rows"]:
            print(
                f"{row['kv_heads']:>9} {row['kind']:>4} {row['cache_bytes'] / 2**20:>10.2f} "
                f"{row['step_ms']:>8.2f} {row['perplexity']:>11.2f}"
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

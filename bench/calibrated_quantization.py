"""Calibrated quantization: round-to-nearest vs AWQ vs GPTQ vs AWQ+GPTQ, on held-out text.

    nice -n 10 .venv/bin/python bench/calibrated_quantization.py [--models tiny,smollm2] [--settings 4:128,3:128]
        [--sequences N] [--length T] [--ppl-tokens N] [--window 256] [--stride 128] [--gen-tokens 32] [--prompts 3]

For each model and each setting (bits : group size) every decoder-layer linear is quantized by each
method (`decodelab.model.calibration.calibrate_model`, layer by layer; the tied embedding / lm_head
stays float32) on the asymmetric group-wise grid of `decodelab.model.groupwise`, and measured:
perplexity on held-out text, greedy agreement with float32 (tokens identical before the first
difference, `--prompts` prompts x `--gen-tokens` tokens), bytes of those linears (packed levels,
scales, zero points, AWQ's input scales) against float32, and the calibration time.

Texts (`calibration.text_split`, disjoint): `tiny` calibrates on its training modules and is scored
on 7 modules it never saw; SmolLM2 calibrates on the second half of heldout_en.txt's paragraphs and
is scored on the first half. Writes bench/results/calibrated_quantization_<model>.json (with the
command). Timings share a 2-core machine with whatever else runs: the load average is recorded.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning threads thrash a busy CPU

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "lib"), str(HERE)]

from quantization import PROMPTS, asymmetric_g32_error, same_prefix  # noqa: E402  (bench/quantization.py)

from decodelab.decoding.generate import stream_token_ids  # noqa: E402
from decodelab.lessons.perplexity import perplexity  # noqa: E402
from decodelab.model.calibration import METHODS, apply_layers, calibrate_model, calibration_ids, text_split  # noqa: E402
from decodelab.model.registry import load  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402

TEXT = {"tiny": "code", "smollm2": "en"}
DEFAULTS = {  # calibration sequences x length, held-out tokens scored
    "tiny": {"sequences": 32, "length": 256, "ppl_tokens": 4096},
    "smollm2": {"sequences": 16, "length": 256, "ppl_tokens": 2048},
}


def float_linear_bytes(model) -> int:
    return sum(m.weight.nbytes for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))


def greedy(model, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [list(stream_token_ids(model, p, params)) for p in prompts]


def bench_model(name, args):
    model, tokenizer = load(name, device="cpu", dtype="float32")
    sizes = {k: getattr(args, k) or v for k, v in DEFAULTS[name].items()}
    split = text_split(TEXT[name])
    calib = calibration_ids(tokenizer, split.calibration, sizes["sequences"], sizes["length"])
    heldout = tokenizer.encode(split.heldout)[: sizes["ppl_tokens"]]
    window = min(args.window, model.config.max_position_embeddings)
    stride = args.stride or window // 2
    prompts = [tokenizer.encode(p) for p in PROMPTS[name][: args.prompts]]
    base_ppl = perplexity(model, heldout, window=window, stride=stride)
    reference = greedy(model, prompts, args.gen_tokens)
    result = {
        "model": name,
        "calibration": split.calibration_name,
        "heldout": split.heldout_name,
        "calibration_tokens": list(calib.shape),
        "heldout_tokens": len(heldout),
        "float32": {"perplexity": base_ppl, "linear_bytes": float_linear_bytes(model)},
        "rows": [],
    }
    if name == "smollm2":
        result["q4_1_grid_relative_error"] = asymmetric_g32_error(model)
    print(
        f"{name}: float32 perplexity {base_ppl:.3f} on {len(heldout)} tokens of {split.heldout_name}; "
        f"calibration {calib.shape[0]} x {calib.shape[1]} tokens of {split.calibration_name}",
        flush=True,
    )
    for bits, group_size in args.settings:
        for method in METHODS:
            made = calibrate_model(model, calib, method, bits, group_size, awq_rows=args.awq_rows)
            quantized = apply_layers(copy.deepcopy(model), made.layers)
            ppl = perplexity(quantized, heldout, window=window, stride=stride)
            prefix = [same_prefix(a, b) for a, b in zip(greedy(quantized, prompts, args.gen_tokens), reference)]
            groups = sorted(
                {
                    f"{m.in_features} inputs -> g{m.group_size}"
                    for m in made.layers.values()
                    if m.group_size != group_size
                }
            )
            row = {
                "setting": f"int{bits}-g{group_size}",
                "method": method,
                "perplexity": ppl,
                "ppl_change_pct": 100 * (ppl / base_ppl - 1),
                "greedy_same_prefix": prefix,
                "greedy_tokens_each": args.gen_tokens,
                "linear_bytes": made.nbytes,
                "bytes_vs_fp32": made.nbytes / result["float32"]["linear_bytes"],
                "calibration_seconds": made.seconds,
                "group_size_fallbacks": groups,
            }
            result["rows"].append(row)
            print(
                f"  int{bits}-g{group_size} {method:<9} ppl {ppl:9.3f} ({row['ppl_change_pct']:+7.1f}%)  "
                f"greedy {sum(prefix)}/{len(prefix) * args.gen_tokens}  {made.seconds:6.1f} s",
                flush=True,
            )
            del quantized, made
    return result


def print_table(r):
    print(
        f"\n== {r['model']}: decoder-layer linears quantized; perplexity on {r['heldout_tokens']} tokens of "
        f"{r['heldout']}; calibration {r['calibration_tokens'][0]} x {r['calibration_tokens'][1]} tokens of "
        f"{r['calibration']} =="
    )
    print(f"float32: perplexity {r['float32']['perplexity']:.3f}, {r['float32']['linear_bytes'] / 1e6:.2f} MB")
    print(
        f"{'setting':<10} {'method':<9} {'ppl':>9} {'d.ppl':>8} {'greedy':>8} {'MB':>7} {'vs fp32':>7} {'calib s':>8}"
    )
    for row in r["rows"]:
        greedy = f"{sum(row['greedy_same_prefix'])}/{len(row['greedy_same_prefix']) * row['greedy_tokens_each']}"
        print(
            f"{row['setting']:<10} {row['method']:<9} {row['perplexity']:9.3f} {row['ppl_change_pct']:+7.1f}% "
            f"{greedy:>8} {row['linear_bytes'] / 1e6:7.2f} {row['bytes_vs_fp32']:7.3f} "
            f"{row['calibration_seconds']:8.1f}"
        )
    fallbacks = sorted({g for row in r["rows"] for g in row["group_size_fallbacks"]})
    if fallbacks:
        print(f"group size fell back where 128 does not divide the inputs: {', '.join(fallbacks)}")
    if r["model"] == "smollm2":
        print(f"""Note: SmolLM2 ships as Q4_1 (GGUF): its float32 weights are the dequantized 4-bit levels, asymmetric
min/max in blocks of 32 (on that grid their relative error is {r["q4_1_grid_relative_error"]:.1e}). Every
setting here rounds weights that already carry a 4-bit rounding onto a different grid (groups of 64/128
whose levels do not line up with Q4_1's): a second rounding stacked on the first, where re-rounding onto
Q4_1's own grid would be lossless. int3 lies below the weights' own precision; the `tiny` rows (weights
never quantized before) show the methods without that caveat.""")


def parse_settings(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument(
        "--settings",
        type=parse_settings,
        default=parse_settings("4:128,3:128"),
        help="bits:group_size, comma-separated",
    )
    parser.add_argument("--sequences", type=int, default=None, help="calibration sequences (default per model)")
    parser.add_argument("--length", type=int, default=None, help="tokens per calibration sequence")
    parser.add_argument("--ppl-tokens", type=int, default=None, help="held-out tokens scored")
    parser.add_argument("--awq-rows", type=int, default=512, help="calibration rows AWQ's alpha search uses")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--stride", type=int, default=None, help="perplexity window stride (default window / 2)")
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    command = "nice -n 10 python bench/calibrated_quantization.py " + shlex.join(sys.argv[1:])
    for name in args.models.split(","):
        if name not in TEXT:
            raise SystemExit(f"unknown model {name!r}: choose from {sorted(TEXT)}")
        result = bench_model(name, args)
        print_table(result)
        record = {
            "command": command.strip(),
            "settings": {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(args).items()},
            "machine": {
                "platform": platform.platform(),
                "torch": torch.__version__,
                "threads": args.threads,
                "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            },
            "result": result,
        }
        out = args.out_dir / f"calibrated_quantization_{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

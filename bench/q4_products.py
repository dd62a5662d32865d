"""SmolLM2's 211 matrix products per forward pass: float32 F.linear vs the GGUF block kernels, side by side.

    .venv/bin/python bench/q4_products.py [--rows 1,4,16,64,256] [--rounds 5] [--out FILE]

For each row count M (1: a batch-1 decode step; more: batched decode or a prefill chunk), the
milliseconds of one pass over every linear of SmolLM2 on inputs x [M, K]:
* `float32`: F.linear on the float32 weights the library loads (210 decoder linears + lm_head);
* `Q4Linear`: what `quantization="q4"` runs: `decodelab.model.q4_linear.Q4Linear` on the GGUF's
  own Q4_1 blocks for the 210 decoder linears and `q8_linear.Q8Linear` on its Q8_0 blocks for the
  lm_head (tied to the Q8_0 embedding); C kernels up to `KERNEL_MAX_ROWS` rows, dequantize +
  F.linear above;
* `dequantize + F.linear`: their pure-torch path (the fallback, and their choice above
  `KERNEL_MAX_ROWS` rows, forced here at every M), the same 210 + lm_head.
Interleaved, best of the rounds; the weight bytes each reads and the ratios are printed. Writes
bench/results/q4_products_smollm2_cpu.json (or --out) with the load average and the CPU's name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

# What `import decodelab` sets, here before torch starts its OpenMP threads (the imports below
# are sorted: torch comes first), so the figures are those a user of the library gets.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omp_settings import cpu_name, omp_settings  # noqa: E402  (bench/omp_settings.py)

from decodelab.model import q4_kernel  # noqa: E402
from decodelab.model.llama import MLP  # noqa: E402
from decodelab.model.q4_kernel import kernel  # noqa: E402
from decodelab.model.q4_linear import Q4Linear, use_gguf_q4_weights  # noqa: E402
from decodelab.model.q4_swiglu import Q4SwiGLU  # noqa: E402
from decodelab.model.q8_linear import Q8Linear  # noqa: E402
from decodelab.model.registry import load, smollm2_gguf_path  # noqa: E402
from decodelab.model.thread_team import team_sleeps  # noqa: E402


def best_ms(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def swiglu_times(model, rounds: int) -> dict:
    """ms of one pass over the model's 30 MLPs at 1, 2, 4, 8 and 16 rows: the three Q4Linear and silu * up
    (unfused), against `Q4SwiGLU`'s one C call on one thread and on the team (while it sleeps, the
    threshold `q4_kernel.SWIGLU_ONE_THREAD_BELOW` chooses between the two)."""
    mlps = [m for m in model.modules() if isinstance(m, Q4SwiGLU)]
    hidden = mlps[0].gate_proj.in_features
    found = {}
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, hidden)

        def unfused():
            for m in mlps:
                MLP.forward(m, x)  # llama.MLP's own forward over the three Q4Linear

        def fused(below: int):
            q4_kernel.SWIGLU_ONE_THREAD_BELOW = below
            for m in mlps:
                m(x)

        contenders = {
            "three Q4Linear + silu * up": unfused,
            "Q4SwiGLU, one thread": lambda: fused(1 << 62),
            "Q4SwiGLU, the team": lambda: fused(0),
        }
        times = {name: [] for name in contenders}
        threshold = q4_kernel.SWIGLU_ONE_THREAD_BELOW
        with torch.inference_mode():
            for _ in range(rounds * 4):
                for name, fn in contenders.items():
                    times[name].append(best_ms(fn, 1))
        q4_kernel.SWIGLU_ONE_THREAD_BELOW = threshold
        found[rows] = {name: min(t) for name, t in times.items()}
        work = 3 * rows * hidden * mlps[0].gate_proj.out_features
        print(
            f"MLPs M={rows}: "
            + "  ".join(f"{name} {ms:6.2f} ms" for name, ms in found[rows].items())
            + f"  (one MLP {work:,} multiply-adds; the library: "
            + ("one thread)" if team_sleeps() and work < threshold else "the team)")
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,256", help="comma-separated row counts M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "q4_products_smollm2_cpu.json")
    args = parser.parse_args()
    if kernel() is None:
        sys.exit("the Q4_1 kernel cannot run here (see the line above): nothing to compare")
    load_before = os.getloadavg()
    model, _ = load("smollm2", device="cpu", dtype="float32")
    weights = {name: m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    use_gguf_q4_weights(model, smollm2_gguf_path())
    q4 = {name: m for name, m in model.named_modules() if isinstance(m, (Q4Linear, Q8Linear))}
    assert len(q4) == len(weights), "every linear, lm_head included, holds GGUF blocks"
    float_bytes = sum(w.numel() * 4 for w in weights.values())
    q4_bytes = sum(buffer.numel() * buffer.element_size() for m in q4.values() for buffer in m.buffers())
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(rows, w.shape[1]) for name, w in weights.items()}

        def run_float():
            for name, w in weights.items():
                F.linear(xs[name], w)

        def run_kernel():
            for name, m in q4.items():
                m(xs[name])

        def run_dequantize():
            for name, m in q4.items():
                F.linear(xs[name], m.dequantized_weight())

        times = {"float32": [], "Q4Linear": [], "dequantize + F.linear": []}
        with torch.inference_mode():
            for _ in range(args.rounds):  # interleaved: the same noise for all three
                for name, fn in zip(times, (run_float, run_kernel, run_dequantize)):
                    times[name].append(best_ms(fn, 1))
        best = {name: min(t) for name, t in times.items()}
        results[rows] = best
        print(
            f"M={rows:4d}: float32 {best['float32']:7.1f} ms  Q4Linear {best['Q4Linear']:7.1f} ms  "
            f"dequantize + F.linear {best['dequantize + F.linear']:7.1f} ms  "
            f"float32 / Q4Linear = {best['float32'] / best['Q4Linear']:.2f}x"
        )
    print(f"weight bytes read per pass: float32 {float_bytes / 1e6:.0f} MB, q4 {q4_bytes / 1e6:.0f} MB")
    swiglu = swiglu_times(model, args.rounds)
    result = {
        "command": "python bench/q4_products.py " + " ".join(sys.argv[1:]),
        "what": "ms of one pass over SmolLM2's 211 linears on x [M, K], best of the rounds, interleaved",
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_name(),
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "weight_bytes_per_pass": {"float32": float_bytes, "q4 (Q4_1 linears, Q8_0 lm_head)": q4_bytes},
        "ms_per_pass_by_rows": results,
        "float32_over_Q4Linear": {rows: r["float32"] / r["Q4Linear"] for rows, r in results.items()},
        **omp_settings(),
        "swiglu_ms_per_pass_by_rows (the 30 MLPs)": swiglu,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

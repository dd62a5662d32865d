"""Time to first token of `LLM(quantization="q4")` as `q4_kernel.KERNEL_MAX_ROWS` moves: where a
prompt's products leave the C kernel for dequantize + F.linear.

    .venv/bin/python bench/q4_prefill_rows.py [--lengths 24,40,48,56,64] [--caps 64,48,32] [--rounds 6]
        [--out FILE]

Each round prefills one fresh prompt (random token ids, so the engine's prefix cache never hits) of
every length under every cap, interleaved: `LLM.generate(max_tokens=1)`, what a user's first token
waits for, end to end. The cap is the module constant the products read at each call, set between
calls. Median and best over the rounds. Writes bench/results/q4_prefill_rows_smollm2_cpu.json (or
--out) with the CPU's name, the load average and OpenMP's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from omp_settings import cpu_name, omp_settings, spin_prefix  # noqa: E402  (bench/omp_settings.py)

from decodelab import LLM, SamplingParams  # noqa: E402  (sets OMP_WAIT_POLICY=PASSIVE before torch starts)
from decodelab.model import q4_kernel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="24,40,48,56,64", help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--caps", default="64,48,32", help="comma-separated KERNEL_MAX_ROWS values")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "q4_prefill_rows_smollm2_cpu.json"
    )
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    caps = [int(c) for c in args.caps.split(",")]
    if q4_kernel.kernel() is None:
        sys.exit("the Q4_1 kernel cannot run here (see the line above): nothing to compare")
    load_before = os.getloadavg()
    llm = LLM("smollm2", quantization="q4")
    params = SamplingParams(temperature=0, max_tokens=1)
    vocabulary = random.Random(0)
    shipped = q4_kernel.KERNEL_MAX_ROWS

    def first_token_ms(length: int, cap: int) -> float:
        prompt = [vocabulary.randrange(200, 40_000) for _ in range(length)]
        q4_kernel.KERNEL_MAX_ROWS = cap
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return (time.perf_counter() - start) * 1e3

    first_token_ms(max(lengths), caps[0])  # warm-up: scratch, thread team, page cache
    times = {(n, cap): [] for n in lengths for cap in caps}
    try:
        for _ in range(args.rounds):
            for n in lengths:
                for cap in caps:
                    times[n, cap].append(first_token_ms(n, cap))
    finally:
        q4_kernel.KERNEL_MAX_ROWS = shipped
    results = {}
    for n in lengths:
        results[n] = {
            f"cap {cap}": {"median_ms": statistics.median(times[n, cap]), "best_ms": min(times[n, cap])} for cap in caps
        }
        cells = "  ".join(f"{name}: {cell['median_ms']:6.1f} ms" for name, cell in results[n].items())
        print(f"{n:3d} tokens, TTFT median  {cells}")
    result = {
        "command": spin_prefix() + "python bench/q4_prefill_rows.py " + " ".join(sys.argv[1:]),
        "what": "ms from LLM.generate(max_tokens=1) on a fresh prompt of each length, q4, by KERNEL_MAX_ROWS",
        "shipped_KERNEL_MAX_ROWS": shipped,
        "rounds": args.rounds,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        **omp_settings(),
        "ttft_by_prompt_tokens": results,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""A decode token's attention on one thread vs OpenMP's team, while the team sleeps between calls.

    .venv/bin/python bench/attention_threads.py [--keys 16,64,256,512,1024,2048,4096] [--batch 1,8] [--calls 400]

`import decodelab` sets OMP_WAIT_POLICY=PASSIVE, so every parallel region wakes sleeping threads.
For B sequences of one new token each, SmolLM2's shapes (9 query heads over 3 KV heads, head_dim
64) and S keys, the microseconds of one SDPA call (the engine's: `masked_attention`) with torch's
threads (the team) and with one thread, calls alternated in blocks so machine noise hits both
alike; the median of the blocks. The work B * H * S * D, the ratio, and where the library's
`ATTENTION_ONE_THREAD_BELOW` falls are printed; below it `one_thread_if_small` runs the call alone.
Writes bench/results/attention_threads_cpu.json with the load average. A figure end to end (the
whole decode step) comes from bench/decode_speed.py --end-to-end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

# What `import decodelab` sets, here before torch starts its OpenMP threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omp_settings import omp_settings  # noqa: E402  (bench/omp_settings.py)

from decodelab.model.attention import ATTENTION_ONE_THREAD_BELOW  # noqa: E402
from decodelab.model.thread_team import team_sleeps  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def call_us(q, k, v, threads: int, calls: int) -> float:
    """Mean microseconds of one SDPA call on `threads` threads, over `calls` calls."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return (time.perf_counter() - start) / calls * 1e6
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", default="16,64,256,512,1024,2048,4096", help="context lengths S")
    parser.add_argument("--batch", default="1,8", help="sequences B, one new token each")
    parser.add_argument("--calls", type=int, default=400, help="calls per block (7 blocks each way)")
    args = parser.parse_args()
    team = torch.get_num_threads()
    print(
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')} "
        f"team of {team}, sleeps between calls: {team_sleeps()}"
    )
    if team == 1:
        sys.exit("torch runs one thread here: nothing to compare")
    load_before, rows = os.getloadavg(), []
    for batch in (int(b) for b in args.batch.split(",")):
        for keys in (int(s) for s in args.keys.split(",")):
            q = torch.randn(batch, HEADS, 1, HEAD_DIM)
            k, v = torch.randn(batch, KV_HEADS, keys, HEAD_DIM), torch.randn(batch, KV_HEADS, keys, HEAD_DIM)
            call_us(q, k, v, team, 20)  # warm
            both = {team: [], 1: []}
            for block in range(14):
                threads = (team, 1)[block % 2] if block < 7 else (1, team)[block % 2]  # alternate, then swap
                both[threads].append(call_us(q, k, v, threads, args.calls))
            work = batch * HEADS * keys * HEAD_DIM
            row = {
                "batch": batch,
                "keys": keys,
                "work": work,
                "team_us": statistics.median(both[team]),
                "one_thread_us": statistics.median(both[1]),
            }
            row["team_over_one_thread"] = row["team_us"] / row["one_thread_us"]
            row["library_runs_alone"] = work < ATTENTION_ONE_THREAD_BELOW
            rows.append(row)
            verdict = "alone" if row["library_runs_alone"] else "team"
            print(
                f"B={batch:2d} S={keys:5d} work={work:>9,d}  team {row['team_us']:7.1f} us  one thread "
                f"{row['one_thread_us']:7.1f} us  team/one {row['team_over_one_thread']:.2f}  library: {verdict}"
            )
    out = Path(__file__).parent / "results" / "attention_threads_cpu.json"
    result = {
        "command": "python bench/attention_threads.py " + " ".join(sys.argv[1:]),
        "what": "one SDPA call of B one-token queries over S keys (SmolLM2's heads), torch's team vs one thread",
        "torch": torch.__version__,
        **omp_settings(),
        "team_threads": team,
        "ATTENTION_ONE_THREAD_BELOW": ATTENTION_ONE_THREAD_BELOW,
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

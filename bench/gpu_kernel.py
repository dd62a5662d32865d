"""The Triton paged decode attention kernel (notebook 12, `decodelab.lessons.gpu_kernel`) against
the engine's gather + SDPA, on a CUDA device: batch 32, SmolLM2's heads (9 query heads over 3 KV
heads, D = 64), blocks of 16, across context lengths, in one run, with the KV bytes each call must
read over its time as a fraction of the device's measured copy bandwidth (the roofline).

    python3 bench/gpu_kernel.py [--dtype bfloat16] [--batch 32] [--contexts 256,512,1024,2048,4096,8192]

Writes bench/results/gpu_kernel_cuda.json. The issue's goal: >= 2x gather + SDPA at 4,096 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "lib")]

import torch  # noqa: E402

import decodelab  # noqa: E402,F401  (first: sets OMP_WAIT_POLICY before torch starts its threads)
from decodelab.lessons import gpu_kernel as gk  # noqa: E402
from decodelab.lessons.measure import memory_bandwidth  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="256,512,1024,2048,4096,8192")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_kernel.py needs a CUDA device (the interpreter's times mean nothing)")
    dtype = getattr(torch, args.dtype)
    contexts = [int(n) for n in args.contexts.split(",")]
    batch = gk.random_paged_batch([contexts[0]] * 2, device="cuda", dtype=dtype)
    torch.testing.assert_close(
        gk.paged_attention(**batch).float(), gk.batched_sdpa_by_gather(**batch).float(), atol=2e-2, rtol=2e-2
    )  # the same numbers before any timing
    timed = gk.time_against_gather(
        {"triton": gk.paged_attention, "gather_sdpa": gk.batched_sdpa_by_gather},
        contexts,
        batch_size=args.batch,
        device="cuda",
        dtype=dtype,
    )
    bandwidth = memory_bandwidth("cuda")
    rows = []
    for kernel, gather in zip(timed["triton"], timed["gather_sdpa"]):
        row = {
            "context": kernel["context"],
            "triton_ms": kernel["ms"],
            "gather_sdpa_ms": gather["ms"],
            "speedup": gather["ms"] / kernel["ms"],
            "triton_roofline": kernel["bytes_per_s"] / bandwidth,
            "gather_sdpa_roofline": gather["bytes_per_s"] / bandwidth,
        }
        rows.append(row)
        print(
            f"context {row['context']:5}: triton {row['triton_ms']:.4f} ms ({row['triton_roofline']:.1%} of roofline), "
            f"gather + SDPA {row['gather_sdpa_ms']:.4f} ms ({row['gather_sdpa_roofline']:.1%}): "
            f"{row['speedup']:.2f}x"
        )
    result = {
        "command": "python3 " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": gk.triton.__version__,
        "dtype": args.dtype,
        "batch": args.batch,
        "heads": [9, 3, 64],
        "block_size": 16,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
    }
    out = HERE / "results" / "gpu_kernel_cuda.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()

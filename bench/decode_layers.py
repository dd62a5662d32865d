"""SmolLM2's q4 decode step with every layer in one C call vs each layer in two C calls vs its modules
one by one, and the engine's paged decode attention in C vs gathered blocks + SDPA.

    .venv/bin/python bench/decode_layers.py [--rows 1,4,16] [--keys 16,128,512,1024] [--batch 1,8] [--calls 30]

1. The model's forward for one new token per row over a KVCache holding 100 tokens (rows = batch
   size B): `Q4Backbone` handing the whole stack to one C call (`decodelab.model.q4_stack`); the
   same layers one by one, each `Q4DecoderLayer` running its two C calls around torch's attention
   (`decodelab.model.q4_layer`); and the same layers running `DecoderLayer.forward` (their Q4
   modules one by one): ms per step.
2. One layer's decode attention of `PagedBatch` (block size 16, B sequences of S keys each, SmolLM2's
   9 query heads over 3 KV heads): `engine.paged_decode_kernel` vs the torch path: us per call.
Contenders alternate in blocks (7 each way, the order swapped halfway) so machine noise hits both
alike; the median of the blocks. Writes bench/results/decode_layers_cpu.json with the load average.
The figure end to end (`generate`, `LLM`, the CLI, beside llama.cpp) is bench/decode_speed.py --end-to-end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

# What `import decodelab` sets, here before torch starts its OpenMP threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from omp_settings import omp_settings  # noqa: E402  (bench/omp_settings.py)

from decodelab.engine import paged_decode_kernel  # noqa: E402
from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice  # noqa: E402
from decodelab.model.kv_cache import KVCache  # noqa: E402
from decodelab.model.llama import Backbone  # noqa: E402
from decodelab.model.q4_layer import Q4DecoderLayer  # noqa: E402
from decodelab.model.q4_linear import use_gguf_q4_weights  # noqa: E402
from decodelab.model.q4_stack import Q4Backbone  # noqa: E402
from decodelab.model.registry import load, smollm2_gguf_path  # noqa: E402

HELD = 100  # tokens in the cache before the timed step


@contextmanager
def patched(owner, name, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def alternated(contenders: dict, calls: int) -> dict[str, float]:
    """Median over 14 blocks (7 each, order swapped halfway) of each contender's mean seconds per call."""
    names = list(contenders)
    times = {name: [] for name in names}
    for name in names:
        contenders[name](3)  # warm
    for block in range(14):
        order = names if (block < 7) == (block % 2 == 0) else names[::-1]
        for name in order:
            start = time.perf_counter()
            contenders[name](calls)
            times[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in times.items()}


def layer_steps(model, rows: int):
    """A function running `calls` one-token steps of `rows` sequences over a cache of HELD tokens."""
    cache = KVCache(model.config, batch_size=rows, max_seq_len=HELD + 1)
    ids = torch.randint(0, model.config.vocab_size, (rows, 1))

    def steps(calls: int) -> None:
        with torch.inference_mode():
            for _ in range(calls):
                cache.lengths = [HELD] * len(cache.lengths)
                model(ids, kv_cache=cache, last_only=True)

    return steps


def attention_calls(store: PagedKVStore, batch: int, keys: int):
    block = store.block_size
    blocks_each = -(-keys // block)
    slices = [SequenceSlice(i, 1, keys, list(range(i * blocks_each, (i + 1) * blocks_each))) for i in range(batch)]
    slots = torch.tensor([s.block_table[(keys - 1) // block] * block + (keys - 1) % block for s in slices])
    paged = PagedBatch(store, slices, slots)
    q, k, v = torch.randn(1, 9, batch, 64), torch.randn(1, 3, batch, 64), torch.randn(1, 3, batch, 64)

    def calls_of(n: int) -> None:
        with torch.inference_mode():
            for _ in range(n):
                paged.attend(0, q, k, v)

    return calls_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16", help="sequences per decode step (part 1)")
    parser.add_argument("--keys", default="16,128,512,1024", help="keys per sequence (part 2)")
    parser.add_argument("--batch", default="1,8", help="sequences per attention call (part 2)")
    parser.add_argument("--calls", type=int, default=30, help="steps per block in part 1 (x20 in part 2)")
    args = parser.parse_args()
    if not paged_decode_kernel.runs_here(torch.zeros(1), torch.zeros(1)):
        sys.exit("the C kernels do not load here: nothing to compare")
    load_before = os.getloadavg()
    float_model, _ = load("smollm2")
    model = use_gguf_q4_weights(copy.deepcopy(float_model), smollm2_gguf_path())
    del float_model
    steps = {}
    for rows in (int(r) for r in args.rows.split(",")):
        step = layer_steps(model, rows)

        def layer_by_layer(calls, step=step):
            with patched(Q4Backbone, "run_layers", Backbone.run_layers):
                step(calls)

        def modules(calls, step=step):
            with patched(Q4Backbone, "run_layers", Backbone.run_layers):
                with patched(Q4DecoderLayer, "fused", lambda self, x, cos: False):
                    step(calls)

        contenders = {"one_call": step, "fused_layers": layer_by_layer, "modules": modules}
        ms = {name: s * 1e3 for name, s in alternated(contenders, args.calls).items()}
        ms["fused_layers_over_one_call"] = ms["fused_layers"] / ms["one_call"]
        ms["modules_over_one_call"] = ms["modules"] / ms["one_call"]
        steps[str(rows)] = ms
        print(
            f"rows {rows:2d}: step {ms['one_call']:6.2f} ms in one call, {ms['fused_layers']:6.2f} ms layer by layer "
            f"({ms['fused_layers_over_one_call']:.2f}x), {ms['modules']:6.2f} ms modules ({ms['modules_over_one_call']:.2f}x)"
        )
    store = PagedKVStore(model.config, num_blocks=8 * 64 + 8, block_size=16)
    store.keys.normal_()
    store.values.normal_()
    attention = []
    for batch in (int(b) for b in args.batch.split(",")):
        for keys in (int(s) for s in args.keys.split(",")):
            call = attention_calls(store, batch, keys)

            def torch_path(n, call=call):
                with patched(paged_decode_kernel, "runs_here", lambda q, k: False):
                    call(n)

            us = {name: s * 1e6 for name, s in alternated({"c": call, "torch": torch_path}, args.calls * 20).items()}
            row = {
                "batch": batch,
                "keys": keys,
                "c_us": us["c"],
                "torch_us": us["torch"],
                "torch_over_c": us["torch"] / us["c"],
            }
            attention.append(row)
            print(
                f"attention B={batch} S={keys:5d}: C {row['c_us']:7.1f} us, gather + SDPA {row['torch_us']:7.1f} us ({row['torch_over_c']:.2f}x)"
            )
    out = Path(__file__).parent / "results" / "decode_layers_cpu.json"
    result = {
        "command": "python bench/decode_layers.py " + " ".join(sys.argv[1:]),
        "what": "SmolLM2 q4: a decode step's ms, all layers in one C call vs two C calls per layer vs modules "
        "(cache of 100 tokens); one layer's paged decode attention in C vs gather + SDPA, us",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **omp_settings(),
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "decode_step_ms_by_rows": steps,
        "paged_decode_attention": attention,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

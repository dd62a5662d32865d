"""Batch-1 greedy decode speed: decodelab vs transformers on the same weights, against
this machine's bandwidth roofline (every weight byte is read once per generated token).

    .venv/bin/python bench/decode_speed.py [--model smollm2] [--tokens 64] [--rounds 3]

Both engines run interleaved in one process, so machine noise hits them alike. Per-token
decode time is (time for N+16 tokens - time for 16 tokens) / N, which cancels prefill.
Writes bench/results/decode_speed_<model>_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

import decodelab  # noqa: E402,F401  (first: sets OMP_WAIT_POLICY before torch starts its threads)
import torch  # noqa: E402
from decodelab.decoding.generate import stream_token_ids  # noqa: E402
from decodelab.lessons.measure import Roofline, matmul_flops, memory_bandwidth, parameter_bytes, synchronize  # noqa: E402
from decodelab.model.registry import load, resolve_model  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402


def time_ours(model, prompt_ids, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    synchronize(model.device)
    start = time.perf_counter()
    out = list(stream_token_ids(model, prompt_ids, params))
    synchronize(model.device)
    return time.perf_counter() - start, out


def time_transformers(hf_model, prompt_ids, n):
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    synchronize(hf_model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
    synchronize(hf_model.device)
    return time.perf_counter() - start, out[0, len(prompt_ids):].tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()

    device = torch.device(args.device)
    model, tokenizer = load(args.model, device=device, dtype="float32")
    prompt = "What is gravity?"
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                                  if tokenizer.chat_template else prompt)
    engines = {"decodelab": lambda n: time_ours(model, prompt_ids, n)}
    if not args.no_transformers:
        import transformers
        transformers.logging.set_verbosity_error()
        hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32)
        hf = hf.to(device).eval()
        engines["transformers"] = lambda n: time_transformers(hf, prompt_ids, n)

    bandwidth = memory_bandwidth(device)
    roof = Roofline(bandwidth, matmul_flops(device))
    weight_bytes = parameter_bytes(model)
    base = 16
    per_token = {name: [] for name in engines}
    outputs = {}
    for name, run in engines.items():
        run(base)  # warm-up
    for _ in range(args.rounds):
        for name, run in engines.items():  # interleaved: same noise for both
            short, _ = run(base)
            long, tokens = run(base + args.tokens)
            per_token[name].append((long - short) / args.tokens)
            outputs[name] = tokens
    result = {
        "command": "python bench/decode_speed.py " + " ".join(sys.argv[1:]),
        "model": args.model, "device": str(device), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "weight_bytes": weight_bytes, "bandwidth_GBps": bandwidth / 1e9,
        "matmul_GFLOPs": roof.peak_flops / 1e9,
        "roofline_tokens_per_s": roof.decode_tokens_per_second(weight_bytes),
        "tokens_per_s": {name: 1 / min(v) for name, v in per_token.items()},
        "all_ms_per_token": {name: [1e3 * t for t in v] for name, v in per_token.items()},
    }
    result["fraction_of_roofline"] = {n: tps / result["roofline_tokens_per_s"] for n, tps in result["tokens_per_s"].items()}
    if "transformers" in outputs:
        result["same_greedy_tokens"] = outputs["decodelab"] == outputs["transformers"]
        result["speedup_vs_transformers"] = result["tokens_per_s"]["decodelab"] / result["tokens_per_s"]["transformers"]
    out = Path(__file__).parent / "results" / f"decode_speed_{args.model}_{device.type}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"weights {weight_bytes / 1e6:.0f} MB; read bandwidth (GEMV) {bandwidth / 1e9:.1f} GB/s "
          f"-> roofline {result['roofline_tokens_per_s']:.1f} tok/s")
    for name, tps in result["tokens_per_s"].items():
        print(f"{name:>13}: {tps:6.1f} tok/s  ({100 * result['fraction_of_roofline'][name]:.0f}% of roofline)")
    if "speedup_vs_transformers" in result:
        print(f"decodelab / transformers = {result['speedup_vs_transformers']:.2f}x; "
              f"same greedy tokens: {result['same_greedy_tokens']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

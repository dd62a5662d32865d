"""The engine on an accelerator, with weights of SmolLM2's exact shape: random values (a GPU
machine has no model hub, and SmolLM2's 98 MB file is more than `make gpu-check` carries), so
the speed is SmolLM2's and the correctness oracle is `transformers` on the same weights.

    python3 bench/gpu_engine.py [--device cuda] [--dtype bfloat16] [--requests 128] [--max-num-seqs 64]

In one run: (1) our logits vs `transformers`' on one prompt, in float32 and in --dtype;
(2) batch-1 greedy decode, ours vs `transformers` generate (interleaved rounds, per-token time
with prefill cancelled as in bench/decode_speed.py), against the device's measured read
bandwidth (the roofline); (3) the batched engine on --requests requests (prompts 32..256
tokens, 128 generated each) against the `transformers` batch-1 loop's rate.
Writes bench/results/gpu_engine_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "lib"), str(HERE)]

import torch  # noqa: E402
from decode_speed import time_ours, time_transformers  # noqa: E402

import decodelab  # noqa: E402,F401  (first: sets OMP_WAIT_POLICY before torch starts its threads)
from decodelab.config import ModelConfig  # noqa: E402
from decodelab.engine.llm import LLM  # noqa: E402
from decodelab.lessons.kv_size import config_fields  # noqa: E402
from decodelab.lessons.measure import memory_bandwidth, parameter_bytes, synchronize  # noqa: E402
from decodelab.model.llama import LlamaForCausalLM  # noqa: E402
from decodelab.model.registry import load  # noqa: E402
from decodelab.model.toy import random_llama  # noqa: E402
from decodelab.model.weights import resolve_dtype, save_model  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402


def smollm2_shaped(layers: int | None) -> LlamaForCausalLM:
    fields = config_fields("smollm2")
    fields = {k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__}
    if layers:
        fields["num_hidden_layers"] = layers
    return random_llama(0, **fields)


def logit_gap(ours, hf, prompt_ids) -> tuple[float, float]:
    """(max |our logits - transformers'|, max |transformers' logits|) on one prompt."""
    ids = torch.tensor([prompt_ids], device=ours.device)
    with torch.inference_mode():
        theirs = hf(ids).logits.float()
        return (ours(ids).float() - theirs).abs().max().item(), theirs.abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than SmolLM2's 30 (a quick CPU try)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype)

    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    reference = smollm2_shaped(args.layers)
    with tempfile.TemporaryDirectory() as folder:
        save_model(reference, folder)
        hf32 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    ours32 = reference.to(device)
    rng = random.Random(0)
    prompt_ids = [rng.randrange(reference.config.vocab_size) for _ in range(64)]
    gap32, scale = logit_gap(ours32, hf32, prompt_ids)
    ours, hf = ours32.to(dtype), hf32.to(dtype)
    gap, _ = logit_gap(ours, hf, prompt_ids)
    print(
        f"max |our logits - transformers'|: float32 {gap32:.2e}, {args.dtype} {gap:.2e} "
        f"(logits up to {scale:.0f} in size)"
    )

    engines = {
        "decodelab": lambda n: time_ours(ours, prompt_ids, n),
        "transformers": lambda n: time_transformers(hf, prompt_ids, n),
    }
    base, per_token, outputs = 16, {name: [] for name in engines}, {}
    for run in engines.values():
        run(base)  # warm-up
    for _ in range(args.rounds):
        for name, run in engines.items():
            short, _ = run(base)
            long, outputs[name] = run(base + args.tokens)
            per_token[name].append((long - short) / args.tokens)
    tokens_per_s = {name: 1 / min(v) for name, v in per_token.items()}
    bandwidth, weight_bytes = memory_bandwidth(device), parameter_bytes(ours)
    roofline = bandwidth / weight_bytes
    agree = next((i for i, (a, b) in enumerate(zip(*outputs.values())) if a != b), len(outputs["decodelab"]))
    for name, tps in tokens_per_s.items():
        print(
            f"batch-1 decode {name:>12}: {tps:7.1f} tok/s ({100 * tps / roofline:.0f}% of the "
            f"{roofline:.0f} tok/s roofline: {weight_bytes / 1e6:.0f} MB at {bandwidth / 1e9:.0f} GB/s)"
        )
    print(
        f"decodelab / transformers = {tokens_per_s['decodelab'] / tokens_per_s['transformers']:.2f}x; "
        f"greedy tokens agree for the first {agree} of {len(outputs['decodelab'])}"
    )

    _, tokenizer = load("tiny")  # the engine needs a tokenizer object; these ids never become text
    llm = LLM((ours, tokenizer), max_num_seqs=args.max_num_seqs)
    prompts = [
        [rng.randrange(reference.config.vocab_size) for _ in range(rng.randint(32, 256))] for _ in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(device)
    engine_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    print(
        f"engine, {args.requests} requests x {args.tokens} tokens, {args.max_num_seqs} wide: {engine_tps:.0f} tok/s"
        f" = {engine_tps / tokens_per_s['transformers']:.1f}x the transformers batch-1 loop"
    )

    result = {
        "command": "python bench/gpu_engine.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": args.dtype,
        "layers": reference.config.num_hidden_layers,
        "max_logit_gap": {"float32": gap32, args.dtype: gap},
        "max_abs_logit": scale,
        "batch1_tokens_per_s": tokens_per_s,
        "batch1_ms_per_token": {n: [1e3 * t for t in v] for n, v in per_token.items()},
        "bandwidth_GBps": bandwidth / 1e9,
        "weight_bytes": weight_bytes,
        "roofline_tokens_per_s": roofline,
        "greedy_tokens_agree_for": agree,
        "engine": {
            "requests": args.requests,
            "tokens_each": args.tokens,
            "max_num_seqs": args.max_num_seqs,
            "tokens_per_s": engine_tps,
            "vs_transformers_batch1": engine_tps / tokens_per_s["transformers"],
        },
    }
    out = HERE / "results" / f"gpu_engine_{device.type}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

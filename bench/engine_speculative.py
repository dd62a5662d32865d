"""SmolLM2's feature drafter inside the batched engine: tokens/s against the target alone, in one run.

    .venv/bin/python bench/engine_speculative.py [--device cpu] [--batches 1,4] [--ks 1,2,3]
                                                 [--tokens 64] [--rounds 2] [--temperature 0]

For each batch size B, B held-out chat prompts (`decodelab.training.chat_prompts.eval_prompts`)
are served at once by `LLM("smollm2")` alone and with `speculative_model="smollm2-eagle"` for each k,
on the same loaded weights, with prefix caching on (the engine's default: sessions start after
the cached system prompt) and off (each drafter session sees its whole prompt). Every engine runs
`--rounds` times in alternating order and keeps its fastest round (another program on the machine
only ever adds time). Reported: tokens/s, the ratio to the target alone in the same batch,
accepted / proposed drafts, tokens per target call per sequence, and whether the greedy tokens
equal the target alone's. Writes bench/results/engine_speculative_<device>.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning threads thrash a shared machine

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodelab.decoding.generate import encode_prompt  # noqa: E402
from decodelab.engine.llm import LLM  # noqa: E402
from decodelab.model.registry import load  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402
from decodelab.training.chat_prompts import eval_prompts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run_once(weights, prompt_ids, params, **engine_args) -> dict:
    llm = LLM(weights, max_num_seqs=len(prompt_ids), **engine_args)
    llm.generate(prompt_ids[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm up
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    row = {"seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds, "tokens": tokens}
    if llm.speculator is not None:
        stats = llm.speculator.stats()
        row.update(
            acceptance=stats["acceptance_rate"],
            tokens_per_call=sum(map(len, tokens)) / len(tokens) / max(stats["target_calls"], 1),
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--ks", default="1,2,3")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    model, tokenizer = load("smollm2", device=args.device)
    weights = (model, tokenizer)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True, seed=0)
    report = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "device": args.device,
        "tokens": args.tokens,
        "temperature": args.temperature,
        "rows": [],
    }
    print(f"SmolLM2 on {args.device}, {args.tokens} tokens per request, temperature {args.temperature}")
    print(f"{'batch':>5} {'engine':<28} {'tok/s':>7} {'ratio':>6} {'accepted':>9} {'tok/call':>9} {'same':>5}")
    for batch in map(int, args.batches.split(",")):
        prompt_ids = [encode_prompt(tokenizer, p, chat=True) for p in eval_prompts()[:batch]]
        engines = {"target alone": {}}
        for caching in (True, False):
            for k in map(int, args.ks.split(",")):
                engines[f"eagle k={k}, prefix cache {'on' if caching else 'off'}"] = dict(
                    speculative_model="smollm2-eagle", num_speculative_tokens=k, enable_prefix_caching=caching
                )
        best: dict[str, dict] = {}
        for round_index in range(args.rounds):
            order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
            for name in order:
                row = run_once(weights, prompt_ids, params, **engines[name])
                if name not in best or row["seconds"] < best[name]["seconds"]:
                    best[name] = row
        alone = best["target alone"]
        for name, row in best.items():
            ratio = row["tokens_per_s"] / alone["tokens_per_s"]
            same = row["tokens"] == alone["tokens"] if args.temperature == 0 else None
            accepted = f"{row['acceptance']:.0%}" if "acceptance" in row else "-"
            per_call = f"{row['tokens_per_call']:.2f}" if "tokens_per_call" in row else "1.00"
            print(
                f"{batch:>5} {name:<28} {row['tokens_per_s']:>7.1f} {ratio:>5.2f}x {accepted:>9} {per_call:>9} "
                f"{'-' if same is None else same!s:>5}"
            )
            report["rows"].append(
                {
                    "batch": batch,
                    "engine": name,
                    "ratio": ratio,
                    "same_tokens": same,
                    **{key: value for key, value in row.items() if key != "tokens"},
                }
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"engine_speculative_{args.device}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

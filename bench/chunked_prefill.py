"""The stall of a long prompt: chunked prefill vs whole-prompt prefill, on the serving engine, in one run.

    .venv/bin/python bench/chunked_prefill.py [--model smollm2] [--device cpu] [--running 8]
                                              [--newcomer 1024] [--budgets 128,256,512] [--rounds 2]

`--running` chat requests decode (greedy, no early stop) when a newcomer arrives with a
`--newcomer`-token prompt (held-out English prose). Engines, all on the same weights, no prefix
caching (every round repeats the same newcomer):
  whole, unmixed   the newcomer's whole prompt in one step of its own; the running requests wait
  whole, mixed     the engine's default: they decode in that same (long) step
  chunked B        LLM(chunked_prefill=True, max_num_batched_tokens=B): slices of at most B tokens,
                   decodes included, one per step between decodes
For each: the running requests' inter-token latency (ITL) from the newcomer's arrival on (p50,
p99, max) and the newcomer's time to first token (TTFT), from `decodelab.lessons.chunked_prefill`.
Every engine runs `--rounds` times in alternating order and keeps its run with the smallest p99
(another program on the machine only ever adds time). Ratios are against "whole, mixed".
Writes bench/results/chunked_prefill_<model>_<device>.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning threads thrash a shared machine

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodelab.decoding.generate import encode_prompt  # noqa: E402
from decodelab.engine.llm import LLM  # noqa: E402
from decodelab.lessons.chunked_prefill import compare_stalls  # noqa: E402
from decodelab.lessons.perplexity import heldout_text  # noqa: E402
from decodelab.model.registry import load  # noqa: E402

QUESTIONS = [
    "What is gravity?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Explain photosynthesis simply.",
    "Give me a tip for learning Python.",
    "What is a prime number?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "Suggest a name for a dog.",
    "What does a CPU do?",
    "Summarize the plot of Cinderella.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--running", type=int, default=8, help="requests decoding when the newcomer arrives")
    parser.add_argument("--newcomer", type=int, default=1024, help="tokens of the newcomer's prompt")
    parser.add_argument("--budgets", default="128,256,512", help="max_num_batched_tokens of the chunked engines")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.running + 1 > min(budgets):
        parser.error(f"every budget must be > --running ({args.running}): each step decodes every running request")

    model, tokenizer = load(args.model, device=args.device)
    running = [encode_prompt(tokenizer, q, chat=True) for q in (QUESTIONS * args.running)[: args.running]]
    passage = tokenizer.encode(heldout_text("en") * 4)
    if len(passage) < args.newcomer:
        parser.error(f"the held-out text has {len(passage)} tokens; ask for --newcomer <= that")
    newcomer = passage[: args.newcomer]

    def engine(**settings):
        return LLM(
            (model, tokenizer),
            max_num_seqs=args.running + 1,
            kv_cache_memory=256 * 2**20,
            enable_prefix_caching=False,
            **settings,
        )

    engines = {"whole, unmixed": engine(mix_decode_with_prefill=False), "whole, mixed": engine()}
    for budget in budgets:
        engines[f"chunked {budget}"] = engine(chunked_prefill=True, max_num_batched_tokens=budget)
    results = compare_stalls(
        engines, running, newcomer, decode_tokens=args.decode_tokens, arrive_after=3, rounds=args.rounds
    )

    base = results["whole, mixed"]
    rows = []
    print(f"{args.model} on {args.device}: {args.running} requests decoding, a {args.newcomer}-token prompt arrives")
    for label, result in results.items():
        print(result.summary())
        rows.append(
            {
                "engine": label,
                "itl_p50_ms": 1000 * result.itl_p50,
                "itl_p99_ms": 1000 * result.itl_p99,
                "itl_max_ms": 1000 * max(result.gaps),
                "ttft_ms": 1000 * result.ttft,
                "steps_to_first_token": result.steps_to_first_token,
                "p99_vs_whole_mixed": result.itl_p99 / base.itl_p99,
                "ttft_vs_whole_mixed": result.ttft / base.ttft,
            }
        )
    for row in rows[2:]:
        print(
            f"{row['engine']:>16}: p99 ITL x{row['p99_vs_whole_mixed']:.2f}, TTFT x{row['ttft_vs_whole_mixed']:.2f} "
            "of whole-prompt mixed prefill"
        )
    command = "python bench/chunked_prefill.py " + " ".join(sys.argv[1:])
    out = Path(__file__).parent / "results" / f"chunked_prefill_{args.model}_{torch.device(args.device).type}.json"
    out.write_text(
        json.dumps(
            {
                "command": command.strip(),
                "machine": platform.platform(),
                "threads": torch.get_num_threads(),
                "model": args.model,
                "running": args.running,
                "newcomer_tokens": args.newcomer,
                "rounds": args.rounds,
                "engines": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

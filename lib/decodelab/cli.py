"""`python -m decodelab`: generate text from the command line, prepare the default model.

    python -m decodelab generate "What is gravity?" [--model smollm2|tiny|tiny-draft|DIR]
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
        [--repetition-penalty R] [--device D] [--dtype fp32|bf16|fp16] [--no-chat] [--json]
    python -m decodelab prepare        # convert SmolLM2 into the cache once
    python -m decodelab progress --course DIR [--notebooks 02_sampling,03] [--timeout S] [--json]
        # your notebooks' exercises: passing, failing (and why), not started, hints used
    python -m decodelab progress --course DIR --serve "PROMPT" [--quantization int8] [--json]
        # ... and SmolLM2 served by an engine made of your passing parts (decodelab.course.parts)
    python -m decodelab hints [--notebook 02_sampling] [--json]   # every exercise's hint ladder

Text streams to stdout; with --json exactly one JSON object is printed there instead.
Progress and errors go to stderr; a bad command line exits with 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m decodelab", description="Decode Lab inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, tiny-draft, or a model folder")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu, cuda, mps (default: best available)")
    gen.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    gen.add_argument("--no-chat", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, output_ids, text")
    commands.add_parser("prepare", help="convert the default model (SmolLM2) into the cache")
    prog = commands.add_parser(
        "progress", help="run the visible tests of your notebooks' exercises and list what passes",
        description="For every exercise in DIR/NN_topic/NN_topic.ipynb: passing, failing (with the first line "
                    "of the message) or not started. It runs the code in your notebooks, one subprocess per "
                    "notebook: use it on your own folder.")
    prog.add_argument("--course", required=True, metavar="DIR",
                      help="the folder that holds NN_topic/NN_topic.ipynb (your course/ or your home after a fetch)")
    prog.add_argument("--notebooks", default=None, metavar="NAMES",
                      help="only these notebooks, comma-separated: 02_sampling,03_kv_cache or 02,03")
    prog.add_argument("--timeout", type=float, default=60.0, metavar="S",
                      help="seconds per notebook (default 60); an exercise still running then fails")
    prog.add_argument("--json", action="store_true",
                      help='print one JSON object: {"exercises": [{notebook, exercise, part, status, hints_used}]} '
                           '(with --serve also "serve": {prompt_ids, output_ids, text, parts, why})')
    prog.add_argument("--serve", default=None, metavar="PROMPT",
                      help="then answer PROMPT with SmolLM2 (greedy, float32, chat template, up to 32 new tokens) "
                           "on an engine whose every stage is your passing part, the library's otherwise")
    prog.add_argument("--quantization", default=None, choices=["int8"],
                      help="with --serve: int8 weights, built by your Int8Linear when it passes")
    hints = commands.add_parser(
        "hints", help="print every exercise's hints, from a nudge to a sketch",
        description="The hints behind the notebooks' hint buttons, for every exercise, gentlest first.")
    hints.add_argument("--notebook", default=None, metavar="NAME", help="only this notebook: 02_sampling or 02")
    hints.add_argument("--json", action="store_true",
                       help='print one JSON object: {"NN_topic": {"ex_<name>": ["hint 1", ...]}}')
    return parser


def run_hints(args) -> int:
    from decodelab.course import hints

    found = hints.select(hints.load_hints(), args.notebook)
    print(json.dumps(found, ensure_ascii=False) if args.json else hints.format_text(found))
    return 0


def run_generate(args) -> int:
    from decodelab.params import SamplingParams

    # Check the sampling values before importing torch, so a typo fails at once.
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            repetition_penalty=args.repetition_penalty, max_tokens=args.max_new_tokens,
                            seed=args.seed)
    from decodelab.decoding.generate import Completion, encode_prompt, stream_text
    from decodelab.model.registry import load

    model, tokenizer = load(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat)
    completion = Completion(prompt_ids)
    for piece in stream_text(model, tokenizer, prompt_ids, params, completion):
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({"prompt_ids": completion.prompt_ids, "output_ids": completion.output_ids,
                          "text": completion.text, "finish_reason": completion.finish_reason}))
    else:
        sys.stdout.write("\n")
    return 0


def run_progress(args) -> int:
    from decodelab.course import progress

    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout:g}")
    names = args.notebooks.split(",") if args.notebooks else None
    def tell(notebook):
        print(f"checking {notebook} ...", file=sys.stderr, flush=True)
    if args.quantization and args.serve is None:
        raise ValueError("--quantization goes with --serve")
    rows = progress.check_course(args.course, names, timeout=args.timeout, progress=tell if sys.stderr.isatty() else None)
    if args.serve is None:
        print(progress.to_json(rows) if args.json else progress.format_table(rows))
        return 0
    from decodelab.course import parts

    engine = parts.assemble(args.course, rows, quantization=args.quantization)
    served = parts.serve(engine, args.serve)
    if args.json:
        print(json.dumps({**json.loads(progress.to_json(rows)), "serve": served}))
    else:
        print(progress.format_table(rows) + "\n\n" + parts.format_bill(engine.bill) + "\n")
        print(f"> {args.serve}\n{served['text']}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            from decodelab.model.registry import prepare_smollm2
            print(prepare_smollm2(), file=sys.stderr)
            return 0
        if args.command == "progress":
            return run_progress(args)
        if args.command == "hints":
            return run_hints(args)
        return run_generate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`python -m decodelab`: generate text from the command line, prepare the default model.

    python -m decodelab generate "What is gravity?" [--model smollm2|tiny|tiny-draft|tiny-mamba|DIR]
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
        [--repetition-penalty R] [--device D] [--dtype fp32|bf16|fp16] [--no-chat] [--json]
        [--q4]                      # SmolLM2's own Q4_1 blocks from its GGUF, a fused C kernel (x86-64 AVX2):
                                    # the default for SmolLM2 on a CPU in float32 where the kernel loads
        [--float]                   # the float weights even there
        [--int8 [--no-compile]]     # int8 weights, decoded by a compiled step (CPU-dependent: see --help)
    python -m decodelab prepare [--no-compile]   # convert SmolLM2 into the cache once, and build its
        # int8 decode step ahead of time (a few minutes; `generate --int8` then starts it in ~10 ms)
    python -m decodelab progress --course DIR [--notebooks 02_sampling,03] [--timeout S] [--json]
        # your notebooks' exercises: passing, failing (and why), not started, hints used
    python -m decodelab progress --course DIR --serve "PROMPT" [--quantization int8] [--json]
        # ... and SmolLM2 served by an engine made of your passing parts (decodelab.course.parts)
    python -m decodelab progress --course DIR --bench [--json]
        # ... and your engine's timed parts beside the library's: time ratios, roofline (course.speed_credit)
    python -m decodelab hints [--notebook 02_sampling] [--json]   # every exercise's hint ladder
    python -m decodelab serve [--model smollm2|tiny|DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
        [--max-queue N] [--max-num-seqs N] [--chat-template FILE] [--quantization int8|int4|q4|none]
        [--device D] [--dtype fp32|bf16|fp16]
        # an OpenAI-compatible server on the engine (decodelab.serving): /v1/completions, /v1/chat/completions,
        # /v1/models, /health, /metrics; SIGTERM or Ctrl-C stops it

Text streams to stdout; with --json exactly one JSON object is printed there instead, and
nothing at all when the command fails. Progress and errors go to stderr. Bad input (a flag out
of its range, an unknown command, a model that cannot be loaded, a device this machine lacks, a
prompt that is not UTF-8 or does not fit the model) is one line, `decodelab: error: ...`, and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys

from decodelab.params import MAX_SEED, SamplingParams

COMMANDS = ("generate", "prepare", "progress", "hints", "serve")
# engine.args.QUANTIZATIONS without None, named here so that --help does not import torch (a test keeps them equal)
SERVE_QUANTIZATIONS = ("int8", "int4", "q4")
DEVICES = "cpu, cuda, cuda:N or mps"


class CommandLineError(ValueError):
    """Bad input the command line itself finds: a device this machine lacks, a flag misused."""


class CommandLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line, `decodelab: error: ...`, and exit code 2."""

    def error(self, message):
        self.exit(2, f"decodelab: error: {message}\n")


# --------------------------------------------------------------------------- argument types


def utf8_text(text: str) -> str:
    """A prompt as given: bytes that are not UTF-8 reach Python as lone surrogates (os.fsdecode),
    which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if "\udc80" <= bad <= "\udcff" else f"character U+{ord(bad):04X}"
        offset = len(text[: exc.start].encode("utf-8", "surrogateescape"))
        raise argparse.ArgumentTypeError(
            f"must be UTF-8 text, got {what} at byte {offset}: is your terminal's encoding UTF-8?"
        ) from None
    return text


def number_or_none(parse, text: str):
    """parse(text) for an int or a finite float; None when text is not one."""
    try:
        value = parse(text)
    except ValueError:
        return None
    return value if parse is int or math.isfinite(value) else None


def sampling_value(field: str, parse, allowed: str):
    """The argparse type of a flag that sets SamplingParams.`field`: text -> parse(text), judged
    by SamplingParams itself. Its error names the flag (argparse does), the range and the value."""

    def convert(text: str):
        value = number_or_none(parse, text)
        if value is None:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        try:
            SamplingParams(**{field: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{field} ")) from None
        return value

    convert.__name__ = field
    return convert


def seed(text: str) -> int:
    value = number_or_none(int, text)
    if value is None or not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{MAX_SEED} (2**63 - 1), got {text!r}")
    return value


def port(text: str) -> int:
    value = number_or_none(int, text)
    if value is None or not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535 (0: any free port), got {text!r}")
    return value


def count(text: str) -> int:
    value = number_or_none(int, text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def seconds(text: str) -> float:
    value = number_or_none(float, text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


# --------------------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(prog="python -m decodelab", description="Decode Lab inference engine")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", help=", ".join(COMMANDS))
    gen = commands.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", type=utf8_text)
    gen.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (default), tiny, tiny-draft, tiny-mamba, or a model folder (Llama-family or Mamba)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=sampling_value("max_tokens", int, "an integer >= 1"),
        default=128,
        metavar="N",
        help="an integer >= 1 (default 128)",
    )
    gen.add_argument(
        "--temperature",
        type=sampling_value("temperature", float, "a finite number >= 0"),
        default=0.0,
        metavar="T",
        help="a finite number >= 0; 0 = greedy (default)",
    )
    gen.add_argument(
        "--top-k",
        type=sampling_value("top_k", int, "an integer >= 1, or 0 / -1 to disable"),
        default=0,
        metavar="K",
        help="an integer >= 1; 0 = off (default)",
    )
    gen.add_argument(
        "--top-p",
        type=sampling_value("top_p", float, "a number in (0, 1]"),
        default=1.0,
        metavar="P",
        help="a number in (0, 1]; 1 = off (default)",
    )
    gen.add_argument(
        "--repetition-penalty",
        type=sampling_value("repetition_penalty", float, "a finite number > 0"),
        default=1.0,
        metavar="R",
        help="a finite number > 0; 1 = off (default)",
    )
    gen.add_argument("--seed", type=seed, default=None, metavar="S", help=f"an integer in 0..{MAX_SEED}")
    gen.add_argument("--device", default=None, help=f"{DEVICES} (default: best available)")
    gen.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    gen.add_argument("--no-chat", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, output_ids, text")
    gen.add_argument(
        "--int8",
        action="store_true",
        help="int8 weights (every linear, lm_head too), decoded by a compiled step: a quarter of "
        "float32's bytes; its speed depends on the CPU (1.8x float32's tokens/s measured on an AVX-512 "
        "CPU, half of it on an AVX2-only one); the step `prepare` built ahead of time loads at once, "
        "else the first run compiles (tens of seconds)",
    )
    gen.add_argument(
        "--q4",
        action="store_true",
        help="SmolLM2 only: its linears multiply the GGUF's own Q4_1 blocks (4-bit), its lm_head the Q8_0 "
        "ones, through fused C kernels compiled once with the system C compiler (x86-64 with AVX2, FMA "
        "and F16C; elsewhere a slower pure-torch path, said on stderr): ~10x float32's tokens/s. The float32 "
        "SmolLM2 is that GGUF dequantized, so these are the same weights; the activations read as 16-bit "
        "integers and the order of the sums move the logits by ~3e-4 of their size. The default for SmolLM2 on a CPU in float32 wherever the kernels load",
    )
    gen.add_argument(
        "--float",
        action="store_true",
        help="the float weights (the dtype's), even for SmolLM2 on a CPU, where --q4 is the default",
    )
    gen.add_argument(
        "--no-compile",
        action="store_true",
        help="with --int8: run the int8 model eagerly, even where `prepare` built its compiled step "
        "(slower tokens; DECODELAB_COMPILE=0 does the same)",
    )
    prep = commands.add_parser(
        "prepare",
        help="convert the default model (SmolLM2) into the cache and build its int8 decode step",
    )
    prep.add_argument(
        "--no-compile",
        action="store_true",
        help="only convert the model: no ahead-of-time compiled decode step (which takes minutes)",
    )
    prog = commands.add_parser(
        "progress",
        help="run the visible tests of your notebooks' exercises and list what passes",
        description="For every exercise in DIR/NN_topic/NN_topic.ipynb: passing, failing (with the first line "
        "of the message) or not started. It runs the code in your notebooks, one subprocess per "
        "notebook: use it on your own folder.",
    )
    prog.add_argument(
        "--course",
        required=True,
        metavar="DIR",
        help="the folder that holds NN_topic/NN_topic.ipynb (your course/ or your home after a fetch)",
    )
    prog.add_argument(
        "--notebooks",
        default=None,
        metavar="NAMES",
        help="only these notebooks, comma-separated: 02_sampling,03_kv_cache or 02,03",
    )
    prog.add_argument(
        "--timeout",
        type=seconds,
        default=60.0,
        metavar="S",
        help="seconds per notebook (default 60); an exercise still running then fails",
    )
    prog.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object: {"exercises": [{notebook, exercise, part, status, hints_used}]} '
        '(with --serve also "serve": {prompt_ids, output_ids, text, parts, why}; with --bench '
        'also "bench": {bandwidth_bytes_per_s, parts: [{part, status, ratio, roofline_fraction, '
        "...}]})",
    )
    prog.add_argument(
        "--serve",
        default=None,
        metavar="PROMPT",
        type=utf8_text,
        help="then answer PROMPT with SmolLM2 (greedy, float32, chat template, up to 32 new tokens) "
        "on an engine whose every stage is your passing part, the library's otherwise",
    )
    prog.add_argument(
        "--quantization",
        default=None,
        choices=["int8"],
        help="with --serve: int8 weights, built by your Int8Linear when it passes",
    )
    prog.add_argument(
        "--bench",
        action="store_true",
        help="then time your passing engine parts (paged attention, int8 linear, decode step, scheduler "
        "step) against the library's, in order-alternated pairs in fresh processes: the median "
        "time ratio, its spread, and each part's fraction of this machine's memory roofline "
        "(small sizes when DECODELAB_FAST=1)",
    )
    hints = commands.add_parser(
        "hints",
        help="print every exercise's hints, from a nudge to a sketch",
        description="The hints behind the notebooks' hint buttons, for every exercise, gentlest first.",
    )
    hints.add_argument("--notebook", default=None, metavar="NAME", help="only this notebook: 02_sampling or 02")
    hints.add_argument(
        "--json", action="store_true", help='print one JSON object: {"NN_topic": {"ex_<name>": ["hint 1", ...]}}'
    )
    add_serve_parser(commands)
    return parser


def add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible server on the engine",
        description="Serve the model with OpenAI's API: /v1/completions and /v1/chat/completions (whole or "
        "streamed), /v1/models, /health and /metrics (Prometheus). SIGTERM or Ctrl-C stops it.",
    )
    serve.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a model folder")
    serve.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=port, default=8000, help="the port (default 8000; 0: any free port)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("DECODELAB_API_KEY"),
        metavar="KEY",
        help="answer /v1 requests only with `Authorization: Bearer KEY` (default: "
        "$DECODELAB_API_KEY; none: anyone who can connect)",
    )
    serve.add_argument(
        "--max-queue",
        type=count,
        default=256,
        metavar="N",
        help="answer 503 (Retry-After) while N requests wait for the engine (default 256)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=count,
        default=64,
        metavar="N",
        help="sequences in the engine's batch at once (default 64)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template (a file, or the text) for a model without one, such as tiny",
    )
    serve.add_argument(
        "--quantization",
        choices=(*SERVE_QUANTIZATIONS, "none"),
        default=None,
        help="the engine's weights: int8 (decoded by the compiled step where `prepare` built it), int4, "
        "q4 (SmolLM2 only: the GGUF's own Q4_1 blocks through a fused C kernel, the same weights as its "
        "float32 ones), or none (the float weights). Default: q4 for SmolLM2 on a CPU in float32 where "
        "the kernel loads, else none",
    )
    serve.add_argument("--device", default=None, help=f"{DEVICES} (default: best available)")
    serve.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; an unknown or missing command is an error that lists the commands."""
    parser = build_parser()
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command not in COMMANDS and not {"-h", "--help"} & set(argv):
        given = f"unknown command {command!r}" if command is not None else "no command given"
        parser.error(f"{given}: use one of {', '.join(COMMANDS)} (python -m decodelab COMMAND --help)")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- the commands


def run_hints(args) -> int:
    from decodelab.course import hints

    found = hints.select(hints.load_hints(), args.notebook)
    print(json.dumps(found, ensure_ascii=False) if args.json else hints.format_text(found))
    return 0


def check_device(name: str | None) -> None:
    """A --device this machine has (registry.check_device, the library's own judgement)."""
    if name is None:
        return
    from decodelab.model.registry import check_device as library_check

    try:
        library_check(name)
    except ValueError as exc:
        raise CommandLineError(f"argument --device: {exc}") from None


def load_model(model: str, device: str | None, dtype: str):
    """(model, tokenizer) from the registry; a folder whose files cannot be read says so."""
    from decodelab.model.registry import load

    try:
        return load(model, device=device, dtype=dtype)
    except (ValueError, OSError):
        raise  # the library's own message names the problem
    except Exception as exc:  # noqa: BLE001 - safetensors and tokenizers raise their own types
        raise CommandLineError(f"the model {model} cannot be loaded: {type(exc).__name__}: {exc}") from exc


def run_generate(args) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    check_device(args.device)
    from decodelab.decoding.generate import Completion, encode_prompt, stream_text

    if args.no_compile and not args.int8:
        raise CommandLineError("--no-compile goes with --int8 (the float model runs eagerly anyway)")
    chosen = [flag for flag, given in (("--q4", args.q4), ("--int8", args.int8), ("--float", args.float)) if given]
    if len(chosen) > 1:
        raise CommandLineError(f"{' and '.join(chosen)} are different weight formats: choose one")
    if args.q4 and args.model != "smollm2":
        raise CommandLineError(
            f"--q4 reads the Q4_1 blocks of the GGUF a model comes from, and only smollm2 comes from one "
            f"(got --model {args.model}): use --int8"
        )
    from decodelab.model.q4_linear import q4_pays, use_gguf_q4_weights

    q4 = args.q4 or (not chosen and q4_pays(args.model, args.device, args.dtype))
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    if q4:
        from decodelab.model.registry import smollm2_gguf_path

        model = use_gguf_q4_weights(model, smollm2_gguf_path())
    if args.int8:
        from decodelab.model.mamba import refuse_state_space

        try:
            refuse_state_space(model, "--int8 (the int8 decode step)")
        except ValueError as exc:
            raise CommandLineError(str(exc)) from None
        from decodelab.model.fused_int8 import compile_by_default, quantize_for_decode

        model = quantize_for_decode(model)
        if not args.no_compile and compile_by_default():
            from decodelab.decoding.compiled import CompiledDecoder
            from decodelab.decoding.packaged import decoder_for

            # on a CPU the step `prepare` built (no wait), else torch.compile, saying so on stderr
            model = decoder_for(model) if torch_device(model).type == "cpu" else CompiledDecoder(model)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat)
    completion = Completion(prompt_ids)
    for piece in stream_text(model, tokenizer, prompt_ids, params, completion):
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_ids": completion.prompt_ids,
                    "output_ids": completion.output_ids,
                    "text": completion.text,
                    "finish_reason": completion.finish_reason,
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0


def torch_device(model):
    import torch

    return torch.device(model.device)


def run_prepare(args) -> int:
    """Convert SmolLM2 into the cache and build the C kernels there (`q4_kernel`, seconds), then the
    AOT-compiled int8 decode step that `generate --int8` loads (decodelab.decoding.packaged; minutes,
    once) unless --no-compile."""
    import time

    from decodelab.model import q4_kernel
    from decodelab.model.registry import load, prepare_smollm2

    print(prepare_smollm2(), file=sys.stderr)
    print(q4_kernel.prepared(), file=sys.stderr)  # compiled now, not on a first decode (nor in a grading kernel)
    if args.no_compile:
        return 0
    from decodelab.decoding.packaged import build_package, package_path
    from decodelab.model.fused_int8 import quantize_for_decode

    model = quantize_for_decode(load("smollm2", device="cpu", dtype="float32")[0])
    path = package_path(model)
    if path.is_file():
        print(f"{path} (the int8 decode step, already built)", file=sys.stderr)
        return 0
    print("building the int8 decode step ahead of time (a few minutes, once) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    build_package(model, path)
    print(f"{path} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


def run_progress(args) -> int:
    from decodelab.course import progress

    if args.quantization and args.serve is None:
        raise CommandLineError("--quantization goes with --serve")
    names = args.notebooks.split(",") if args.notebooks else None

    def tell(line):
        print(line, file=sys.stderr, flush=True)

    told = tell if sys.stderr.isatty() else None
    rows = progress.check_course(
        args.course,
        names,
        timeout=args.timeout,
        progress=(lambda notebook: tell(f"checking {notebook} ...")) if told else None,
    )
    found, texts = json.loads(progress.to_json(rows)), [progress.format_table(rows)]
    if args.serve is not None:
        from decodelab.course import parts

        engine = parts.assemble(args.course, rows, quantization=args.quantization)
        served = parts.serve(engine, args.serve)
        found["serve"] = served
        texts += [parts.format_bill(engine.bill), f"> {args.serve}\n{served['text']}"]
    if args.bench:
        from decodelab.course import speed_credit
        from decodelab.course.notebook import fast_mode

        report = speed_credit.bench_course(args.course, rows, size="small" if fast_mode() else "full", on_progress=told)
        found["bench"] = report.to_dict()
        texts.append(speed_credit.format_report(report))
    print(json.dumps(found) if args.json else "\n\n".join(texts))
    return 0


def run_serve(args) -> int:
    check_device(args.device)
    quantization = None if args.quantization == "none" else args.quantization
    if args.quantization is None:
        from decodelab.model.q4_linear import q4_pays

        quantization = "q4" if q4_pays(args.model, args.device, args.dtype) else None
    try:
        from decodelab.serving.server import ServeSettings, serve
    except ImportError as exc:
        raise CommandLineError(f"serve needs fastapi and uvicorn: pip install 'decodelab[serve]' ({exc})") from None
    return serve(
        ServeSettings(
            model=args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_queue=args.max_queue,
            chat_template=args.chat_template,
            engine=dict(
                device=args.device,
                dtype=args.dtype,
                max_num_seqs=args.max_num_seqs,
                quantization=quantization,
            ),
        )
    )


def run(args) -> int:
    if args.command == "prepare":
        return run_prepare(args)
    if args.command == "progress":
        return run_progress(args)
    if args.command == "hints":
        return run_hints(args)
    if args.command == "serve":
        return run_serve(args)
    return run_generate(args)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (torch's and others' may span several)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or type(exc).__name__


def stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds: progress kills the notebook's processes on the way out


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit:  # argparse: --help (0) or one error line already printed (2)
        return exit.code if isinstance(exit.code, int) else 2
    if args.command == "progress" and argv is None:
        signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        return run(args)
    except (ValueError, TypeError, RuntimeError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):  # `... generate | head`: the reader has gone; so do we
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        print(f"decodelab: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

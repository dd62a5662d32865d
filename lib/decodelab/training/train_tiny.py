"""Train the course's tiny models offline: a BPE tokenizer, `tiny` (target) and `tiny-draft`.

    python -m decodelab.training.train_tiny --which corpus      # rebuild data/corpus/*.txt (needs Python 3.11)
    python -m decodelab.training.train_tiny --which tokenizer   # BPE on data/corpus/train.txt
    python -m decodelab.training.train_tiny --which target --minutes 30
    python -m decodelab.training.train_tiny --which draft --minutes 10
    python -m decodelab.training.train_tiny --which all         # tokenizer, target, draft
    python -m decodelab.training.train_tiny --which report      # rewrite TRAINING.md from the model folders

The corpus is a committed slice of CPython's standard library, so results do not drift
with the Python installed. Training is time-budgeted: the step count is fixed from the
speed of the first steps (still in warm-up, so the run is the same as one given `--steps`
with that count) and recorded in each model folder's training.json and in TRAINING.md.
Shapes: B batch, T sequence length, V vocab_size.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from decodelab.config import ModelConfig
from decodelab.model.llama import LlamaForCausalLM
from decodelab.model.tokenizer import Tokenizer
from decodelab.model.weights import load_model, save_model
from decodelab.paths import PACKAGE_DATA

EOT = "<|endoftext|>"  # id 0: BOS, EOS and document separator
HEADER = "# ---- file: {} ----\n"
TRAIN_FILES = """argparse abc ast base64 bisect calendar cmd code collections/__init__ configparser
contextlib copy csv dataclasses datetime difflib email/feedparser email/generator email/header
email/message email/parser email/utils enum fnmatch fractions functools getopt gettext glob
hashlib heapq hmac http/client inspect json/__init__ json/decoder json/encoder json/scanner
json/tool logging/__init__ numbers operator pathlib pprint queue random sched secrets selectors
shlex shutil statistics string subprocess tarfile tempfile textwrap tokenize traceback typing
unittest/case urllib/parse weakref zipfile""".split()
HELDOUT_FILES = "optparse smtplib plistlib timeit filecmp graphlib reprlib".split()
MODELS = {  # name -> (folder, architecture, default minutes)
    "target": (
        "tiny",
        dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8),
        30.0,
    ),
    "draft": (
        "tiny-draft",
        dict(hidden_size=128, intermediate_size=352, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4),
        10.0,
    ),
}
SEQ_LEN, BATCH, PEAK_LR, WARMUP = 256, 16, 3e-3, 50
ESTIMATE_AT = WARMUP  # the step count is fixed from the speed of steps 5..ESTIMATE_AT


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- corpus
def build_corpus(out: Path) -> None:
    """Concatenate the named stdlib modules into train.txt and heldout.txt under out."""
    if sys.version_info[:2] != (3, 11):
        log(f"warning: the committed corpus came from Python 3.11, this is {sys.version.split()[0]}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out.mkdir(parents=True, exist_ok=True)
    for name, files in (("train.txt", TRAIN_FILES), ("heldout.txt", HELDOUT_FILES)):
        parts = [HEADER.format(f"{f}.py") + (stdlib / f"{f}.py").read_text(encoding="utf-8") for f in files]
        (out / name).write_text("".join(p if p.endswith("\n") else p + "\n" for p in parts), encoding="utf-8")
        log(f"{out / name}: {len(files)} files, {(out / name).stat().st_size:,} bytes")


def documents(text: str) -> list[str]:
    """Split a corpus file back into its files, each starting with its header line."""
    return ["# ---- file: " + d for d in text.split("# ---- file: ") if d]


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(corpus: Path, out: Path, vocab_size: int) -> None:
    """Byte-level BPE on the training corpus -> out/tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(documents((corpus / "train.txt").read_text(encoding="utf-8")), trainer)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    log(f"tokenizer: {backend.get_vocab_size()} tokens -> {out}")


def token_stream(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """[N] int64: every document preceded by <|endoftext|>."""
    ids = []
    for doc in documents(text):
        ids += [tokenizer.bos_token_id] + tokenizer.encode(doc, add_bos=False)
    return torch.tensor(ids, dtype=torch.long)


def byte_lengths(tokenizer: Tokenizer) -> torch.Tensor:
    """[V]: bytes of text per token (byte-level BPE spells each byte as one character)."""
    lengths = torch.zeros(tokenizer.vocab_size)
    for token, i in tokenizer.backend.get_vocab(with_added_tokens=False).items():
        lengths[i] = len(token)
    lengths[tokenizer.bos_token_id] = 0
    return lengths


# -------------------------------------------------------------------------- model
def make_model(which: str, vocab_size: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialized model: normal(0.02) weights, residual outputs scaled by 1/sqrt(2L)."""
    arch = MODELS[which][1]
    config = ModelConfig(
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        **arch,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = (
                0.02 / math.sqrt(2 * config.num_hidden_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else 0.02
            )
            torch.nn.init.normal_(p, std=std)
    return model


def batch(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows at `starts` [B] -> inputs [B, T] and next-token targets [B, T]."""
    window = stream[starts[:, None] + torch.arange(seq_len + 1)]  # [B, T + 1]
    return window[:, :-1], window[:, 1:]


def lr_at(step: int, total: int) -> float:
    """Linear warm-up for WARMUP steps, then cosine decay to 10% of PEAK_LR at `total`."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, total - WARMUP))
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor) -> dict:
    """Mean next-token nll (nats/token) and bits/byte over the windows at `starts`."""
    model.eval()
    nll, count, nbytes = 0.0, 0, 0.0
    for chunk in starts.split(BATCH):
        inputs, targets = batch(stream, chunk, SEQ_LEN)
        logits = model(inputs)  # [B, T, V]
        nll += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count, nbytes = count + targets.numel(), nbytes + lengths[targets].sum().item()
    model.train()
    return {"nats_per_token": nll / count, "bits_per_byte": nll / math.log(2) / nbytes, "tokens": count}


def make_optimizer(model) -> torch.optim.AdamW:
    """AdamW; weight decay on the matrices only (not on the norms' gains)."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=PEAK_LR, betas=(0.9, 0.95)
    )


def train_step(model, opt, inputs: torch.Tensor, targets: torch.Tensor, lr: float, bf16: bool) -> float:
    """One AdamW step on inputs/targets [B, T]; returns the loss (nats/token)."""
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def train(which: str, minutes: float, steps: int | None, seed: int, out: Path, command: str, bf16: bool = True) -> dict:
    """Train one model, save it to out/<folder>, return its statistics.

    bf16: autocast the matmuls to bfloat16 (master weights and optimizer stay float32);
    about 1.5x faster on CPUs with AMX / AVX512-BF16.
    """
    tokenizer = Tokenizer.from_folder(out / "tokenizer")
    train_ids = token_stream(tokenizer, (out / "corpus" / "train.txt").read_text(encoding="utf-8"))
    heldout = token_stream(tokenizer, (out / "corpus" / "heldout.txt").read_text(encoding="utf-8"))
    probe = torch.arange(BATCH) * ((len(heldout) - SEQ_LEN - 1) // BATCH)  # held-out windows for progress
    lengths = byte_lengths(tokenizer)
    model = make_model(which, tokenizer.vocab_size, seed)
    opt = make_optimizer(model)
    data_gen = torch.Generator().manual_seed(seed + 1)
    log(f"{which}: {model.num_parameters():,} parameters, {len(train_ids):,} training tokens")
    total, step, loss_avg = steps or 10**9, 0, None
    start = last_print = time.time()
    while step < total:
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (BATCH,), generator=data_gen)
        loss = train_step(model, opt, *batch(train_ids, starts, SEQ_LEN), lr_at(step, total), bf16)
        step += 1
        loss_avg = loss if loss_avg is None else 0.95 * loss_avg + 0.05 * loss
        if steps is None and step == 5:
            t5 = time.time()
        if steps is None and step == ESTIMATE_AT:  # warm-up ends: no lr so far depended on `total`
            total = max(ESTIMATE_AT, int(minutes * 60 / ((time.time() - t5) / (ESTIMATE_AT - 5))))
            log(f"{which}: {minutes} min budget -> {total} steps")
        if time.time() - last_print >= 30 or step == total:
            probe_loss = evaluate(model, heldout, lengths, probe)["nats_per_token"]
            last_print = time.time()
            log(
                f"{which}: step {step}/{total} loss {loss_avg:.3f} held-out {probe_loss:.3f} "
                f"lr {lr_at(step - 1, total):.2e} {last_print - start:,.0f}s"
            )
    stats = {
        "command": command,
        "steps": step,
        "train_seconds": round(time.time() - start),
        "seed": seed,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "peak_lr": PEAK_LR,
        "warmup": WARMUP,
        "bf16_autocast": bf16,
        "threads": torch.get_num_threads(),
    }
    return finish(which, model, train_ids, heldout, lengths, out, stats)


def finish(
    which: str, model, train_ids: torch.Tensor, heldout: torch.Tensor, lengths: torch.Tensor, out: Path, stats: dict
) -> dict:
    """Save in bfloat16, then measure the saved weights on train and held-out windows."""
    folder = out / MODELS[which][0]
    save_model(model, folder, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / "tokenizer" / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}) + "\n")
    saved = load_model(folder)
    all_heldout = torch.arange(0, len(heldout) - SEQ_LEN - 1, SEQ_LEN)
    some_train = torch.randint(
        0, len(train_ids) - SEQ_LEN - 1, (len(all_heldout),), generator=torch.Generator().manual_seed(0)
    )
    stats.update(
        parameters=saved.num_parameters(),
        config=MODELS[which][1],
        train=evaluate(saved, train_ids, lengths, some_train),
        heldout=evaluate(saved, heldout, lengths, all_heldout),
    )
    (folder / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    log(
        f"{which}: train {stats['train']['nats_per_token']:.3f}, held-out {stats['heldout']['nats_per_token']:.3f} "
        f"nats/token ({stats['heldout']['bits_per_byte']:.3f} bits/byte) -> {folder}"
    )
    return stats


# ----------------------------------------------------------------------- report
SAMPLE_PROMPTS = ("import os\n", "def fibonacci(n):", "class Stack:\n", "    def __init__(self")


def samples(folder: Path, prompts=SAMPLE_PROMPTS) -> list[tuple[str, str]]:
    from decodelab.decoding.generate import generate
    from decodelab.params import SamplingParams

    model, tokenizer = load_model(folder), Tokenizer.from_folder(folder)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    return [(p, generate(model, tokenizer, p, params, chat=False).text) for p in prompts]


def write_report(out: Path) -> None:
    """TRAINING.md from each model folder's training.json."""
    lines = [
        "# The tiny models: how they were trained",
        "",
        "Written by `python -m decodelab.training.train_tiny`; the corpus is described in `corpus/README.md`.",
        "Losses are measured on the saved bfloat16 weights (run in float32): held-out = every",
        "256-token window of `corpus/heldout.txt`, train = as many random windows of `train.txt`.",
        "The corpus is small (0.8M tokens), so longer training overfits: a 1600-step run of the",
        "target (46 min) reached train 1.455 but held-out 3.304 nats/token, worse than the run below.",
        "",
    ]
    for which, (name, _, _) in MODELS.items():
        path = out / name / "training.json"
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        lines += [
            f"## `{name}` ({which})",
            "",
            f"- architecture: `{json.dumps(s['config'])}`, "
            f"vocab {json.loads((out / name / 'config.json').read_text())['vocab_size']}, tied embeddings, context 1024",
            f"- parameters: {s['parameters']:,}",
            f"- training: {s['steps']} steps of {s['batch']} x {s['seq_len']} tokens in {s['train_seconds'] / 60:.1f} min "
            f"({s['threads']} CPU thread{'s' * (s['threads'] > 1)}{', bfloat16 autocast' if s['bf16_autocast'] else ''}), AdamW peak lr {s['peak_lr']}, warm-up {s['warmup']}, cosine to 10%, seed {s['seed']}",
            f"- command: `{s['command']}`",
            f"- reproduce exactly: `python -m decodelab.training.train_tiny --which {which} --steps {s['steps']} --seed {s['seed']}"
            f"{'' if s['bf16_autocast'] else ' --fp32'}`",
        ]
        for split, label in (("train", "train"), ("heldout", "held-out")):
            r = s[split]
            lines.append(
                f"- {label} loss: {r['nats_per_token']:.3f} nats/token, {r['bits_per_byte']:.3f} bits/byte "
                f"({r['tokens']:,} tokens)"
            )
        lines += ["", "Greedy samples (40 tokens):", ""]
        for prompt, text in samples(out / name):
            lines += ["```python", prompt + text, "```"]
        lines.append("")
    (out / "TRAINING.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodelab.training.train_tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--which", choices=["corpus", "tokenizer", "target", "draft", "all", "report"], default="all")
    parser.add_argument("--minutes", type=float, default=None, help="training budget (default: target 30, draft 10)")
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (overrides --minutes)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fp32", action="store_true", help="train without bfloat16 autocast")
    parser.add_argument("--out", type=Path, default=PACKAGE_DATA, help="data folder (default: the package's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.which == "corpus":
        build_corpus(args.out / "corpus")
        return 0
    if args.which in ("tokenizer", "all"):
        train_tokenizer(args.out / "corpus", args.out / "tokenizer", args.vocab_size)
    command = "python -m decodelab.training.train_tiny " + " ".join(argv if argv is not None else sys.argv[1:])
    for which in ("target", "draft"):
        if args.which in (which, "all"):
            train(which, args.minutes or MODELS[which][2], args.steps, args.seed, args.out, command, not args.fp32)
    if args.which != "tokenizer":
        write_report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train `tiny-mamba` offline: a Mamba-style model beside `tiny`, on the same corpus and tokenizer.

    python -m decodelab.training.train_ssm --minutes 20
    python -m decodelab.training.train_ssm --steps 300       # a fixed step count
    python -m decodelab.training.train_ssm --report          # rewrite its section of TRAINING.md

Everything but the model comes from `train_tiny`: the corpus, the tokenizer in `data/tokenizer`,
the windows, the learning-rate schedule, the evaluation (held-out = every 256-token window of
heldout.txt, on the saved bfloat16 weights) and the time budget rule (the step count fixed from
the speed of the first steps). The batch is smaller than tiny's (8, not 16 windows): on a CPU the
scan costs about b * T * E * N per layer, so the same minutes buy fewer tokens than attention's.
A step of 8 x 256 tokens took 95 s of CPU in float32 on the shared 2-core AVX2 machine until the
token-by-token scan stopped slicing its [b, T, E, N] tensors (each slice's backward wrote a whole zero
tensor); it takes about 3.3 s wall now at 2 threads in float32 (bfloat16 autocast is slower on a CPU
without native bfloat16), near tiny's 2.2 s. The shipped weights' run is in TRAINING.md.
Shapes: b batch, T sequence length.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from decodelab.model.mamba import MambaConfig, MambaForCausalLM, load_mamba, save_mamba
from decodelab.model.tokenizer import Tokenizer
from decodelab.paths import PACKAGE_DATA
from decodelab.training import train_tiny
from decodelab.training.train_tiny import PEAK_LR, SEQ_LEN, batch, byte_lengths, evaluate, log, token_stream

FOLDER = "tiny-mamba"
ARCH = dict(hidden_size=256, num_hidden_layers=7, state_size=8, expand=2, conv_kernel=4)
BATCH = 8
CHUNK = 1  # the scan token by token while training: the least arithmetic, the fastest on one CPU thread
WARMUP = 10  # fewer than tiny's 50: on a shared CPU a step here takes seconds, the run few steps
ESTIMATE_AT = WARMUP  # the step count is fixed from the speed of steps 2..ESTIMATE_AT
SECTION = "## `tiny-mamba`"


def make_model(vocab_size: int, seed: int) -> MambaForCausalLM:
    """Initialized as transformers' Mamba: A_log = log(1..N), D = 1, Δ's bias the inverse softplus of
    Δ drawn log-uniformly in [0.001, 0.1], dt_proj weight uniform(±R^-0.5); other matrices
    normal(0.02), out_proj scaled by 1/sqrt(2L); the conv keeps PyTorch's default."""
    config = MambaConfig(vocab_size=vocab_size, max_position_embeddings=1024, **ARCH)
    torch.manual_seed(seed)
    model = MambaForCausalLM(config)
    scale = 0.02 / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("out_proj.weight"):
                torch.nn.init.normal_(p, std=scale)
            elif name.endswith(("in_proj.weight", "x_proj.weight", "embeddings.weight")):
                torch.nn.init.normal_(p, std=0.02)
        for layer in model.backbone.layers:
            mixer = layer.mixer
            torch.nn.init.uniform_(mixer.dt_proj.weight, -(mixer.R**-0.5), mixer.R**-0.5)
            dt = torch.exp(torch.rand(mixer.E) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
            mixer.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return model


def make_optimizer(model: MambaForCausalLM) -> torch.optim.AdamW:
    """AdamW; weight decay on the linear and embedding matrices only (not A_log, D, the conv, norms)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.endswith("A_log")]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.endswith("A_log"))]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
    )


def lr_at(step: int, total: int) -> float:
    """Linear warm-up for WARMUP steps, then cosine decay to 10% of PEAK_LR at `total` (tiny's shape)."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, total - WARMUP))
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Chunked(torch.nn.Module):
    """The model with the training chunk size: model(ids [b, T]) -> logits [b, T, V]."""

    def __init__(self, model: MambaForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, chunk_size=CHUNK)


def train(minutes: float, steps: int | None, seed: int, out: Path, command: str, bf16: bool = True) -> dict:
    tokenizer = Tokenizer.from_folder(out / "tokenizer")
    train_ids = token_stream(tokenizer, (out / "corpus" / "train.txt").read_text(encoding="utf-8"))
    heldout = token_stream(tokenizer, (out / "corpus" / "heldout.txt").read_text(encoding="utf-8"))
    probe = torch.arange(BATCH) * ((len(heldout) - SEQ_LEN - 1) // BATCH)
    lengths = byte_lengths(tokenizer)
    model = make_model(tokenizer.vocab_size, seed)
    runner, opt = Chunked(model), make_optimizer(model)
    data_gen = torch.Generator().manual_seed(seed + 1)
    log(f"tiny-mamba: {model.num_parameters():,} parameters, {len(train_ids):,} training tokens")
    total, step, loss_avg = steps or 10**9, 0, None
    start = last_print = time.time()
    while step < total:
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (BATCH,), generator=data_gen)
        loss = train_tiny.train_step(runner, opt, *batch(train_ids, starts, SEQ_LEN), lr_at(step, total), bf16)
        step += 1
        loss_avg = loss if loss_avg is None else 0.95 * loss_avg + 0.05 * loss
        if steps is None and step == 2:
            t2 = time.time()
        if steps is None and step == ESTIMATE_AT:
            total = max(ESTIMATE_AT, int(minutes * 60 / ((time.time() - t2) / (ESTIMATE_AT - 2))))
            log(f"tiny-mamba: {minutes} min budget -> {total} steps")
        if time.time() - last_print >= 300 or step == total:
            probe_loss = evaluate(runner, heldout, lengths, probe)["nats_per_token"]
            last_print = time.time()
            log(
                f"tiny-mamba: step {step}/{total} loss {loss_avg:.3f} held-out {probe_loss:.3f} {last_print - start:,.0f}s"
            )
    stats = {
        "command": command,
        "steps": step,
        "train_seconds": round(time.time() - start),
        "seed": seed,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "scan_chunk": CHUNK,
        "peak_lr": PEAK_LR,
        "warmup": WARMUP,
        "bf16_autocast": bf16,
        "threads": torch.get_num_threads(),
    }
    folder = out / FOLDER
    save_mamba(model, folder, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / "tokenizer" / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}) + "\n")
    saved = Chunked(load_mamba(folder))
    all_heldout = torch.arange(0, len(heldout) - SEQ_LEN - 1, SEQ_LEN)
    some_train = torch.randint(
        0, len(train_ids) - SEQ_LEN - 1, (len(all_heldout),), generator=torch.Generator().manual_seed(0)
    )
    stats.update(
        parameters=saved.model.num_parameters(),
        config=ARCH,
        train=evaluate(saved, train_ids, lengths, some_train),
        heldout=evaluate(saved, heldout, lengths, all_heldout),
    )
    (folder / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    log(
        f"tiny-mamba: train {stats['train']['nats_per_token']:.3f}, held-out {stats['heldout']['nats_per_token']:.3f} "
        f"nats/token ({stats['heldout']['bits_per_byte']:.3f} bits/byte) -> {folder}"
    )
    return stats


def samples(folder: Path) -> list[tuple[str, str]]:
    """Greedy 40-token continuations of train_tiny's sample prompts."""
    from decodelab.decoding.generate import generate
    from decodelab.params import SamplingParams

    model, tokenizer = load_mamba(folder), Tokenizer.from_folder(folder)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    return [(p, generate(model, tokenizer, p, params, chat=False).text) for p in train_tiny.SAMPLE_PROMPTS]


def report(out: Path) -> list[str]:
    """The tiny-mamba section of TRAINING.md, from its training.json and greedy samples."""
    s = json.loads((out / FOLDER / "training.json").read_text())
    lines = [
        SECTION,
        "",
        "A Mamba-style selective state-space model (`model/mamba.py`, transformers' `MambaForCausalLM` layout),",
        "written by `python -m decodelab.training.train_ssm`, on the same corpus and tokenizer as `tiny`.",
        "",
        f"- architecture: `{json.dumps(s['config'])}`, vocab 1024, tied embeddings",
        f"- parameters: {s['parameters']:,} (tiny: 3,475,712)",
        f"- training: {s['steps']} steps of {s['batch']} x {s['seq_len']} tokens in {s['train_seconds'] / 60:.1f} min "
        f"({s['threads']} CPU thread{'s' * (s['threads'] > 1)} under `nice -n 19` on a shared machine"
        f"{', bfloat16 autocast' if s['bf16_autocast'] else ''}), scan chunk {s['scan_chunk']}, "
        f"AdamW peak lr {s['peak_lr']}, warm-up {s['warmup']}, cosine to 10%, seed {s['seed']}",
        f"- command: `{s['command']}`",
        f"- reproduce exactly: `python -m decodelab.training.train_ssm --steps {s['steps']} --seed {s['seed']} "
        f"--threads {s['threads']}{'' if s['bf16_autocast'] else ' --fp32'}`",
    ]
    for split, label in (("train", "train"), ("heldout", "held-out")):
        r = s[split]
        lines.append(
            f"- {label} loss: {r['nats_per_token']:.3f} nats/token, {r['bits_per_byte']:.3f} bits/byte ({r['tokens']:,} tokens)"
        )
    lines += ["", "Greedy samples (40 tokens):", ""]
    for prompt, text in samples(out / FOLDER):
        lines += ["```python", prompt + text, "```"]
    return lines + [""]


def write_report(out: Path) -> None:
    """Replace (or append) the tiny-mamba section of TRAINING.md."""
    path = out / "TRAINING.md"
    text = path.read_text()
    head = text.split(SECTION)[0].rstrip("\n") + "\n\n"
    path.write_text(head + "\n".join(report(out)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodelab.training.train_ssm", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (overrides --minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fp32", action="store_true", help="train without bfloat16 autocast")
    parser.add_argument("--report", action="store_true", help="only rewrite the TRAINING.md section")
    parser.add_argument("--out", type=Path, default=PACKAGE_DATA, help="data folder (default: the package's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.report:
        command = "python -m decodelab.training.train_ssm " + " ".join(argv if argv is not None else sys.argv[1:])
        train(args.minutes, args.steps, args.seed, args.out, command.strip(), not args.fp32)
    write_report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does speculative sampling really sample from the target? First-token distributions against
the exact target distribution p, for three prefixes.

    .venv/bin/python bench/speculative_tvd.py [--model tiny] [--samples 200000] [--loop-samples 500]

For each prefix (see `tvd_prefixes`): p (target) and q (draft) at that prefix, then N draws of the first emitted
token three ways: speculative (the acceptance rule, `accept_draft_tokens_batched`, with the
draft token drawn from q), direct (torch.multinomial from p) and draft-only (from q). The TVD
of each empirical law to p is printed beside the noise floor: the expected TVD of N exact
draws from p, sum_x E|X_x - N p_x| / (2N) with X_x ~ Binomial(N, p_x) (de Moivre's formula
for the binomial mean absolute deviation). Speculative and direct should both sit at the
floor; draft-only at about TVD(p, q). `--loop-samples` also draws first tokens through the
whole loop (`speculative_generate`, k=4, one seed per draw), with its own, higher floor.
Writes bench/results/speculative_tvd_<model>_<device>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodelab.decoding.sampling import probs  # noqa: E402
from decodelab.decoding.speculative import accept_draft_tokens_batched, speculative_generate, tvd  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_speculative", Path(__file__).with_name("speculative.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

SEED_FIGURES = {"speculative": "0.005-0.007", "direct": "0.0045-0.0058", "draft_only": "0.10-0.14"}


def expected_tvd_floor(p: torch.Tensor, n: int) -> float:
    """E[TVD(empirical law of n draws from p, p)], exactly: sum_x MAD(Binomial(n, p_x)) / (2n), with
    de Moivre's MAD = 2 v C(n, v) p^v (1-p)^(n-v+1), v = floor(n p) + 1 (0 when p is 0 or 1)."""
    p = p.double().clamp(0, 1)
    v = torch.floor(n * p) + 1
    log_mad = (
        math.log(2)
        + torch.log(v)
        + math.lgamma(n + 1)
        - torch.lgamma(v + 1)
        - torch.lgamma(n - v + 1)
        + v * torch.log(p)
        + (n - v + 1) * torch.log1p(-p)
    )
    mad = torch.where((p > 0) & (p < 1) & (v <= n), log_mad.exp(), torch.zeros_like(p))
    return float(mad.sum() / (2 * n))


def tvd_prefixes(tokenizer, model_name: str) -> list[list[int]]:
    """Three prefixes: for code, the benchmark prompts cut where the next token is easy (a new
    line's indentation), medium (after `self.`) and hard (a new method's name, after `def `)."""
    if not model_name.startswith("tiny"):
        return bench.prompt_ids_for(tokenizer, model_name, 3)
    easy, medium, hard = bench.code_prompts(3)
    medium = medium[: medium.rindex("self.") + len("self.")]
    return [tokenizer.encode(text) for text in (easy[: easy.rindex("\n") + 1], medium, hard)]


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


@torch.inference_mode()
def next_token_probs(model, prompt_ids: list[int], params: SamplingParams) -> torch.Tensor:
    logits = model(torch.tensor([prompt_ids], device=model.device), last_only=True)[0, -1]
    return probs(logits, params).double().cpu()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="tiny (default when present) or smollm2 or a folder")
    parser.add_argument("--draft-layers", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--loop-samples", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    target, draft, tokenizer, pair = bench.load_pair(args.model, args.draft_layers, device)
    model_name = args.model or ("tiny" if bench.tiny_available() else "smollm2")
    prompts = tvd_prefixes(tokenizer, model_name)
    params = SamplingParams(temperature=args.temperature)
    vocab, n = target.config.vocab_size, args.samples
    chunk = max(1, 2**24 // vocab)  # steps per batched call: [chunk, V] float32 is 64 MiB
    generator = torch.Generator().manual_seed(args.seed)
    print(f"{pair}; T={args.temperature}; N={n:,}; V={vocab}")
    print(
        f"{'prefix':>6} {'speculative':>11} {'direct':>8} {'draft-only':>10} {'floor':>7} {'TVD(p,q)':>8} "
        f"{'alpha':>6}" + (f" {'loop':>7} {'floor':>7}" if args.loop_samples else "")
    )
    rows = []
    for index, prompt_ids in enumerate(prompts):
        p = next_token_probs(target, prompt_ids, params)  # [V]
        q = next_token_probs(draft, prompt_ids, params)
        p_rows, q_rows = p.float()[None], q.float()[None]  # [1, V]: k = 1 (the first token sees only these)
        first = []
        for size in [chunk] * (n // chunk) + [n % chunk] * (n % chunk > 0):  # [size, V] fits in memory
            drafts = torch.multinomial(q_rows, size, replacement=True, generator=generator).T  # [size, 1]
            num_accepted, next_token = accept_draft_tokens_batched(
                drafts, q_rows.expand(size, 1, vocab), torch.cat([p_rows, p_rows]).expand(size, 2, vocab), generator
            )
            first.append(torch.where(num_accepted > 0, drafts[:, 0], next_token))
        first = torch.cat(first)
        row = dict(
            prefix=index,
            prompt_tokens=len(prompt_ids),
            speculative=float(tvd(empirical(first, vocab), p)),
            direct=float(tvd(empirical(torch.multinomial(p, n, replacement=True, generator=generator), vocab), p)),
            draft_only=float(tvd(empirical(torch.multinomial(q, n, replacement=True, generator=generator), vocab), p)),
            floor=expected_tvd_floor(p, n),
            tvd_p_q=float(tvd(p, q)),
            alpha=float(torch.minimum(p, q).sum()),
        )
        line = (
            f"{index:>6} {row['speculative']:>11.4f} {row['direct']:>8.4f} {row['draft_only']:>10.4f} "
            f"{row['floor']:>7.4f} {row['tvd_p_q']:>8.4f} {row['alpha']:>6.3f}"
        )
        if args.loop_samples:
            start = time.perf_counter()
            tokens = [
                speculative_generate(
                    target,
                    draft,
                    prompt_ids,
                    SamplingParams(
                        temperature=args.temperature, max_tokens=2, ignore_eos=True, seed=args.seed * 10**6 + i
                    ),
                    4,
                )[0][0]
                for i in range(args.loop_samples)
            ]
            row.update(
                loop=float(tvd(empirical(torch.tensor(tokens), vocab), p)),
                loop_samples=args.loop_samples,
                loop_floor=expected_tvd_floor(p, args.loop_samples),
                loop_seconds=time.perf_counter() - start,
            )
            line += f" {row['loop']:>7.4f} {row['loop_floor']:>7.4f}"
        rows.append(row)
        print(line, flush=True)
    print(
        f"seed: speculative {SEED_FIGURES['speculative']}, direct {SEED_FIGURES['direct']}, "
        f"draft-only {SEED_FIGURES['draft_only']}"
    )
    command = "python bench/speculative_tvd.py " + " ".join(sys.argv[1:])
    print(f"command: {command}")
    bench.RESULTS.mkdir(exist_ok=True)
    out = bench.RESULTS / f"speculative_tvd_{Path(model_name).name}_{device.type}.json"
    out.write_text(
        json.dumps(
            dict(
                command=command,
                pair=pair,
                temperature=args.temperature,
                samples=n,
                vocab_size=vocab,
                rows=rows,
                seed=SEED_FIGURES,
            ),
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Train `smollm2-eagle`, the feature drafter (`decodelab.decoding.eagle`) for SmolLM2, offline.

    python -m decodelab.training.train_eagle                  # data, features, training, evaluation, save
    python -m decodelab.training.train_eagle --minutes 20     # the training budget (default 20)
    python -m decodelab.training.train_eagle --stage eval     # only re-measure the saved drafter

Stages (cached under --cache, default /tmp/decodelab_eagle):
  data      SmolLM2's own answers to the training prompts of `decodelab.training.chat_prompts`, written
            by the batched engine (`decodelab.LLM`, bfloat16 copy: about 3x the fp32 speed on
            CPU): greedy for every prompt, sampled at temperature 0.7 for a share of them;
            the held-out prompts answered greedily in float32 (what alpha is measured against)
  features  one teacher-forced float32 pass of SmolLM2 over every conversation: its feature
            (last hidden state after the final norm) at every position, stored as bfloat16
  train     for --minutes: the drafter reads (f_t + noise, x_{t+1}) and predicts f_{t+1};
            loss = smooth-L1(f^_{t+1}, f_{t+1}) + 0.5 x cross-entropy of softmax(lm_head(f^))
            against the target's softmax(lm_head(f)) (EAGLE's two terms; the softmaxes run over
            the ~11k token ids of the training text plus 1,024 random ones per step). Every
            --eval-every seconds the one-step agreement (drafter argmax = target argmax,
            teacher-forced, answer positions of the held-out conversations) picks the best
            checkpoint.
  save      the best drafter -> lib/decodelab/data/smollm2-eagle/ (bf16, its own tensors only)
  eval      alpha at temperature 0 and 0.7 for k = 1..4 with `decodelab.decoding.speculative` on the
            held-out prompts, the drafter/target step-time ratio c and the greedy speedup;
            written to eval.json and TRAINING.md beside the weights

Shapes: B conversations in a batch, T positions, E hidden_size, V vocab_size.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from decodelab.decoding.eagle import CONFIG_FILE, FeatureDrafter, load_drafter, save_drafter
from decodelab.paths import PACKAGE_DATA
from decodelab.training.chat_prompts import broad_train_prompts, eval_prompts, train_prompts

OUT_NAME = "smollm2-eagle"
MAX_NEW, EVAL_MAX_NEW = 192, 128
SAMPLED_SHARE = 0.5  # of train_prompts, also answered at temperature 0.7 (all of broad_train_prompts are)
REG_WEIGHT, CLS_WEIGHT, NOISE = 1.0, 0.5, 0.2
TRAIN_JOBS = (  # cache name, prompt set, share of it answered, temperature
    ("train_greedy", train_prompts, 1.0, 0.0),
    ("train_sampled", train_prompts, SAMPLED_SHARE, 0.7),
    ("train_broad", broad_train_prompts, 1.0, 0.0),
    ("train_broad_sampled", broad_train_prompts, 1.0, 0.7),
)
TRAIN_SETS = tuple(name for name, *_ in TRAIN_JOBS)
RANDOM_CANDIDATES = 1024  # vocabulary entries added at random to each step's softmax


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))


# ----------------------------------------------------------------------------- data
def answer(llm, prompts: list[list[int]], temperature: float, max_new: int, seed: int) -> list[dict]:
    from decodelab.params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_new, seed=seed + i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=True)
    return [{"prompt": p, "answer": o.outputs[0].token_ids} for p, o in zip(prompts, outs)]


def make_data(cache: Path) -> None:
    from decodelab.engine.llm import LLM

    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "eval.pt").exists():
        llm = LLM("smollm2", device="cpu", dtype="float32", max_num_seqs=24)
        prompts = [chat_ids(llm.tokenizer, p) for p in eval_prompts()]
        t0 = time.time()
        torch.save(answer(llm, prompts, 0.0, EVAL_MAX_NEW, 0), cache / "eval.pt")
        log(f"data: held-out answers (fp32 greedy) in {time.time() - t0:.0f} s")
        del llm
    llm = None
    for name, prompt_set, share, temperature in TRAIN_JOBS:
        path = cache / f"{name}.pt"
        if path.exists():
            continue
        texts = prompt_set()
        subset = texts[: int(share * len(texts))]
        llm = llm or LLM("smollm2", device="cpu", dtype="bfloat16", max_num_seqs=48)
        prompts = [chat_ids(llm.tokenizer, p) for p in subset]
        t0 = time.time()
        rows = answer(llm, prompts, temperature, MAX_NEW, 1000)
        torch.save(rows, path)
        log(
            f"data: {name}: {len(rows)} conversations, {sum(len(r['answer']) for r in rows):,} answer tokens "
            f"in {time.time() - t0:.0f} s"
        )


@torch.inference_mode()
def make_features(cache: Path, target) -> None:
    """features_<name>.pt: per conversation, ids [T] and the target's features [T, E] (bf16)."""
    for name in ("eval",) + TRAIN_SETS:
        path = cache / f"features_{name}.pt"
        if path.exists():
            continue
        rows, out, t0 = torch.load(cache / f"{name}.pt"), [], time.time()
        for row in rows:
            ids = torch.tensor([row["prompt"] + row["answer"]])
            out.append(
                {"ids": ids[0], "start": len(row["prompt"]), "features": target.features(ids)[0].to(torch.bfloat16)}
            )
        torch.save(out, path)
        log(f"features: {name}: {sum(len(r['ids']) for r in out):,} positions in {time.time() - t0:.0f} s")


def load_features(cache: Path, names) -> list[dict]:
    rows = []
    for name in names:
        rows += torch.load(cache / f"features_{name}.pt")
    return rows


# ----------------------------------------------------------------------------- training
def make_batch(rows: list[dict]):
    """-> ids [B, T], features [B, T, E] float32, valid [B, T] (real positions), answer [B, T]."""
    t = max(len(r["ids"]) for r in rows)
    b, e = len(rows), rows[0]["features"].shape[1]
    ids = torch.zeros(b, t, dtype=torch.long)
    feats = torch.zeros(b, t, e)
    valid = torch.zeros(b, t, dtype=torch.bool)
    answer_mask = torch.zeros(b, t, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n], feats[i, :n], valid[i, :n] = r["ids"], r["features"].float(), True
        answer_mask[i, r["start"] : n] = True
    return ids, feats, valid, answer_mask


def predict(drafter, ids, feats, noise: float = 0.0):
    """Teacher-forced: from (f_t, x_{t+1}) for t = 0 .. T-2 -> predicted f^_{t+1} [B, T-1, E]."""
    inputs = feats[:, :-1]
    if noise:
        scale = inputs.abs().mean(dim=-1, keepdim=True)  # [B, T-1, 1]
        inputs = inputs + noise * scale * (torch.rand_like(inputs) - 0.5)
    return drafter(inputs, ids[:, 1:])


def losses(drafter, ids, feats, valid, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(feature regression, cross-entropy against the target's distribution). The softmaxes run
    over `candidates` [C] (every token id of the training text plus random others), about a
    quarter of the vocabulary: the same gradient where the target puts its mass, 4x cheaper."""
    predicted = predict(drafter, ids, feats, NOISE)  # [B, T-1, E]
    mask = valid[:, 1:]
    pred, real = predicted[mask], feats[:, 1:][mask]  # [N, E]
    reg = F.smooth_l1_loss(pred, real)
    lm_head = drafter.target.lm_head.weight[candidates]  # [C, E], frozen
    with torch.autocast("cpu", dtype=torch.bfloat16):
        student = pred @ lm_head.T
        with torch.no_grad():
            teacher = real @ lm_head.T
    cls = -(F.softmax(teacher.float(), -1) * F.log_softmax(student.float(), -1)).sum(-1).mean()
    return reg, cls


@torch.inference_mode()
def agreement(drafter, rows: list[dict], batch: int = 8) -> float:
    """One-step teacher-forced agreement at answer positions: argmax lm_head(f^_{t+1}) ==
    argmax lm_head(f_{t+1}) (alpha for the first draft at temperature 0)."""
    hits = total = 0
    for i in range(0, len(rows), batch):
        ids, feats, valid, answer_mask = make_batch(rows[i : i + batch])
        predicted = predict(drafter, ids, feats)
        mask = (valid & answer_mask)[:, 1:]
        draft_choice = drafter.logits(predicted[mask]).argmax(-1)
        target_choice = drafter.target.lm_head(feats[:, 1:][mask]).argmax(-1)
        hits += int((draft_choice == target_choice).sum())
        total += int(mask.sum())
    return hits / max(1, total)


def training_vocabulary(rows: list[dict]) -> torch.Tensor:
    """[C] every token id of the training text: the softmax candidates while training, and the
    drafter's draft vocabulary afterwards (`FeatureDrafter.restrict_vocabulary`)."""
    return torch.unique(torch.cat([r["ids"] for r in rows]))


def init_drafter(target) -> FeatureDrafter:
    """Layer <- the target's last layer, norm <- its final norm, fc <- [I | I] (g = embed + f)."""
    drafter = FeatureDrafter(target.config).attach(target)
    drafter.layer.load_state_dict(target.model.layers[-1].state_dict())
    drafter.norm.load_state_dict(target.model.norm.state_dict())
    e = target.config.hidden_size
    with torch.no_grad():
        drafter.fc.weight.copy_(torch.cat([torch.eye(e), torch.eye(e)], dim=1))
    return drafter


def train(
    cache: Path,
    target,
    minutes: float,
    lr: float,
    tokens_per_batch: int,
    eval_every: float,
    seed: int,
    resume: Path | None = None,
) -> tuple[FeatureDrafter, dict]:
    """Train for `minutes`, from `init_drafter` or, with `resume`, from a saved drafter (its
    training record is kept under "resumed_from")."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = load_features(cache, TRAIN_SETS)
    held_out = load_features(cache, ("eval",))
    for p in target.parameters():
        p.requires_grad_(False)
    # a resumed drafter is trained and scored over the whole vocabulary, like a new one; its draft
    # vocabulary is set again from this training text at the end
    drafter = init_drafter(target) if resume is None else load_drafter(target, resume).restrict_vocabulary(None).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    seen = training_vocabulary(rows)  # [C0]
    vocab = target.config.vocab_size
    rows.sort(key=lambda r: len(r["ids"]))
    batches, current, longest = [], [], 0
    for r in rows:  # length-bucketed batches of about tokens_per_batch (padded) tokens
        longest = max(longest, len(r["ids"]))
        if current and longest * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, longest = [], len(r["ids"])
        current.append(r)
    batches.append(current)
    history, best = [], {"agreement": agreement(drafter, held_out), "step": 0, "state": None}
    log(
        f"train: {len(rows)} conversations, {sum(len(r['ids']) for r in rows):,} positions, {len(batches)} batches; "
        f"agreement before training {best['agreement']:.3f}"
    )
    budget, spent, step, next_eval, ema = 60 * minutes, 0.0, 0, eval_every, None
    order = []
    while spent < budget:
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        t0 = time.perf_counter()
        progress = spent / budget
        for group in optimizer.param_groups:  # warm-up 3%, then cosine to 10%
            group["lr"] = lr * (min(1.0, progress / 0.03) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress))))
        ids, feats, valid, _ = make_batch(batches[order.pop()])
        candidates = torch.unique(torch.cat([seen, torch.randint(vocab, (RANDOM_CANDIDATES,))]))
        reg, cls = losses(drafter, ids, feats, valid, candidates)
        loss = REG_WEIGHT * reg + CLS_WEIGHT * cls
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        spent += time.perf_counter() - t0
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if spent >= next_eval or spent >= budget:
            next_eval += eval_every
            score = agreement(drafter, held_out)
            history.append(
                {
                    "step": step,
                    "minutes": spent / 60,
                    "loss_ema": ema,
                    "reg": reg.item(),
                    "cls": cls.item(),
                    "agreement": score,
                }
            )
            log(
                f"train: step {step}, {spent / 60:.1f} min, loss {ema:.4f} (reg {reg.item():.4f}, "
                f"cls {cls.item():.3f}), held-out one-step agreement {score:.3f}"
            )
            if score > best["agreement"]:
                best = {
                    "agreement": score,
                    "step": step,
                    "state": {k: v.detach().clone() for k, v in drafter.state_dict().items()},
                }
    if best["state"] is not None:
        drafter.load_state_dict(best["state"])
    drafter.restrict_vocabulary(seen)  # it proposes only what its softmax was trained over
    earlier = json.loads((resume / CONFIG_FILE).read_text())["training"] if resume is not None else None
    info = {
        "resumed_from": earlier,
        "steps": step,
        "minutes": spent / 60,
        "lr": lr,
        "tokens_per_batch": tokens_per_batch,
        "conversations": len(rows),
        "positions": sum(len(r["ids"]) for r in rows),
        "held_out_conversations": len(held_out),
        "best_step": best["step"],
        "best_agreement": best["agreement"],
        "history": history,
        "seed": seed,
        "loss": {
            "reg_weight": REG_WEIGHT,
            "cls_weight": CLS_WEIGHT,
            "noise": NOISE,
            "softmax_candidates": int(seen.numel()),
            "random_candidates": RANDOM_CANDIDATES,
        },
    }
    return drafter.eval(), info


# ----------------------------------------------------------------------------- evaluation
def step_times(target, drafter, prompt_ids: list[int], rounds: int = 7, steps: int = 16) -> dict:
    """Median wall seconds of one target decode step and of one drafter step (drafter forward +
    lm_head), interleaved round by round so machine noise hits both alike."""
    from decodelab.decoding.eagle import FeatureDraftSession
    from decodelab.model.kv_cache import KVCache

    samples = {"target": [], "drafter": []}
    with torch.inference_mode():
        for _ in range(rounds):
            cache = KVCache(target.config, 1, len(prompt_ids) + steps + 8, dtype=target.dtype)
            features = target.features(torch.tensor([prompt_ids]), kv_cache=cache)[0]
            x = torch.tensor([[prompt_ids[-1]]])
            start = time.perf_counter()
            for _ in range(steps):
                target(x, kv_cache=cache, last_only=True)
            samples["target"].append((time.perf_counter() - start) / steps)
            session = FeatureDraftSession(drafter, len(prompt_ids) + steps + 8)
            session.add_features(features[:-1])
            feature = drafter(session.unfed[None], torch.tensor([prompt_ids[1:]]), kv_cache=session.cache)[:, -1:]
            start = time.perf_counter()
            for _ in range(steps):
                drafter.logits(feature).argmax(-1)
                feature = drafter(feature, x, kv_cache=session.cache)
            samples["drafter"].append((time.perf_counter() - start) / steps)
    result = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    result["c"] = result["drafter"] / result["target"]
    return result


def evaluate(
    target,
    drafter,
    tokenizer,
    ks=(1, 2, 3, 4),
    temperatures=(0.0, 0.7),
    max_tokens: int = 96,
    speedup_k: int = 2,
    n_prompts: int = 16,
) -> dict:
    import dataclasses

    from decodelab.decoding.generate import stream_token_ids
    from decodelab.decoding.speculative import SpeculativeStats, speculative_generate
    from decodelab.params import SamplingParams

    stops = tokenizer.stop_token_ids()
    prompts = [chat_ids(tokenizer, p) for p in eval_prompts()[:n_prompts]]
    out = {"prompts": len(prompts), "max_tokens": max_tokens, "alpha": {}}
    for temperature in temperatures:
        for k in ks:
            stats, t0 = SpeculativeStats(), time.time()
            for i, ids in enumerate(prompts):
                params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i)
                _, s = speculative_generate(target, drafter, ids, params, k, stops)
                for f in dataclasses.fields(s):
                    setattr(stats, f.name, getattr(stats, f.name) + getattr(s, f.name))
            out["alpha"][f"t{temperature}_k{k}"] = {
                "temperature": temperature,
                "k": k,
                "alpha": stats.acceptance_rate,
                "tokens_per_target_call": stats.tokens_per_target_call,
                **dataclasses.asdict(stats),
            }
            log(
                f"eval T={temperature} k={k}: alpha {stats.acceptance_rate:.3f}, "
                f"{stats.tokens_per_target_call:.2f} tokens per target call ({time.time() - t0:.0f} s)"
            )
    out["step_times"] = step_times(target, drafter, prompts[0] + list(range(1000, 1064)))
    log(
        f"eval: target step {1e3 * out['step_times']['target']:.1f} ms, drafter step "
        f"{1e3 * out['step_times']['drafter']:.1f} ms, c = {out['step_times']['c']:.3f}"
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    totals = {"plain": 0.0, "speculative": 0.0}
    tokens = 0
    for ids in prompts[:8]:
        start = time.perf_counter()
        with torch.inference_mode():
            reference = list(stream_token_ids(target, ids, greedy, stops))
        totals["plain"] += time.perf_counter() - start
        start = time.perf_counter()
        output, _ = speculative_generate(target, drafter, ids, greedy, speedup_k, stops)
        totals["speculative"] += time.perf_counter() - start
        if output != reference:
            raise AssertionError("greedy speculative output differs from plain greedy decoding")
        tokens += len(output)
    out["speedup"] = {
        "k": speedup_k,
        "prompts": 8,
        "tokens": tokens,
        **{f"{k}_s": v for k, v in totals.items()},
        "wall": totals["plain"] / totals["speculative"],
    }
    log(f"eval: greedy speedup at k = {speedup_k}: {out['speedup']['wall']:.2f}x (wall clock, {tokens} tokens)")
    return out


def write_report(folder: Path, training: dict, evaluation: dict, data: dict) -> None:
    rows = [
        f"| {r['temperature']} | {r['k']} | {r['alpha']:.3f} | {r['tokens_per_target_call']:.2f} |"
        for r in evaluation["alpha"].values()
    ]
    phases = [training]  # the first phase first: a resumed run keeps the run it continued
    while phases[0].get("resumed_from"):
        phases.insert(0, phases[0]["resumed_from"])
    hist, steps_before, minutes_before = [], 0, 0.0
    for phase in phases:
        hist += [
            f"| {steps_before + h['step']} | {minutes_before + h['minutes']:.1f} | {h['loss_ema']:.4f} | "
            f"{h['agreement']:.3f} |"
            for h in phase["history"]
        ]
        steps_before, minutes_before = steps_before + phase["steps"], minutes_before + phase["minutes"]
    schedule = "; ".join(
        f"{p['minutes']:.1f} min at lr {p['lr']} ({p['steps']} steps, {p['conversations']} conversations)"
        for p in phases
    )
    st = evaluation["step_times"]
    lines = [
        "# `smollm2-eagle`: a feature drafter for SmolLM2-135M-Instruct",
        "",
        "Written by `python -m decodelab.training.train_eagle` (the method is in that module's docstring and in",
        "`decodelab.decoding.eagle`). Load it with `decodelab.decoding.eagle.load_drafter(target)` and pass it to",
        "`decodelab.decoding.speculative.speculative_generate(target, drafter, ...)`.",
        "",
        "## What it is",
        "",
        f"fc (2 x 576 -> 576) + one decoder layer of SmolLM2's shape + an RMSNorm: "
        f"{data['own_parameters'] / 1e6:.2f} M parameters of its own, stored in bfloat16; the embedding and "
        "lm_head are SmolLM2's (frozen, not stored here). It proposes only the "
        f"{training['loss']['softmax_candidates']:,} token ids of its training text (its draft vocabulary, stored "
        "with it): its lm_head product reads those rows only, the largest part of a draft step.",
        "",
        "## Data",
        "",
        f"- {data['conversations']} conversations written by SmolLM2 itself (the batched engine, bfloat16 copy) to "
        f"the training prompts of `decodelab.training.chat_prompts` (`train_prompts`, then the broader "
        f"`broad_train_prompts`): greedy for every prompt, and sampled at temperature 0.7 for "
        f"{int(100 * SAMPLED_SHARE)}% of the first set and all of the second; at most {MAX_NEW} answer tokens; "
        f"{data['positions']:,} positions with SmolLM2's float32 features",
        f"- held out: {data['held_out']} prompts from other templates and subjects, answered greedily in float32",
        "",
        "## Training",
        "",
        f"- {minutes_before:.1f} min on this 2-core CPU, {steps_before} steps, batches of about "
        f"{training['tokens_per_batch']} padded positions, AdamW; each phase warms up for 3% of its time, then "
        f"follows a cosine to 10% of its lr: {schedule} (a later phase resumes from the best checkpoint of the one "
        f"before); the best checkpoint of the last phase is kept",
        f"- loss: smooth-L1 on features x {REG_WEIGHT} + cross-entropy against the target's distribution x "
        f"{CLS_WEIGHT} (softmaxes over the {training['loss']['softmax_candidates']:,} token ids of the training "
        f"text plus {training['loss']['random_candidates']:,} random ones per step; evaluation uses the full "
        f"vocabulary); input features get uniform noise of {NOISE} x their mean magnitude",
        "- initialization: the layer from SmolLM2's last layer, the norm from its final norm, fc = [I | I]",
        "",
        "| step | minutes | loss (EMA) | held-out one-step agreement |",
        "|---:|---:|---:|---:|",
        *hist,
        "",
        "## Measured (held-out prompts, `decodelab.decoding.speculative.speculative_generate`)",
        "",
        f"alpha = accepted / judged drafts, {evaluation['prompts']} prompts, at most {evaluation['max_tokens']} "
        "tokens each.",
        "",
        "| temperature | k | alpha | tokens per target call |",
        "|---:|---:|---:|---:|",
        *rows,
        "",
        f"One drafter step (drafter forward + lm_head) {1e3 * st['drafter']:.1f} ms vs one SmolLM2 decode step "
        f"{1e3 * st['target']:.1f} ms: c = {st['c']:.3f} (float32, CPU, medians of interleaved rounds; with "
        "the whole vocabulary instead of the draft vocabulary c is about 3x larger).",
        f"Greedy speculative decoding at k = {evaluation['speedup']['k']} vs plain greedy decoding, same "
        f"{evaluation['speedup']['prompts']} prompts: {evaluation['speedup']['wall']:.2f}x wall clock, "
        "identical output. On this CPU verifying k + 1 tokens in one pass costs more than one decode step "
        "(the matmuls are compute-bound already at a few rows), so the gain needs a small k; "
        "`bench/speculative.py --model smollm2 --drafter smollm2-eagle` measures every k.",
        "",
    ]
    (folder / "TRAINING.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["all", "data", "features", "train", "eval"], default="all")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/decodelab_eagle"))
    parser.add_argument("--out", type=Path, default=PACKAGE_DATA / OUT_NAME)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--eval-every", type=float, default=120.0, help="seconds of training between evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a saved drafter folder to continue training from (instead of the initialization)",
    )
    args = parser.parse_args(argv)
    from decodelab.model.registry import load

    if args.stage in ("all", "data"):
        make_data(args.cache)
    target, tokenizer = load("smollm2", device="cpu", dtype="float32")
    target.eval()
    if args.stage in ("all", "features"):
        make_features(args.cache, target)
    if args.stage in ("all", "train"):
        drafter, info = train(
            args.cache, target, args.minutes, args.lr, args.tokens_per_batch, args.eval_every, args.seed, args.resume
        )
        save_drafter(drafter, args.out, "smollm2", {"training": info})
    if args.stage in ("all", "train", "eval"):
        drafter = load_drafter(target, args.out)
        meta = json.loads((args.out / "drafter.json").read_text())
        evaluation = evaluate(target, drafter, tokenizer)
        (args.out / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n")
        data = {
            "conversations": meta["training"]["conversations"],
            "positions": meta["training"]["positions"],
            "held_out": meta["training"]["held_out_conversations"],
            "own_parameters": sum(p.numel() for p in drafter.parameters()),
        }
        write_report(args.out, meta["training"], evaluation, data)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding on this machine: acceptance rate, tokens per target call, draft cost,
the verify-time curve and wall-clock speedup over target-only decoding, against theory.

    .venv/bin/python bench/speculative.py                      # tiny + tiny-draft (else SmolLM2)
    .venv/bin/python bench/speculative.py --model smollm2 --draft-layers 4 --ks 2,3,4 --temperatures 0
    .venv/bin/python bench/speculative.py --model smollm2 --drafter smollm2-eagle --ks 1,2,3,4 --temperatures 0,0.7
    .venv/bin/python bench/speculative.py --model smollm2 --drafter smollm2-eagle --ks 1,2,3 --temperatures 0 --dtype bfloat16

For every temperature and k = 1..8 it runs target-only decoding (`stream_token_ids`) and
speculative decoding on the same prompts, interleaved (same round, same prompt, one after the
other) so machine noise hits both alike; times are whole requests (prefill included) with
ignore_eos, so both produce the same number of tokens. alpha is accepted / judged (drafts
after a rejection are proposed but never judged, so accepted / proposed falls as k grows);
(1 - alpha^(k+1)) / (1 - alpha) is what independent acceptances would give per target call;
c is the draft's one-token step time over the target's; "Thm 3.8" is Leviathan et al.'s
(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); "with verify" replaces the 1 in (k c + 1) by the
measured cost of verifying k+1 tokens. On a shared machine, `--threads 1 --clock process`
times CPU seconds instead of wall-clock ones (steadier when other jobs compete).
Writes bench/results/speculative_<model>[_draft<N> | _lookup][_process-clock]_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from decodelab.decoding.eagle import NAMED_DRAFTERS, FeatureDrafter, FeatureDraftSession, load_drafter  # noqa: E402
from decodelab.decoding.generate import stream_token_ids  # noqa: E402
from decodelab.decoding.lookup import propose_from_prompt  # noqa: E402
from decodelab.decoding.speculative import (  # noqa: E402
    SpeculativeStats,
    expected_speedup,
    expected_tokens_per_call,
    stream_speculative,
    truncated_draft,
)
from decodelab.lessons.measure import synchronize, timed  # noqa: E402
from decodelab.model.kv_cache import KVCache  # noqa: E402
from decodelab.model.packed_linear import can_prepack, prepack_linear_layers  # noqa: E402
from decodelab.model.registry import load  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402
from decodelab.paths import PACKAGE_DATA  # noqa: E402
from decodelab.training.chat_prompts import eval_prompts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SEED_FIGURES = {"draft_cost": 0.22, "best_speedup": "1.2-1.3x at k = 2-3", "alpha_on_code": "0.85-0.91"}


def tiny_available() -> bool:
    return all((PACKAGE_DATA / name / "config.json").exists() for name in ("tiny", "tiny-draft"))


def load_pair(model_name: str | None, draft_layers: int, device, drafter: str = "model", dtype: str = "float32"):
    """(target, drafter, tokenizer, description): tiny + tiny-draft, a model + its first layers,
    a model + prompt lookup, or a model + a named draft model (drafter = its name or folder)."""
    model_name = model_name or ("tiny" if tiny_available() else "smollm2")
    target, tokenizer = load(model_name, device=device, dtype=dtype)
    if drafter == "lookup":
        return target, propose_from_prompt, tokenizer, f"{model_name} / prompt lookup (max_ngram 3)"
    if drafter in NAMED_DRAFTERS or (Path(drafter) / "drafter.json").exists():
        return target, load_drafter(target, drafter), tokenizer, f"{model_name} / {drafter} (feature drafter)"
    if drafter != "model":
        draft, _ = load(drafter, device=device, dtype=dtype)
        return target, draft.eval(), tokenizer, f"{model_name} / {drafter}"
    if model_name == "tiny" and not draft_layers:
        draft, _ = load("tiny-draft", device=device, dtype=dtype)
        return target, draft.eval(), tokenizer, "tiny / tiny-draft"
    layers = draft_layers or max(1, target.config.num_hidden_layers // 8)
    return target, truncated_draft(target, layers), tokenizer, f"{model_name} / its first {layers} layers"


def code_prompts(count: int, chars: int = 400) -> list[str]:
    """Deterministic prompts from held-out Python source: the text before a method's `def`."""
    text = (PACKAGE_DATA / "corpus" / "heldout.txt").read_text(encoding="utf-8")
    prompts = []
    for document in text.split("# ---- file: ")[1:]:
        at = document.find("\n    def ", len(document) // 3)
        if at > chars:
            prompts.append(document[at - chars : at + len("\n    def ")])
        if len(prompts) == count:
            break
    return prompts


def prompt_ids_for(tokenizer, model_name: str, count: int) -> list[list[int]]:
    if model_name.startswith("tiny"):
        return [tokenizer.encode(p) for p in code_prompts(count)]
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
        for p in eval_prompts()[:count]
    ]  # held out from the feature drafter's training


@torch.inference_mode()
def step_times(target, draft, prompt_ids: list[int], max_new: int, repeats: int) -> tuple[dict, float]:
    """Median seconds of one cached forward after the prompt: the target's over n = 1..max_new new
    tokens, and the draft's over 1. All are timed round-robin, so machine noise hits them alike."""
    if not isinstance(draft, torch.nn.Module):  # a drafter function: time a call on the prompt
        start = clock()
        for _ in range(repeats):
            draft(prompt_ids, max_new - 1)
        draft_step = (clock() - start) / repeats
        return step_times(target, target, prompt_ids, max_new, repeats)[0], draft_step
    if isinstance(draft, FeatureDrafter):  # one drafter step: its forward on one token + the lm_head
        times, drafter = step_times(target, target, prompt_ids, max_new, repeats)[0], draft
        session = FeatureDraftSession(drafter, len(prompt_ids) + 1)
        session.add_features(target.features(torch.tensor([prompt_ids[:-1]], device=target.device))[0])
        feature = session.catch_up(prompt_ids)  # [1, 1, E]
        token = torch.tensor([prompt_ids[-1:]], device=target.device)
        samples = []
        for _ in range(repeats + 2):
            synchronize(target.device)
            start = clock()
            drafter.logits(drafter(feature, token, kv_cache=session.cache)).argmax(-1)
            synchronize(target.device)
            samples.append(clock() - start)
            session.cache.truncate(len(prompt_ids) - 1)
        return times, statistics.median(samples[2:])
    jobs = {("target", n): target for n in range(1, max_new + 1)} | {("draft", 1): draft}
    caches = {}
    for key, model in jobs.items():
        caches[key] = KVCache(model.config, 1, len(prompt_ids) + key[1], device=model.device, dtype=model.dtype)
        model(torch.tensor([prompt_ids], device=model.device), kv_cache=caches[key])
    times = {key: [] for key in jobs}
    for _ in range(repeats + 2):
        for key, model in jobs.items():
            new = torch.tensor([prompt_ids[-key[1] :]], device=model.device)
            synchronize(model.device)
            start = clock()
            model(new, kv_cache=caches[key])
            synchronize(model.device)
            times[key].append(clock() - start)
            caches[key].truncate(len(prompt_ids))
    median = {key: statistics.median(values[2:]) for key, values in times.items()}
    return {n: median[("target", n)] for n in range(1, max_new + 1)}, median[("draft", 1)]


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
clock = time.perf_counter


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="tiny (default when present) or smollm2 or a folder")
    parser.add_argument("--draft-layers", type=int, default=0, help="draft = the target's first N layers")
    parser.add_argument(
        "--drafter",
        default="model",
        help="model (tiny-draft, or --draft-layers), lookup (decodelab.decoding.lookup), a feature "
        "drafter (smollm2-eagle), or a draft model's name or folder",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="of target and drafter; bfloat16 on a CPU runs on prepacked oneDNN weights "
        "(decodelab.model.packed_linear) unless --unpacked",
    )
    parser.add_argument("--unpacked", action="store_true", help="bfloat16 on CPU: keep plain weights")
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--temperatures", default="0,0.7,1.0")
    parser.add_argument(
        "--tree-widths",
        default="",
        help="feature drafter: also k = 1 at T = 0 with the drafter's top-w candidates judged "
        "in one pass (decodelab.decoding.draft_tree), for each w listed, e.g. 2,3",
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30, help="timings per point of the step-cost curves")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="process: CPU seconds of this process, steadier on a shared machine (use --threads 1)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    ks = [int(k) for k in args.ks.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    widths = [int(w) for w in args.tree_widths.split(",") if w]
    device = torch.device(args.device)
    target, draft, tokenizer, pair = load_pair(args.model, args.draft_layers, device, args.drafter, args.dtype)
    packed = not args.unpacked and can_prepack(device, target.dtype)
    if packed:  # the same packing for target-only decoding and for speculative decoding
        for model in (target, draft):
            if isinstance(model, torch.nn.Module):
                prepack_linear_layers(model)
    pair += f"; {args.dtype}" + (" (prepacked weights)" if packed else "")
    model_name = args.model or ("tiny" if tiny_available() else "smollm2")
    prompts = prompt_ids_for(tokenizer, model_name, args.prompts)
    print(
        f"{pair}; {len(prompts)} prompts of {[len(p) for p in prompts]} tokens; {args.tokens} tokens each; "
        f"torch threads {torch.get_num_threads()}; {args.clock} clock; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )

    # Step costs: the draft's one-token step vs the target's, and the target's verify curve.
    probe = prompts[0]
    target_times, draft_step = step_times(target, draft, probe, max(ks + widths) + 1, args.repeats)
    target_step = target_times[1]
    draft_cost = draft_step / target_step
    verify_curve = {n: t / target_step for n, t in target_times.items()}
    print(
        f"target step {target_step * 1e3:.2f} ms; draft cost c = {draft_cost:.3f} (seed: "
        f"{SEED_FIGURES['draft_cost']}); verify time / one-token time: "
        + " ".join(f"{n}:{r:.2f}" for n, r in verify_curve.items()),
        flush=True,
    )

    rows = []
    header = (
        f"{'T':>4} {'k':>2} {'w':>2} {'alpha':>6} {'acc/prop':>10} {'tok/call':>8} {'(1-a^k+1)/(1-a)':>15} "
        f"{'Thm3.8':>7} {'w/verify':>8} {'speedup':>8} {'same':>5}"
    )
    print(header)
    configs = [(t, k, 1) for t in temperatures for k in ks] + [(0.0, 1, w) for w in widths]
    for temperature, k, width in configs:
        stats = SpeculativeStats()
        base_time = spec_time = 0.0
        identical = True
        for round_index in range(args.rounds):
            for prompt_index, prompt_ids in enumerate(prompts):
                seed = 1000 * round_index + prompt_index
                params = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True, seed=seed)
                base = lambda: stream_token_ids(target, prompt_ids, params)  # noqa: E731
                spec = lambda: stream_speculative(
                    target,
                    draft,
                    prompt_ids,
                    params,
                    k,
                    stats=stats,  # noqa: E731
                    tree_width=width,
                )
                order = (base, spec) if (round_index + prompt_index) % 2 == 0 else (spec, base)
                results = {id(run): timed(lambda run=run: list(run()), clock=clock) for run in order}
                (t_base, out_base), (t_spec, out_spec) = results[id(base)], results[id(spec)]
                base_time, spec_time = base_time + t_base, spec_time + t_spec
                identical &= (out_base == out_spec) if temperature == 0 else len(out_base) == len(out_spec)
        alpha = stats.acceptance_rate
        per_call = expected_tokens_per_call(alpha, k)
        row = dict(
            temperature=temperature,
            k=k,
            tree_width=width,
            alpha=alpha,
            accepted=stats.accepted,
            proposed=stats.proposed,
            rejected=stats.rejected,
            accepted_per_proposed=stats.accepted_per_proposed,
            target_calls=stats.target_calls,
            draft_calls=stats.draft_calls,
            generated=stats.generated,
            tokens_per_target_call=stats.tokens_per_target_call,
            expected_tokens_per_call=per_call,
            theorem_3_8=expected_speedup(alpha, k, draft_cost),
            with_measured_verify=per_call / (k * draft_cost + verify_curve[k + width]),
            speedup=base_time / spec_time,
            target_only_s=base_time,
            speculative_s=spec_time,
            greedy_identical=identical if temperature == 0 else None,
        )
        rows.append(row)
        print(
            f"{temperature:>4} {k:>2} {width:>2} {alpha:>6.3f} {stats.accepted:>5}/{stats.proposed:<4} "
            f"{row['tokens_per_target_call']:>8.2f} {per_call:>15.2f} {row['theorem_3_8']:>7.2f} "
            f"{row['with_measured_verify']:>8.2f} {row['speedup']:>7.2f}x {str(identical):>5}",
            flush=True,
        )

    best = max(rows, key=lambda r: r["speedup"])
    greedy = [r for r in rows if r["temperature"] == 0]
    print(
        f"\nbest: {best['speedup']:.2f}x at T={best['temperature']}, k={best['k']} (seed: "
        f"{SEED_FIGURES['best_speedup']}); greedy alpha {min(r['alpha'] for r in greedy):.2f}-"
        f"{max(r['alpha'] for r in greedy):.2f} (seed on code: {SEED_FIGURES['alpha_on_code']}); "
        f"c = {draft_cost:.2f} (seed: {SEED_FIGURES['draft_cost']})"
        if greedy
        else ""
    )
    command = "python bench/speculative.py " + " ".join(sys.argv[1:])
    print(f"command: {command}")
    RESULTS.mkdir(exist_ok=True)
    suffix = (
        f"_{Path(args.drafter).name}"
        if args.drafter != "model"
        else f"_draft{args.draft_layers}"
        if args.draft_layers
        else ""
    )
    suffix += "" if args.dtype == "float32" else f"_{args.dtype}" + ("" if packed else "-unpacked")
    suffix += "_process-clock" if args.clock == "process" else ""
    out = RESULTS / f"speculative_{Path(model_name).name}{suffix}_{device.type}.json"
    out.write_text(
        json.dumps(
            dict(
                command=command,
                pair=pair,
                device=device.type,
                clock=args.clock,
                torch=torch.__version__,
                torch_threads=torch.get_num_threads(),
                cpu=platform.machine(),
                load_average=os.getloadavg(),
                prompts_tokens=[len(p) for p in prompts],
                tokens=args.tokens,
                rounds=args.rounds,
                target_step_ms=target_step * 1e3,
                draft_step_ms=draft_step * 1e3,
                draft_cost=draft_cost,
                verify_time_over_one_token=verify_curve,
                rows=rows,
                best=best,
                seed=SEED_FIGURES,
            ),
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""The timed parts of the learner's engine: what `progress --bench` and the speed checks run, on
which inputs, and how many bytes each call must move at the least.

Four parts, each one exercise's code (with the exercises it calls) beside the library's reference
for it, from the table of exercises (`course.exercises`):

| part | notebook: exercise | one call |
|---|---|---|
| paged attention | 07: `paged_decode_attention` | a decode batch's attention read through its block tables |
| int8 linear | 06: `Int8Linear` (from `quantize_int8_per_channel`) | a few tokens through one int8 layer |
| decode step | 01: `forward` (with `rms_norm`, `rope`, `mlp`) | one new token per sequence through a random Llama |
| scheduler step | 08: `preempt`, `decode_batch`, `schedule_chunked`, `finish` | one chunked-prefill `schedule()` |

A part builds its callable the same way from the learner's notebook namespace and from the
references' (`reference_namespace`), so both sides run on the same inputs (`workload(impl, size,
seed)`); `same_output` is the guard that the work was done. `bytes_moved` is the least a call must
read and write (each input and output byte once), from the shapes: the roofline's numerator. The
scheduler step moves no tensors: it has none.

Sizes: "small" (fast mode, the capstone, the tests: each call well under 10 ms on a laptop CPU)
and "full" (`progress --bench`: tensors larger than a CPU's caches).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from decodelab.course.exercises import find, stage_exercises

SIZES = ("small", "full")


@dataclass
class Workload:
    """One side's calls on one set of inputs."""

    ready: Callable[[], Callable[[], object]]  # -> a zero-argument callable that makes `calls` calls
    calls: int  # calls made by one callable from `ready` (a timing sample is their time / calls)
    bytes_moved: int | None  # the least one call reads and writes, None for a part that moves no tensor
    output: Callable[[], object]  # one call's result, comparable with `same_output`


@dataclass(frozen=True)
class TimedPart:
    name: str
    notebook: str
    exercises: tuple[str, ...]  # the exercises whose cells must pass and load (the one the report names last)
    build: Callable[[dict], object]  # a namespace (the learner's or the references') -> what is timed
    workload: Callable[[object, str, int], Workload]  # (what build returned, size, seed) -> Workload
    tolerance: float = 0.0  # outputs agree within this (absolute and relative) for tensors

    @property
    def exercise(self) -> str:
        return self.exercises[-1]


def _import(reference: str):
    module, _, attr = reference.partition(":")
    return getattr(importlib.import_module(module), attr)


def reference_namespace(part: TimedPart) -> dict:
    """What the part's notebook cells would define, taken from the library's references."""
    namespace = {"__name__": f"decodelab_reference_{part.notebook}"}
    for name in part.exercises:
        namespace[name] = _import(find(part.notebook, name).reference)
    return namespace


def _repeated(fn: Callable[[], object], calls: int) -> Callable[[], Callable[[], object]]:
    def ready():
        def run():
            for _ in range(calls):
                fn()

        return run

    return ready


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------- paged attention (07)

PAGED_SHAPES = {
    "small": dict(batch=8, heads=8, kv_heads=2, head_dim=64, block_size=16, context=512, calls=2),
    "full": dict(batch=16, heads=16, kv_heads=4, head_dim=64, block_size=16, context=1024, calls=1),
}


def paged_attention_workload(attend, size: str, seed: int, device="cpu") -> Workload:
    """q [B, H, D] over a pool [num_blocks, block_size, H_kv, D] holding every sequence's K/V in
    shuffled blocks; context lengths between 3/4 of `context` and `context`."""
    s = PAGED_SHAPES[size]
    g = torch.Generator().manual_seed(seed)
    batch, block = s["batch"], s["block_size"]
    lengths = torch.randint(3 * s["context"] // 4, s["context"] + 1, (batch,), generator=g)  # [B]
    per_seq = [-(-int(n) // block) for n in lengths]  # blocks each sequence holds
    order = torch.randperm(sum(per_seq), generator=g).tolist()  # blocks scattered over the pool
    tables, start = [], 0
    for count in per_seq:
        tables.append(order[start : start + count])
        start += count
    shape = (sum(per_seq), block, s["kv_heads"], s["head_dim"])
    keys, values = (torch.randn(shape, generator=g).to(device) for _ in range(2))
    q = torch.randn(batch, s["heads"], s["head_dim"], generator=g).to(device)  # [B, H, D]
    lengths = lengths.to(device)
    run = lambda: attend(q, keys, values, tables, lengths)  # noqa: E731 - one call, as timed
    read_kv = 2 * int(lengths.sum()) * s["kv_heads"] * s["head_dim"] * keys.element_size()
    return Workload(_repeated(run, s["calls"]), s["calls"], read_kv + 2 * _nbytes(q), run)


# --------------------------------------------------------------------------- int8 linear (06)

LINEAR_SHAPES = {
    "small": dict(tokens=4, in_features=2048, out_features=2048, calls=2),
    "full": dict(tokens=4, in_features=4096, out_features=8192, calls=1),
}


def int8_linear_workload(layer_class, size: str, seed: int, device="cpu") -> Workload:
    """x [tokens, in] through `layer_class.from_linear` of a random nn.Linear (with a bias)."""
    s = LINEAR_SHAPES[size]
    torch.manual_seed(seed)
    linear = torch.nn.Linear(s["in_features"], s["out_features"])
    layer = layer_class.from_linear(linear).to(device)
    x = torch.randn(s["tokens"], s["in_features"], generator=torch.Generator().manual_seed(seed)).to(device)
    run = lambda: layer(x)  # noqa: E731
    weights = s["in_features"] * s["out_features"] + 4 * s["out_features"] * 2  # int8 levels, a scale and a bias a row
    moved = weights + _nbytes(x) + s["tokens"] * s["out_features"] * x.element_size()
    return Workload(_repeated(torch.inference_mode()(run), s["calls"]), s["calls"], moved, run)


# --------------------------------------------------------------------------- decode step (01)

MODEL_SHAPES = {
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
        batch=4,
        context=128,
        calls=2,
    ),
    "full": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=8192,
        batch=4,
        context=512,
        calls=1,
    ),
}


def decode_step_workload(forward, size: str, seed: int, device="cpu") -> Workload:
    """One new token for each of `batch` sequences of `context` tokens, through `forward(weights,
    config, ids [B, 1], attend, positions)` of notebook 01, on a random Llama. The attention is
    the library's over fixed K/V (both sides read the same; nothing is appended)."""
    from decodelab.model.attention import causal_attention
    from decodelab.model.toy import random_llama

    s = dict(MODEL_SHAPES[size])
    batch, context, calls = s.pop("batch"), s.pop("context"), s.pop("calls")
    model = random_llama(seed, max_position_embeddings=context + 1, **s)
    config = model.config
    weights = {name: t.to(device) for name, t in model.state_dict().items()}
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    g = torch.Generator().manual_seed(seed)
    held_shape = (batch, config.num_key_value_heads, context, config.head_dim)  # [B, H_kv, S, D]
    held = [
        tuple(torch.randn(held_shape, generator=g).to(device) for _ in range(2))
        for _ in range(config.num_hidden_layers)
    ]

    def attend(layer_index, q, k, v):  # q [B, H, 1, D], k, v [B, H_kv, 1, D]
        keys, values = held[layer_index]
        return causal_attention(q, torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2), q_offset=context)

    ids = torch.randint(config.vocab_size, (batch, 1), generator=g).to(device)  # [B, 1]
    positions = torch.tensor([context], device=device)
    run = torch.inference_mode()(lambda: forward(weights, config, ids, attend, positions))
    read = sum(_nbytes(t) for name, t in weights.items() if name != "model.embed_tokens.weight")
    read += batch * config.hidden_size * 4  # the embedding rows of the new tokens
    read += sum(_nbytes(k, v) for k, v in held)
    return Workload(_repeated(run, calls), calls, read + batch * config.vocab_size * 4, run)


# --------------------------------------------------------------------------- scheduler step (08)

SCHEDULER_SHAPES = {
    "small": dict(running=48, waiting=8, block_size=16, calls=8),
    "full": dict(running=192, waiting=32, block_size=16, calls=4),
}


def _scheduler_state(scheduler_class, size: str, seed: int):
    """A scheduler (chunked prefill) whose running sequences each need a slot for their newest
    token (every sixteenth needs a new block), with prompts waiting behind them."""
    from decodelab.lessons.continuous_batching import make_sequence, toy_scheduler

    s = SCHEDULER_SHAPES[size]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 200, (s["running"],), generator=g).tolist()
    blocks = sum(-(-(n + 1) // s["block_size"]) + 1 for n in lengths) + 16
    scheduler = toy_scheduler(
        lengths,
        num_blocks=blocks,
        block_size=s["block_size"],
        max_num_seqs=s["running"] + 4,
        max_num_batched_tokens=10**6,
        admitted=True,
        scheduler_cls=scheduler_class,
    )
    for i in range(s["waiting"]):
        scheduler.add(make_sequence(s["running"] + i, int(torch.randint(16, 300, (1,), generator=g))))
    scheduler.chunked_prefill = True
    scheduler.max_num_batched_tokens = s["running"] + 256
    return scheduler


def _schedule_summary(scheduler) -> tuple:
    seqs, is_prefill = scheduler.schedule()
    return (
        [(s.seq_id, s.num_scheduled_tokens, list(s.block_table)) for s in seqs],
        is_prefill,
        [s.seq_id for s in scheduler.waiting],
        scheduler.num_preemptions,
    )


def scheduler_step_workload(scheduler_class, size: str, seed: int, device="cpu") -> Workload:
    """`schedule()` of a fresh scheduler state each call (the states are built before the clock
    starts)."""
    calls = SCHEDULER_SHAPES[size]["calls"]

    def ready():
        states = [_scheduler_state(scheduler_class, size, seed) for _ in range(calls)]

        def run():
            for scheduler in states:
                scheduler.schedule()

        return run

    return Workload(ready, calls, None, lambda: _schedule_summary(_scheduler_state(scheduler_class, size, seed)))


def your_scheduler(namespace: dict) -> type:
    """A Scheduler whose step pieces are the namespace's 08 exercises (bound the way 08's closing
    cells bind them): the scheduler step here, and the scheduler stage of `course.parts`."""
    from decodelab.engine.scheduler import Scheduler

    _, methods = stage_exercises("scheduler")
    return type(
        "YourScheduler",
        (Scheduler,),
        {**{name: namespace[name] for name in methods}, "__module__": namespace["__name__"]},
    )


PARTS: tuple[TimedPart, ...] = (
    TimedPart(
        "paged attention",
        "07_paged_kv",
        ("paged_decode_attention",),
        lambda ns: ns["paged_decode_attention"],
        paged_attention_workload,
        tolerance=1e-4,
    ),
    TimedPart(
        "int8 linear",
        "06_quantization",
        ("quantize_int8_per_channel", "Int8Linear"),
        lambda ns: ns["Int8Linear"],
        int8_linear_workload,
        tolerance=1e-3,
    ),
    TimedPart(
        "decode step",
        "01_forward_pass",
        ("rms_norm", "rope", "mlp", "forward"),
        lambda ns: ns["forward"],
        decode_step_workload,
        tolerance=1e-3,
    ),
    TimedPart(
        "scheduler step",
        "08_continuous_batching",
        ("preempt", "decode_batch", "finish", "schedule_chunked"),
        your_scheduler,
        scheduler_step_workload,
    ),
)


def part_named(name: str) -> TimedPart:
    for part in PARTS:
        if part.name == name:
            return part
    raise ValueError(f"no timed part {name!r}: the parts are {', '.join(p.name for p in PARTS)}")


def function_workload(fn: Callable, args: tuple, calls: int = 1) -> Workload:
    """fn(*args) as a Workload (no byte count): for timing any function on fixed inputs."""
    run = lambda: fn(*args)  # noqa: E731
    return Workload(_repeated(run, calls), calls, None, run)


def same_output(part: TimedPart, got, expected) -> str | None:
    """None when `got` (the learner's output) matches `expected` (the reference's), else what differs."""
    return outputs_differ(got, expected, part.tolerance)


def outputs_differ(got, expected, tolerance: float) -> str | None:
    """None when got matches expected (tensors: within `tolerance`, absolute and relative; anything
    else: equal), else what differs."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return f"the output has shape {shape}, the reference's {tuple(expected.shape)}"
        gap = (got.float() - expected.float()).abs().max().item()
        if not torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance):
            return f"the output differs from the reference's by up to {gap:.3g} (allowed {tolerance:g})"
        return None
    if got != expected:
        return (
            "the output differs from the reference's (for the scheduler: the sequences scheduled, their "
            "token counts or block tables)"
        )
    return None


__all__ = [
    "PARTS",
    "SIZES",
    "TimedPart",
    "Workload",
    "function_workload",
    "outputs_differ",
    "part_named",
    "reference_namespace",
    "same_output",
    "your_scheduler",
]

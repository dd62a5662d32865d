"""Pictures drawn by the library, so they stay true: the engine with one notebook's part
highlighted, and the flows the notebooks explain, drawn from a real object's state.

    from decodelab.course import pictures
    pictures.engine_map("03_kv_cache")                 # the engine, notebook 03's parts highlighted
    pictures.kv_cache_flow(cache, previous_length=5)   # a KVCache: rows held, rows just appended, room left
    pictures.block_table_picture(allocator, {"A": table_a, "B": table_b})   # tables -> pool blocks
    pictures.draft_verify_picture(trace_speculative_step(speculative.speculative_step, target, draft, ...))

Each returns a `decodelab.course.svg.Picture`: `.svg` is the SVG text, and a notebook cell
shows it. The engine map is built from the library itself: its boxes are the parts of
`exercises.PARTS` (which notebook builds what), placed on the engine's stages in serving order,
each stage naming the code that runs it and its `EngineHooks` field; a new notebook's part or a
new hook shows up without editing this file (a part whose words match no stage lands in an
"other" row, a hook no stage claims gets its own stage). The flow pictures live in
`decodelab.course.flow_pictures` and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from decodelab.course.exercises import PARTS
from decodelab.course.flow_pictures import (
    SpeculativeTrace,
    block_table_picture,
    draft_verify_picture,
    kv_cache_flow,
    trace_speculative_step,
)
from decodelab.course.svg import Canvas, Picture, text_width

HIGHLIGHT_FILL, HIGHLIGHT_STROKE = "#fde68a", "#d97706"
PART_FILL, PART_STROKE = "#e0e7ff", "#6366f1"


@dataclass(frozen=True)
class Stage:
    """One stage of the engine: a row of the map. `code`: "module:attribute" names (checked by
    tests/test_pictures.py to exist); `hook`: the EngineHooks field that swaps it; depth 1: a
    piece inside the model forward."""

    key: str
    title: str
    code: tuple[str, ...] = ()
    hook: str | None = None
    depth: int = 0


# The engine's stages in serving order (engine/llm.py: LLM.generate -> engine_step), then the
# loop around them and the measurements that are not a stage.
STAGES = (
    Stage(
        "request", "request in: LLM.generate / chat", ("decodelab.engine.llm:LLM", "decodelab.engine.sequence:Request")
    ),
    Stage("tokenizer", "tokenizer and chat template", ("decodelab.model.tokenizer:Tokenizer",)),
    Stage("scheduler", "scheduler: continuous batching", ("decodelab.engine.scheduler:Scheduler",), "scheduler"),
    Stage(
        "paged_kv",
        "block allocator and paged KV",
        ("decodelab.engine.block_allocator:BlockAllocator", "decodelab.engine.paged_attention:PagedKVStore"),
        "allocator",
    ),
    Stage("forward", "model forward: the decoder", ("decodelab.model.llama:LlamaForCausalLM",), "forward"),
    Stage("embedding", "token embedding", ("decodelab.model.llama:Backbone",), depth=1),
    Stage("rmsnorm", "RMSNorm", ("decodelab.model.llama:RMSNorm",), depth=1),
    Stage(
        "attention",
        "attention: RoPE, GQA, KV cache",
        ("decodelab.model.llama:Attention", "decodelab.model.rope:apply_rope", "decodelab.model.kv_cache:KVCache"),
        "attention",
        depth=1,
    ),
    Stage("mlp", "SwiGLU MLP", ("decodelab.model.llama:MLP",), depth=1),
    Stage("linear", "linear layers: int8 / int4", ("decodelab.model.quantization:QuantizedLinear",), "linear", depth=1),
    Stage("lm_head", "final RMSNorm and LM head: logits", ("decodelab.model.llama:LlamaForCausalLM",), depth=1),
    Stage("sampling", "sampling", ("decodelab.decoding.sampling:sample",), "sample"),
    Stage(
        "speculative",
        "speculative: draft, verify, roll back",
        ("decodelab.decoding.speculative.steps:speculative_step", "decodelab.engine.speculative:BatchSpeculator"),
        "accept_draft_tokens",
    ),
    Stage(
        "stream",
        "detokenize and stream",
        ("decodelab.model.tokenizer:StreamDecoder", "decodelab.engine.llm:StreamEvent"),
    ),
    Stage("loop", "the loop: a step per token", ("decodelab.engine.llm:engine_step",), "step"),
    Stage("measure", "measurements: what it costs", ("decodelab.lessons.measure:CountingModel",)),
    # Not in LLM's path (it refuses a model without a KV cache): the decoder's alternative, decoded alone.
    Stage(
        "state_space",
        "beside the decoder: a state-space model, a fixed state for the KV cache",
        ("decodelab.model.mamba:MambaForCausalLM", "decodelab.model.mamba:MambaState"),
    ),
)
# Words of a PARTS entry -> its stage, tried in this order (the first match wins): the
# state-space model's parts first (their words would match the decoder's), then the
# measurements ("KV cache size" is a measurement, not the cache), "tiled attention"
# before "loop" (its tiled loop is attention's), "decoder layer" before "loop", "detokeniz" before
# "tokenizer"; serving's TTFT/TPOT/goodput is a measurement, a client's stream the stream stage.
PLACES = (
    ("state-space", "state_space"),
    ("size", "measure"),
    ("speed", "measure"),
    ("latency", "measure"),
    ("roofline", "measure"),
    ("waste", "measure"),
    ("memory", "measure"),
    ("ttft", "measure"),
    ("decoder layer", "forward"),
    ("tiled attention", "attention"),
    ("loop", "loop"),
    ("the step", "loop"),
    ("prefill", "loop"),
    ("speculative", "speculative"),
    ("sampling", "sampling"),
    ("scheduler", "scheduler"),
    ("paged kv", "paged_kv"),
    ("block", "paged_kv"),
    ("prefix", "paged_kv"),
    ("quantiz", "linear"),
    ("linear", "linear"),
    ("rmsnorm", "rmsnorm"),
    ("mlp", "mlp"),
    ("attention", "attention"),
    ("rope", "attention"),
    ("gqa", "attention"),
    ("kv cache", "attention"),
    ("detokeniz", "stream"),
    ("client's stream", "stream"),
    ("tokenizer", "tokenizer"),
)
OTHER = Stage("other", "also built in the course")


def notebooks() -> list[str]:
    """The notebooks that build a part of the engine, in course order (from `exercises.PARTS`)."""
    return sorted({notebook for notebook, _ in PARTS})


def place_part(part: str) -> str:
    """The key of the stage a PARTS description belongs to ("other" when no stage's words match)."""
    text = part.lower()
    return next((stage for words, stage in PLACES if words in text), OTHER.key)


def stages() -> list[Stage]:
    """STAGES, plus one stage per EngineHooks field no stage claims (before the stream), plus
    the "other" row when some part matches no stage."""
    from decodelab.engine.llm import EngineHooks

    claimed = {stage.hook for stage in STAGES}
    extra = [
        Stage(f"hook_{f.name}", f"hook: {f.name}", ("decodelab.engine.hooks:EngineHooks",), f.name)
        for f in dataclasses.fields(EngineHooks)
        if f.name not in claimed
    ]
    at = [stage.key for stage in STAGES].index("stream")
    rows = list(STAGES[:at]) + extra + list(STAGES[at:])
    return rows + ([OTHER] if any(place_part(p) == OTHER.key for p in PARTS.values()) else [])


def code_exists(name: str) -> bool:
    """Does "module:attribute" name something in the library?"""
    module, _, attribute = name.partition(":")
    return hasattr(importlib.import_module(module), attribute)


def _chip_label(notebook: str, part: str) -> str:
    return f"{notebook[:2]} · {part.split(': ', 1)[-1]}"


def _chip_rows(parts: list[tuple[str, str, str]], left: float, right: float) -> list[list[tuple]]:
    """Wrap the chips (notebook, exercise, part) into lines that fit between left and right."""
    lines, x = [[]], left
    for chip in parts:
        width = text_width(_chip_label(chip[0], chip[2]), 10) + 14
        if lines[-1] and x + width > right:
            lines.append([])
            x = left
        lines[-1].append((chip, x, width))
        x += width + 6
    return lines


def _draw_stage(canvas: Canvas, stage: Stage, parts, y: float, highlight: str | None) -> float:
    """One stage row at y, its parts as chips on the right -> the row's height."""
    width, inset = canvas.width, 14 + 18 * stage.depth
    lines = _chip_rows(parts, 360, width - 36) if parts else []
    height = max(46, 12 + 24 * len(lines))
    lit = any(notebook == highlight for notebook, _, _ in parts)
    canvas.box(
        inset,
        y,
        width - inset - 28,
        height,
        f"stage-{stage.key}",
        "stage highlight" if lit else "stage",
        fill="#fffbeb" if lit else ("#f1f5f9" if stage.depth else "#f8fafc"),
        stroke=HIGHLIGHT_STROKE if lit else "#94a3b8",
        stroke_width=2 if lit else 1,
        data={"stage": stage.key, "hook": stage.hook},
    )
    canvas.text(inset + 8, y + 17, stage.title, size=12, bold=stage.depth == 0)
    hook = f"  · hook: {stage.hook}" if stage.hook else ""
    where = ", ".join(name.split(":")[1] for name in stage.code[:2]) if stage.code else ""
    canvas.text(
        inset + 8,
        y + 33,
        f"{where}{hook}" if parts else f"{where}{hook}  (given by the library)",
        size=9,
        color="#475569",
        monospace=True,
    )
    for row, line in enumerate(lines):
        for (notebook, exercise, part), x, chip_width in line:
            on = notebook == highlight
            canvas.box(
                x,
                y + 8 + 24 * row,
                chip_width,
                19,
                f"part-{notebook}-{exercise}",
                "part highlight" if on else "part",
                label=_chip_label(notebook, part),
                fill=HIGHLIGHT_FILL if on else PART_FILL,
                stroke=HIGHLIGHT_STROKE if on else PART_STROKE,
                size=10,
                tooltip=f"{notebook}, exercise {exercise}: {part}",
                bold=on,
                data={"notebook": notebook, "exercise": exercise, "stage": stage.key},
            )
    return height


def engine_map(highlight: str | None = None) -> Picture:
    """The engine's stages in serving order, each with the parts the notebooks build there
    (a chip "03 · KV cache" per exercise, from `exercises.PARTS`); `highlight`, a notebook name
    such as "03_kv_cache", colours that notebook's parts and their stages. ValueError for a
    notebook that builds no part of the engine."""
    if highlight is not None and highlight not in notebooks():
        raise ValueError(
            f"no notebook {highlight!r} builds a part of the engine; the notebooks are {', '.join(notebooks())}"
        )
    rows = stages()
    by_stage = {stage.key: [] for stage in rows}
    for (notebook, exercise), part in PARTS.items():
        by_stage[place_part(part)].append((notebook, exercise, part))
    title = "The engine, in serving order" + (f": what {highlight} builds is highlighted" if highlight else "")
    canvas = Canvas(980, title)
    canvas.text(14, 22, title, size=15, bold=True)
    canvas.text(
        14,
        40,
        "Each chip is an exercise (its notebook's number first); a stage without chips is the library's own code.",
        size=11,
        color="#475569",
    )
    y, tops, parent_bottom = 54.0, {}, 0.0
    for stage in rows:
        if stage.key in ("loop", "measure", OTHER.key):
            y += 16  # not a stage of the pipeline: set apart
        elif stage.depth == 0 and tops:
            canvas.arrow(40, y, 40, y + 14)
            y += 16
        tops[stage.key] = y
        height = _draw_stage(canvas, stage, by_stage[stage.key], y, highlight)
        if stage.depth:  # a piece of the stage above: a branch from it
            canvas.path(f"M 23 {parent_bottom:.1f} V {y + height / 2:.1f} H 31", arrow=False)
        else:
            parent_bottom = y + height
        y += height + 4
    _loop_arrow(canvas, tops)
    return canvas.picture(y + 8)


def _loop_arrow(canvas: Canvas, tops: dict[str, float]) -> None:
    """The way back: after a token is streamed, the next step starts at the scheduler."""
    right, bottom, top = canvas.width - 10, tops["stream"] + 20, tops["scheduler"] + 20
    canvas.path(f"M {right - 10} {bottom} H {right} V {top} H {right - 12}", dashed=True, cls="loop-arrow")


__all__ = [
    "STAGES",
    "PLACES",
    "Picture",
    "SpeculativeTrace",
    "Stage",
    "block_table_picture",
    "code_exists",
    "draft_verify_picture",
    "engine_map",
    "kv_cache_flow",
    "notebooks",
    "place_part",
    "stages",
    "trace_speculative_step",
]

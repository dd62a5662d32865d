"""Notebook 07's pictures and explorer: KV waste against block size, and the block pool as
requests come and go. The notebook passes in the functions and classes to use (the learner's
own, or the library's reference while an exercise is unfinished).

    box = waste_explorer(kv_waste)          # box.figure, box.controls, box.redraw()
    allocator_cls = allocator_class_or_reference(BlockAllocator, block_allocator.BlockAllocator)
    snapshots = play_block_story(allocator_cls(12, 4), events)
    block_table_figure(snapshots, title).show()
    outputs, snapshots = serve_recording(llm, chats, params)   # the engine's pool, step by step

An allocator here is anything with the library `BlockAllocator`'s interface; the pictures read
it only through that interface (`ref_count`, `is_cached`, `num_blocks`, `num_free`).
"""

from __future__ import annotations

import random

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.flow_pictures import pool_snapshot
from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer

# The seed article: 1,000 requests of 50..2,047 tokens, max_len 2,048.
SEED_WASTE = {"preallocate 2,048": 0.472, "blocks of 16": 0.007, "blocks of 32": 0.014}
SEED_BLOCK_SIZES = {16: 0.007, 32: 0.014}
BLOCK_SIZES = [2, 4, 8, 16, 32, 64, 128, 256, 512]  # 1 wastes nothing: off a log axis


def uniform_lengths(num_requests: int = 1000, shortest: int = 50, longest: int = 2047, seed: int = 0) -> list[int]:
    """The seed's workload: request lengths drawn uniformly from shortest..longest (inclusive)."""
    rng = random.Random(seed)
    return [rng.randint(shortest, longest) for _ in range(num_requests)]


def waste_figure(block_sizes: list[int], measured: list[float], preallocated: float, title: str) -> go.Figure:
    """Waste (percent of reserved slots left empty) against block size: measured line, the
    preallocation level as a dashed line, the seed's points as red diamonds."""
    fig = go.Figure()
    fig.add_scatter(
        x=block_sizes,
        y=[100 * w for w in measured],
        mode="lines+markers",
        name="paged blocks (measured)",
        marker_color=MEASURED_COLOR,
    )
    fig.add_scatter(
        x=[block_sizes[0], block_sizes[-1]],
        y=[100 * preallocated] * 2,
        mode="lines",
        name="preallocate max_len (measured)",
        line=dict(dash="dash", color=OTHER_COLOR),
    )
    seed_x = list(SEED_BLOCK_SIZES) + [block_sizes[-1]]
    seed_y = [100 * w for w in SEED_BLOCK_SIZES.values()] + [100 * SEED_WASTE["preallocate 2,048"]]
    fig.add_scatter(
        x=seed_x,
        y=seed_y,
        mode="markers+text",
        name="seed article",
        marker=dict(color=SEED_COLOR, symbol="diamond", size=11),
        text=[f"seed {y:.1f}%" for y in seed_y],
        textposition=["bottom right"] * len(SEED_BLOCK_SIZES) + ["bottom left"],
    )
    fig.update_layout(
        title=title, height=430, margin=dict(l=10, r=10, t=80, b=40), legend=dict(orientation="h", y=-0.22)
    )
    fig.update_xaxes(type="log", title="block size (tokens per block)")
    fig.update_yaxes(type="log", title="KV slots reserved but empty (%)", range=[-2, 2.1])
    return fig


def waste_explorer(waste_fn, num_requests: int = 1000):
    """Sliders for block size and the longest request -> waste of paged blocks vs preallocation.

    waste_fn(sequence_lengths, block_size, max_len=None) -> fraction (the kv_waste exercise).
    Requests are uniform in 50..longest; preallocation reserves longest + 1 slots per request.
    """
    block_size = widgets.SelectionSlider(options=BLOCK_SIZES, value=16, description="block size (tokens)", **SLIDER)
    longest = widgets.SelectionSlider(
        options=[255, 511, 1023, 2047, 4095, 8191], value=2047, description="longest request (tokens)", **SLIDER
    )

    def measure():
        lengths = uniform_lengths(num_requests, 50, longest.value)
        max_len = longest.value + 1
        paged = [waste_fn(lengths, b) for b in BLOCK_SIZES]
        prealloc, current = waste_fn(lengths, None, max_len), waste_fn(lengths, block_size.value)
        title = (
            f"blocks of {block_size.value} tokens: {100 * current:.2f}% of reserved KV slots empty<br>"
            f"{num_requests} requests of 50..{longest.value} tokens (mean {sum(lengths) / len(lengths):.0f}); "
            f"preallocating {max_len} each: {100 * prealloc:.1f}% empty"
        )
        return paged, prealloc, current, title

    # The widget starts from a complete figure, so its first state already holds every trace
    # (a browser that renders it while the kernel is busy with later cells shows it whole).
    paged, prealloc, current, title = measure()
    start = waste_figure(BLOCK_SIZES, paged, prealloc, title)
    start.add_scatter(
        x=[block_size.value],
        y=[100 * current],
        mode="markers",
        name="your block size",
        marker=dict(size=16, color=MEASURED_COLOR, line=dict(width=2, color="black")),
    )
    fig = go.FigureWidget(start)
    choice = fig.data[-1]

    def redraw(*_):
        paged, prealloc, current, title = measure()
        # One batch per kind of change: plotly merges a batch into one restyle, and traces that
        # do not set a property it carries (here x) would lose it in the browser.
        with fig.batch_update():
            fig.data[0].y = [100 * w for w in paged]
            fig.data[1].y = [100 * prealloc] * 2
        with fig.batch_update():
            choice.update(x=[block_size.value], y=[100 * current])
            fig.layout.title.text = title

    return finish_explorer(fig, {"block_size": block_size, "longest": longest}, redraw)


def fragmentation_figure(results, labels: list[str], title: str) -> go.Figure:
    """Stacked bars, one per layout: the shares of the pool's memory-time that hold tokens, are
    internal fragmentation, external fragmentation, or idle (`lessons.fragmentation.simulate`)."""
    fig = go.Figure()
    parts = [
        ("tokens", "holds tokens", MEASURED_COLOR),
        ("internal", "internal fragmentation", "#9467bd"),
        ("external", "external fragmentation", "#ff7f0e"),
        ("idle", "free, too little for the next request", "#d9d9d9"),
    ]
    for key, name, color in parts:
        values = [100 * getattr(r, key) for r in results]
        fig.add_bar(
            y=labels,
            x=values,
            name=name,
            orientation="h",
            marker_color=color,
            text=[f"{v:.1f}%" if v >= 3 else "" for v in values],
            textposition="inside",
            insidetextanchor="middle",
            hovertemplate="%{y}: %{x:.2f}%<extra>" + name + "</extra>",
        )
    fig.update_layout(
        barmode="stack",
        title=title,
        height=150 + 45 * len(results),
        margin=dict(l=10, r=10, t=80, b=40),
        legend=dict(orientation="h", y=-0.3, traceorder="normal"),
    )
    fig.update_xaxes(title="share of the pool's memory over time (%)", range=[0, 100])
    fig.update_yaxes(autorange="reversed")
    return fig


# --------------------------------------------------------------------------- the block pool over time


def allocator_class_or_reference(learner_class, reference_class, drafts: bool = False):
    """The learner's allocator class if a short story runs through it with its counts right at
    every step (two prompts sharing a block, a fork, a copy-on-write, everyone freed), and with
    drafts=True a speculative step too (reserve past a shared last block, shrink back), else the
    reference, with `course.use_or_reference`'s notice on stdout."""
    from decodelab import course

    def probe():
        story = [
            ("A", "arrive", "A", [1, 2, 3, 4, 5]),
            ("B", "arrive", "B", [1, 2, 3, 4, 6, 7]),
            ("B2", "fork", "B2", "B"),
            ("B2 grows", "grow", "B2", [8, 9, 10]),
            ("A ends", "finish", "A"),
            ("B ends", "finish", "B"),
            ("B2 ends", "finish", "B2"),
        ]
        allocator = learner_class(8, 4)
        play_block_story(allocator, story)  # checks the ref counts and free + held = all after every event
        if allocator.num_free != 8:
            raise AssertionError(f"{allocator.num_free} of 8 blocks free after every sequence was freed")
        if len(allocator.copy_on_write_log) != 1:
            raise AssertionError(f"copy_on_write_log {allocator.copy_on_write_log} after one copy-on-write")
        if allocator.allocate([1, 2, 3, 4])[1] != 0:
            raise AssertionError("a prompt of one cached block found it: its last token must stay to compute")
        if drafts:  # 6 tokens in 2 blocks, shared with a fork; room for 3 drafts, then 1 accepted
            allocator = learner_class(8, 4)
            table, _ = allocator.allocate([1, 2, 3, 4, 5, 6])
            sibling = allocator.fork(table)
            if allocator.reserve(table, 6 + 3) is not True or len(table) != 3 or table[1] == sibling[1]:
                raise AssertionError(
                    f"reserve for 3 drafts gave the table {table} (its sibling's: {sibling}); "
                    "expected a copy of the shared last block and one new block"
                )
            allocator.shrink(table, [1, 2, 3, 4, 5, 6, 7, 8], 7)
            if len(table) != 2 or allocator.num_free != 5:
                raise AssertionError(
                    f"shrink after 1 draft accepted left the table {table} and "
                    f"{allocator.num_free} blocks free; expected 2 blocks and 5 free"
                )

    chosen = course.use_or_reference(probe, reference_class, name=getattr(learner_class, "__name__", "BlockAllocator"))
    return learner_class if chosen is probe else reference_class


def play_block_story(allocator, events) -> list[dict]:
    """Run events on a BlockAllocator and take a snapshot of the pool after each.

    events: (label, action, name, *args) with action one of
      "arrive" (token ids): allocate a new sequence;
      "grow" (token ids): append tokens one by one (append_slot, copy-on-write included);
      "fork" (parent name): share every block of the parent (a second sample);
      "finish": free the sequence's blocks.
    Snapshot: {"label", "holders": [names per block], "ref_counts", "cached": [bool per block]}.
    """
    tables, tokens, snapshots = {}, {}, []
    for label, action, name, *args in events:
        if action == "arrive":
            tokens[name] = list(args[0])
            tables[name], _ = allocator.allocate(tokens[name])
        elif action == "grow":
            for token in args[0]:
                tokens[name].append(token)
                allocator.append_slot(tables[name], tokens[name])
        elif action == "fork":
            tokens[name] = list(tokens[args[0]])
            tables[name] = allocator.fork(tables[args[0]])
        elif action == "finish":
            allocator.free_sequence(tables.pop(name))
            tokens.pop(name)
        else:
            raise ValueError(f"unknown action {action!r}; use arrive, grow, fork or finish")
        snapshots.append(pool_snapshot(allocator, tables, label))
    return snapshots


def serve_recording(llm, prompts, params, label=None):
    """llm.chat(prompts, params) (a prompt is a conversation), with a snapshot of the engine's
    pool after every step that changed a block table -> (outputs, snapshots). A sequence is
    named by its prompt's letter and its sample's number (A1, A2, B1, ...)."""
    from decodelab.engine.llm import engine_step

    snapshots, last, steps = [], [None], [0]
    label = label or (lambda step: f"after step {step}")

    def step(engine):
        events = engine_step(engine)
        steps[0] += 1
        seqs = sorted(engine.scheduler.running, key=lambda s: (s.request_index, s.sample_index))
        tables = {f"{chr(65 + s.request_index)}{s.sample_index + 1}": list(s.block_table) for s in seqs}
        if tables != last[0]:
            snapshots.append(pool_snapshot(engine.allocator, tables, label(steps[0]) if tables else "all finished"))
            last[0] = tables
        return events

    saved, llm.hooks.step = llm.hooks.step, step
    try:
        outputs = llm.chat(prompts, params)
    finally:
        llm.hooks.step = saved
    if last[0] != {}:
        snapshots.append(pool_snapshot(llm.allocator, {}, "all finished"))
    return outputs, snapshots


def block_table_figure(snapshots: list[dict], title: str, used_only: bool = False) -> go.Figure:
    """One row per moment, one column per block of the pool: colour = how many sequences hold
    the block (white free, grey free but still named in the prefix cache), text = who.
    used_only: leave out the blocks that no moment shows held or cached."""
    columns = list(range(len(snapshots[0]["ref_counts"])))
    if used_only:
        columns = [b for b in columns if any(s["ref_counts"][b] or s["cached"][b] for s in snapshots)] or columns
    z, text, hover = [], [], []
    for snap in snapshots:
        z.append([0.5 if snap["cached"][b] else snap["ref_counts"][b] for b in columns])
        names = [
            "+".join(snap["holders"][b]) if snap["holders"][b] else ("cached" if snap["cached"][b] else "")
            for b in columns
        ]
        hover.append(names)
        text.append(
            [
                name if len(snap["holders"][b]) <= 3 else f"{len(snap['holders'][b])} seqs"
                for b, name in zip(columns, names)
            ]
        )
    top = max(3, max(max(row) for row in z))
    scale = [[0, "#ffffff"], [0.5 / top, "#d9d9d9"], [1 / top, "#9ecae1"], [2 / top, "#3182bd"], [1, "#08306b"]]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(b) for b in columns],
            y=[s["label"] for s in snapshots],
            text=text,
            customdata=hover,
            hovertemplate="block %{x}: %{customdata}<extra>%{y}</extra>",
            texttemplate="%{text}",
            textfont=dict(size=10),
            colorscale=scale,
            zmin=0,
            zmax=top,
            xgap=2,
            ygap=2,
            colorbar=dict(title="ref count", tickvals=list(range(top + 1))),
        )
    )
    fig.update_layout(title=title, height=110 + 38 * len(snapshots), margin=dict(l=10, r=10, t=70, b=40))
    fig.update_xaxes(title="block id in the pool", type="category")
    fig.update_yaxes(autorange="reversed")
    return fig


__all__ = [
    "SEED_WASTE",
    "uniform_lengths",
    "waste_figure",
    "waste_explorer",
    "fragmentation_figure",
    "allocator_class_or_reference",
    "pool_snapshot",
    "play_block_story",
    "serve_recording",
    "block_table_figure",
]

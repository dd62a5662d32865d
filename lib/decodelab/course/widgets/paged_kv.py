"""Notebook 07's pictures and explorer: KV waste against block size, and the block pool as
requests come and go. The notebook passes in the functions to use (the learner's own, or the
library's reference while an exercise is unfinished).

    box = waste_explorer(kv_waste)          # box.figure, box.controls, box.redraw()
    snapshots = play_block_story(allocator, events)
    block_table_figure(snapshots).show()
"""
from __future__ import annotations

import random

import ipywidgets as widgets
import plotly.graph_objects as go

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
    fig.add_scatter(x=block_sizes, y=[100 * w for w in measured], mode="lines+markers", name="paged blocks (measured)",
                    marker_color=MEASURED_COLOR)
    fig.add_scatter(x=[block_sizes[0], block_sizes[-1]], y=[100 * preallocated] * 2, mode="lines",
                    name="preallocate max_len (measured)", line=dict(dash="dash", color=OTHER_COLOR))
    seed_x = list(SEED_BLOCK_SIZES) + [block_sizes[-1]]
    seed_y = [100 * w for w in SEED_BLOCK_SIZES.values()] + [100 * SEED_WASTE["preallocate 2,048"]]
    fig.add_scatter(x=seed_x, y=seed_y, mode="markers+text", name="seed article", marker=dict(
        color=SEED_COLOR, symbol="diamond", size=11), text=[f"seed {y:.1f}%" for y in seed_y],
        textposition=["bottom right"] * len(SEED_BLOCK_SIZES) + ["bottom left"])
    fig.update_layout(title=title, height=430, margin=dict(l=10, r=10, t=80, b=40),
                      legend=dict(orientation="h", y=-0.22))
    fig.update_xaxes(type="log", title="block size (tokens per block)")
    fig.update_yaxes(type="log", title="KV slots reserved but empty (%)", range=[-2, 2.1])
    return fig


def waste_explorer(waste_fn, num_requests: int = 1000):
    """Sliders for block size and the longest request -> waste of paged blocks vs preallocation.

    waste_fn(sequence_lengths, block_size, max_len=None) -> fraction (the kv_waste exercise).
    Requests are uniform in 50..longest; preallocation reserves longest + 1 slots per request.
    """
    block_size = widgets.SelectionSlider(options=BLOCK_SIZES, value=16, description="block size (tokens)", **SLIDER)
    longest = widgets.SelectionSlider(options=[255, 511, 1023, 2047, 4095, 8191], value=2047,
                                      description="longest request (tokens)", **SLIDER)
    def measure():
        lengths = uniform_lengths(num_requests, 50, longest.value)
        max_len = longest.value + 1
        paged = [waste_fn(lengths, b) for b in BLOCK_SIZES]
        prealloc, current = waste_fn(lengths, None, max_len), waste_fn(lengths, block_size.value)
        title = (f"blocks of {block_size.value} tokens: {100 * current:.2f}% of reserved KV slots empty<br>"
                 f"{num_requests} requests of 50..{longest.value} tokens (mean {sum(lengths) / len(lengths):.0f}); "
                 f"preallocating {max_len} each: {100 * prealloc:.1f}% empty")
        return paged, prealloc, current, title

    # The widget starts from a complete figure, so its first state already holds every trace
    # (a browser that renders it while the kernel is busy with later cells shows it whole).
    paged, prealloc, current, title = measure()
    start = waste_figure(BLOCK_SIZES, paged, prealloc, title)
    start.add_scatter(x=[block_size.value], y=[100 * current], mode="markers", name="your block size",
                      marker=dict(size=16, color=MEASURED_COLOR, line=dict(width=2, color="black")))
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

    for control in (block_size, longest):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.VBox([block_size, longest]), fig])
    return finish_explorer(box, fig, {"block_size": block_size, "longest": longest}, redraw)


# --------------------------------------------------------------------------- the block pool over time


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
        allocator.check_invariants(list(tables.values()))
        holders = [[] for _ in range(allocator.num_blocks)]
        for seq, table in tables.items():
            for block_id in table:
                holders[block_id].append(seq)
        snapshots.append({"label": label, "holders": holders, "ref_counts": [b.ref_count for b in allocator.blocks],
                          "cached": [b.ref_count == 0 and b.hash is not None for b in allocator.blocks]})
    return snapshots


def block_table_figure(snapshots: list[dict], title: str) -> go.Figure:
    """One row per moment, one column per block of the pool: colour = how many sequences hold
    the block (white free, grey free but still named in the prefix cache), text = who."""
    z, text = [], []
    for snap in snapshots:
        z.append([0.5 if cached else refs for refs, cached in zip(snap["ref_counts"], snap["cached"])])
        text.append(["+".join(h) if h else ("cached" if c else "") for h, c in zip(snap["holders"], snap["cached"])])
    top = max(3, max(max(row) for row in z))
    scale = [[0, "#ffffff"], [0.5 / top, "#d9d9d9"], [1 / top, "#9ecae1"], [2 / top, "#3182bd"], [1, "#08306b"]]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(len(z[0]))), y=[s["label"] for s in snapshots], text=text,
                               texttemplate="%{text}", textfont=dict(size=10), colorscale=scale, zmin=0, zmax=top,
                               xgap=2, ygap=2, colorbar=dict(title="ref count", tickvals=list(range(top + 1)))))
    fig.update_layout(title=title, height=110 + 38 * len(snapshots), margin=dict(l=10, r=10, t=70, b=40))
    fig.update_xaxes(title="block id in the pool", dtick=1)
    fig.update_yaxes(autorange="reversed")
    return fig


__all__ = ["SEED_WASTE", "uniform_lengths", "waste_figure", "waste_explorer", "play_block_story", "block_table_figure"]

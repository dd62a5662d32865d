"""Bonus notebook 12 (your first GPU kernel): the KV pool as the kernel sees it, an explorer of
one program walking its blocks (running the learner's kernel), and the GPU measurement of the
Triton kernel against gather + SDPA on the bandwidth roofline.

The explorer follows `decodelab.course.widgets.controls`: it returns an ipywidgets box with
``.figure``, ``.controls`` and ``.redraw()``.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer

_SEQUENCE_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]


def pool_figure(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> go.Figure:
    """The pool, one row per physical block and one cell per slot: each slot coloured by the
    sequence whose token it holds and labelled with that token's position; grey slots are stale
    (no sequence's token lives there, the last blocks' tails included)."""
    owner, position = _owners(block_tables, context_lens, num_blocks, block_size)
    label = [
        [f"s{o}:{p}" if o >= 0 else "" for o, p in zip(orow, prow)]
        for orow, prow in zip(owner.tolist(), position.tolist())
    ]
    colors = ["#dddddd"] + _SEQUENCE_COLORS[: max(1, len(context_lens))]
    scale = []  # a discrete scale: value k (owner + 1) gets colors[k]
    for k, color in enumerate(colors):
        scale += [[k / len(colors), color], [(k + 1) / len(colors), color]]
    fig = go.Figure(
        go.Heatmap(
            z=(owner + 1).tolist(),
            text=label,
            texttemplate="%{text}",
            colorscale=scale,
            zmin=-0.5,
            zmax=len(colors) - 0.5,
            showscale=False,
            xgap=2,
            ygap=2,
            hovertemplate="block %{y}, slot %{x}: %{text}<extra></extra>",
        )
    )
    fig.update_layout(
        title="The KV pool: each slot coloured by the sequence whose token it holds<br>"
        "(s1:17 = sequence 1, token 17; grey: stale, no sequence's token)",
        height=60 + 34 * num_blocks,
        margin=dict(l=10, r=10, t=60, b=40),
        xaxis=dict(title="slot in the block", dtick=1),
        yaxis=dict(title="physical block", dtick=1, autorange="reversed"),
    )
    return fig


def _owners(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int):
    """([num_blocks, block_size] owning sequence or -1, [num_blocks, block_size] token position or -1)."""
    owner = torch.full((num_blocks, block_size), -1)
    position = torch.full((num_blocks, block_size), -1)
    for b, (table, n) in enumerate(zip(block_tables.tolist(), context_lens.tolist())):
        for i in range(n):
            owner[table[i // block_size], i % block_size] = b
            position[table[i // block_size], i % block_size] = i
    return owner, position


def program_explorer(attention, batch: dict):
    """Sliders for the sequence b and the number of its blocks read -> left, the pool with the blocks
    program (b, kv) has read so far (the current one outlined); right, for every query head of b,
    how far the output after those blocks still is from the final one. attention(**batch) has the
    signature of `decodelab.lessons.gpu_kernel.paged_attention` (the learner's kernel behind it):
    "after j blocks" is the kernel run with context_lens[b] cut to the first j blocks."""
    q, tables, lens = batch["q"], batch["block_tables"], batch["context_lens"]
    num_blocks, block_size, num_kv_heads, _ = batch["key_cache"].shape
    num_heads, group = q.shape[1], q.shape[1] // num_kv_heads
    owner, position = _owners(tables, lens, num_blocks, block_size)
    final = attention(**batch)  # [B, H, D]
    sequence = widgets.IntSlider(
        value=0, min=0, max=len(lens) - 1, description="sequence b (its programs)", continuous_update=False, **SLIDER
    )
    step = widgets.IntSlider(value=1, min=1, max=1, description="blocks read", continuous_update=False, **SLIDER)
    play = widgets.Play(value=1, min=1, max=1, interval=900, description="play")
    widgets.jslink((play, "value"), (step, "value"))
    colors = ["#eeeeee", "#c6dbef", "#fdd0a2", MEASURED_COLOR]  # stale, other sequences, not read yet, read
    scale = []
    for k, color in enumerate(colors):
        scale += [[k / len(colors), color], [(k + 1) / len(colors), color]]
    base = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.5, 0.5],
        horizontal_spacing=0.12,
        subplot_titles=(
            "the pool: read (blue), still to read (orange),<br>other sequences' (pale), stale (grey)",
            "per query head: |output so far − final|<br>(max over D)",
        ),
    )
    base.add_heatmap(
        z=[[0]],
        text=[[""]],
        texttemplate="%{text}",
        colorscale=scale,
        zmin=-0.5,
        zmax=len(colors) - 0.5,
        showscale=False,
        xgap=2,
        ygap=2,
        row=1,
        col=1,
    )
    base.add_bar(x=[0], y=[0], marker_color=SEED_COLOR, name="max over D", row=1, col=2)
    base.update_yaxes(autorange="reversed", title="physical block", dtick=1, row=1, col=1)
    base.update_xaxes(title="slot", dtick=1, row=1, col=1)
    base.update_xaxes(title="query head (grouped by KV head)", dtick=1, row=1, col=2)
    base.update_yaxes(type="log", title="error (log scale)", range=[-8, 1], row=1, col=2)
    base.update_layout(height=200 + 30 * num_blocks, margin=dict(l=10, r=10, t=175, b=40), showlegend=False)

    def draw(target):
        b = sequence.value
        n = int(lens[b])
        total = -(-n // block_size)
        step.max = play.max = total
        done = min(step.value, total)
        read = tables[b, :done].tolist()
        z = torch.where(owner < 0, 0, torch.where(owner != b, 1, 2))
        z[read] = torch.where(owner[read] == b, 3, z[read])
        labels = [
            [f"{p}" if o == b else "" for o, p in zip(orow, prow)]
            for orow, prow in zip(owner.tolist(), position.tolist())
        ]
        partial = dict(
            batch,
            q=q[b : b + 1],
            block_tables=tables[b : b + 1],
            context_lens=torch.tensor([min(done * block_size, n)], dtype=lens.dtype),
        )
        error = (attention(**partial)[0] - final[b]).abs().amax(dim=-1).clamp_min(1e-9)  # [H]
        current = tables[b, done - 1].item()
        with target.batch_update():
            target.data[0].z, target.data[0].text = z.tolist(), labels
            target.data[1].x, target.data[1].y = [f"{h} (kv {h // group})" for h in range(num_heads)], error.tolist()
            target.layout.shapes = [
                dict(
                    type="rect",
                    xref="x",
                    yref="y",
                    x0=-0.5,
                    x1=block_size - 0.5,
                    y0=current - 0.5,
                    y1=current + 0.5,
                    line=dict(color="black", width=3),
                )
            ]
            target.layout.title.text = (
                f"sequence {b} ({n} tokens), its {num_kv_heads} programs: {done} of {total} blocks read<br>"
                f"logical block {done - 1} is physical block {current}; tokens read: {min(done * block_size, n)} of {n}"
                f"<br>largest error so far: "
                + (f"{error.max().item():.1e}" if error.max() > 1e-6 else "none (to float rounding): every block is in")
            )

    fig = go.FigureWidget(base)  # never displayed into an ipywidgets.Output (see controls.py)

    def redraw(*_):
        draw(fig)

    return finish_explorer(
        fig,
        {"sequence": sequence, "step": step},
        redraw,
        children=[widgets.VBox([sequence, widgets.HBox([play, step])]), fig],
    )


def timing_figure(results: dict[str, list[dict]], bandwidth: float, title: str) -> go.Figure:
    """Left: milliseconds per call against the context length (log-log). Right: the KV bytes each
    call must read divided by its time, as a fraction of the measured bandwidth (the roofline)."""
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("time of one decode attention call", "fraction of the bandwidth roofline")
    )
    colors = [MEASURED_COLOR, OTHER_COLOR, SEED_COLOR]
    for i, (name, rows) in enumerate(results.items()):
        x = [r["context"] for r in rows]
        fig.add_scatter(
            x=x,
            y=[r["ms"] for r in rows],
            mode="lines+markers",
            name=name,
            legendgroup=name,
            marker_color=colors[i % len(colors)],
            row=1,
            col=1,
        )
        fig.add_scatter(
            x=x,
            y=[r["bytes_per_s"] / bandwidth for r in rows],
            mode="lines+markers",
            name=name,
            legendgroup=name,
            showlegend=False,
            marker_color=colors[i % len(colors)],
            row=1,
            col=2,
        )
    fig.add_hline(y=1.0, line_dash="dash", line_color=SEED_COLOR, annotation_text="measured bandwidth", row=1, col=2)
    fig.update_xaxes(type="log", title="context length (tokens per sequence, log scale)")
    fig.update_yaxes(type="log", title="milliseconds (median, log scale)", row=1, col=1)
    fig.update_yaxes(title="KV bytes read / time / bandwidth", rangemode="tozero", row=1, col=2)
    fig.update_layout(
        title=title, height=440, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.25)
    )
    return fig


__all__ = ["pool_figure", "program_explorer", "timing_figure"]

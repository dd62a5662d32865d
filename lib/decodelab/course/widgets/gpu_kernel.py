"""Bonus notebook 12 (your first GPU kernel): the KV pool as the kernel sees it, and the GPU
measurement of the Triton kernel against gather + SDPA on the bandwidth roofline."""
from __future__ import annotations

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR

_SEQUENCE_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]


def pool_figure(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int) -> go.Figure:
    """The pool, one row per physical block and one cell per slot: each slot coloured by the
    sequence whose token it holds and labelled with that token's position; grey slots are stale
    (no sequence's token lives there, the last blocks' tails included)."""
    owner = torch.full((num_blocks, block_size), -1)
    label = [["" for _ in range(block_size)] for _ in range(num_blocks)]
    for b, (table, n) in enumerate(zip(block_tables.tolist(), context_lens.tolist())):
        for i in range(n):
            block, slot = table[i // block_size], i % block_size
            owner[block, slot] = b
            label[block][slot] = f"s{b}:{i}"
    colors = ["#dddddd"] + _SEQUENCE_COLORS[:max(1, len(context_lens))]
    scale = []  # a discrete scale: value k (owner + 1) gets colors[k]
    for k, color in enumerate(colors):
        scale += [[k / len(colors), color], [(k + 1) / len(colors), color]]
    fig = go.Figure(go.Heatmap(z=(owner + 1).tolist(), text=label, texttemplate="%{text}", colorscale=scale,
                               zmin=-0.5, zmax=len(colors) - 0.5, showscale=False, xgap=2, ygap=2,
                               hovertemplate="block %{y}, slot %{x}: %{text}<extra></extra>"))
    fig.update_layout(title="The KV pool: each block's slots, coloured by the sequence whose token they hold "
                            "(s1:17 = sequence 1, token 17; grey = stale)",
                      height=60 + 34 * num_blocks, margin=dict(l=10, r=10, t=60, b=40),
                      xaxis=dict(title="slot in the block", dtick=1), yaxis=dict(title="physical block", dtick=1,
                                                                                 autorange="reversed"))
    return fig


def timing_figure(results: dict[str, list[dict]], bandwidth: float, title: str) -> go.Figure:
    """Left: milliseconds per call against the context length (log-log). Right: the KV bytes each
    call must read divided by its time, as a fraction of the measured bandwidth (the roofline)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time of one decode attention call",
                                                        "fraction of the bandwidth roofline"))
    colors = [MEASURED_COLOR, OTHER_COLOR, SEED_COLOR]
    for i, (name, rows) in enumerate(results.items()):
        x = [r["context"] for r in rows]
        fig.add_scatter(x=x, y=[r["ms"] for r in rows], mode="lines+markers", name=name, legendgroup=name,
                        marker_color=colors[i % len(colors)], row=1, col=1)
        fig.add_scatter(x=x, y=[r["bytes_per_s"] / bandwidth for r in rows], mode="lines+markers", name=name,
                        legendgroup=name, showlegend=False, marker_color=colors[i % len(colors)], row=1, col=2)
    fig.add_hline(y=1.0, line_dash="dash", line_color=SEED_COLOR, annotation_text="measured bandwidth", row=1, col=2)
    fig.update_xaxes(type="log", title="context length (tokens per sequence, log scale)")
    fig.update_yaxes(type="log", title="milliseconds (median, log scale)", row=1, col=1)
    fig.update_yaxes(title="KV bytes read / time / bandwidth", rangemode="tozero", row=1, col=2)
    fig.update_layout(title=title, height=440, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.25))
    return fig


__all__ = ["pool_figure", "timing_figure"]

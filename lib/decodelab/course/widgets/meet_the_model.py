"""Notebook 00's explorer: model size, bytes per parameter and bandwidth -> the decode bound."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.plots import OTHER_COLOR, SEED_COLOR, log_range, si
from decodelab.course.widgets.controls import SLIDER, finish_explorer

PRECISIONS = [("fp32 (4 B)", 4.0), ("fp16 (2 B)", 2.0), ("int8 (1 B)", 1.0), ("int4 (0.5 B)", 0.5)]
SEED_BANDWIDTHS = {"H100, 3.35 TB/s (seed)": 3.35e12, "2 TB/s (seed)": 2e12}


def decode_bound_explorer(bound_fn, references: dict[str, float] | None = None):
    """Sliders for model size, bytes per parameter and bandwidth -> the batch-1 decode bound.

    bound_fn(num_params, bytes_per_param, bandwidth_bytes_per_s) -> tokens/s. The plot shows
    the bound against bandwidth for every precision, the current choice as a dot, and a
    vertical line per reference bandwidth (name -> bytes/s).
    """
    references = dict(SEED_BANDWIDTHS if references is None else references)
    size = widgets.FloatLogSlider(
        value=70,
        base=10,
        min=-1,
        max=3,
        step=0.001,
        description="parameters (billions)",
        readout_format=".3g",
        **SLIDER,
    )
    precision = widgets.SelectionSlider(options=PRECISIONS, value=2.0, description="bytes per parameter", **SLIDER)
    bandwidth = widgets.FloatLogSlider(
        value=3350, base=10, min=1, max=4, step=0.001, description="bandwidth (GB/s)", readout_format=".4g", **SLIDER
    )
    gbps = log_range(10, 10_000, 41)
    fig = go.FigureWidget()
    for name, _ in PRECISIONS:
        fig.add_scatter(x=gbps, y=[1] * len(gbps), mode="lines", name=name)
    fig.add_scatter(x=[1], y=[1], mode="markers", marker=dict(size=14, color=SEED_COLOR), name="your choice")
    choice = fig.data[-1]
    by_bandwidth = sorted(references.items(), key=lambda item: item[1])
    for i, (name, bytes_per_s) in enumerate(by_bandwidth):  # vertical reference lines, as traces (log axes)
        fig.add_scatter(
            x=[bytes_per_s / 1e9] * 3,
            y=[1e-3, 1e5 / 10**i, 3e5],
            mode="lines+text",
            text=["", name, ""],
            textposition="middle left",
            line=dict(dash="dot", color=OTHER_COLOR),
            showlegend=False,
        )
    fig.update_layout(height=480, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(type="log", title="memory bandwidth (GB/s)")
    fig.update_yaxes(type="log", title="decode bound (tokens per second, batch 1)", range=[-3, 5.5])

    def redraw(*_):
        num_params = size.value * 1e9
        # One batch per kind of change: plotly merges a batch into one restyle, and traces that
        # do not set a property it carries (here x) would lose it.
        with fig.batch_update():
            for trace, (_, bytes_per_param) in zip(fig.data, PRECISIONS):
                trace.y = [bound_fn(num_params, bytes_per_param, g * 1e9) for g in gbps]
        tokens_per_s = bound_fn(num_params, precision.value, bandwidth.value * 1e9)
        with fig.batch_update():
            choice.update(x=[bandwidth.value], y=[tokens_per_s])
            fig.layout.title.text = (
                f"{size.value:.3g}B parameters x {precision.value:g} bytes = {si(num_params * precision.value, 'B')} "
                f"read per token<br>at {si(bandwidth.value * 1e9, 'B/s')}: {1000 / tokens_per_s:.3g} ms per token, "
                f"at most {tokens_per_s:.3g} tokens/s"
            )

    return finish_explorer(fig, {"size": size, "precision": precision, "bandwidth": bandwidth}, redraw)

"""Notebook 10's widget: batched decode on this machine's roofline.

A decode step reads every weight once and yields one token per sequence in the batch, so the
memory roof rises with the batch: batch x bandwidth / weight_bytes tokens/s. The arithmetic
roof does not: each token costs about 2 x num_params FLOPs, so no batch beats
flops / (2 x num_params) tokens/s. Batching slides decode from the first roof to the second.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR, si
from decodelab.course.widgets.controls import SLIDER, finish_explorer

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def roofline_tokens_per_s(
    batch: float, weight_bytes: float, bandwidth: float, flops: float, num_params: float
) -> float:
    """min(memory roof, arithmetic roof) for batched decode, in tokens/s."""
    return min(batch * bandwidth / weight_bytes, flops / (2 * num_params))


def batch_roofline_explorer(
    fraction_fn, weight_bytes: float, num_params: float, bandwidth: float, flops: float, measured: list[dict]
):
    """Sliders for the batch size, the bandwidth and the bytes per weight -> the decode roofline.

    fraction_fn(tokens_per_s, batch_size, weight_bytes, bandwidth) -> fraction of the memory roof
    (the learner's `decode_roofline_fraction`). measured: [{"name", "batch", "tokens_per_s"}],
    points measured on this machine at the measured bandwidth and fp32 weights.
    """
    batch = widgets.SelectionSlider(options=BATCHES, value=16, description="batch size (sequences)", **SLIDER)
    gbps = widgets.FloatLogSlider(
        value=bandwidth / 1e9,
        base=10,
        min=0,
        max=3.7,
        step=0.01,
        description="bandwidth (GB/s)",
        readout_format=".3g",
        **SLIDER,
    )
    bytes_per_weight = widgets.Dropdown(
        options=[("fp32 (4 B)", 4.0), ("bf16 (2 B)", 2.0), ("int8 (1 B)", 1.0), ("int4 (0.5 B)", 0.5)],
        value=4.0,
        description="bytes per weight",
        **SLIDER,
    )
    fig = go.FigureWidget(
        layout=dict(
            height=440,
            xaxis=dict(type="log", title="batch size (sequences per step)"),
            yaxis=dict(type="log", title="tokens per second"),
            margin=dict(t=70),
        )
    )
    fig.add_scatter(name="memory roof", mode="lines", line=dict(color=OTHER_COLOR, dash="dot"))
    fig.add_scatter(name="roofline: min(memory, arithmetic)", mode="lines", line=dict(color=SEED_COLOR))
    fig.add_scatter(name="your choice", mode="markers", marker=dict(size=13, color=SEED_COLOR, symbol="diamond"))
    fig.add_scatter(
        name="measured here",
        mode="markers+text",
        textposition="top center",
        marker=dict(size=11, color=MEASURED_COLOR),
        x=[m["batch"] for m in measured],
        y=[m["tokens_per_s"] for m in measured],
        text=[m["name"] for m in measured],
    )
    controls = {"batch": batch, "bandwidth": gbps, "bytes_per_weight": bytes_per_weight}

    def redraw(*_):
        bw, wbytes = gbps.value * 1e9, num_params * bytes_per_weight.value
        with fig.batch_update():
            fig.data[0].x, fig.data[0].y = BATCHES, [b * bw / wbytes for b in BATCHES]
            fig.data[1].x = BATCHES
            fig.data[1].y = [roofline_tokens_per_s(b, wbytes, bw, flops, num_params) for b in BATCHES]
            roof = roofline_tokens_per_s(batch.value, wbytes, bw, flops, num_params)
            fig.data[2].x, fig.data[2].y = [batch.value], [roof]
            same = [m for m in measured if m["batch"] == batch.value]
            note = ""
            if same and bytes_per_weight.value == 4.0:
                share = fraction_fn(same[0]["tokens_per_s"], batch.value, wbytes, bw)
                note = f"; measured {same[0]['tokens_per_s']:.0f} tok/s = {share:.0%} of the memory roof"
            bound = "memory" if batch.value * bw / wbytes < flops / (2 * num_params) else "arithmetic"
            fig.layout.title = (
                f"batch {batch.value}: roofline {si(roof)} tokens/s ({bound}-bound) at {gbps.value:.3g} GB/s{note}"
            )

    return finish_explorer(fig, controls, redraw, children=[widgets.HBox([batch, gbps]), bytes_per_weight, fig])

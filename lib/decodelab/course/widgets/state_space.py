"""Notebook 15's explorer: what decoding carries, a transformer's K/V against an SSM's fixed state.

Two sliders, the context length and the batch size; the figure draws both models' bytes over every
context up to the chosen one (log axes) and the title gives the two at the chosen point and their
ratio. The bytes come from the library: `lessons.kv_size.kv_bytes` for the transformer's config and
`model.mamba.state_bytes` for the SSM's, the formulas the notebook's measured bytes bear out.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.lessons.kv_size import format_bytes, kv_bytes
from decodelab.model.mamba import state_bytes

CONTEXTS = [2**k for k in range(4, 18)]  # 16 .. 131,072 tokens


def memory_explorer(transformer_config, ssm_config, names=("tiny", "tiny-mamba"), dtype_bytes: int = 4):
    """transformer_config: a `ModelConfig`; ssm_config: a `MambaConfig`; names: how the title calls them;
    dtype_bytes: bytes of one stored K/V or conv value (the scan state is float32 whatever it is)."""
    fig = go.FigureWidget()
    controls = {
        "context": widgets.SelectionSlider(options=CONTEXTS, value=1024, description="context (tokens)", **SLIDER),
        "batch": widgets.IntSlider(value=1, min=1, max=64, description="batch size", **SLIDER),
    }

    def redraw(*_):
        n, b = controls["context"].value, controls["batch"].value
        xs = [c for c in CONTEXTS if c <= n]
        kv = [kv_bytes(transformer_config, c, b, dtype_bytes) for c in xs]
        state = [state_bytes(ssm_config, b, dtype_bytes)] * len(xs)
        with fig.batch_update():
            fig.data = []
            fig.add_scatter(x=xs, y=kv, mode="lines+markers", name=f"{names[0]}: K and V", line_color=OTHER_COLOR)
            fig.add_scatter(x=xs, y=state, mode="lines+markers", name=f"{names[1]}: state", line_color=MEASURED_COLOR)
            fig.update_layout(
                title=f"context {n:,}, batch {b}: {names[0]}'s K/V {format_bytes(kv[-1])}, "
                f"{names[1]}'s state {format_bytes(state[-1])} ({kv[-1] / state[-1]:.3g}x)",
                height=420,
                margin=dict(l=10, r=10, t=60, b=40),
                legend=dict(orientation="h", y=-0.25),
            )
            fig.update_xaxes(title="context length (tokens)", type="log")
            fig.update_yaxes(title="bytes carried while decoding", type="log")

    return finish_explorer(fig, controls, redraw)

"""Notebook 09's explorer: acceptance rate alpha, draft cost c and the number of drafts k ->
tokens per target call and the speed-up they allow, beside what was measured.

Same shape as `decodelab.course.widgets.controls`: an ipywidgets box with ``.figure`` (the FigureWidget),
``.controls`` (name -> slider) and ``.redraw()``. The formulas come in as functions (the
library's `expected_tokens_per_call` / `expected_speedup`), so the sliders run the code the
notebook teaches.
"""
from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer


# Seed article (tiny char-level pair on CPU, temperature 0.7): k -> (tokens per target call, speedup)
SEED_POINTS = {1: (1.91, 1.19), 2: (2.58, 1.29), 3: (3.25, 1.28), 4: (4.00, 1.24), 6: (4.80, 0.92), 8: (4.63, 0.77)}


def speculative_explorer(tokens_fn, speedup_fn, measured: dict | None = None, seed_points: dict | None = None,
                         alpha: float = 0.8, draft_cost: float = 0.25, max_k: int = 10):
    """Sliders for alpha, the draft cost c and the largest k shown.

    tokens_fn(alpha, k) -> expected tokens per target call; speedup_fn(alpha, k, c) -> expected
    speed-up. measured: k -> (tokens per target call, speedup) measured in the notebook (drawn as
    dots); seed_points: the same from the seed article (SEED_POINTS by default).
    """
    seed_points = SEED_POINTS if seed_points is None else seed_points
    alpha_slider = widgets.FloatSlider(value=alpha, min=0.0, max=0.99, step=0.01, description="acceptance rate α",
                                       readout_format=".2f", **SLIDER)
    cost_slider = widgets.FloatSlider(value=draft_cost, min=0.0, max=1.0, step=0.01,
                                      description="draft cost c (× target step)", readout_format=".2f", **SLIDER)
    k_slider = widgets.IntSlider(value=max_k, min=2, max=16, description="largest k shown", **SLIDER)
    fig = go.FigureWidget()
    fig.add_scatter(mode="lines+markers", name="tokens per target call, (1 - α^(k+1)) / (1 - α)",
                    line=dict(color=MEASURED_COLOR))
    fig.add_scatter(mode="lines+markers", name="speed-up bound, Theorem 3.8", line=dict(color=OTHER_COLOR))
    for name, points, color, symbol in (("measured here", measured or {}, MEASURED_COLOR, "diamond"),
                                         ("seed article", seed_points, SEED_COLOR, "x")):
        ks = sorted(points)
        fig.add_scatter(x=ks, y=[points[k][0] for k in ks], mode="markers", name=f"{name}: tokens per call",
                        marker=dict(color=color, size=10, symbol=symbol))
        fig.add_scatter(x=ks, y=[points[k][1] for k in ks], mode="markers", name=f"{name}: measured speed-up",
                        marker=dict(color=color, size=10, symbol=f"{symbol}-open"))
    fig.update_layout(height=500, margin=dict(l=10, r=10, t=80, b=40), legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(title="drafts per step k")
    fig.update_yaxes(title="tokens per target call / speed-up (×)", rangemode="tozero")

    def redraw(*_):
        a, c, top = alpha_slider.value, cost_slider.value, k_slider.value
        ks = list(range(0, top + 1))
        tokens = [tokens_fn(a, k) for k in ks]
        speedups = [speedup_fn(a, k, c) for k in ks]
        best = max(ks, key=lambda k: speedups[k])
        with fig.batch_update():
            fig.data[0].update(x=ks, y=tokens)
            fig.data[1].update(x=ks, y=speedups)
            fig.layout.title.text = (f"α = {a:.2f}, c = {c:.2f}: at k = {top}, {tokens[-1]:.2f} tokens per target call "
                                     f"(at most {1 / (1 - a):.3g} for any k)<br>best k = {best}: "
                                     f"speed-up at most {speedups[best]:.2f}× if verifying k+1 tokens costs one step")

    for control in (alpha_slider, cost_slider, k_slider):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.VBox([alpha_slider, cost_slider, k_slider]), fig])
    return finish_explorer(box, fig, {"alpha": alpha_slider, "draft_cost": cost_slider, "max_k": k_slider}, redraw)


__all__ = ["speculative_explorer", "SEED_POINTS"]


def tvd_bars_figure(rows: dict[str, dict[str, float]], bounds: dict[str, float], title: str,
                    seed_ranges: dict[str, tuple[float, float]] | None = None) -> go.Figure:
    """Grouped bars: one group per prefix (rows: prefix -> {method: TVD to p}), the noise bound of
    each prefix as a dashed marker, the seed's range per method as a shaded band."""
    fig = go.Figure()
    prefixes = list(rows)
    methods = list(next(iter(rows.values())))
    colors = [MEASURED_COLOR, OTHER_COLOR, SEED_COLOR, "#9467bd", "#2ca02c"]
    for method, color in zip(methods, colors):
        fig.add_bar(x=prefixes, y=[rows[p][method] for p in prefixes], name=method, marker_color=color,
                    text=[f"{rows[p][method]:.4f}" for p in prefixes], textposition="outside")
    fig.add_scatter(x=prefixes, y=[bounds[p] for p in prefixes], mode="markers", name="noise bound (from the sample count)",
                    marker=dict(symbol="line-ew-open", size=60, color="black", line=dict(width=2)))
    places = ["top left", "bottom right", "top right"]  # the seed's bands overlap: spread the labels
    for i, (method, (low, high)) in enumerate((seed_ranges or {}).items()):
        fig.add_hrect(y0=low, y1=high, fillcolor=colors[i % len(colors)], opacity=0.12, line_width=0,
                      annotation_text=f"seed: {method} {low:g}-{high:g}", annotation_position=places[i % len(places)])
    fig.update_layout(title=title, barmode="group", height=460, margin=dict(l=10, r=10, t=60, b=40),
                      legend=dict(orientation="h", y=-0.2))
    fig.update_yaxes(title="TVD to the target's distribution p", type="log")
    return fig


__all__ = ["speculative_explorer", "tvd_bars_figure", "SEED_POINTS"]

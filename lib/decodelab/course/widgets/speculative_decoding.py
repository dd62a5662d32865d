"""Notebook 09's explorer: acceptance rate alpha, draft cost c and the number of drafts k ->
tokens per target call and the speed-up they allow, beside what was measured; and its figures:
the TVD bars, alpha and speed-up against the temperature, the verify pass's cost against the
number of tokens it checks.

Same shape as `decodelab.course.widgets.controls`: an ipywidgets box with ``.figure`` (the FigureWidget),
``.controls`` (name -> slider) and ``.redraw()``. The formulas come in as functions (the
library's `expected_tokens_per_call` / `expected_speedup`), so the sliders run the code the
notebook teaches.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer

# Seed article (tiny char-level pair on CPU, temperature 0.7): k -> (tokens per target call, speedup)
SEED_POINTS = {1: (1.91, 1.19), 2: (2.58, 1.29), 3: (3.25, 1.28), 4: (4.00, 1.24), 6: (4.80, 0.92), 8: (4.63, 0.77)}
# The seed's other figures: alpha of its pair on code, and its draft cost c (bench/speculative.py SEED_FIGURES).
SEED_ALPHA_RANGE, SEED_DRAFT_COST = (0.85, 0.91), 0.22

# The repository's benchmark of the tiny pair on the course's 2-core CPU (`bench/speculative.py --rounds 3`,
# bench/results/speculative_tiny_cpu.json: 3 prompts x 128 tokens, 2 threads):
# temperature -> (alpha, speed-up) at k = 2, and the time to verify n tokens in one pass / one decode step.
BENCH_TINY_BY_TEMPERATURE = {0.0: (0.636, 1.06), 0.7: (0.615, 1.06), 1.0: (0.620, 1.24)}
BENCH_TINY_VERIFY_COST = {1: 1.0, 2: 1.106, 3: 1.152, 4: 1.254, 5: 1.303, 6: 1.324, 7: 1.391, 8: 1.428, 9: 1.464}
# SmolLM2-135M on the same CPU (bench/results/speculative_smollm2_draft10_cpu.json, 1 to 5 tokens).
BENCH_SMOLLM2_VERIFY_COST = {1: 1.0, 2: 1.067, 3: 1.151, 4: 1.582, 5: 1.621}


def speculative_explorer(
    tokens_fn,
    speedup_fn,
    measured: dict | None = None,
    seed_points: dict | None = None,
    alpha: float = 0.8,
    draft_cost: float = 0.25,
    max_k: int = 10,
):
    """Sliders for alpha, the draft cost c and the largest k shown.

    tokens_fn(alpha, k) -> expected tokens per target call; speedup_fn(alpha, k, c) -> expected
    speed-up. measured: k -> (tokens per target call, speedup) measured in the notebook (drawn as
    dots); seed_points: the same from the seed article (SEED_POINTS by default).
    """
    seed_points = SEED_POINTS if seed_points is None else seed_points
    alpha_slider = widgets.FloatSlider(
        value=alpha, min=0.0, max=0.99, step=0.01, description="acceptance rate α", readout_format=".2f", **SLIDER
    )
    cost_slider = widgets.FloatSlider(
        value=draft_cost,
        min=0.0,
        max=1.0,
        step=0.01,
        description="draft cost c (× target step)",
        readout_format=".2f",
        **SLIDER,
    )
    k_slider = widgets.IntSlider(value=max_k, min=2, max=16, description="largest k shown", **SLIDER)
    fig = go.FigureWidget()
    fig.add_scatter(
        mode="lines+markers", name="tokens per target call, (1 - α^(k+1)) / (1 - α)", line=dict(color=MEASURED_COLOR)
    )
    fig.add_scatter(mode="lines+markers", name="speed-up bound, Theorem 3.8", line=dict(color=OTHER_COLOR))
    for name, points, color, symbol in (
        ("measured here", measured or {}, MEASURED_COLOR, "diamond"),
        ("seed article", seed_points, SEED_COLOR, "x"),
    ):
        ks = sorted(points)
        fig.add_scatter(
            x=ks,
            y=[points[k][0] for k in ks],
            mode="markers",
            name=f"{name}: tokens per call",
            marker=dict(color=color, size=10, symbol=symbol),
        )
        fig.add_scatter(
            x=ks,
            y=[points[k][1] for k in ks],
            mode="markers",
            name=f"{name}: measured speed-up",
            marker=dict(color=color, size=10, symbol=f"{symbol}-open"),
        )
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
            fig.layout.title.text = (
                f"α = {a:.2f}, c = {c:.2f}: at k = {top}, {tokens[-1]:.2f} tokens per target call "
                f"(at most {1 / (1 - a):.3g} for any k)<br>best k = {best}: "
                f"speed-up at most {speedups[best]:.2f}× if verifying k+1 tokens costs one step"
            )

    return finish_explorer(fig, {"alpha": alpha_slider, "draft_cost": cost_slider, "max_k": k_slider}, redraw)


def tvd_bars_figure(
    rows: dict[str, dict[str, float]],
    bounds: dict[str, float],
    title: str,
    seed_ranges: dict[str, tuple[float, float]] | None = None,
) -> go.Figure:
    """Grouped bars: one group per prefix (rows: prefix -> {method: TVD to p}), the noise bound of
    each prefix as a dashed marker, the seed's range per method as a shaded band."""
    fig = go.Figure()
    prefixes = list(rows)
    methods = list(next(iter(rows.values())))
    colors = [MEASURED_COLOR, OTHER_COLOR, SEED_COLOR, "#9467bd", "#2ca02c"]
    for method, color in zip(methods, colors):
        fig.add_bar(
            x=prefixes,
            y=[rows[p][method] for p in prefixes],
            name=method,
            marker_color=color,
            text=[f"{rows[p][method]:.4f}" for p in prefixes],
            textposition="outside",
        )
    fig.add_scatter(
        x=prefixes,
        y=[bounds[p] for p in prefixes],
        mode="markers",
        name="noise bound (from the sample count)",
        marker=dict(symbol="line-ew-open", size=60, color="black", line=dict(width=2)),
    )
    places = ["top left", "bottom right", "top right"]  # the seed's bands overlap: spread the labels
    for i, (method, (low, high)) in enumerate((seed_ranges or {}).items()):
        fig.add_hrect(
            y0=low,
            y1=high,
            fillcolor=colors[i % len(colors)],
            opacity=0.12,
            line_width=0,
            annotation_text=f"seed: {method} {low:g}-{high:g}",
            annotation_position=places[i % len(places)],
        )
    fig.update_layout(
        title=title,
        barmode="group",
        height=460,
        margin=dict(l=10, r=10, t=60, b=40),
        legend=dict(orientation="h", y=-0.2),
    )
    fig.update_yaxes(title="TVD to the target's distribution p", type="log")
    return fig


def temperature_figure(
    rows: dict[float, tuple[float, float]], k: int, bench: dict[float, tuple[float, float]] | None = None
) -> go.Figure:
    """Two panels against the temperature: alpha, and the speed-up over target-only decoding.
    rows: temperature -> (alpha, speed-up) measured in the notebook at k drafts; bench: the same
    from the repository's benchmark (BENCH_TINY_BY_TEMPERATURE by default); the seed's alpha range
    and its speed-up at T = 0.7 (SEED_POINTS[k]) drawn beside them."""
    bench = BENCH_TINY_BY_TEMPERATURE if bench is None else bench
    fig = make_subplots(rows=1, cols=2, subplot_titles=("acceptance rate α", "speed-up over target-only (×)"))
    temperatures, bench_t = sorted(rows), sorted(bench)
    for col, index in ((1, 0), (2, 1)):
        fig.add_scatter(
            x=temperatures,
            y=[rows[t][index] for t in temperatures],
            mode="lines+markers+text",
            name="measured here",
            legendgroup="here",
            showlegend=col == 1,
            text=[f"{rows[t][index]:.2f}" for t in temperatures],
            textposition="top center",
            marker=dict(color=MEASURED_COLOR, size=10, symbol="diamond"),
            row=1,
            col=col,
        )
        fig.add_scatter(
            x=bench_t,
            y=[bench[t][index] for t in bench_t],
            mode="lines+markers",
            name="repository benchmark (3 prompts × 128 tokens)",
            legendgroup="bench",
            showlegend=col == 1,
            line=dict(color=OTHER_COLOR, dash="dot"),
            marker=dict(color=OTHER_COLOR, size=8),
            row=1,
            col=col,
        )
    low, high = SEED_ALPHA_RANGE
    fig.add_hrect(
        y0=low,
        y1=high,
        fillcolor=SEED_COLOR,
        opacity=0.12,
        line_width=0,
        row=1,
        col=1,
        annotation_text=f"seed's pair on code: α {low:g}-{high:g}",
        annotation_position="bottom left",
    )
    if k in SEED_POINTS:
        fig.add_scatter(
            x=[0.7],
            y=[SEED_POINTS[k][1]],
            mode="markers",
            name=f"seed article, T = 0.7, k = {k}",
            marker=dict(color=SEED_COLOR, size=11, symbol="x"),
            row=1,
            col=2,
        )
    fig.add_hline(y=1, line_dash="dash", line_color=OTHER_COLOR, row=1, col=2)
    fig.update_xaxes(title="temperature", tickvals=temperatures)
    fig.update_yaxes(range=[0, 1], row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    fig.update_layout(
        title=f"Tiny pair, k = {k}: α and speed-up against the temperature",
        height=430,
        margin=dict(l=10, r=10, t=80, b=40),
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def verify_cost_figure(
    measured: dict[int, float], title: str, benches: dict[str, dict[int, float]] | None = None
) -> go.Figure:
    """The time of one target pass over n tokens divided by one decode step, against n.
    measured: n -> that ratio here; benches: label -> the same from the repository's benchmarks
    (the tiny pair's and SmolLM2's by default); the dashed line at 1 is what Theorem 3.8 assumes."""
    benches = (
        {
            "tiny, repository benchmark": BENCH_TINY_VERIFY_COST,
            "SmolLM2-135M, repository benchmark": BENCH_SMOLLM2_VERIFY_COST,
        }
        if benches is None
        else benches
    )
    fig = go.Figure()
    ns = sorted(measured)
    fig.add_scatter(
        x=ns,
        y=[measured[n] for n in ns],
        mode="lines+markers+text",
        name="measured here",
        text=[f"{measured[n]:.2f}" for n in ns],
        textposition="top left",
        marker=dict(color=MEASURED_COLOR, size=10, symbol="diamond"),
    )
    for (label, points), dash in zip(benches.items(), ("dot", "dashdot", "longdash")):
        xs = sorted(points)
        fig.add_scatter(
            x=xs,
            y=[points[n] for n in xs],
            mode="lines+markers",
            name=label,
            line=dict(color=OTHER_COLOR, dash=dash),
            marker=dict(color=OTHER_COLOR, size=7),
        )
    top = max(ns + [max(p) for p in benches.values()])
    fig.add_scatter(
        x=[1, top],
        y=[1, 1],
        mode="lines",
        name="Theorem 3.8's assumption: as cheap as one step",
        line=dict(color=SEED_COLOR, dash="dash"),
    )
    fig.update_layout(
        title=title, height=430, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25)
    )
    fig.update_xaxes(title="tokens verified in one target pass (k + 1)", tickvals=ns)
    fig.update_yaxes(title="time / one decode step", rangemode="tozero")
    return fig


__all__ = [
    "speculative_explorer",
    "tvd_bars_figure",
    "temperature_figure",
    "verify_cost_figure",
    "SEED_POINTS",
    "SEED_ALPHA_RANGE",
    "SEED_DRAFT_COST",
    "BENCH_TINY_BY_TEMPERATURE",
    "BENCH_TINY_VERIFY_COST",
    "BENCH_SMOLLM2_VERIFY_COST",
]

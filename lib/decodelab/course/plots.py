"""Plotly figures the notebooks draw: next-token bars, decode speed against the bandwidth bound,
and the sampling experiments. Each function returns a `go.Figure` (or fills a FigureWidget);
the numbers are computed by the caller, with the learner's functions where there are some.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

SEED_COLOR, MEASURED_COLOR, OTHER_COLOR = "#d62728", "#1f77b4", "#7f7f7f"


def token_label(text: str) -> str:
    """A token as it reads on an axis: a leading space as '␣', a newline as '⏎'."""
    return text.replace(" ", "\u2423").replace("\n", "\u23ce") or "\u2205"


def next_token_bars(tokens: list[str], probabilities: list[float], title: str) -> go.Figure:
    """Horizontal bars, most likely token on top."""
    labels = [f"{i + 1}. {token_label(t)}" for i, t in enumerate(tokens)]
    fig = go.Figure(
        go.Bar(
            x=probabilities[::-1],
            y=labels[::-1],
            orientation="h",
            marker_color=MEASURED_COLOR,
            text=[f"{p:.1%}" for p in probabilities[::-1]],
            textposition="outside",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="probability",
        height=60 + 32 * len(tokens),
        margin=dict(l=10, r=40, t=50, b=40),
        xaxis_range=[0, min(1.0, max(probabilities) * 1.25)],
    )
    return fig


def add_seed_and_measured_points(fig, points: list[dict], x_key: str, y_key: str, textposition: str) -> None:
    """One labelled marker trace for the seed's figures and one for this machine's measurements.

    points: dicts with "kind" ("seed" or "measured"), "name", x_key, y_key and optionally
    "textposition" (default `textposition`)."""
    for kind, color, symbol in (("seed", SEED_COLOR, "diamond"), ("measured", MEASURED_COLOR, "circle")):
        chosen = [p for p in points if p["kind"] == kind]
        if chosen:
            fig.add_scatter(
                x=[p[x_key] for p in chosen],
                y=[p[y_key] for p in chosen],
                mode="markers+text",
                text=[p["name"] for p in chosen],
                textposition=[p.get("textposition", textposition) for p in chosen],
                marker=dict(size=11, color=color, symbol=symbol),
                name="seed's figure" if kind == "seed" else "measured here",
            )


def log_range(low: float, high: float, num: int) -> list[float]:
    return [low * (high / low) ** (i / (num - 1)) for i in range(num)]


def decode_bound_figure(bound_fn, bandwidths: dict[str, float], points: list[dict], title: str) -> go.Figure:
    """Tokens/s against gigabytes read per token, log-log.

    bandwidths: name -> bytes/s; each becomes the line bound_fn(bytes, 1, bandwidth) (a roof).
    points: dicts with gb_per_token, tokens_per_s, name, kind ("seed" or "measured") and
    optionally textposition (where the name goes: "top left", ...).
    """
    gigabytes = log_range(1e-3, 1e3, 61)
    fig = go.Figure()
    dashes = ["solid", "dash", "dot", "dashdot"]
    for i, (name, bandwidth) in enumerate(bandwidths.items()):
        fig.add_scatter(
            x=gigabytes,
            y=[bound_fn(gb * 1e9, 1, bandwidth) for gb in gigabytes],
            mode="lines",
            name=f"bound: {name}",
            line=dict(dash=dashes[i % len(dashes)], color=MEASURED_COLOR if "measured" in name else OTHER_COLOR),
        )
    add_seed_and_measured_points(fig, points, "gb_per_token", "tokens_per_s", "top right")
    fig.update_layout(
        title=title, height=480, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.2)
    )
    fig.update_xaxes(type="log", title="gigabytes read per generated token (all weights, batch 1)")
    fig.update_yaxes(type="log", title="tokens per second")
    return fig


def distribution_bars(fig, tokens: list[str], exact: list[float], empirical: list[float] | None, title: str):
    """Exact probabilities and (optionally) drawn frequencies of the same tokens; fills `fig`
    (a go.Figure or go.FigureWidget) in place so that a widget redraws it."""
    labels = [token_label(t) for t in tokens]
    with fig.batch_update():
        fig.data[0].x, fig.data[0].y = labels, exact
        fig.data[1].x, fig.data[1].y = labels, empirical if empirical is not None else [0.0] * len(labels)
        fig.layout.title.text = title
    return fig


def distribution_figure(widget: bool = False, height: int = 420):
    """An empty two-bar figure for `distribution_bars`."""
    fig = (go.FigureWidget if widget else go.Figure)()
    fig.add_bar(name="exact probability", marker_color=OTHER_COLOR)
    fig.add_bar(name="drawn frequency", marker_color=MEASURED_COLOR)
    fig.update_layout(
        barmode="group",
        height=height,
        margin=dict(l=10, r=10, t=60, b=80),
        yaxis=dict(title="probability"),
        legend=dict(orientation="h", y=1.12, x=0.5),
    )
    return fig


def kept_tokens_figure(tokens: list[str], kept_top_p: list[int], top_k: int, p: float, title: str) -> go.Figure:
    """How many tokens top-p keeps at each step of a text, next to top-k's constant count."""
    steps = list(range(1, len(kept_top_p) + 1))
    labels = [token_label(t) for t in tokens]
    fig = go.Figure()
    fig.add_scatter(
        x=steps,
        y=kept_top_p,
        mode="lines+markers",
        name=f"top-p, p = {p}: cut by mass",
        text=labels,
        hovertemplate="step %{x}: next token %{text}<br>kept %{y}<extra></extra>",
        marker_color=MEASURED_COLOR,
    )
    fig.add_scatter(
        x=steps,
        y=[top_k] * len(steps),
        mode="lines",
        name=f"top-k, k = {top_k}: cut by count",
        line=dict(dash="dash", color=OTHER_COLOR),
    )
    fig.update_layout(
        title=title, height=420, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.2)
    )
    fig.update_xaxes(title="generation step")
    fig.update_yaxes(type="log", title="tokens kept (log scale)")
    return fig


def line_figure(
    x: list[float],
    series: dict[str, list[float]],
    title: str,
    xaxis_title: str,
    yaxis_title: str,
    log_x: bool = False,
    log_y: bool = False,
) -> go.Figure:
    fig = go.Figure()
    for name, y in series.items():
        fig.add_scatter(x=x, y=y, mode="lines+markers", name=name)
    fig.update_layout(
        title=title, height=400, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25)
    )
    fig.update_xaxes(title=xaxis_title, type="log" if log_x else None)
    fig.update_yaxes(title=yaxis_title, type="log" if log_y else None)
    return fig


def bar_figure(
    labels: list[str], values: list[float], title: str, yaxis_title: str, texts: list[str] | None = None
) -> go.Figure:
    """One bar per label, with an optional text on each bar."""
    fig = go.Figure(go.Bar(x=labels, y=values, text=texts, textposition="outside", marker_color=MEASURED_COLOR))
    fig.update_layout(
        title=title,
        height=380,
        margin=dict(l=10, r=10, t=60, b=40),
        yaxis=dict(title=yaxis_title, range=[0, max(1.0, max(values) * 1.3)]),
    )
    return fig


def si(value: float, unit: str = "") -> str:
    """3 significant digits with an SI prefix: si(3.35e12, 'B/s') -> '3.35 TB/s'."""
    if value == 0 or not math.isfinite(value):
        return f"{value} {unit}".strip()
    exponent = max(-4, min(4, int(math.floor(math.log10(abs(value)) / 3))))
    prefix = {-4: "p", -3: "n", -2: "\u00b5", -1: "m", 0: "", 1: "k", 2: "M", 3: "G", 4: "T"}[exponent]
    return f"{value / 1000**exponent:.3g} {prefix}{unit}".strip()

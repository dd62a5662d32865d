"""Figures and the roofline explorer of notebook 04 (prefill and decode).

The numbers are computed by the caller (with the learner's functions where there are some);
these functions only draw. The explorer follows widgets.py: an ipywidgets box with
``.figure`` (the FigureWidget), ``.controls`` (name -> widget) and ``.redraw()``.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR, add_seed_and_measured_points, log_range
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.lessons.measure import Roofline

# The seed's H100 figures (fp16 dense matrix units, HBM3): about 990 TFLOP/s and 3.35 TB/s.
H100_ROOF = Roofline(bandwidth=3.35e12, peak_flops=990e12)
INTENSITIES = log_range(0.05, 1e5, 61)  # FLOPs per byte, the roofline's x axis
PROMPT_LENGTHS = [2**i for i in range(14)]  # 1 ... 8192 tokens
_DASHES = ["solid", "dash", "dot", "dashdot"]


def _where(roof: Roofline, intensity: float) -> str:
    return "compute-bound" if intensity >= roof.ridge_intensity else "memory-bound"


def _add_roofs(fig, roofs: dict[str, Roofline]) -> None:
    for i, (name, roof) in enumerate(roofs.items()):
        color = MEASURED_COLOR if "this machine" in name else OTHER_COLOR
        fig.add_scatter(
            x=INTENSITIES,
            y=[roof.attainable_flops(x) for x in INTENSITIES],
            mode="lines",
            name=f"roof: {name} (ridge {roof.ridge_intensity:.3g} FLOP/B)",
            line=dict(dash=_DASHES[i % len(_DASHES)], color=color),
        )
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOPs per byte moved)")
    fig.update_yaxes(type="log", title="FLOP/s")
    fig.update_layout(height=500, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.2))


def roofline_figure(roofs: dict[str, Roofline], points: list[dict], title: str) -> go.Figure:
    """Roofs (name -> Roofline) as lines, min(peak, intensity x bandwidth), and points: dicts with
    intensity, flops_per_s, name and kind ("measured" or "seed"; optional textposition)."""
    fig = go.Figure()
    _add_roofs(fig, roofs)
    add_seed_and_measured_points(fig, points, "intensity", "flops_per_s", "top left")
    fig.update_layout(title=title)
    return fig


def speedup_figure(measured: dict[int, float], seed: dict[int, float], title: str) -> go.Figure:
    """Prefill's speed over one-by-one feeding (a ratio) against the prompt length: measured
    here and the seed's (prompt length -> ratio)."""
    fig = go.Figure()
    fig.add_scatter(
        x=list(measured),
        y=list(measured.values()),
        mode="lines+markers+text",
        name="measured here",
        text=[f"{r:.1f}x" for r in measured.values()],
        textposition="top left",
        marker=dict(size=10, color=MEASURED_COLOR),
    )
    fig.add_scatter(
        x=list(seed),
        y=list(seed.values()),
        mode="markers+text",
        name="seed (numpy, 2-core Xeon)",
        text=[f"{r:.1f}x" for r in seed.values()],
        textposition="bottom right",
        marker=dict(size=12, color=SEED_COLOR, symbol="diamond"),
    )
    fig.add_hline(y=1, line=dict(dash="dot", color=OTHER_COLOR))
    fig.update_layout(
        title=title, height=420, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25)
    )
    fig.update_xaxes(type="log", title="prompt length (tokens)")
    fig.update_yaxes(type="log", title="prefill tokens/s ÷ one-by-one tokens/s")
    return fig


def latency_figure(series: dict[str, tuple[float, list[float]]], title: str) -> go.Figure:
    """Per generated token, the wait for it: token 0 is the TTFT, then the inter-token latencies.
    series: name -> (ttft_s, itl_s)."""
    fig = go.Figure()
    for i, (name, (ttft, itl)) in enumerate(series.items()):
        waits = [1000 * t for t in [ttft, *itl]]
        fig.add_scatter(
            x=list(range(len(waits))),
            y=waits,
            mode="lines+markers",
            name=name,
            line=dict(dash=_DASHES[i % len(_DASHES)]),
        )
    fig.update_layout(
        title=title, height=420, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25)
    )
    fig.update_xaxes(title="generated token (0 = the first: its wait is the TTFT)")
    fig.update_yaxes(type="log", title="wait for this token (ms)")
    return fig


def timing_bars(groups: dict[str, dict[str, float]], title: str, yaxis_title: str = "milliseconds") -> go.Figure:
    """Grouped bars: group (e.g. "recompute") -> {series ("measured here", "seed"): value}."""
    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    fig = go.Figure()
    for name in series:
        values = [groups[g].get(name) for g in groups]
        fig.add_bar(
            x=list(groups),
            y=values,
            name=name,
            text=[f"{v:.3g}" if v is not None else "" for v in values],
            textposition="outside",
            marker_color=SEED_COLOR if "seed" in name else MEASURED_COLOR,
        )
    top = max(v for values in groups.values() for v in values.values())
    fig.update_layout(
        title=title,
        barmode="group",
        height=420,
        margin=dict(l=10, r=10, t=60, b=40),
        yaxis=dict(title=yaxis_title, range=[0, top * 1.25]),
        legend=dict(orientation="h", y=-0.2),
    )
    return fig


def roofline_explorer(
    intensity_fn,
    roofs: dict[str, Roofline],
    presets: list[str],
    dtypes=(("fp32 (4 B)", "fp32"), ("bf16 (2 B)", "bf16"), ("int8 (1 B)", "int8")),
):
    """Sliders for prompt length and batch size (and a model preset, a dtype) -> where a prefill and
    a decode step land on the roofline.

    intensity_fn(config, num_tokens, kv_len, bytes_per_param) -> FLOPs per byte (the learner's
    arithmetic_intensity). A prefill of B prompts of T tokens is one pass over B x T new tokens;
    a decode step after them is one pass over B new tokens with B x T cached. Each point sits on
    each roof at the FLOP/s that roof allows for its intensity.
    """
    length = widgets.SelectionSlider(
        options=PROMPT_LENGTHS, value=256, description="prompt length T (tokens)", **SLIDER
    )
    batch = widgets.SelectionSlider(
        options=[2**i for i in range(9)], value=1, description="batch B (requests)", **SLIDER
    )
    preset = widgets.Dropdown(options=list(presets), value=presets[0], description="model", **SLIDER)
    dtype = widgets.Dropdown(options=list(dtypes), value=dtypes[0][1], description="weights and K/V", **SLIDER)
    fig = go.FigureWidget()
    _add_roofs(fig, roofs)
    names = list(roofs)
    for phase, symbol in (("prefill", "circle"), ("decode step", "square")):
        fig.add_scatter(
            x=[1] * len(names),
            y=[1] * len(names),
            mode="markers+text",
            name=phase,
            text=[phase] * len(names),
            textposition="top left",
            marker=dict(size=13, symbol=symbol, color=SEED_COLOR if phase == "prefill" else MEASURED_COLOR),
        )
    prefill_dots, decode_dots = fig.data[-2], fig.data[-1]

    def redraw(*_):
        t, b = length.value, batch.value
        prefill_i = intensity_fn(preset.value, t * b, 0, dtype.value)
        decode_i = intensity_fn(preset.value, b, t * b, dtype.value)
        with fig.batch_update():
            prefill_dots.update(x=[prefill_i] * len(names), y=[roofs[n].attainable_flops(prefill_i) for n in names])
            decode_dots.update(x=[decode_i] * len(names), y=[roofs[n].attainable_flops(decode_i) for n in names])
            here = roofs[names[0]]
            fig.layout.title.text = (
                f"{preset.value}: prompt T = {t} tokens, batch B = {b}, {dtype.value}, on {names[0]}<br>"
                f"prefill {prefill_i:.3g} FLOP/B, {_where(here, prefill_i)} \u00b7 "
                f"decode {decode_i:.3g} FLOP/B, {_where(here, decode_i)}"
            )

    return finish_explorer(fig, {"length": length, "batch": batch, "preset": preset, "dtype": dtype}, redraw)


__all__ = ["H100_ROOF", "roofline_figure", "speedup_figure", "latency_figure", "timing_bars", "roofline_explorer"]

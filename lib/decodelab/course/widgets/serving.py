"""Notebook 14's figure and explorer: each request of a load run as a bar on a timeline.

A request's bar is grey from the moment it was sent to its first token (the TTFT: waiting for
the queue and its prefill) and blue from its first to its last token (streaming, TPOT per gap).
The explorer switches between load runs (one per engine setting) measured by the notebook; it runs
nothing itself, so moving it is instant and shows exactly what was measured.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.lessons.serving import serving_metrics


def _bars(records):
    """(waits, streams): per request i, (i, start, length) of its grey and blue bars, in seconds
    from the run's first send; a request without tokens has a grey bar to the last token seen."""
    if not records:
        return [], []
    start = min(sent for sent, _ in records)
    end = max([t[-1] for _, t in records if t] or [start])
    waits, streams = [], []
    for i, (sent, times) in enumerate(records):
        first = times[0] if times else end
        waits.append((i, sent - start, first - sent))
        if len(times) > 1:
            streams.append((i, first - start, times[-1] - first))
    return waits, streams


def draw_timeline(fig, records, title: str) -> None:
    """Redraw fig (a Figure or FigureWidget) with the requests of one load run: records as
    `serving_metrics` takes them, (sent_at, token_times) per request."""
    waits, streams = _bars(records)
    with fig.batch_update() if isinstance(fig, go.FigureWidget) else _nothing():
        fig.data = []
        for bars, color, name in (
            (waits, OTHER_COLOR, "waiting: sent -> first token"),
            (streams, MEASURED_COLOR, "streaming"),
        ):
            fig.add_trace(
                go.Bar(
                    y=[i for i, _, _ in bars],
                    base=[b for _, b, _ in bars],
                    x=[w for _, _, w in bars],
                    orientation="h",
                    marker_color=color,
                    name=name,
                )
            )
        fig.update_layout(
            title=title,
            barmode="overlay",
            xaxis_title="seconds since the first request was sent",
            yaxis_title="request (in order sent)",
            yaxis_autorange="reversed",
            height=420,
        )


def timeline_figure(records, title: str) -> go.Figure:
    """A static figure of one load run's requests (records as `serving_metrics` takes them)."""
    fig = go.Figure()
    draw_timeline(fig, records, title)
    return fig


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def load_explorer(runs: dict, duration_of: dict, ttft_slo: float, tpot_slo: float):
    """runs: a label ("max_num_seqs 8, chunked prefill") -> that run's records; duration_of: label ->
    its duration in seconds. A slider picks the run; the title gives its p99 TTFT, p99 TPOT and
    goodput under the SLO (computed by the library's `serving_metrics`)."""
    if not runs:
        raise ValueError("load_explorer needs at least one run")
    fig = go.FigureWidget()
    controls = {"run": widgets.SelectionSlider(options=list(runs), description="engine setting", **SLIDER)}

    def redraw(*_):
        label = controls["run"].value
        m = serving_metrics(runs[label], duration_of[label], ttft_slo, tpot_slo)
        p99 = m["tpot_p99"]
        tpot = "n/a" if p99 is None else f"{1000 * p99:.0f} ms"
        draw_timeline(
            fig,
            runs[label],
            f"{label}: p99 TTFT {1000 * (m['ttft_p99'] or 0):.0f} ms, p99 TPOT {tpot}, "
            f"goodput {m['goodput']:.2f} req/s",
        )

    return finish_explorer(fig, controls, redraw)

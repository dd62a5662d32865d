"""Figures and the explorer of notebook 08 (continuous batching): slot occupancy over time, the
batch-size trade-off, a scheduler trace, an arrival-rate slider over static vs continuous, and
the stall a long prompt causes with and without chunked prefill.

Every figure takes results computed by the caller (`decodelab.lessons.continuous_batching` with the learner's
scheduler); the explorer runs `batching_sim.simulate` itself with the scheduler class it is given.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.lessons.chunked_prefill import StallResult
from decodelab.lessons.continuous_batching import POLICIES, BatchingResult, StepCost, mixed_workload, simulate

POLICY_COLORS = {"continuous": MEASURED_COLOR, "static": SEED_COLOR}


def _occupancy_xy(result: BatchingResult):
    """A step line: slots in use from each step's start to its end, 0 while idle."""
    xs, ys, end = [], [], None
    for step in result.steps:
        if end is not None and step.start > end + 1e-12:
            xs += [end, step.start]
            ys += [0, 0]
        xs += [step.start, step.start + step.seconds]
        ys += [step.num_running, step.num_running]
        end = step.start + step.seconds
    return xs, ys


def _add_occupancy(fig, results: dict[str, BatchingResult], **where):
    for name, result in results.items():
        xs, ys = _occupancy_xy(result)
        policy = result.policy
        fig.add_scatter(
            x=xs,
            y=ys,
            mode="lines",
            name=f"{name}: {100 * result.occupancy:.0f}% of slots in use",
            line=dict(
                color=POLICY_COLORS.get(policy, OTHER_COLOR),
                width=1.5,
                dash="solid" if policy == "continuous" else "dot",
            ),
            **where,
        )


def occupancy_figure(results: dict[str, BatchingResult], title: str, max_num_seqs: int | None = None) -> go.Figure:
    """Slots in use over time, one line per run (name -> result)."""
    fig = go.Figure()
    _add_occupancy(fig, results)
    top = max_num_seqs or max(r.max_num_seqs for r in results.values())
    fig.update_layout(
        title=title, height=420, margin=dict(l=10, r=10, t=70, b=40), legend=dict(orientation="h", y=-0.22)
    )
    fig.update_xaxes(title="time (s)")
    fig.update_yaxes(title=f"sequences running (of {top} slots)", range=[0, top + 0.5])
    return fig


def stall_figure(results: dict[str, StallResult], title: str) -> go.Figure:
    """Left: every inter-token gap of the running requests against when its token came (ms after
    the newcomer arrived), one colour per engine, the newcomer's first token a dashed line. Right:
    p50 and p99 of those gaps and the newcomer's TTFT, side by side per engine."""
    colors = [SEED_COLOR, MEASURED_COLOR, OTHER_COLOR]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.6, 0.4],
        horizontal_spacing=0.1,
        subplot_titles=["running requests: gap before each token", "p50 / p99 gap and TTFT"],
    )
    metrics = ["ITL p50", "ITL p99", "newcomer TTFT"]
    for (label, result), color in zip(results.items(), colors):
        points = [(1000 * b, 1000 * (b - a)) for times in result.token_times for a, b in zip(times, times[1:]) if b > 0]
        fig.add_scatter(
            x=[x for x, _ in points],
            y=[y for _, y in points],
            mode="markers",
            name=label,
            legendgroup=label,
            marker=dict(color=color, size=6, opacity=0.7),
            row=1,
            col=1,
        )
        fig.add_vline(x=1000 * result.ttft, line=dict(color=color, dash="dash", width=1), row=1, col=1)
        values = [1000 * result.itl_p50, 1000 * result.itl_p99, 1000 * result.ttft]
        fig.add_bar(
            x=metrics,
            y=values,
            name=label,
            legendgroup=label,
            showlegend=False,
            marker_color=color,
            text=[f"{v:.0f}" for v in values],
            textposition="outside",
            row=1,
            col=2,
        )
    fig.update_layout(
        title=title,
        height=460,
        barmode="group",
        margin=dict(l=10, r=10, t=90, b=40),
        legend=dict(orientation="h", y=-0.18),
    )
    fig.update_xaxes(title="ms after the newcomer arrived (dashed: its first token)", row=1, col=1)
    fig.update_yaxes(title="ms since the previous token", row=1, col=1)
    fig.update_yaxes(title="ms", row=1, col=2)
    return fig


def batch_tradeoff_figure(step_seconds: dict[int, float], cost: StepCost, title: str) -> go.Figure:
    """Measured decode steps: tokens per second (left axis) and ms per step (right axis) vs batch size,
    with the fitted line fixed_s + per_seq_s * batch dashed."""
    sizes = list(step_seconds)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_scatter(
        x=sizes,
        y=[b / step_seconds[b] for b in sizes],
        mode="lines+markers",
        name="throughput: tokens per second (all requests)",
        line=dict(color=MEASURED_COLOR),
    )
    fig.add_scatter(
        x=sizes,
        y=[1000 * step_seconds[b] for b in sizes],
        mode="lines+markers",
        name="latency: ms per step (each request waits this per token)",
        line=dict(color=SEED_COLOR),
        secondary_y=True,
    )
    fig.add_scatter(
        x=sizes,
        y=[1000 * cost(b) for b in sizes],
        mode="lines",
        line=dict(color=SEED_COLOR, dash="dash"),
        name=f"fit: {1000 * cost.fixed_s:.3g} ms + {1000 * cost.per_seq_s:.3g} ms x batch",
        secondary_y=True,
    )
    fig.update_layout(
        title=title, height=430, margin=dict(l=10, r=10, t=80, b=40), legend=dict(orientation="h", y=-0.25)
    )
    fig.update_xaxes(title="batch size (sequences decoded together)", type="log", tickvals=sizes)
    fig.update_yaxes(title="tokens per second", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title="ms per decode step", rangemode="tozero", secondary_y=True)
    return fig


def trace_figure(result: BatchingResult, num_blocks: int, title: str) -> go.Figure:
    """Per step: sequences running and waiting, free KV blocks, preemptions so far."""
    steps = list(range(1, len(result.steps) + 1))
    fig = go.Figure()
    fig.add_scatter(
        x=steps,
        y=[s.num_running for s in result.steps],
        name="running",
        mode="lines+markers",
        line=dict(color=MEASURED_COLOR, shape="hv"),
    )
    fig.add_scatter(
        x=steps,
        y=[s.num_waiting for s in result.steps],
        name="waiting",
        mode="lines+markers",
        line=dict(color=OTHER_COLOR, shape="hv"),
    )
    fig.add_scatter(
        x=steps,
        y=[s.num_free_blocks for s in result.steps],
        name=f"free blocks (of {num_blocks})",
        mode="lines",
        line=dict(color="#2ca02c", shape="hv", dash="dot"),
    )
    fig.add_scatter(
        x=steps,
        y=[s.num_preemptions for s in result.steps],
        name="preemptions so far",
        mode="lines",
        line=dict(color=SEED_COLOR, shape="hv"),
    )
    prefill = [i for i, s in zip(steps, result.steps) if s.is_prefill]
    fig.add_scatter(
        x=prefill,
        y=[0] * len(prefill),
        mode="markers",
        name="prefill step (admissions)",
        marker=dict(symbol="triangle-up", size=10, color="#9467bd"),
    )
    fig.update_layout(
        title=title, height=400, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25)
    )
    fig.update_xaxes(title="engine step")
    fig.update_yaxes(title="count")
    return fig


def batching_explorer(
    scheduler_cls,
    cost: StepCost,
    num_requests: int = 48,
    max_num_seqs: int = 8,
    output_lens=(16, 128),
    prompt_lens=(16, 128),
    seed: int = 0,
):
    """Sliders: arrival rate (first) and max_num_seqs -> static vs continuous batching of a mixed
    workload, simulated with scheduler_cls at the given step cost: slots in use over time (left)
    and mean latency / time to first token per policy (right)."""
    saturation = max_num_seqs / (cost(max_num_seqs) * sum(output_lens) / 2)  # requests/s a full batch serves
    rate = widgets.FloatLogSlider(
        value=saturation,
        base=10,
        min=-1,
        max=3,
        step=0.05,
        description="arrival rate (requests/s)",
        readout_format=".3g",
        **SLIDER,
    )
    slots = widgets.IntSlider(value=max_num_seqs, min=1, max=32, description="max_num_seqs (slots)", **SLIDER)
    fig = go.FigureWidget(
        make_subplots(
            rows=1,
            cols=2,
            column_widths=[0.66, 0.34],
            horizontal_spacing=0.1,
            subplot_titles=("slots in use over time", "per request (mean)"),
        )
    )
    for policy in POLICIES:
        fig.add_scatter(
            x=[0],
            y=[0],
            mode="lines",
            name=policy,
            row=1,
            col=1,
            line=dict(color=POLICY_COLORS[policy], width=1.5, dash="solid" if policy == "continuous" else "dot"),
        )
    bar_x = [0, 1]  # numbers, labelled on the axis: categories can be lost when a FigureWidget restyles
    for policy in POLICIES:
        fig.add_bar(
            x=bar_x,
            y=[0, 0],
            name=f"{policy} (s)",
            row=1,
            col=2,
            marker_color=POLICY_COLORS[policy],
            showlegend=False,
            textposition="outside",
        )
    fig.update_layout(
        height=520,
        margin=dict(l=10, r=10, t=150, b=40),
        legend=dict(orientation="h", y=-0.2),
        barmode="group",
        title=dict(y=0.96, yanchor="top"),
    )
    fig.update_xaxes(tickvals=bar_x, ticktext=["latency", "time to first token"], row=1, col=2)
    fig.update_xaxes(title="time (s)", row=1, col=1)
    fig.update_yaxes(title="sequences running", row=1, col=1)
    fig.update_yaxes(title="seconds", row=1, col=2)

    def redraw(*_):
        workload = mixed_workload(num_requests, rate.value, prompt_lens, output_lens, seed)
        results = {p: simulate(workload, p, scheduler_cls, max_num_seqs=slots.value, cost=cost) for p in POLICIES}
        with fig.batch_update():
            for trace, policy in zip(fig.data[:2], POLICIES):
                xs, ys = _occupancy_xy(results[policy])
                trace.update(x=xs, y=ys, name=f"{policy}: {100 * results[policy].occupancy:.0f}% of slots in use")
            for trace, policy in zip(fig.data[2:], POLICIES):  # x too: a batch must set what every trace carries
                trace.update(
                    x=bar_x, y=[results[policy].mean_latency, results[policy].mean_ttft], text=[policy, policy]
                )
            fig.update_yaxes(range=[0, slots.value + 0.5], row=1, col=1)
            c, s = results["continuous"], results["static"]
            fig.layout.title.text = (
                f"arrival rate {rate.value:.3g} requests/s, {slots.value} slots, {num_requests} requests<br>"
                f"continuous: {c.throughput:.0f} tokens/s, mean latency {c.mean_latency:.2f} s<br>"
                f"static: {s.throughput:.0f} tokens/s, mean latency {s.mean_latency:.2f} s"
            )

    return finish_explorer(fig, {"arrival_rate": rate, "max_num_seqs": slots}, redraw)


__all__ = ["occupancy_figure", "batch_tradeoff_figure", "trace_figure", "batching_explorer", "POLICY_COLORS"]

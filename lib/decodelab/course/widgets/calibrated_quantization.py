"""Notebook 13's measurements and figures: a model calibrated by RTN, AWQ or GPTQ (the learner's search and
GPTQ where they pass a probe), scored on held-out text, and the sweep over bits, group size and method.

A measured row: {"method", "bits", "group_size", "perplexity", "ppl_change_pct", "greedy_same" (tokens equal
to float32's before the first difference, summed over the prompts), "greedy_tokens", "linear_bytes",
"bytes_vs_fp32", "seconds" (calibration)}.
"""

from __future__ import annotations

import copy

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.decoding.generate import stream_token_ids
from decodelab.lessons.perplexity import perplexity
from decodelab.model.calibration import apply_layers, calibrate_model
from decodelab.params import SamplingParams

METHOD_COLORS = {"float32": "#7f7f7f", "rtn": "#d62728", "awq": "#2ca02c", "gptq": "#1f77b4", "awq+gptq": "#9467bd"}


def float_linear_bytes(model) -> int:
    """Bytes of the decoder layers' float linears (the lm_head / embedding is never quantized here)."""
    return sum(m.weight.nbytes for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))


def greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    return [list(stream_token_ids(model, p, params)) for p in prompts]


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def float_row(model, heldout_ids: list[int], prompts: list[list[int]], num_tokens: int, window: int) -> dict:
    """The float32 model's row, with its greedy tokens (the reference the quantized rows are held to)."""
    return {
        "method": "float32",
        "perplexity": perplexity(model, heldout_ids, window=window, stride=window // 2),
        "linear_bytes": float_linear_bytes(model),
        "greedy": greedy(model, prompts, num_tokens),
    }


def measure(
    model,
    calibration_ids,
    heldout_ids,
    prompts,
    reference: dict,
    method: str,
    bits: int,
    group_size: int,
    window: int,
    awq_rows: int = 256,
    **implementations,
) -> dict:
    """Calibrate a copy's layers by `method` (implementations: awq_search, gptq_layer, as `calibrate_model`
    takes them), score it on the held-out ids and the prompts; the row described in the module docstring."""
    made = calibrate_model(model, calibration_ids, method, bits, group_size, awq_rows=awq_rows, **implementations)
    quantized = apply_layers(copy.deepcopy(model), made.layers)
    ppl = perplexity(quantized, heldout_ids, window=window, stride=window // 2)
    tokens = greedy(quantized, prompts, len(reference["greedy"][0]))
    return {
        "method": method,
        "bits": bits,
        "group_size": group_size,
        "perplexity": ppl,
        "ppl_change_pct": 100 * (ppl / reference["perplexity"] - 1),
        "greedy_same": sum(same_prefix(a, b) for a, b in zip(tokens, reference["greedy"])),
        "greedy_tokens": sum(len(t) for t in reference["greedy"]),
        "linear_bytes": made.nbytes,
        "bytes_vs_fp32": made.nbytes / reference["linear_bytes"],
        "seconds": made.seconds,
    }


def print_table(label: str, rows: list[dict], reference: dict) -> None:
    print(
        f"{label}: float32 perplexity {reference['perplexity']:.3f}, decoder linears {reference['linear_bytes'] / 1e6:.2f} MB"
    )
    print(
        f"{'setting':>10} {'method':>8} {'perplexity':>10} {'change':>8} {'greedy = fp32':>14} {'MB':>7} "
        f"{'of fp32':>8} {'calib s':>8}"
    )
    for r in rows:
        print(
            f"{'int%d-g%d' % (r['bits'], r['group_size']):>10} {r['method']:>8} {r['perplexity']:>10.3f} "
            f"{r['ppl_change_pct']:>+7.2f}% {str(r['greedy_same']) + '/' + str(r['greedy_tokens']):>14} "
            f"{r['linear_bytes'] / 1e6:>7.2f} {r['bytes_vs_fp32']:>8.3f} {r['seconds']:>8.2f}"
        )


def results_figure(rows: list[dict], reference: dict, title: str) -> go.Figure:
    """Perplexity by setting, one bar per method, float32 as a dashed line."""
    fig = go.Figure()
    settings = list(dict.fromkeys(f"int{r['bits']} g{r['group_size']}" for r in rows))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = {f"int{r['bits']} g{r['group_size']}": r for r in rows if r["method"] == method}
        fig.add_bar(
            name=method,
            x=settings,
            y=[mine[s]["perplexity"] if s in mine else None for s in settings],
            marker_color=METHOD_COLORS.get(method),
        )
    fig.add_hline(y=reference["perplexity"], line_dash="dash", annotation_text="float32")
    fig.update_layout(title=title, barmode="group", yaxis_title="held-out perplexity (lower is better)", height=400)
    return fig


def outlier_figure(stats: dict, threshold: float) -> go.Figure:
    """Per decoder linear: the largest |x| of its inputs, and how many input dims exceed the threshold."""
    names = list(stats)
    short = [n.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "") for n in names]
    largest = [float(stats[n].max_abs[0]) if len(stats[n].dims) else 0.0 for n in names]
    fig = go.Figure()
    fig.add_bar(x=short, y=[len(stats[n].dims) for n in names], name=f"input dims with |x| > {threshold:g}")
    fig.add_scatter(x=short, y=largest, name="largest |x|", yaxis="y2", mode="markers", marker=dict(size=9))
    fig.update_layout(
        title="Activation outliers per linear: how many dims, how large",
        height=420,
        yaxis=dict(title="dims above the threshold"),
        yaxis2=dict(title="largest |x|", overlaying="y", side="right", type="log"),
        legend=dict(orientation="h", y=-0.35),
    )
    return fig


def sweep_explorer(measure_setting, reference: dict, cache: dict):
    """Sliders for bits, group size and method -> bytes and perplexity of the whole model, every setting
    measured so far on one bytes-vs-perplexity plot. measure_setting(method, bits, group_size) -> a row;
    rows are kept in `cache` by (method, bits, group_size), so each is measured once (those the table
    measured are there already)."""
    bits = widgets.SelectionSlider(options=[3, 4, 8], value=3, description="bits per weight", **SLIDER)
    group = widgets.SelectionSlider(options=[32, 64, 128], value=128, description="group size", **SLIDER)
    method = widgets.SelectionSlider(options=["rtn", "awq", "gptq"], value="gptq", description="method", **SLIDER)
    fig = go.FigureWidget()
    mb = reference["linear_bytes"] / 1e6
    fig.add_scatter(
        x=[mb],
        y=[reference["perplexity"]],
        mode="markers+text",
        text=["float32"],
        textposition="top center",
        marker=dict(size=12, color=METHOD_COLORS["float32"]),
        name="float32",
    )
    for name in ("rtn", "awq", "gptq"):
        fig.add_scatter(x=[], y=[], mode="markers", marker=dict(size=10, color=METHOD_COLORS[name]), name=name)
    fig.add_scatter(
        x=[], y=[], mode="markers", marker=dict(size=20, symbol="diamond-open", color="black"), name="current setting"
    )
    fig.update_layout(height=460, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title="bytes of the decoder-layer weights (MB)", type="log")
    fig.update_yaxes(title="held-out perplexity (lower is better)")

    def redraw(*_):
        key = (method.value, bits.value, group.value)
        if key not in cache:
            cache[key] = measure_setting(*key)
        row = cache[key]
        for i, name in enumerate(("rtn", "awq", "gptq"), start=1):
            mine = sorted((r for k, r in cache.items() if k[0] == name), key=lambda r: r["linear_bytes"])
            with fig.batch_update():
                fig.data[i].update(
                    x=[r["linear_bytes"] / 1e6 for r in mine],
                    y=[r["perplexity"] for r in mine],
                    text=[f"int{r['bits']} g{r['group_size']}" for r in mine],
                )
        with fig.batch_update():
            fig.data[4].update(x=[row["linear_bytes"] / 1e6], y=[row["perplexity"]])
            fig.layout.title.text = (
                f"{row['method']} int{row['bits']} g{row['group_size']}: {row['bytes_vs_fp32']:.3f} of the float32 bytes, "
                f"perplexity {row['perplexity']:.3f} (float32 {reference['perplexity']:.3f})<br>greedy tokens equal "
                f"to float32: {row['greedy_same']}/{row['greedy_tokens']}, calibration {row['seconds']:.1f} s"
            )

    return finish_explorer(fig, {"bits": bits, "group": group, "method": method}, redraw)


__all__ = [
    "float_linear_bytes",
    "float_row",
    "greedy",
    "measure",
    "outlier_figure",
    "print_table",
    "results_figure",
    "same_prefix",
    "sweep_explorer",
]

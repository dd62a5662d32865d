"""Notebook 01 (the forward pass): your decoder layers against the library's, layer by layer, and
the RoPE explorer (what rotating by position does to an attention score).

Everything takes the functions to run as arguments (the learner's own, or the library's
reference while an exercise is unfinished), so the plots show the code the exercises build.
"""

from __future__ import annotations

import functools

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.model.kv_cache import KVCache

# The seed article's numpy Transformer gave the same 96 greedy characters with and without its KV
# cache, logits apart by at most 2.86e-6: float32 rounding, the size of difference to expect
# between two correct float32 implementations of one model (SmolLM2's logits are ~10x larger).
SEED_MAX_LOGIT_DIFF = 2.86e-6


@torch.inference_mode()
def layer_by_layer(model, input_ids: torch.Tensor, layer_fn, attention_fn) -> dict[str, list[float]]:
    """Run `layer_fn` (a `decoder_layer`: weights, config, layer_index, x, positions, attend) over
    the model's state dict beside the library's own layers on input_ids [1, T], each decoder
    layer fed the SAME input (the library's), so a difference shows where it enters, not how it
    adds up. attend is `attention_fn` over a fresh KVCache.

    Returns per layer: "library_rms" and "yours_rms" (root mean square of the residual stream
    after the layer), "library_max" (its largest |entry|) and "max_diff" (largest
    |yours - library| in it)."""
    config, weights = model.config, model.state_dict()
    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _inputs, out: captured.append(out)) for layer in model.model.layers]
    try:
        model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    cache = KVCache(config, input_ids.shape[0], input_ids.shape[1], device=input_ids.device, dtype=model.dtype)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    x = model.model.embed_tokens(input_ids)  # [1, T, E]
    result: dict[str, list[float]] = {"library_rms": [], "yours_rms": [], "library_max": [], "max_diff": []}
    for i, library_out in enumerate(captured):
        yours = layer_fn(weights, config, i, x, positions, functools.partial(attention_fn, cache))
        result["library_rms"].append(library_out.float().pow(2).mean().sqrt().item())
        result["yours_rms"].append(yours.float().pow(2).mean().sqrt().item())
        result["library_max"].append(library_out.abs().max().item())
        result["max_diff"].append(max((yours - library_out).abs().max().item(), 1e-9))
        x = library_out
    return result


def layers_figure(result: dict[str, list[float]], logit_diff: float) -> go.Figure:
    """Two panels over the layers: the size of the residual stream (yours and the library's) and
    the largest difference after each layer, beside the final logits' and the seed's figure."""
    layers = list(range(len(result["max_diff"])))
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.12,
        subplot_titles=("RMS of the residual stream after each layer", "largest |yours - library| after each layer"),
    )
    fig.add_scatter(
        x=layers,
        y=result["library_rms"],
        name="library",
        mode="lines",  # a band under yours
        line=dict(color=OTHER_COLOR, width=8),
        opacity=0.4,
        row=1,
        col=1,
    )
    fig.add_scatter(
        x=layers,
        y=result["yours_rms"],
        name="yours",
        mode="lines+markers",
        line=dict(color=MEASURED_COLOR),
        row=1,
        col=1,
    )
    fig.add_scatter(
        x=layers,
        y=result["max_diff"],
        name="yours - library, per layer",
        mode="lines+markers",
        line=dict(color=MEASURED_COLOR),
        row=1,
        col=2,
    )
    fig.add_scatter(
        x=[layers[0], layers[-1]],
        y=[logit_diff] * 2,
        name="your final logits - library's",
        mode="lines",
        line=dict(color=MEASURED_COLOR, dash="dot"),
        row=1,
        col=2,
    )
    fig.add_scatter(
        x=[layers[0], layers[-1]],
        y=[SEED_MAX_LOGIT_DIFF] * 2,
        name="seed: cache vs no cache",
        mode="lines",
        line=dict(color=SEED_COLOR, dash="dash"),
        row=1,
        col=2,
    )
    fig.update_xaxes(title="decoder layer")
    fig.update_yaxes(type="log", title="RMS", row=1, col=1)
    fig.update_yaxes(type="log", title="max |difference|", exponentformat="e", row=1, col=2)
    fig.update_layout(height=420, margin=dict(l=10, r=10, t=60, b=40), legend=dict(orientation="h", y=-0.25))
    return fig


@torch.inference_mode()
def rope_score_curve(
    rope_fn, head_dim: int, rope_theta: float, shift: int, distances: int, samples: int = 32, seed: int = 0
) -> list[float]:
    """The mean attention score of a vector with itself after RoPE, q at position shift + d and
    k at position shift, for d = 0 .. distances-1, relative to d = 0 (so 1 at d = 0).

    rope_fn(x [B, heads, T, D], positions [T], rope_theta) is the notebook's `rope`."""
    vectors = torch.randn(samples, head_dim, generator=torch.Generator().manual_seed(seed))  # [n, D]
    x = vectors[None, :, None, :].expand(1, samples, distances, head_dim).contiguous()  # [1, n, d, D]
    rotated = rope_fn(x, torch.arange(shift, shift + distances), rope_theta)  # [1, n, d, D]
    scores = (rotated * rotated[:, :, :1]).sum(-1)  # [1, n, d]: q at shift + d against k at shift
    return (scores[0] / vectors.pow(2).sum(-1, keepdim=True)).mean(0).tolist()


def rope_explorer(rope_fn, max_distance: int = 1024):
    """Sliders for rope_theta, head_dim and a shift of both positions -> the curve of
    `rope_score_curve` at that shift beside the one at shift 0 (they coincide: the score
    depends on the distance only)."""
    theta = widgets.FloatLogSlider(
        value=100000, base=10, min=2, max=6, step=0.1, description="rope_theta", readout_format=".3g", **SLIDER
    )
    head_dim = widgets.SelectionSlider(options=[8, 16, 32, 64, 128], value=64, description="head_dim D", **SLIDER)
    shift = widgets.IntSlider(value=3000, min=0, max=8000, step=100, description="both positions + shift", **SLIDER)
    fig = go.FigureWidget()
    distances = list(range(1, max_distance))  # d = 0 is the reference, 1, and has no place on a log axis
    fig.add_scatter(
        x=distances,
        y=[0.0] * len(distances),
        mode="lines",
        name="q at d, k at 0",  # a band under
        line=dict(color=OTHER_COLOR, width=8),
        opacity=0.4,
    )
    fig.add_scatter(
        x=distances,
        y=[0.0] * len(distances),
        mode="lines",
        name="q at shift + d, k at shift",
        line=dict(color=MEASURED_COLOR),
    )
    fig.update_layout(height=420, margin=dict(l=10, r=10, t=80, b=40), legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title="distance d = position of q - position of k", type="log")
    fig.update_yaxes(title="score(q, k) / score at d = 0", range=[-0.4, 1.05])

    def redraw(*_):
        shifted = rope_score_curve(rope_fn, head_dim.value, theta.value, shift.value, max_distance)
        at_zero = rope_score_curve(rope_fn, head_dim.value, theta.value, 0, max_distance)
        gap = max(abs(a - b) for a, b in zip(shifted, at_zero))
        with fig.batch_update():
            fig.data[0].y, fig.data[1].y = at_zero[1:], shifted[1:]
            fig.data[1].name = f"q at {shift.value} + d, k at {shift.value}"
            fig.layout.title.text = (
                f"RoPE, theta = {theta.value:.3g}, D = {head_dim.value}: the score falls and "
                f"wobbles with distance<br>shifting both positions by {shift.value} moves it "
                f"by at most {gap:.1e}"
            )

    return finish_explorer(fig, {"theta": theta, "head_dim": head_dim, "shift": shift}, redraw)

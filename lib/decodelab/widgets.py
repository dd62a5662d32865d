"""Interactive sweeps: ipywidgets sliders driving a plotly FigureWidget. The notebooks pass in
the functions to sweep (the learner's own, or the library's reference while an exercise is
unfinished), so the sliders run exactly the code the exercises build.

Each explorer returns an ipywidgets box with three extra attributes, so that code (and the
tests) can drive it without a browser: ``box.figure`` (the FigureWidget), ``box.controls``
(name -> widget) and ``box.redraw()``.
"""
from __future__ import annotations

import copy
import html

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from .params import SamplingParams
from .plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR, distribution_bars, distribution_figure, log_range, si

PRECISIONS = [("fp32 (4 B)", 4.0), ("fp16 (2 B)", 2.0), ("int8 (1 B)", 1.0), ("int4 (0.5 B)", 0.5)]
SEED_BANDWIDTHS = {"H100, 3.35 TB/s (seed)": 3.35e12, "2 TB/s (seed)": 2e12}
_SLIDER = dict(style={"description_width": "170px"}, layout=widgets.Layout(width="440px"))


def bake_current_state(fig) -> None:
    """Make a FigureWidget's current traces and layout the state its views start from.

    A FigureWidget sends each change as a one-off message that only views already on the page
    apply; its synced start state stays what it was constructed with. When a view is created
    after the first redraw (Run All on a busy kernel renders outputs late), it would draw that
    empty start state. Call this after the first redraw, before the widget is displayed.
    """
    fig._widget_data = copy.deepcopy(fig._data)
    fig._widget_layout = copy.deepcopy(fig._layout_obj._props)


def _finish(box, fig, controls, redraw):
    box.figure, box.controls, box.redraw = fig, controls, redraw
    redraw()
    bake_current_state(fig)
    return box


def decode_bound_explorer(bound_fn, references: dict[str, float] | None = None):
    """Sliders for model size, bytes per parameter and bandwidth -> the batch-1 decode bound.

    bound_fn(num_params, bytes_per_param, bandwidth_bytes_per_s) -> tokens/s. The plot shows
    the bound against bandwidth for every precision, the current choice as a dot, and a
    vertical line per reference bandwidth (name -> bytes/s).
    """
    references = dict(SEED_BANDWIDTHS if references is None else references)
    size = widgets.FloatLogSlider(value=70, base=10, min=-1, max=3, step=0.001, description="parameters (billions)",
                                  readout_format=".3g", **_SLIDER)
    precision = widgets.SelectionSlider(options=PRECISIONS, value=2.0, description="bytes per parameter", **_SLIDER)
    bandwidth = widgets.FloatLogSlider(value=3350, base=10, min=1, max=4, step=0.001, description="bandwidth (GB/s)",
                                       readout_format=".4g", **_SLIDER)
    gbps = log_range(10, 10_000, 41)
    fig = go.FigureWidget()
    for name, _ in PRECISIONS:
        fig.add_scatter(x=gbps, y=[1] * len(gbps), mode="lines", name=name)
    fig.add_scatter(x=[1], y=[1], mode="markers", marker=dict(size=14, color=SEED_COLOR), name="your choice")
    choice = fig.data[-1]
    by_bandwidth = sorted(references.items(), key=lambda item: item[1])
    for i, (name, bytes_per_s) in enumerate(by_bandwidth):  # vertical reference lines, as traces (log axes)
        fig.add_scatter(x=[bytes_per_s / 1e9] * 3, y=[1e-3, 1e5 / 10 ** i, 3e5], mode="lines+text", text=["", name, ""],
                        textposition="middle left", line=dict(dash="dot", color=OTHER_COLOR), showlegend=False)
    fig.update_layout(height=480, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(type="log", title="memory bandwidth (GB/s)")
    fig.update_yaxes(type="log", title="decode bound (tokens per second, batch 1)", range=[-3, 5.5])

    def redraw(*_):
        num_params = size.value * 1e9
        # One batch per kind of change: plotly merges a batch into one restyle, and traces that
        # do not set a property it carries (here x) would lose it.
        with fig.batch_update():
            for trace, (_, bytes_per_param) in zip(fig.data, PRECISIONS):
                trace.y = [bound_fn(num_params, bytes_per_param, g * 1e9) for g in gbps]
        tokens_per_s = bound_fn(num_params, precision.value, bandwidth.value * 1e9)
        with fig.batch_update():
            choice.update(x=[bandwidth.value], y=[tokens_per_s])
            fig.layout.title.text = (
                f"{size.value:.3g}B parameters x {precision.value:g} bytes = {si(num_params * precision.value, 'B')} "
                f"read per token<br>at {si(bandwidth.value * 1e9, 'B/s')}: {1000 / tokens_per_s:.3g} ms per token, "
                f"at most {tokens_per_s:.3g} tokens/s")

    for control in (size, precision, bandwidth):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.VBox([size, precision, bandwidth]), fig])
    return _finish(box, fig, {"size": size, "precision": precision, "bandwidth": bandwidth}, redraw)


def exact_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, fns) -> torch.Tensor:
    """The distribution sampling draws from, with the given functions: temperature, then top-k,
    then top-p, then softmax (float64). Temperature 0: a one-hot on the argmax (greedy)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).double()
    filtered = fns["temperature"](logits, temperature)
    if top_k >= 1:
        filtered = fns["top_k"](filtered, top_k)
    if top_p < 1:
        filtered = fns["top_p"](filtered, top_p)
    return filtered.double().softmax(dim=-1)


def sampling_explorer(logits: torch.Tensor, history: torch.Tensor, tokenizer, fns: dict, num_draws: int = 256,
                      shown: int = 20, generate_text=None, seed: int = 0):
    """Sliders T / k / p / penalty redraw the next-token distribution after a real prompt.

    logits [V]: the model's next-token logits; history [n]: the ids the repetition penalty
    sees. fns: "temperature", "top_k", "top_p", "repetition_penalty", "sample" (the library's
    signatures). Each redraw shows the exact probabilities of the `shown` most likely tokens
    next to the frequencies of `num_draws` draws made by fns["sample"]. generate_text(params)
    -> str, if given, backs a button that samples a whole reply with the same settings.
    """
    logits = logits.detach().float().cpu()
    history = history.detach().long().cpu()
    temperature = widgets.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.05, description="temperature (0 = greedy)",
                                      continuous_update=False, **_SLIDER)
    top_k = widgets.IntSlider(value=0, min=0, max=100, description="top-k (0 = off)", continuous_update=False, **_SLIDER)
    top_p = widgets.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top-p (1 = off)",
                                continuous_update=False, **_SLIDER)
    penalty = widgets.FloatSlider(value=1.0, min=1.0, max=3.0, step=0.1, description="repetition penalty",
                                  continuous_update=False, **_SLIDER)
    summary = widgets.HTML()
    fig = distribution_figure(widget=True)
    generator = torch.Generator().manual_seed(seed)

    def redraw(*_):
        x = logits
        if penalty.value != 1:
            x = fns["repetition_penalty"](x, history, penalty.value)
        exact = exact_distribution(x, temperature.value, top_k.value, top_p.value, fns)
        params = SamplingParams(temperature=temperature.value, top_k=top_k.value, top_p=top_p.value)
        ids = fns["sample"](x.expand(num_draws, -1).contiguous(), params, generator)
        drawn = torch.bincount(torch.as_tensor(ids).reshape(-1).long(), minlength=x.shape[-1]).double() / num_draws
        order = torch.argsort(exact * 1e6 + x.double().softmax(dim=-1), descending=True)[:shown]
        tokens = tokenizer.token_strings(order.tolist())
        kept = int((exact > 0).sum())
        outside = 1 - float(drawn[order].sum())
        distribution_bars(fig, tokens, exact[order].tolist(), drawn[order].tolist(),
                          f"T={temperature.value:g}, top-k={top_k.value or 'off'}, top-p={top_p.value:g}, "
                          f"penalty={penalty.value:g}: {kept:,} tokens can be drawn")
        fig.layout.yaxis.range = [0, min(1.0, 1.15 * max(float(exact[order].max()), float(drawn[order].max())))]
        summary.value = (f"most likely: <b>{html.escape(repr(tokens[0]))}</b> with p = {float(exact[order[0]]):.3f}; "
                         f"{num_draws} draws with <code>{getattr(fns['sample'], '__name__', 'sample')}</code>, "
                         f"{outside:.1%} of them outside the {shown} tokens shown")

    controls = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "penalty": penalty}
    for control in controls.values():
        control.observe(redraw, names="value")
    rows = [widgets.HBox([widgets.VBox([temperature, top_k]), widgets.VBox([top_p, penalty])]), summary, fig]
    if generate_text is not None:
        button = widgets.Button(description="sample a reply", button_style="primary")
        reply = widgets.HTML("<i>a reply sampled with the settings above appears here</i>",
                             layout=widgets.Layout(border=f"1px solid {MEASURED_COLOR}", padding="4px 8px"))
        draws = iter(range(1, 10**9))

        def on_click(_):
            params = SamplingParams(temperature=temperature.value, top_k=top_k.value, top_p=top_p.value,
                                    repetition_penalty=penalty.value, max_tokens=40, seed=seed + next(draws))
            reply.value = html.escape(generate_text(params)).replace("\n", "<br>")

        button.on_click(on_click)
        rows += [widgets.HBox([button, reply])]
        controls["sample_reply"] = button
    box = widgets.VBox(rows)
    return _finish(box, fig, controls, redraw)

"""Notebook 02's explorer: sliders T / k / p / penalty redraw the next-token distribution."""

from __future__ import annotations

import html

import ipywidgets as widgets
import torch

from decodelab.course.plots import MEASURED_COLOR, distribution_bars, distribution_figure
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.params import SamplingParams


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


def sampling_explorer(
    logits: torch.Tensor,
    history: torch.Tensor,
    tokenizer,
    fns: dict,
    num_draws: int = 256,
    shown: int = 20,
    generate_text=None,
    seed: int = 0,
):
    """Sliders T / k / p / penalty redraw the next-token distribution after a real prompt.

    logits [V]: the model's next-token logits; history [n]: the ids the repetition penalty
    sees. fns: "temperature", "top_k", "top_p", "repetition_penalty", "sample" (the library's
    signatures). Each redraw shows the exact probabilities of the `shown` most likely tokens
    next to the frequencies of `num_draws` draws made by fns["sample"]. generate_text(params)
    -> str, if given, backs a button that samples a whole reply with the same settings.
    """
    logits = logits.detach().float().cpu()
    history = history.detach().long().cpu()
    temperature = widgets.FloatSlider(
        value=1.0,
        min=0.0,
        max=2.0,
        step=0.05,
        description="temperature (0 = greedy)",
        continuous_update=False,
        **SLIDER,
    )
    top_k = widgets.IntSlider(value=0, min=0, max=100, description="top-k (0 = off)", continuous_update=False, **SLIDER)
    top_p = widgets.FloatSlider(
        value=1.0, min=0.05, max=1.0, step=0.05, description="top-p (1 = off)", continuous_update=False, **SLIDER
    )
    penalty = widgets.FloatSlider(
        value=1.0, min=1.0, max=3.0, step=0.1, description="repetition penalty", continuous_update=False, **SLIDER
    )
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
        distribution_bars(
            fig,
            tokens,
            exact[order].tolist(),
            drawn[order].tolist(),
            f"T={temperature.value:g}, top-k={top_k.value or 'off'}, top-p={top_p.value:g}, "
            f"penalty={penalty.value:g}: {kept:,} tokens can be drawn",
        )
        fig.layout.yaxis.range = [0, min(1.0, 1.15 * max(float(exact[order].max()), float(drawn[order].max())))]
        summary.value = (
            f"most likely: <b>{html.escape(repr(tokens[0]))}</b> with p = {float(exact[order[0]]):.3f}; "
            f"{num_draws} draws with <code>{getattr(fns['sample'], '__name__', 'sample')}</code>, "
            f"{outside:.1%} of them outside the {shown} tokens shown"
        )

    controls = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "penalty": penalty}
    rows = [widgets.HBox([widgets.VBox([temperature, top_k]), widgets.VBox([top_p, penalty])]), summary, fig]
    if generate_text is not None:
        button = widgets.Button(description="sample a reply", button_style="primary")
        reply = widgets.HTML(
            "<i>a reply sampled with the settings above appears here</i>",
            layout=widgets.Layout(border=f"1px solid {MEASURED_COLOR}", padding="4px 8px"),
        )
        draws = iter(range(1, 10**9))

        def on_click(_):
            params = SamplingParams(
                temperature=temperature.value,
                top_k=top_k.value,
                top_p=top_p.value,
                repetition_penalty=penalty.value,
                max_tokens=40,
                seed=seed + next(draws),
            )
            reply.value = html.escape(generate_text(params)).replace("\n", "<br>")

        button.on_click(on_click)
        rows += [widgets.HBox([button, reply])]
        controls["sample_reply"] = button
    return finish_explorer(fig, controls, redraw, children=rows)

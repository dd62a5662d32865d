"""Notebook 05 (grouped-query attention): the KV-heads explorer, and the experiment of one decode
step of attention (time and the memory of the tensors it creates) against the number of KV heads
and the sequence length, with its figures beside the seed's.

The explorer follows widgets.py: it returns an ipywidgets box with ``.figure`` (here
a FigureWidget, see `kv_heads_explorer`), ``.controls`` and ``.redraw()``.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR, si
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.lessons.gqa import attention_kind
from decodelab.lessons.kv_size import config_fields, format_bytes, kv_bytes
from decodelab.lessons.measure import median, time_call
from decodelab.lessons.tiled_attention import measure_tensor_memory

MiB = 2**20

# The seed's measurement: one layer's attention alone, 8 query heads, head_dim 128, 4,096 cached
# tokens, fp32, random weights, median of 51 decode steps (numpy on a shared 2-core Xeon).
SEED_KV_HEADS = [8, 2, 1]
SEED_CACHE_MB = [32.0, 8.0, 4.0]
SEED_STEP_MS = [5.947, 2.057, 1.182]

SERIES_COLORS = ["#ff7f0e", MEASURED_COLOR, OTHER_COLOR, "#2ca02c"]
CACHE_COLOR = "#9467bd"  # the cache itself, apart from the series measured on it


# --------------------------------------------------------------------------- the experiment


def measure_decode_attention(
    attention,
    num_kv_heads: int,
    num_heads: int = 8,
    seq_len: int = 4096,
    head_dim: int = 128,
    repeats: int = 11,
    device="cpu",
    dtype=torch.float32,
) -> dict:
    """One decode step of one layer's attention: a query [1, H, 1, D] over a cache [1, H_kv, S, D],
    `attention(q, k, v, q_offset)` with q_offset = S - 1.

    Returns {"cache_bytes": bytes of K and V, "ms": median milliseconds of `repeats` calls,
    "peak_bytes": the most bytes of new tensors the call held at once (`measure_tensor_memory`,
    which also sees the copies inside a broadcasting matmul), "largest_shape": its largest tensor}.
    """
    generator = torch.Generator().manual_seed(num_kv_heads)
    q = torch.randn(1, num_heads, 1, head_dim, generator=generator).to(device, dtype)  # [1, H, 1, D]
    k = torch.randn(1, num_kv_heads, seq_len, head_dim, generator=generator).to(device, dtype)  # [1, H_kv, S, D]
    v = torch.randn(1, num_kv_heads, seq_len, head_dim, generator=generator).to(device, dtype)
    _, seen = measure_tensor_memory(attention, q, k, v, seq_len - 1)
    with torch.inference_mode():
        seconds = time_call(lambda: attention(q, k, v, seq_len - 1), device, repeats=repeats, warmup=2)
    return {
        "cache_bytes": k.nbytes + v.nbytes,
        "ms": 1000 * median(seconds),
        "peak_bytes": seen.peak_bytes,
        "largest_shape": seen.largest_shape,
    }


def _add_series(fig, x: list, measured: dict[str, list[dict]], key: str, scale: float, col: int, legend: bool) -> None:
    for i, (name, results) in enumerate(measured.items()):
        fig.add_scatter(
            x=x,
            y=[r[key] / scale for r in results],
            mode="lines+markers",
            name=name,
            legendgroup=name,
            showlegend=legend,
            marker_color=SERIES_COLORS[i % len(SERIES_COLORS)],
            row=1,
            col=col,
        )


def kv_heads_figure(kv_heads: list[int], measured: dict[str, list[dict]], seq_len: int, title: str) -> go.Figure:
    """Cache size, decode-step time and the peak memory of the tensors one step creates, against the
    number of KV heads; the seed's size and time beside ours.

    measured: series name -> one `measure_decode_attention` result per entry of kv_heads.
    """
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=(
            f"KV cache of one layer, {seq_len:,} tokens, fp32",
            "one decode step of attention",
            "new tensors held at once (peak)",
        ),
    )
    first = next(iter(measured.values()))
    fig.add_scatter(
        x=kv_heads,
        y=[r["cache_bytes"] / MiB for r in first],
        mode="lines+markers",
        name="measured here: K and V tensors",
        marker_color=CACHE_COLOR,
        row=1,
        col=1,
    )
    _add_series(fig, kv_heads, measured, "ms", 1, 2, True)
    _add_series(fig, kv_heads, measured, "peak_bytes", MiB, 3, False)
    for col, values, unit in ((1, SEED_CACHE_MB, "MB"), (2, SEED_STEP_MS, "ms")):
        fig.add_scatter(
            x=SEED_KV_HEADS,
            y=values,
            mode="markers+text",
            text=[f"{v:g} {unit}" for v in values],
            textposition=["middle left", "middle right", "middle right"],  # 8 is at the right edge
            marker=dict(size=12, color=SEED_COLOR, symbol="diamond"),
            name="seed (numpy, 4,096 tokens)",
            showlegend=col == 1,
            row=1,
            col=col,
        )
    fig.update_xaxes(type="log", title="KV heads (8 query heads)", tickvals=[1, 2, 4, 8])
    fig.update_yaxes(title="MiB", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title="milliseconds (median)", row=1, col=2, rangemode="tozero")
    fig.update_yaxes(title="MiB (log scale)", type="log", row=1, col=3)
    fig.update_layout(
        title=dict(text=title, y=0.97),
        height=500,
        margin=dict(l=10, r=10, t=120, b=40),
        legend=dict(orientation="h", y=-0.25),
    )
    return fig


def seq_len_figure(lengths: list[int], measured: dict[str, list[dict]], num_kv_heads: int, title: str) -> go.Figure:
    """Decode-step time and peak memory of the tensors it creates against the number of cached tokens.

    measured: series name -> one `measure_decode_attention` result per entry of lengths.
    """
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("one decode step of attention", "new tensors held at once (peak)")
    )
    _add_series(fig, lengths, measured, "ms", 1, 1, True)
    _add_series(fig, lengths, measured, "peak_bytes", MiB, 2, False)
    cache = [r["cache_bytes"] / MiB for r in next(iter(measured.values()))]
    fig.add_scatter(
        x=lengths,
        y=cache,
        mode="lines",
        line=dict(dash="dash", color=CACHE_COLOR),
        name=f"the cache itself (K and V, {num_kv_heads} KV heads)",
        row=1,
        col=2,
    )
    fig.update_xaxes(type="log", title="cached tokens S (log scale)", tickvals=lengths)
    fig.update_yaxes(type="log", title="milliseconds (median, log scale)", row=1, col=1)
    fig.update_yaxes(type="log", title="MiB (log scale)", row=1, col=2)
    fig.update_layout(
        title=title, height=440, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.3)
    )
    return fig


# --------------------------------------------------------------------------- the explorer


def kv_heads_explorer(config="Llama-3.1-8B", dtype="fp16", kv_bytes_fn=kv_bytes):
    """Sliders for the number of KV heads and the sequence length -> KV cache and attention cost.

    config: a `decodelab.lessons.kv_size` preset name, `ModelConfig` or config.json dict; its query heads
    stay fixed and the KV heads run over their divisors. kv_bytes_fn(config, seq_len, dtype=...)
    sizes the cache. One bar per choice of KV heads: the cache of one sequence, labelled with the
    FLOPs one decode step of attention does per byte of K/V it reads. The current choice is red.
    """
    fields = config_fields(config)
    name = config if isinstance(config, str) else fields.get("model_type", "model")
    heads, layers, head_dim = fields["num_attention_heads"], fields["num_hidden_layers"], fields["head_dim"]
    choices = [n for n in range(1, heads + 1) if heads % n == 0]
    start = fields["num_key_value_heads"] if fields["num_key_value_heads"] in choices[:-1] else choices[0]
    kv_heads = widgets.SelectionSlider(
        options=choices, value=start, description="KV heads (H_kv)", continuous_update=False, **SLIDER
    )
    lengths = [2**i for i in range(8, 18)]
    seq_len = widgets.SelectionSlider(
        options=[(f"{n:,}", n) for n in lengths],
        value=4096,
        description="sequence length",
        continuous_update=False,
        **SLIDER,
    )
    labels = [f"{n} {attention_kind(heads, n)}" for n in choices]
    base = go.Figure()
    base.add_bar(
        x=labels,
        y=[0] * len(choices),
        textposition="outside",
        marker_color=OTHER_COLOR,
        name="KV cache (text: FLOPs per byte read in a decode step)",
    )
    base.add_bar(x=labels[:1], y=[0], textposition="none", marker_color=SEED_COLOR, name="your choice")
    base.update_layout(
        height=480, margin=dict(l=10, r=10, t=110, b=40), barmode="overlay", legend=dict(orientation="h", y=-0.2)
    )
    base.update_xaxes(title=f"KV heads ({heads} query heads)")
    base.update_yaxes(title=f"KV cache of one sequence ({dtype}), GiB")

    def draw(target):
        n, length = kv_heads.value, seq_len.value
        sizes = [kv_bytes_fn(dict(fields, num_key_value_heads=c), length, dtype=dtype) for c in choices]
        chosen = sizes[choices.index(n)]
        flops = 4 * heads * length * head_dim * layers  # q.k and weights.v: 2 FLOPs per multiply-add, every query head
        with target.batch_update():
            target.data[0].y = [b / 2**30 for b in sizes]
            target.data[0].text = [f"{format_bytes(b)}<br>{flops / b:.3g} FLOP/B" for b in sizes]
            target.data[1].x = [labels[choices.index(n)]]
            target.data[1].y = [chosen / 2**30]
            target.layout.yaxis.range = [0, 1.3 * max(sizes) / 2**30]
            group = heads // n
            versus_mha = "the MHA size" if n == heads else f"{group}x smaller than MHA's {format_bytes(sizes[-1])}"
            target.layout.title.text = (
                f"{name}: KV heads = {n} ({attention_kind(heads, n)}, {group} query head{'s' * (group > 1)} per KV "
                f"head), {length:,} tokens<br>cache {format_bytes(chosen)}, {versus_mha}; a decode step reads all "
                f"of it for the same {si(flops, 'FLOP')}: {flops / chosen:.3g} FLOP per byte"
            )

    fig = go.FigureWidget(base)

    def redraw(*_):
        draw(fig)

    return finish_explorer(fig, {"kv_heads": kv_heads, "seq_len": seq_len}, redraw)


__all__ = [
    "measure_decode_attention",
    "kv_heads_figure",
    "seq_len_figure",
    "kv_heads_explorer",
    "SEED_KV_HEADS",
    "SEED_CACHE_MB",
    "SEED_STEP_MS",
]

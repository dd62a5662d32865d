"""What notebook 03 (the KV cache) draws and measures beyond the shared widgets: per-token
timing with and without a cache, the KV-size calculator, and the memory a cache holds as the
sequence grows (a full cache against the sliding-window ring).

Everything takes the functions to run as arguments (the learner's own, or the library's
reference while an exercise is unfinished), so the plots show the code the exercises build.
"""

from __future__ import annotations

import statistics
import time

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR, log_range
from decodelab.course.widgets.controls import finish_explorer
from decodelab.lessons.kv_size import PRESETS, config_fields, format_bytes, parameter_count, tensor_bytes_held
from decodelab.lessons.measure import synchronize
from decodelab.model.toy import tiny_model

# The seed's table: position T -> (ms per token without a cache, with a cache), a 0.5M-parameter
# numpy Transformer on a shared 2-core Xeon, one thread.
SEED_MS_PER_TOKEN = {
    16: (4.02, 0.950),
    32: (5.94, 0.648),
    64: (11.09, 0.611),
    128: (22.36, 1.072),
    256: (50.61, 0.692),
    511: (106.57, 1.157),
}
SEED_MAX_LOGIT_DIFF = 2.86e-6  # same 96 greedy tokens with and without the cache


def cache_class_or_reference(learner_class, reference_class, sliding_window: int | None = None):
    """The learner's cache class if a tiny model runs through it, else the reference, with
    `course.use_or_reference`'s notice on stdout. The probe: prefill, one step, `truncate`, `view`;
    with a sliding_window (a ring cache, which cannot truncate), a tiny model with that window, a
    prefill longer than it, one step and `view`."""
    from decodelab import course

    def probe():
        model = tiny_model(0, sliding_window=sliding_window)
        cache = learner_class(model.config, 1, 8)
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
            model(torch.tensor([[4]]), kv_cache=cache)
        if sliding_window is None:
            cache.truncate(2)
        cache.view(0)

    chosen = course.use_or_reference(probe, reference_class, name=getattr(learner_class, "__name__", "KVCache"))
    return learner_class if chosen is probe else reference_class


@torch.inference_mode()
def bytes_held_after(make_cache, config, lengths: list[int], chunk: int = 256, seed: int = 0) -> list[int]:
    """For each length n: a fresh cache `make_cache(n)`, fed n positions of K/V in chunks of `chunk`
    rows per layer ([1, H_kv, chunk, D] float32, one random block reused: the values do not change
    the bytes), then the bytes behind the tensors it holds (`kv_size.tensor_bytes_held`, so a
    cache is measured whatever its layout)."""
    block = torch.randn(
        1, config.num_key_value_heads, chunk, config.head_dim, generator=torch.Generator().manual_seed(seed)
    )  # [1, H_kv, chunk, D]
    held = []
    for length in lengths:
        cache = make_cache(length)
        for start in range(0, length, chunk):
            rows = block[:, :, : min(chunk, length - start)]
            for layer in range(config.num_hidden_layers):
                cache.append(layer, rows, rows)
        held.append(tensor_bytes_held(cache))
    return held


@torch.inference_mode()
def per_token_ms(model, positions: list[int], cache_class, repeats: int = 3, seed: int = 0) -> dict[str, list[float]]:
    """Median milliseconds to produce the token at each position T, two ways.

    Without a cache: one forward pass over all T + 1 tokens (last position's logits only).
    With a cache: the longest prefix is prefilled once into `cache_class` (not timed); for each
    T the cache is truncated back to T (its `truncate`) and the token at T is fed alone."""
    vocab, device, longest = model.config.vocab_size, model.device, max(positions)
    ids = torch.randint(0, vocab, (1, longest + 1), generator=torch.Generator().manual_seed(seed)).to(device)
    cache = cache_class(model.config, 1, longest + 1, device=device, dtype=model.dtype)
    model(ids[:, :longest], kv_cache=cache, last_only=True)
    synchronize(device)
    without, with_cache = {}, {}
    for t in sorted(positions, reverse=True):  # longest first: truncate only ever shortens the cache
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(ids[:, : t + 1], last_only=True)
            synchronize(device)
            times.append(time.perf_counter() - started)
        without[t] = 1000 * statistics.median(times)
        times = []
        for _ in range(repeats):
            cache.truncate(t)
            started = time.perf_counter()
            model(ids[:, t : t + 1], kv_cache=cache, last_only=True)
            synchronize(device)
            times.append(time.perf_counter() - started)
        with_cache[t] = 1000 * statistics.median(times)
    return {"without cache": [without[t] for t in positions], "with cache": [with_cache[t] for t in positions]}


def speedup_figure(positions: list[int], times: dict[str, list[float]]) -> go.Figure:
    """Speed-up (time without / with the cache) against position: measured here and the seed's."""
    ratios = [a / b for a, b in zip(times["without cache"], times["with cache"])]
    seed_t = list(SEED_MS_PER_TOKEN)
    seed_ratio = [a / b for a, b in SEED_MS_PER_TOKEN.values()]
    fig = go.Figure()
    fig.add_scatter(
        x=seed_t,
        y=seed_ratio,
        mode="lines+markers+text",
        name="seed (0.5M-parameter numpy model)",
        text=[f"{r:.1f}x" for r in seed_ratio],
        textposition="top left",
        marker=dict(color=SEED_COLOR, symbol="diamond", size=10),
        line=dict(color=SEED_COLOR, dash="dash"),
    )
    fig.add_scatter(
        x=positions,
        y=ratios,
        mode="lines+markers+text",
        name="measured here (SmolLM2-135M, your cache)",
        text=[f"{r:.1f}x" for r in ratios],
        textposition="bottom right",
        marker=dict(color=MEASURED_COLOR, size=10),
        line=dict(color=MEASURED_COLOR),
    )
    fig.update_layout(
        title=f"The cache's speed-up grows with the position: {ratios[0]:.1f}x at T={positions[0]} "
        f"to {ratios[-1]:.1f}x at T={positions[-1]} here<br>(seed: 4.2x at T=16 to 92x at T=511)",
        height=430,
        margin=dict(l=10, r=10, t=80, b=40),
        legend=dict(orientation="h", y=-0.25),
    )
    fig.update_xaxes(type="log", title="position T of the token being generated")
    fig.update_yaxes(type="log", title="time without cache / time with cache")
    return fig


def _variants(fields: dict) -> dict[str, dict]:
    """The config as it is, with every layer full attention, and with one KV head per query head."""
    full = {k: v for k, v in fields.items() if k not in ("layer_types", "sliding_window")}
    mha = {**full, "num_key_value_heads": fields["num_attention_heads"]}
    return {
        "this config": fields,
        "every layer full attention": full,
        "no GQA either (one KV head per query head)": mha,
    }


def kv_size_calculator(kv_bytes_fn, presets: dict[str, dict] | None = None):
    """Sliders for sequence length and batch, a preset and a dtype -> KV-cache bytes.

    kv_bytes_fn(config, seq_len, batch, dtype) -> bytes, the learner's `kv_bytes` or the
    library's. Curves: bytes against sequence length for the config, for the same config with
    every layer full attention (what sliding windows save), and without grouped-query
    attention (what GQA saves); the dot is the current choice, the grey line the weights' size.
    Returns a VBox with .figure, .controls and .redraw() like the other explorers.
    """
    presets = dict(PRESETS if presets is None else presets)
    style = dict(style={"description_width": "150px"}, layout=widgets.Layout(width="460px"))
    lengths = [2**i for i in range(7, 18)]  # 128 .. 131,072
    seq_len = widgets.SelectionSlider(
        options=[(f"{n:,}", n) for n in lengths], value=4096, description="sequence length", **style
    )
    batch = widgets.SelectionSlider(
        options=[1, 2, 4, 8, 16, 32, 64, 128], value=1, description="batch (users)", **style
    )
    preset = widgets.Dropdown(
        options=list(presets),
        value="Llama-3.1-8B" if "Llama-3.1-8B" in presets else list(presets)[0],
        description="model (config.json)",
        **style,
    )
    dtype = widgets.Dropdown(
        options=["fp32", "bf16", "fp16", "fp8", "int4"], value="bf16", description="K/V dtype", **style
    )
    curve_x = log_range(128, 131072, 41)
    curve_x = sorted({int(round(x)) for x in curve_x})
    fig = go.FigureWidget()
    for name, dash, color in (
        ("this config", "solid", MEASURED_COLOR),
        ("every layer full attention", "dash", OTHER_COLOR),
        ("no GQA either (one KV head per query head)", "dot", OTHER_COLOR),
    ):
        fig.add_scatter(x=curve_x, y=[1] * len(curve_x), mode="lines", name=name, line=dict(dash=dash, color=color))
    fig.add_scatter(
        x=[curve_x[0], curve_x[-1]],
        y=[1, 1],
        mode="lines",
        name="the model's weights (bf16)",
        line=dict(color="#2ca02c", width=1),
    )
    fig.add_scatter(x=[4096], y=[1], mode="markers", marker=dict(size=13, color=SEED_COLOR), name="your choice")
    fig.update_layout(height=500, margin=dict(l=10, r=10, t=90, b=40), legend=dict(orientation="h", y=-0.22))
    fig.update_xaxes(type="log", title="sequence length (tokens per sequence)")
    fig.update_yaxes(type="log", title="KV cache (GiB)")

    def redraw(*_):
        fields = config_fields(preset.value)
        variants = _variants(fields)
        gib = 2.0**30
        with fig.batch_update():
            for trace, config in zip(fig.data[:3], variants.values()):
                trace.y = [kv_bytes_fn(config, n, batch.value, dtype.value) / gib for n in curve_x]
            try:
                weights = parameter_count(fields) * 2 / gib
                fig.data[3].update(y=[weights, weights], visible=True)
            except ValueError:  # GPT-3, gpt-oss: not a dense Llama config
                fig.data[3].update(visible=False)
        total = kv_bytes_fn(fields, seq_len.value, batch.value, dtype.value)
        per_token = kv_bytes_fn(fields, 1, 1, dtype.value)
        with fig.batch_update():
            fig.data[4].update(x=[seq_len.value], y=[total / gib])
            fig.layout.title.text = (
                f"{preset.value}, {seq_len.value:,} tokens x {batch.value} sequence{'s' if batch.value > 1 else ''} "
                f"in {dtype.value}: <b>{format_bytes(total)}</b> of K and V<br>"
                f"({format_bytes(per_token)} per token at the start; {fields['num_key_value_heads']} KV heads for "
                f"{fields['num_attention_heads']} query heads, {fields['num_hidden_layers']} layers)"
            )

    controls = widgets.HBox([widgets.VBox([seq_len, batch]), widgets.VBox([preset, dtype])])
    return finish_explorer(
        fig, {"seq_len": seq_len, "batch": batch, "preset": preset, "dtype": dtype}, redraw, children=[controls, fig]
    )


__all__ = [
    "SEED_MS_PER_TOKEN",
    "SEED_MAX_LOGIT_DIFF",
    "cache_class_or_reference",
    "per_token_ms",
    "speedup_figure",
    "kv_size_calculator",
]

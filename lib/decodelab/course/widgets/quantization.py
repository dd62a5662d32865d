"""Notebook 06's measurements and its explorer: quantize a model with the learner's functions,
measure what it costs (bytes, weight error, perplexity, greedy agreement, decode time), compare
KV-cache dtypes, and multiply with a few outlier columns kept in float (LLM.int8's idea).

The functions to use are passed in as a dict (the learner's own, or the library's reference
while an exercise is unfinished); `using` puts them inside `decodelab.model.quantization` for the length of a
`with` block, so `quantize_model` (through `replace_linears`), `QuantizedLinear` and `dequantize_int4` run
the learner's code. A quantized layer is anything with `dequantized_weight()` and `nbytes`
(`QuantizedLinear`, `Int8Linear`, `Int4Linear`, the learner's own `Int8Linear` and `Int4Linear`).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from torch import nn

from decodelab.course.plots import MEASURED_COLOR, OTHER_COLOR, SEED_COLOR
from decodelab.course.widgets.controls import SLIDER, finish_explorer
from decodelab.decoding.generate import stream_token_ids
from decodelab.lessons.perplexity import perplexity
from decodelab.model import quantization as quant
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams

QUANT_FUNCTIONS = (
    "quantize_int8_per_channel",
    "quantize_int4_groupwise",
    "pack_int4",
    "unpack_int4",
    "replace_linears",
)


@contextlib.contextmanager
def using(fns: dict | None):
    """Inside the block, `decodelab.model.quantization`'s functions named in fns (see QUANT_FUNCTIONS) are fns'."""
    saved = {name: getattr(quant, name) for name in QUANT_FUNCTIONS}
    try:
        for name, fn in (fns or {}).items():
            if name in QUANT_FUNCTIONS:
                setattr(quant, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(quant, name, fn)


def _is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "dequantized_weight") and hasattr(module, "weight_q")


def _linears(model) -> dict[str, nn.Module]:
    return {name: m for name, m in model.model.layers.named_modules() if isinstance(m, nn.Linear) or _is_quantized(m)}


@contextlib.contextmanager
def restoring(model):
    """For the block, anything may replace the decoder layers' linears (`quantize_model`, an engine
    built with quantization on this model); afterwards the layers there before come back."""
    originals = _linears(model)
    try:
        yield model
    finally:
        for name, module in originals.items():
            parent, _, attr = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), attr, module)


@contextlib.contextmanager
def quantized(model, bits: int | None, group_size: int = 64, fns: dict | None = None):
    """The model with its decoder-layer linears quantized (bits 8 or 4; None: unchanged) by
    `quant.quantize_model` running fns, for the block; the float layers come back afterwards
    (cheaper than a deep copy of the model). fns["Int8Linear"] and fns["Int4Linear"], if given, are the
    int8 and int4 layer classes."""
    linear_class = (fns or {}).get({8: "Int8Linear", 4: "Int4Linear"}.get(bits, ""))
    make = None
    if linear_class is not None:
        make = (
            linear_class.from_linear
            if bits == 8
            else lambda linear: linear_class.from_linear(
                linear, quant.fallback_group_size(linear.in_features, group_size)
            )
        )
    with restoring(model):
        if bits is not None:
            with using(fns):
                quant.quantize_model(model, bits=bits, group_size=group_size, linear=make)
        yield model


def probe_model():
    """A random two-layer Llama (`decodelab.model.toy`), for probing a learner's function on."""
    from decodelab.model.toy import random_llama

    with torch.random.fork_rng(devices=[]):  # random_llama seeds torch; the notebook's random state stays
        return random_llama(0)


def _layer_or_reference(learner_class, reference, build, bound, bits: int):
    """The learner's layer class if the layer `build(cls, linear)` makes of nn.Linear(64, 8) computes
    that layer's output within `bound(linear, x)` ([3, 8]) in a forward, else `reference`, with
    `course.use_or_reference`'s notice on stdout."""
    from decodelab import course

    def probe():
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # the notebook's random state stays as it was
            torch.manual_seed(0)
            linear = nn.Linear(64, 8)
            x = torch.randn(3, 64)
            y, exact = build(learner_class, linear)(x), linear(x)
        if y.shape != exact.shape or not bool(((y - exact).abs() <= bound(linear, x) + 1e-5).all()):
            raise AssertionError(f"its output is not within the int{bits} bound of nn.Linear(64, 8)'s")

    chosen = course.use_or_reference(probe, reference, name=getattr(learner_class, "__name__", reference.__name__))
    return learner_class if chosen is probe else reference


def int8_linear_or_reference(learner_class):
    """The learner's Int8Linear class if it keeps nn.Linear(64, 8)'s output within the int8 bound
    (half a step of each row's scale times |x|), else `quant.Int8Linear`."""
    return _layer_or_reference(
        learner_class,
        quant.Int8Linear,
        lambda cls, linear: cls.from_linear(linear),
        lambda linear, x: x.abs().sum(-1, keepdim=True) * (linear.weight.abs().amax(dim=1) / 127 / 2),
        bits=8,
    )


def int4_linear_or_reference(learner_class):
    """The learner's Int4Linear class if, with groups of 32, it keeps nn.Linear(64, 8)'s output within
    the int4 bound (half a step of each group's scale times that group's |x|), else `quant.Int4Linear`."""

    def bound(linear, x):
        scale = linear.weight.abs().reshape(8, 2, 32).amax(dim=-1) / 7  # [8, 2]
        return x.abs().reshape(3, 2, 32).sum(-1) @ (scale / 2).T  # [3, 8]

    return _layer_or_reference(
        learner_class, quant.Int4Linear, lambda cls, linear: cls.from_linear(linear, 32), bound, bits=4
    )


def int8_kv_cache_or_reference(learner_class):
    """The learner's Int8KVCache class if two appends to a cache of the toy model's shape hand back
    every value within half its row's step (max|row| / 127 / 2), else `quant.Int8KVCache`."""
    from decodelab import course
    from decodelab.model.toy import toy_config

    def probe():
        config = toy_config()
        with torch.random.fork_rng(devices=[]):  # the notebook's random state stays as it was
            torch.manual_seed(0)
            rows = [
                torch.randn(1, config.num_key_value_heads, t, config.head_dim) * torch.logspace(-2, 1, t)[:, None]
                for t in (3, 2)
            ]  # [1, H_kv, t, D], rows of different magnitude
        cache = learner_class(config, 1, 8)
        for x in rows:
            keys, values = cache.append(0, x, -x)
        held = torch.cat(rows, 2)
        bound = held.abs().amax(-1, keepdim=True) / 127 / 2 + 1e-6
        if keys.shape != held.shape or not bool(
            ((keys - held).abs() <= bound).all() & ((values + held).abs() <= bound).all()
        ):
            raise AssertionError("what it hands back is not within half a step of the rows appended")

    chosen = course.use_or_reference(probe, quant.Int8KVCache, name=getattr(learner_class, "__name__", "Int8KVCache"))
    return learner_class if chosen is probe else quant.Int8KVCache


def linear_bytes(model) -> int:
    """Bytes of the decoder-layer linears' weights (quantized: levels + scales)."""
    return sum(m.nbytes if _is_quantized(m) else m.weight.nbytes for m in _linears(model).values())


def relative_weight_error(model, float_weights: dict[str, torch.Tensor]) -> float:
    """||W - dequantized W|| / ||W|| over all decoder-layer linears (float_weights: name -> W)."""
    err = total = 0.0
    for name, m in _linears(model).items():
        w = float_weights[name].float()
        back = m.dequantized_weight() if _is_quantized(m) else m.weight
        err += float((w - back.float()).pow(2).sum(dtype=torch.float64))  # float64 sums of float32 squares
        total += float(w.pow(2).sum(dtype=torch.float64))
    return (err / total) ** 0.5


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_tokens(model, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy continuations of each prompt and the median seconds per decode step."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outputs, gaps = [], []
    for prompt in prompts:
        tokens, last = [], time.perf_counter()
        for token in stream_token_ids(model, prompt, params):
            now = time.perf_counter()
            if tokens:  # the first gap is the prefill
                gaps.append(now - last)
            tokens.append(token)
            last = now
        outputs.append(tokens)
    return outputs, statistics.median(gaps) if gaps else float("nan")


def measure_variant(
    model,
    text_ids: list[int],
    prompts: list[list[int]],
    bits: int | None,
    group_size: int = 64,
    fns: dict | None = None,
    num_tokens: int = 16,
    window: int = 128,
    reference: dict | None = None,
):
    """One row of the sweep. reference: the fp32 row (its greedy tokens and bytes) to compare with."""
    float_weights = {
        name: m.weight.detach()
        for name, m in _linears(model).items()  # kept: quantized() restores them
        if isinstance(m, nn.Linear)
    }
    with quantized(model, bits, group_size, fns):
        row = {
            "bits": bits or 32,
            "group_size": group_size if bits == 4 else None,
            "linear_bytes": linear_bytes(model),
            "weight_error": relative_weight_error(model, float_weights) if bits is not None else 0.0,
            "perplexity": perplexity(model, text_ids, window=window, stride=window // 2),
        }
        row["greedy"], row["seconds_per_token"] = greedy_tokens(model, prompts, num_tokens)
    reference = reference or row
    row["bytes_vs_fp32"] = row["linear_bytes"] / reference["linear_bytes"]
    row["greedy_same"] = sum(same_prefix(a, b) for a, b in zip(row["greedy"], reference["greedy"]))
    row["greedy_total"] = sum(len(b) for b in reference["greedy"])
    return row


def variant_name(bits: int, group_size: int | None) -> str:
    return {32: "fp32", 8: "int8"}.get(bits) or f"int4-g{group_size}"


# --------------------------------------------------------------------------- the explorer


def quantization_explorer(measure, fp32_row: dict, cache: dict | None = None):
    """Sliders for bits (8, 4) and group size -> bytes, weight error, perplexity, greedy agreement
    and decode time of the whole model, as a point on bytes-vs-perplexity beside fp32.

    measure(bits, group_size) -> a row as `measure_variant` returns it; rows are kept in `cache`
    (keyed by variant name), so every setting is measured once.
    """
    cache = {} if cache is None else cache
    bits = widgets.SelectionSlider(options=[("int8", 8), ("int4", 4)], value=8, description="bits per weight", **SLIDER)
    group = widgets.SelectionSlider(options=[32, 64, 128], value=64, description="int4 group size", **SLIDER)
    fig = go.FigureWidget()
    mb = fp32_row["linear_bytes"] / 1e6
    fig.add_scatter(
        x=[mb],
        y=[fp32_row["perplexity"]],
        mode="markers+text",
        text=["fp32"],
        textposition="top center",
        marker=dict(size=12, color=OTHER_COLOR),
        name="fp32",
    )
    fig.add_scatter(
        x=[mb],
        y=[fp32_row["perplexity"]],
        text=["fp32"],
        mode="markers+text",
        textposition="top center",
        marker=dict(size=10, color=MEASURED_COLOR),
        name="measured so far",
    )
    fig.add_scatter(
        x=[mb],
        y=[fp32_row["perplexity"]],
        mode="markers",
        marker=dict(size=18, color=SEED_COLOR, symbol="diamond"),
        name="current setting",
    )
    fig.update_layout(height=460, margin=dict(l=10, r=10, t=100, b=40), legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title="bytes of the decoder-layer weights (MB)", rangemode="tozero")
    fig.update_yaxes(title="perplexity on held-out text (lower is better)")

    def draw(fig):
        name = variant_name(bits.value, group.value)
        if name not in cache:
            cache[name] = measure(bits.value, group.value)
        row = cache[name]
        rows = sorted(cache.items(), key=lambda item: item[1]["linear_bytes"])
        how = f"groups of {group.value}" if bits.value == 4 else "one scale per output row (group size unused)"
        # One batch per trace (as in widgets.py): plotly merges a batch into one restyle, and a trace
        # that does not set a property another one sets (here text) would lose it.
        with fig.batch_update():
            fig.data[1].update(
                x=[r["linear_bytes"] / 1e6 for _, r in rows],
                y=[r["perplexity"] for _, r in rows],
                text=[n for n, _ in rows],
            )
        with fig.batch_update():
            fig.data[2].update(x=[row["linear_bytes"] / 1e6], y=[row["perplexity"]])
            fig.layout.title.text = (
                f"int{bits.value} weights, {how}: {row['bytes_vs_fp32']:.3f} of the fp32 bytes, weight error "
                f"{row['weight_error']:.2%}<br>perplexity {row['perplexity']:.2f} (fp32 {fp32_row['perplexity']:.2f}), "
                f"greedy tokens as fp32: {row['greedy_same']}/{row['greedy_total']}, "
                f"{1e3 * row['seconds_per_token']:.0f} ms/token (fp32 {1e3 * fp32_row['seconds_per_token']:.0f})"
            )

    def redraw(*_):
        draw(fig)

    return finish_explorer(fig, {"bits": bits, "group_size": group}, redraw)


def asymmetric_int4_error(w: torch.Tensor, block: int = 32) -> float:
    """Relative error ||W - W'|| / ||W|| of min/max 4-bit in blocks of `block` inputs: 16 levels
    from each block's min to its max, GGUF Q4_1's grid (the grid SmolLM2's file was stored on)."""
    blocks = w.detach().double().reshape(w.shape[0], -1, block)  # [out, in / block, block]
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
    back = torch.round((blocks - low) / step) * step + low
    return float((blocks - back).norm() / blocks.norm())


# --------------------------------------------------------------------------- KV cache


@torch.inference_mode()
def kv_cache_comparison(model, prompt_ids: list[int], caches: dict, num_tokens: int) -> dict[str, dict]:
    """Greedy decoding with an fp32 KVCache, then the same tokens fed through each cache of `caches`
    (label -> a kv_dtype of `quant.QuantizedKVCache`, or a cache class built as
    `cls(config, 1, max_seq_len, device=...)`, such as the learner's Int8KVCache) -> label -> its figures.

    Feeding the fp32 run's tokens lets the logits be compared step by step; a cache's own greedy
    text would equal the fp32 text up to the first step whose argmax differs, so `same_prefix` is
    also the length of the identical free-running prefix. `argmax` is the token the cache's logits
    pick at each step. The fp32 run is made once for all the caches.
    """

    def run(cache, teacher=None):
        x, tokens, logits = torch.tensor([prompt_ids], device=model.device), [], []
        for i in range(num_tokens):
            step = model(x, kv_cache=cache, last_only=True)[0, -1].float()  # [V]
            logits.append(step)
            tokens.append(int(step.argmax()))
            x = torch.tensor([[teacher[i] if teacher else tokens[-1]]], device=model.device)
        return tokens, logits, cache.nbytes() / cache.seq_len

    length = len(prompt_ids) + num_tokens
    ref_tokens, ref_logits, ref_bytes = run(KVCache(model.config, 1, length, device=model.device))
    figures = {}
    for label, kind in caches.items():
        cache = (
            quant.QuantizedKVCache(model.config, 1, length, device=model.device, kv_dtype=kind)
            if isinstance(kind, str)
            else kind(model.config, 1, length, device=model.device)
        )
        tokens, logits, per_token = run(cache, teacher=ref_tokens)
        figures[label] = {
            "bytes_per_token": per_token,
            "fp32_bytes_per_token": ref_bytes,
            "argmax": tokens,
            "max_logit_diff": max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits)),
            "same_prefix": same_prefix(tokens, ref_tokens),
            "tokens": num_tokens,
        }
    return figures


# --------------------------------------------------------------------------- outliers


@torch.inference_mode()
def linear_input(model, layer: int, name: str, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, in], W [out, in]): what the linear `name` of decoder layer `layer` multiplies on token_ids."""
    module = model.model.layers[layer].get_submodule(name)
    seen = {}
    handle = module.register_forward_hook(lambda _module, args, out: seen.setdefault("x", args[0][0].detach().float()))
    try:
        model(torch.tensor([token_ids], device=model.device))
    finally:
        handle.remove()
    return seen["x"].cpu(), module.weight.detach().float().cpu()


def int8_matmul(x: torch.Tensor, w: torch.Tensor, quantize_rows, keep_columns=()) -> torch.Tensor:
    """x [T, in] @ w [out, in]^T in int8, as LLM.int8() does: x gets one absmax scale per token
    (row), w one per output row, both via quantize_rows (an int8 per-channel quantizer); the
    integer product is rescaled by scale_x[t] * scale_w[o]. The input columns in keep_columns
    (the outlier features) are left out of both int8 matrices and multiplied in float."""
    keep = torch.zeros(x.shape[-1], dtype=torch.bool)
    keep[list(keep_columns)] = True
    qx, scale_x = quantize_rows(x.masked_fill(keep, 0.0))  # [T, in] int8, [T, 1]
    qw, scale_w = quantize_rows(w.masked_fill(keep, 0.0))  # [out, in] int8, [out, 1]
    product = (qx.double() @ qw.double().T) * scale_x.double() * scale_w.double().T  # exact integer sums, rescaled
    return (product + x[:, keep].double() @ w[:, keep].double().T).float()


__all__ = [
    "using",
    "restoring",
    "quantized",
    "probe_model",
    "int8_linear_or_reference",
    "int4_linear_or_reference",
    "linear_bytes",
    "relative_weight_error",
    "same_prefix",
    "greedy_tokens",
    "measure_variant",
    "variant_name",
    "asymmetric_int4_error",
    "quantization_explorer",
    "kv_cache_comparison",
    "int8_kv_cache_or_reference",
    "linear_input",
    "int8_matmul",
]

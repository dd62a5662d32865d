"""Calibration: the texts, each linear's inputs on them, and the layer-by-layer quantization of a model.

**Texts** (`text_split(which)`): a calibration text and a held-out text, disjoint, each named.

* "code" (for `tiny`): calibration = `corpus/train.txt` (the CPython modules `tiny` was trained on);
  held-out = `corpus/heldout.txt` (7 other modules, never trained on: the perplexity text of
  `lessons.perplexity.heldout_text("code")`).
* "en" (for SmolLM2): `heldout_en.txt` (prose of the Python Language Reference) cut at a paragraph
  boundary: the first half of its paragraphs is held out (perplexity), the second half calibrates.

**Inputs**: `record_inputs` runs the model once with forward hooks on its decoder linears and keeps
what each one was given, [N, in] (N = batch x tokens).

**Layer by layer** (`calibrate_model`): the hidden states of the calibration tokens enter decoder
layer 0; each layer is run once as it is (float) while hooks record its linears' inputs, each linear
is quantized from its own inputs by the chosen method (`METHODS`), and the layer is run again with
its quantized linears to give the next layer its inputs. So every layer is calibrated on the
outputs of the already-quantized layers before it, as GPTQ does (all linears of one layer from one
pass; GPTQ's "true sequential" order inside a layer is not followed). The model itself is left
float; `apply_layers` swaps the made layers in (`quantization.replace_linears`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from decodelab.model.awq import search_scales
from decodelab.model.calibrated_linear import CalibratedLinear, by_identity
from decodelab.model.gptq import BLOCK_SIZE, DAMP, gptq_quantize, hessian
from decodelab.model.groupwise import quantize_groupwise
from decodelab.model.quantization import fallback_group_size, replace_linears
from decodelab.paths import PACKAGE_DATA

METHODS = ("rtn", "awq", "gptq", "awq+gptq")


@dataclass
class TextSplit:
    """A calibration text and a held-out text that share nothing, with their names."""

    calibration: str
    heldout: str
    calibration_name: str
    heldout_name: str


def text_split(which: str) -> TextSplit:
    """ "code" (tiny) or "en" (SmolLM2): see the module docstring. FileNotFoundError if a file is absent."""
    if which == "code":
        train, heldout = PACKAGE_DATA / "corpus" / "train.txt", PACKAGE_DATA / "corpus" / "heldout.txt"
        return TextSplit(
            train.read_text(encoding="utf-8"),
            heldout.read_text(encoding="utf-8"),
            "corpus/train.txt (tiny's training modules)",
            "corpus/heldout.txt (7 modules never trained on)",
        )
    if which == "en":
        paragraphs = (PACKAGE_DATA / "heldout_en.txt").read_text(encoding="utf-8").strip().split("\n\n")
        half = len(paragraphs) // 2
        return TextSplit(
            "\n\n".join(paragraphs[half:]),
            "\n\n".join(paragraphs[:half]),
            f"heldout_en.txt paragraphs {half + 1}-{len(paragraphs)}",
            f"heldout_en.txt paragraphs 1-{half}",
        )
    raise ValueError(f"which must be 'code' or 'en', got {which!r}")


def calibration_ids(tokenizer, text: str, sequences: int, length: int) -> torch.Tensor:
    """The first sequences x length tokens of `text`, cut into rows: LongTensor [sequences, length]."""
    needed = sequences * length
    ids: list[int] = []
    for chars in (needed * 8, len(text)):  # a prefix is usually enough; the whole text if not
        ids = tokenizer.encode(text[:chars])
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise ValueError(f"the text holds {len(ids)} tokens, fewer than {sequences} x {length}")
    return torch.tensor(ids[:needed], dtype=torch.long).reshape(sequences, length)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """{name in model: linear} for every nn.Linear inside model.model.layers (what `replace_linears` swaps)."""
    return {
        f"model.layers.{i}.{name}": module
        for i, layer in enumerate(model.model.layers)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    }


@contextmanager
def recording(modules: dict[str, nn.Module]):
    """Forward hooks that put each module's input, as rows [N, in] (a view, not a copy), in the dict
    yielded (the last call's, if a module runs twice)."""
    seen: dict[str, torch.Tensor] = {}

    def hook_for(name):
        def hook(module, args):
            seen[name] = args[0].detach().reshape(-1, args[0].shape[-1])

        return hook

    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in modules.items()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def record_inputs(model: nn.Module, ids: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
    """Run the model on ids [B, T]; {name: the inputs [B * T, in] of that decoder linear} (names: a subset)."""
    linears = decoder_linears(model)
    wanted = {name: linears[name] for name in (names or linears)}
    with recording(wanted) as seen:
        model(ids)
    return dict(seen)


def quantize_linear(
    linear: nn.Linear,
    x: torch.Tensor,
    method: str,
    bits: int,
    group_size: int = 128,
    awq_rows: int | None = None,
    damp: float = DAMP,
    block_size: int = BLOCK_SIZE,
    awq_search=search_scales,
    gptq_layer=None,
) -> CalibratedLinear:
    """One linear and its calibration inputs x [N, in] -> its CalibratedLinear by `method`:
    "rtn" (x unused), "awq" (scales searched, then RTN), "gptq", "awq+gptq" (AWQ's scales, then GPTQ on
    W * s with inputs x / s). group_size falls back (`fallback_group_size`) where it does not divide in.
    awq_rows: search AWQ's alpha on at most this many rows of x, evenly spaced (None: all).
    awq_search, gptq_layer: the implementations used (`awq.search_scales`'s signature, and
    `gptq.gptq_quantize_layer`'s; None: the library's), so that a notebook can calibrate with its own."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    w = linear.weight.detach().float()
    size = fallback_group_size(w.shape[1], group_size)
    bias = None if linear.bias is None else linear.bias.detach()
    x = x.reshape(-1, w.shape[1]).float()
    scales = None
    if method in ("awq", "awq+gptq"):
        rows = (
            x if awq_rows is None or x.shape[0] <= awq_rows else x[torch.linspace(0, x.shape[0] - 1, awq_rows).long()]
        )
        scales = awq_search(w, rows, bits, size).scales
        w, x = w * scales, x / scales
    if method in ("gptq", "awq+gptq"):
        block = min(block_size, size)
        if gptq_layer is None:
            grid = gptq_quantize(w, hessian(x), bits, size, block_size=block, damp=damp)
        else:
            grid = gptq_layer(w, x, bits, size, block, damp)
    else:
        grid = quantize_groupwise(w, bits, size)
    return CalibratedLinear(grid, bias, scales, method)


@contextmanager
def swapped(layer: nn.Module, replacements: dict[str, nn.Module]):
    """Inside: layer's submodules named in replacements (dotted names in layer) are the replacements."""
    originals = {name: layer.get_submodule(name) for name in replacements}

    def put(name, module):
        parent, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, attr, module)

    for name, module in replacements.items():
        put(name, module)
    try:
        yield layer
    finally:
        for name, module in originals.items():
            put(name, module)


@dataclass
class Calibrated:
    """What `calibrate_model` made: {name in the model: layer}, the seconds it took, and the settings."""

    layers: dict[str, CalibratedLinear]
    seconds: float
    settings: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())


@torch.inference_mode()
def calibrate_model(
    model: nn.Module,
    ids: torch.Tensor,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    awq_rows: int | None = 512,
    on_layer=None,
    **options,
) -> Calibrated:
    """Quantize every decoder linear of `model` by `method`, layer by layer (module docstring), from
    calibration ids [B, T]. The model stays float (apply the result with `apply_layers`).
    on_layer(index, {name in layer: inputs [N, in]}): called with each layer's recorded inputs.
    options: damp, block_size for GPTQ; awq_search, gptq_layer: the implementations (`quantize_linear`)."""
    start = time.perf_counter()
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.device)
    if ids.dim() != 2:
        raise ValueError(f"calibration ids must be [B, T], got shape {tuple(ids.shape)}")
    cos, sin = model.rope_at(torch.arange(ids.shape[1], device=ids.device))
    x = model.model.embed_tokens(ids)  # [B, T, E]: layer 0's input
    layers: dict[str, CalibratedLinear] = {}
    needs_inputs = method != "rtn" or on_layer is not None  # round-to-nearest needs no calibration pass
    for index, layer in enumerate(model.model.layers):
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        if not needs_inputs:
            layers.update(
                {
                    f"model.layers.{index}.{name}": quantize_linear(m, m.weight[:0], method, bits, group_size)
                    for name, m in linears.items()
                }
            )
            continue
        with recording(linears) as inputs:
            float_out = layer(x, cos, sin)
        if on_layer is not None:
            on_layer(index, inputs)
        made = {
            name: quantize_linear(linears[name], inputs[name], method, bits, group_size, awq_rows, **options)
            for name in linears
        }
        layers.update({f"model.layers.{index}.{name}": module for name, module in made.items()})
        del inputs, float_out
        with swapped(layer, made):
            x = layer(x, cos, sin)  # the next layer calibrates on this quantized layer's outputs
    return Calibrated(
        layers,
        time.perf_counter() - start,
        {
            "method": method,
            "bits": bits,
            "group_size": group_size,
            "tokens": list(ids.shape),
            **{k: v for k, v in options.items() if not callable(v)},
        },
    )


def apply_layers(model: nn.Module, layers: dict[str, nn.Module]) -> nn.Module:
    """Swap the calibrated layers into `model` in place (every decoder linear must have one); returns it."""
    return replace_linears(model, by_identity(model, layers))


__all__ = [
    "METHODS",
    "TextSplit",
    "text_split",
    "calibration_ids",
    "decoder_linears",
    "recording",
    "record_inputs",
    "quantize_linear",
    "swapped",
    "Calibrated",
    "calibrate_model",
    "apply_layers",
]

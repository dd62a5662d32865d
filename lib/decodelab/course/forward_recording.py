"""Your forward pass and the library's, recorded at the same named points on the same weights and
token ids: what `decodelab.course.diagnosis` compares.

The library's model is watched by forward hooks on its modules and a recording `kv_cache` (the
model's own `attend` hook). Yours, `forward(weights, config, ids, attend[, positions])`, gets a
recording `attend` (q and k after RoPE, v, attention's output), and while it runs, the functions it
calls by name from its notebook (`decoder_layer`, `rms_norm`, `rope`, `mlp`, looked up in
`forward.__globals__`) are wrapped to record what they take and return, then put back; a norm is
known by the weight it is given, a rope call by attend receiving its result as q or k. What a
forward computes inline (the projections, o_proj and the residual adds, the embedding, the
lm_head) is not recorded: it shows at the next point that is.

Points of layer i, in the order a layer computes them (`LAYER_POINTS`), keys "i.input_norm" and so on:
input_norm [B, T, E]; q, k, v, the projections split into heads [B, H or H_kv, T, D]; q_rope, k_rope;
attention [B, H, T, D]; attn_residual, x + o_proj(out) [B, T, E]; post_norm; mlp; layer_output.
Before the layers "embedding" [B, T, E], after them "final_norm" [B, T, E] and "logits" [B, T, V].
The library's side also keeps "i.k_all" and "i.v_all", everything layer i held [B, H_kv, S, D].
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch

from decodelab.model.kv_cache import KVCache

LAYER_POINTS = (
    "input_norm",
    "q",
    "k",
    "v",
    "q_rope",
    "k_rope",
    "attention",
    "attn_residual",
    "post_norm",
    "mlp",
    "layer_output",
)


class Record:
    """What one side computed, one dict per pass: point key ("embedding", "3.q_rope", "logits") -> tensor."""

    def __init__(self, weights: dict, num_layers: int):
        self.steps: list[dict] = []
        self.num_layers, self.layer, self.pending, self.failed_in = num_layers, 0, [], None
        self.names = {id(t): name for name, t in weights.items()}
        self.norms = {name: t for name, t in weights.items() if name.endswith("norm.weight")}

    def put(self, key: str, value) -> None:
        if isinstance(value, torch.Tensor) and key not in self.steps[-1]:  # the first recording wins
            self.steps[-1][key] = value.detach().clone()

    def name_of(self, weight) -> str:
        """The state dict's name for `weight`: the same tensor, else a norm weight of equal values."""
        if id(weight) in self.names or not isinstance(weight, torch.Tensor):
            return self.names.get(id(weight), "")
        return next((n for n, t in self.norms.items() if t.shape == weight.shape and torch.equal(t, weight.to(t))), "")

    def run(self, key: str, fn, args, kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.failed_in = self.failed_in or key  # the innermost watched call names the failure
            raise


def _leading(fn, args, kwargs, n: int) -> list:
    """The first n arguments of a call to fn, passed by position or by name."""
    try:
        values = list(inspect.signature(fn).bind(*args, **kwargs).arguments.values())
    except (TypeError, ValueError):
        values = list(args)
    return (values + [None] * n)[:n]


def _watch_norm(fn, rec: Record):
    def rms_norm(*args, **kwargs):
        x, weight = _leading(fn, args, kwargs, 2)
        name, step = rec.name_of(weight), rec.steps[-1]
        i = name.split(".")[2] if name.startswith("model.layers.") else None
        keys = None  # (the stream it reads, what it returns); a norm met out of the pre-norm order is not placed
        if name == "model.norm.weight":
            keys = (f"{rec.num_layers - 1}.layer_output", "final_norm")
        elif name.endswith("input_layernorm.weight") and f"{i}.q_rope" not in step:
            rec.layer = int(i)
            keys = ("embedding" if i == "0" else f"{int(i) - 1}.layer_output", f"{i}.input_norm")
        elif name.endswith("post_attention_layernorm.weight") and f"{i}.mlp" not in step:
            keys = (f"{i}.attn_residual", f"{i}.post_norm")
        out = rec.run(keys[1] if keys else "rms_norm", fn, args, kwargs)
        if keys:
            rec.put(keys[0], x), rec.put(keys[1], out)
        return out

    return rms_norm


def _watch_rope(fn, rec: Record):
    def rope(*args, **kwargs):
        out = rec.run(f"{rec.layer}.rope", fn, args, kwargs)
        rec.pending.append((_leading(fn, args, kwargs, 1)[0], out))  # q or k: attend tells which
        return out

    return rope


def _watch_mlp(fn, rec: Record):
    def mlp(*args, **kwargs):
        name = rec.name_of(_leading(fn, args, kwargs, 2)[1])
        key = f"{name.split('.')[2] if name.startswith('model.layers.') else rec.layer}.mlp"
        out = rec.run(key, fn, args, kwargs)
        rec.put(key, out)
        return out

    return mlp


def _watch_layer(fn, rec: Record):
    def decoder_layer(*args, **kwargs):
        _, _, i, x = _leading(fn, args, kwargs, 4)
        if not isinstance(i, int):  # not the exercise's signature: run it unrecorded (its error, if any, is its own)
            return fn(*args, **kwargs)
        rec.layer = i
        rec.put("embedding" if i == 0 else f"{i - 1}.layer_output", x)
        out = rec.run(f"{i}.layer", fn, args, kwargs)
        rec.put(f"{i}.layer_output", out)
        return out

    return decoder_layer


_WATCHERS = {"decoder_layer": _watch_layer, "rms_norm": _watch_norm, "rope": _watch_rope, "mlp": _watch_mlp}


def _watch_attend(attend, rec: Record, cache: KVCache | None = None):
    def watched(layer_index, q, k, v):
        rec.layer = layer_index
        for x, out in rec.pending:  # the rope calls whose results are this q and k: their inputs are the projections
            if out is q or out is k:
                rec.put(f"{layer_index}.{'q' if out is q else 'k'}", x)
        rec.pending = []
        for name, value in (("q_rope", q), ("k_rope", k), ("v", v)):
            rec.put(f"{layer_index}.{name}", value)
        out = rec.run(f"{layer_index}.attention", attend, (layer_index, q, k, v), {})
        rec.put(f"{layer_index}.attention", out)
        if cache is not None:  # the library's side keeps everything held, [B, H_kv, S, D], for known_mistakes
            k_all, v_all = cache.view(layer_index)
            rec.put(f"{layer_index}.k_all", k_all), rec.put(f"{layer_index}.v_all", v_all)
        return out

    return watched


@contextlib.contextmanager
def _watching(model, lib: Record, forward, mine: Record):
    """Hooks on the library's modules; your notebook's decoder_layer, rms_norm, rope and mlp wrapped."""

    def keep(key, heads=None):
        def hook(_module, _inputs, out):  # q_proj's [B, T, H*D] is kept as the layer splits it: [B, H, T, D]
            lib.put(key, out.view(out.shape[0], out.shape[1], heads, -1).transpose(1, 2) if heads else out)

        return hook

    config, m = model.config, model.model
    handles = [
        m.embed_tokens.register_forward_hook(keep("embedding")),
        m.norm.register_forward_hook(keep("final_norm")),
    ]
    for i, layer in enumerate(m.layers):
        handles += [
            layer.input_layernorm.register_forward_hook(keep(f"{i}.input_norm")),
            layer.self_attn.q_proj.register_forward_hook(keep(f"{i}.q", config.num_attention_heads)),
            layer.self_attn.k_proj.register_forward_hook(keep(f"{i}.k", config.num_key_value_heads)),
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda _m, inputs, key=f"{i}.attn_residual": lib.put(key, inputs[0])
            ),
            layer.post_attention_layernorm.register_forward_hook(keep(f"{i}.post_norm")),
            layer.mlp.register_forward_hook(keep(f"{i}.mlp")),
            layer.register_forward_hook(keep(f"{i}.layer_output")),
        ]
    namespace = getattr(forward, "__globals__", {})
    originals = {name: namespace[name] for name in _WATCHERS if callable(namespace.get(name))}
    try:
        namespace.update({name: _WATCHERS[name](fn, mine) for name, fn in originals.items()})
        yield
    finally:
        namespace.update(originals)
        for handle in handles:
            handle.remove()


def record(forward, model, weights: dict, ids: torch.Tensor, chunks: list[int], attention=None):
    """Run the library's `model` and your `forward` on `weights` (the model's state dict, the one dict
    both sides read) and ids [B, T], in passes of `chunks` tokens through a KV cache each (positions
    passed to forward from the second pass on, as the visible tests do); `attention(cache, layer_index,
    q, k, v)` as your attend, or the library's KVCache.attend. Returns (library's Record, yours, the
    passes as (ids [B, n], positions [n]), the exception your forward raised or None): yours stops there."""
    config = model.config
    lib, mine = Record(weights, config.num_hidden_layers), Record(weights, config.num_hidden_layers)
    caches = [KVCache(config, ids.shape[0], ids.shape[1], device=ids.device, dtype=model.dtype) for _ in range(2)]
    library_cache = types.SimpleNamespace(attend=_watch_attend(caches[0].attend, lib, caches[0]))
    attend = _watch_attend(functools.partial(attention, caches[1]) if attention else caches[1].attend, mine)
    error, start, passes = None, 0, []
    with _watching(model, lib, forward, mine):
        for n in chunks:
            piece, positions = ids[:, start : start + n], torch.arange(start, start + n, device=ids.device)
            lib.steps.append({}), mine.steps.append({}), passes.append((piece, positions))
            lib.put("logits", model(piece, positions=positions, kv_cache=library_cache))
            try:
                logits = forward(weights, config, piece, attend, *([positions] if start else []))
                if not isinstance(logits, torch.Tensor):
                    raise TypeError(f"forward returned {type(logits).__name__}, not a tensor of logits [B, T, V]")
            except Exception as exc:  # noqa: BLE001 - whatever your forward raises is part of the diagnosis
                error = exc
                break
            mine.put("logits", logits)
            start += n
    return lib, mine, passes, error

"""Where your forward pass and the library's part: `diagnose(forward, model, input_ids)` runs both on
the same weights and token ids, compares them point by point in the order a model computes them,
and names the first operation that differs, by how much, and what commonly causes it.

    from decodelab import course
    print(course.diagnose(forward, model, ids))                       # one pass from position 0
    print(course.diagnose(forward, model, ids, chunks=[6, 1, 1, 1]))  # a prefill, then one token at a time
    with course.diagnose_on_failure(forward, model, ids):             # a visible test: the diagnosis
        expect_close(got, expected, "...")                            # joins the failure's message

Both run on the model's state dict, recorded at the same named points (`decodelab.course.forward_recording`:
hooks on the library's modules; on your side a recording `attend` and, while your forward runs, the
`decoder_layer`, `rms_norm`, `rope` and `mlp` it calls by name). Points are compared in the order the
model computes them; a point differs when max |yours - library's| exceeds rtol times the library's
largest |value| there. At the first that differs, `decodelab.course.known_mistakes` simulates the
known mistakes of that operation from the library's own inputs: the one your values equal, if any, is
named; else the pattern of the difference and the operation's common causes. What your forward
computes inline (not recorded on its own) is listed, since the cause may lie there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from decodelab.course.forward_recording import LAYER_POINTS, Record, record
from decodelab.course.known_mistakes import COMMON, LABELS, NOT_REPEATED, Inputs, mistakes, symptom


@dataclass
class Diagnosis:
    """Where yours and the library's first differ: the operation's point name ("q_rope", "attention",
    "logits", ...; see `LAYER_POINTS`; None where nothing differs) and its layer (None outside the
    layers), the largest |difference| there, the known mistake your values equal (if one does), the
    error your forward raised (if it did: then `point` is where it raised, if it was inside a recorded
    call), and the message: `str(diagnosis)`, 2-4 lines."""

    point: str | None = None
    layer: int | None = None
    max_diff: float = 0.0
    mistake: str | None = None
    error: str | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return self.error is None and self.point is None

    def __str__(self) -> str:
        return "\n".join(self.lines)

    __repr__ = __str__


# --------------------------------------------------------------------------- comparing, and saying what differs


def _order(num_layers: int) -> list[str]:
    return ["embedding", *(f"{i}.{p}" for i in range(num_layers) for p in LAYER_POINTS), "final_norm", "logits"]


def _split(key: str) -> tuple[int | None, str]:
    layer, _, point = key.rpartition(".")
    return (int(layer) if layer else None), point


def _describe(key: str) -> str:
    layer, point = _split(key)
    return LABELS[point] if layer is None else f"layer {layer}, {LABELS[point]}"


def _previous(key: str, num_layers: int) -> str | None:
    """The point `key` is computed from (one path back through the model), or None."""
    layer, point = _split(key)
    if layer is None:
        return {"logits": "final_norm", "final_norm": f"{num_layers - 1}.layer_output"}.get(point)
    if point == "input_norm":
        return "embedding" if layer == 0 else f"{layer - 1}.layer_output"
    return (
        f"{layer}."
        + {
            "q": "input_norm",
            "k": "input_norm",
            "v": "input_norm",
            "q_rope": "q",
            "k_rope": "k",
            "attention": "q_rope",
            "attn_residual": "attention",
            "post_norm": "attn_residual",
            "mlp": "post_norm",
            "layer_output": "mlp",
        }[point]
    )


def _span(positions: list[int]) -> str:
    if len(positions) == 1:
        return f"position {positions[0]}"
    if positions == list(range(positions[0], positions[-1] + 1)):
        return f"positions {positions[0]}-{positions[-1]}"
    return "positions " + ", ".join(map(str, positions))


def _where(diff: torch.Tensor, point: str, tol: float, first_position: int):
    """' at position 3 (positions 0-2 agree)', whether each new token agrees, whether each head agrees."""
    token_dim = 2 if point in ("q", "k", "v", "q_rope", "k_rope", "attention") else 1
    if diff.dim() <= token_dim:
        return "", [], None
    per_position = diff.transpose(0, token_dim).reshape(diff.shape[token_dim], -1).amax(1)  # [T]
    agrees = (per_position <= tol).tolist()
    text = f" at position {first_position + int(per_position.argmax())}"
    agreeing = [first_position + t for t, ok in enumerate(agrees) if ok]
    if agreeing:
        text += f" ({_span(agreeing)} agree{'s' if len(agreeing) == 1 else ''})"
    elif len(agrees) > 1:
        text += " (every position differs)"
    heads = (diff.transpose(0, 1).reshape(diff.shape[1], -1).amax(1) <= tol).tolist() if token_dim == 2 else None
    return text, agrees, heads


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.double(), b.double()
    return bool((((a - b).abs() <= tol) | (a.isnan() & b.isnan())).all())


def _matching_mistake(point: str, got, expected, tol: float, inputs: Inputs) -> str | None:
    """The first known mistake whose simulated values are yours (and not the library's)."""
    try:
        candidates = mistakes(point, inputs)
    except (KeyError, RuntimeError, ValueError, IndexError):
        return None
    for text, make in candidates:
        try:
            values = make()
        except (KeyError, RuntimeError, ValueError, IndexError):
            continue  # a mistake these shapes do not allow
        if values.shape == got.shape and not _close(values, expected, tol) and _close(got, values, tol):
            return text
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _difference(key: str, ours: dict, theirs: dict, rtol: float, inputs: Inputs, step: str) -> Diagnosis | None:
    """The diagnosis at `key` if yours differs from the library's there, else None."""
    got, expected, num_layers = ours[key], theirs[key], inputs.config.num_hidden_layers
    layer, point = _split(key)
    if got.shape != expected.shape:
        return Diagnosis(
            point,
            layer,
            float("inf"),
            lines=[
                f"The first difference is at {_describe(key)}{step}: shape {list(got.shape)} where the library's is "
                f"{list(expected.shape)}.",
                COMMON[point],
            ],
        )
    diff = (got.double() - expected.double()).abs().nan_to_num(nan=float("inf"))  # [same shape]
    tol = rtol * max(expected.double().abs().max().item(), 1e-12)
    if diff.max().item() <= tol:
        return None
    where, position_agrees, head_agrees = _where(diff, point, tol, int(inputs.positions[0]))
    size = "NaN" if got.isnan().any() else f"{diff.max().item():.3g}"
    mistake = _matching_mistake(point, got, expected, tol, inputs)
    lines = [
        f"The first difference is at {_describe(key)}{step}: max |diff| {size}{where}.",
        f"Your values are exactly what this mistake gives: {mistake}."
        if mistake
        else " ".join(
            filter(
                None,
                [
                    symptom(point, got, expected, tol, position_agrees, int(inputs.positions[0]), head_agrees),
                    COMMON[point],
                ],
            )
        ),
    ]
    unseen, before = [], _previous(key, num_layers)
    while before is not None and before not in ours:  # what your forward computed without a recorded call
        unseen.append(_describe(before))
        before = _previous(before, num_layers)
    if unseen:
        lines.append(
            "Not recorded on its own before it (computed without a call to decoder_layer, rms_norm, rope or "
            f"mlp), so the cause may lie there: {'; '.join(reversed(unseen))}."
        )
    return Diagnosis(point, layer, diff.max().item(), mistake, lines=lines)


def _judge(lib: Record, mine: Record, passes: list, rtol: float, error, weights: dict, config) -> Diagnosis:
    checked = 0
    for theirs, ours, (ids, positions) in zip(lib.steps, mine.steps, passes):
        start = int(positions[0])
        step = (
            f" (in the pass over {_span(list(range(start, start + len(positions))))}, {start} tokens cached)"
            if len(passes) > 1
            else ""
        )
        for key in _order(config.num_hidden_layers):
            if key not in ours or key not in theirs:
                continue
            found = _difference(
                key, ours, theirs, rtol, Inputs(theirs, weights, config, ids, positions, _split(key)[0] or 0), step
            )
            if found is not None:
                if error is not None:
                    found.error = _first_line(error)
                    found.lines.append(f"Later, your forward raised {found.error}")
                return found
            checked += 1
    if error is not None:
        failed = mine.failed_in or "forward"  # the innermost recorded call that raised, else the forward itself
        layer, point = _split(failed)
        many_kv = config.num_key_value_heads not in (1, config.num_attention_heads)
        return Diagnosis(
            point,
            layer,
            0.0,
            None,
            _first_line(error),
            [
                f"Your forward raised {_first_line(error)}, in {_describe(failed)}.",
                f"Everything it computed before agrees with the library's ({checked} points checked).",
                NOT_REPEATED if point == "attention" and many_kv else COMMON[point],
            ],
        )
    every = len(passes) * len(_order(config.num_hidden_layers))
    return Diagnosis(
        lines=[
            f"No difference: all {checked} points recorded on both sides (of {every}: the embedding, each "
            f"layer's norms, projections, RoPE, attention, MLP and residual adds, the final norm, the "
            f"logits) agree with the library's to within {rtol:g} of their size."
        ]
    )


@torch.inference_mode()
def diagnose(
    forward, model, input_ids: torch.Tensor, chunks=None, attention=None, rtol: float | None = None
) -> Diagnosis:
    """Run your `forward` and the library's `model` on the same weights (the model's state dict) and
    input_ids [B, T], and say where they first differ; `str()` of the result is the message.

    forward: forward(weights, config, input_ids, attend, positions=None) -> logits [B, T, V].
    chunks: the lengths of successive passes through a KV cache, e.g. [6, 1, 1, 1] (a prefill of 6,
    then single tokens; positions are passed from the second pass on); default one pass of T.
    attention: your attention(cache, layer_index, q, k, v) as attend (default: the library's KVCache.attend).
    rtol: the largest difference that counts as agreeing, relative to a point's largest |value|
    (default 1e-4 for float32, 1e-2 for half precision). Raises ValueError for chunks that do not add up to T.
    """
    config, weights = model.config, model.state_dict()  # one dict: your norms are known by these very tensors
    ids = input_ids.to(model.device)
    chunks = [ids.shape[1]] if chunks is None else [int(n) for n in chunks]
    if not chunks or min(chunks) < 1 or sum(chunks) != ids.shape[1]:
        raise ValueError(f"chunks {chunks} must be positive lengths adding up to input_ids' {ids.shape[1]} tokens")
    rtol = rtol or (1e-4 if model.dtype == torch.float32 else 1e-2)
    lib, mine, passes, error = record(forward, model, weights, ids, chunks, attention)
    return _judge(lib, mine, passes, rtol, error, weights, config)


@contextlib.contextmanager
def diagnose_on_failure(forward, model, input_ids: torch.Tensor, chunks=None, attention=None):
    """Run the block (a visible test's checks of forward's logits); if it raises AssertionError, raise it
    again with `diagnose(forward, model, input_ids, chunks, attention)` appended to its message."""
    try:
        yield
    except AssertionError as failure:
        try:
            found = str(diagnose(forward, model, input_ids, chunks, attention))
        except Exception as exc:  # noqa: BLE001 - the failure itself matters more than its diagnosis
            found = f"(no diagnosis: {_first_line(exc)})"
        raise AssertionError(f"{failure}\n{found}") from None

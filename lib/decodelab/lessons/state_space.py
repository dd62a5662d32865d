"""Notebook 15's references and measurements: a Mamba-style state-space model beside the transformer.

The references the notebook's exercises are graded against, where the library's model does not
already hold them (`model.mamba.selective_step` and `selective_scan` are the other two):
- `mixer_forward`: one Mamba mixer over a whole prompt, written out step by step (in_proj, the
  causal depthwise conv, the input-dependent Δ, B, C, A = -exp(A_log), the scan, the D skip, the
  SiLU gate, out_proj); it equals `MambaMixer.forward` without a state;
- `generate_with_state`: greedy decoding that carries the fixed-size `MambaState` from the prompt
  to each new token instead of a KV cache.

And what the notebook measures, the transformer (`tiny`) and the SSM (`tiny-mamba`) side by side on
the same token ids: `held_bytes` (K/V or state after a prefill of n tokens), `prefill_seconds`,
`decode_seconds_per_token`, `copy_recall` (a random segment repeated after a gap of other text: how
many of its tokens the model predicts the second time, and how much the first copy lowers their loss)
and `heldout_perplexity`.

Shapes: b batch, T tokens, H hidden_size, E intermediate_size, N state_size, R time_step_rank,
K conv_kernel, V vocab_size.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodelab.decoding.generate import decode_state_class
from decodelab.model.mamba import MambaForCausalLM, MambaMixer, MambaState, selective_scan
from decodelab.validation import check_int

__all__ = [
    "Chunked",
    "CopyScore",
    "copy_recall",
    "copy_task",
    "decode_seconds_per_token",
    "generate_with_state",
    "held_bytes",
    "heldout_perplexity",
    "mixer_forward",
    "prefill_seconds",
    "scan_inputs",
    "text_ids",
]


# --------------------------------------------------------------------------- the references
def scan_inputs(mixer: MambaMixer, h: torch.Tensor):
    """What one mixer feeds its scan for a prompt from a zero state: h [b, T, H] -> (x [b, T, E], Δ [b, T, E],
    A [E, N], B [b, T, N], C [b, T, N], z [b, T, E]), the scan's inputs in float32 and the gate's z.

    x goes through the causal depthwise conv and SiLU; Δ, B and C come from each token's own x (selective);
    A = -exp(A_log). Raises ValueError for an h that is not [b, T, H] with H the mixer's hidden size."""
    if h.dim() != 3 or h.shape[-1] != mixer.in_proj.in_features:
        raise ValueError(f"h must be [b, T, {mixer.in_proj.in_features}], got {list(h.shape)}")
    T = h.shape[1]
    x, z = mixer.in_proj(h).chunk(2, dim=-1)  # [b, T, E] each
    # causal depthwise conv: Conv1d pads K-1 on both sides; the first T outputs see tokens t-K+1..t only
    x = F.silu(mixer.conv1d(x.transpose(1, 2))[..., :T]).transpose(1, 2)  # [b, T, E]
    rank, B, C = mixer.x_proj(x).split([mixer.R, mixer.N, mixer.N], dim=-1)  # [b, T, R], [b, T, N] x2
    dt = F.softplus(mixer.dt_proj(rank))  # [b, T, E]: Δ from each token's own x, > 0
    A = -torch.exp(mixer.A_log.float())  # [E, N]: negative, so exp(Δ A) is a decay in (0, 1]
    return x.float(), dt.float(), A, B.float(), C.float(), z


def mixer_forward(mixer: MambaMixer, h: torch.Tensor) -> torch.Tensor:
    """One Mamba mixer over a whole prompt from a zero state: h [b, T, H] -> [b, T, H] (float32 inside).

    Equals `mixer(h)` (transformers' MambaMixer arithmetic): `scan_inputs`, the chunked scan, the D skip,
    the SiLU gate, out_proj. Raises ValueError for an h that is not [b, T, H]."""
    x, dt, A, B, C, z = scan_inputs(mixer, h)
    y, _ = selective_scan(x, dt, A, B, C)  # [b, T, E]
    y = (y + x * mixer.D.float()) * F.silu(z.float())  # the D skip, the SiLU gate
    return mixer.out_proj(y.to(h.dtype))


@torch.inference_mode()
def generate_with_state(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding that carries the model's fixed-size state: the max_new_tokens new ids.

    The prompt goes in once ([1, P]) into a fresh `MambaState(model.config, 1)`; each later step feeds
    only the newest token ([1, 1]) with the same state, which the model updates in place. The ids equal
    `generate_without_cache` (the whole sequence recomputed each step). ValueError for an empty prompt
    or a negative max_new_tokens."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    state = MambaState(model.config, 1, device=model.device, dtype=model.dtype)
    inputs, new_ids = torch.tensor([list(prompt_ids)], device=model.device), []
    for _ in range(max_new_tokens):
        logits = model(inputs, kv_cache=state, last_only=True)  # [1, 1, V]
        new_ids.append(int(logits[0, -1].argmax()))
        inputs = torch.tensor([[new_ids[-1]]], device=model.device)
    return new_ids


# --------------------------------------------------------------------------- measurements
def text_ids(tokenizer, text: str, count: int) -> list[int]:
    """The first `count` token ids of text (ValueError when it holds fewer)."""
    ids = tokenizer.encode(text)
    if len(ids) < count:
        raise ValueError(f"the text holds {len(ids)} tokens, fewer than the {count} asked for")
    return ids[:count]


# The scan's chunk for the measurements: token by token is the least arithmetic, the fastest form on a CPU
# (the chunked form trades L times more arithmetic for T / L sequential turns, which pays on a GPU).
MEASURE_CHUNK = 1


def _forward(model, ids: torch.Tensor, chunk_size: int = MEASURE_CHUNK, **kwargs) -> torch.Tensor:
    """model(ids, **kwargs), a Mamba model's scan in chunks of chunk_size (a transformer has no chunks)."""
    if isinstance(model, MambaForCausalLM):
        kwargs["chunk_size"] = chunk_size
    return model(ids, **kwargs)


class Chunked:
    """A model whose calls use the scan chunk `chunk_size` (for `lessons.perplexity`, which calls model(ids))."""

    def __init__(self, model, chunk_size: int = MEASURE_CHUNK):
        self.model, self.chunk_size = model, chunk_size

    config = property(lambda self: self.model.config)
    device = property(lambda self: self.model.device)

    def __call__(self, ids, **kwargs):
        return _forward(self.model, ids, self.chunk_size, **kwargs)


def _carried(model, length: int):
    """What the model carries for a sequence of `length` tokens: its state or a KV cache of that length."""
    cls = decode_state_class(model)
    return cls(model.config, 1, length, device=model.device, dtype=model.dtype)


@torch.inference_mode()
def held_bytes(model, ids: list[int]) -> int:
    """Bytes of what decoding carries after a prefill of ids: K and V held (`KVCache.nbytes`) for a
    transformer, the whole `MambaState` for a state-space model."""
    carried = _carried(model, len(ids) + 1)
    _forward(model, torch.tensor([ids], device=model.device), kv_cache=carried, last_only=True)
    return carried.nbytes()


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def prefill_seconds(model, ids: list[int], repeats: int = 3, chunk_size: int = MEASURE_CHUNK) -> float:
    """Median wall seconds of one prefill of ids into a fresh cache or state (after one warm-up); a Mamba
    model scans in chunks of chunk_size."""
    check_int("repeats", repeats, minimum=1)
    batch = torch.tensor([ids], device=model.device)

    def prefill():
        _forward(model, batch, chunk_size, kv_cache=_carried(model, len(ids) + 1), last_only=True)

    prefill()
    return _median_seconds(prefill, repeats)


@torch.inference_mode()
def decode_seconds_per_token(model, ids: list[int], steps: int = 8) -> float:
    """Median wall seconds of one decode step ([1, 1] in, the cache or state carried) after a prefill of
    ids: the cost of the next token at a context of len(ids)."""
    check_int("steps", steps, minimum=1)
    carried = _carried(model, len(ids) + steps + 1)
    logits = _forward(model, torch.tensor([ids], device=model.device), kv_cache=carried, last_only=True)
    token = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, kv_cache=carried, last_only=True)
        token = logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_task(
    filler: list[int],
    vocab_size: int,
    gap: int,
    segment: int = 12,
    trials: int = 8,
    seed: int = 0,
    control: bool = False,
):
    """(ids [trials, L], start): each row is 16 tokens of filler text, a segment of random token ids, `gap`
    tokens of filler, and the segment again, which starts at column `start`. With control=True the first
    segment is another random one (nothing to recall; the rows are otherwise the same). The filler is
    taken from a different place of `filler` in each row; ValueError when it is too short."""
    for name, value, low in (("gap", gap, 0), ("segment", segment, 2), ("trials", trials, 1)):
        check_int(name, value, minimum=low)
    lead = 16
    need = lead + gap
    if len(filler) < need + trials:
        raise ValueError(f"the filler holds {len(filler)} tokens; a gap of {gap} needs {need + trials}")
    rng = random.Random(seed)
    rows = []
    for _ in range(trials):
        at = rng.randrange(0, len(filler) - need)
        piece = filler[at : at + need]
        seg = [rng.randrange(3, vocab_size) for _ in range(segment)]
        other = [rng.randrange(3, vocab_size) for _ in range(segment)]
        rows.append(piece[:lead] + (other if control else seg) + piece[lead:] + seg)
    return torch.tensor(rows), lead + segment + gap


@dataclass(frozen=True)
class CopyScore:
    accuracy: float  # fraction of the second copy's tokens 2..segment predicted exactly (greedy)
    nats_saved: float  # their mean NLL with another segment first minus with the same one first
    standard_error: float  # of nats_saved: the per-token differences' standard deviation / sqrt(their count)


@torch.inference_mode()
def copy_recall(model, filler: list[int], gap: int, segment: int = 12, trials: int = 8, seed: int = 0) -> CopyScore:
    """How much the model recalls of a random segment seen `gap` tokens back, on `copy_task`'s rows: the
    second copy's tokens 2..segment (the first cannot be known), greedy accuracy, and the NLL the first copy
    saves against the control rows (another segment first, the same targets), token by token, with its
    standard error. 0 nats saved: nothing recalled."""
    losses, correct = {}, None
    for control in (False, True):
        ids, start = copy_task(filler, model.config.vocab_size, gap, segment, trials, seed, control)
        ids = ids.to(model.device)
        # a few rows per pass: a Mamba scan's token-by-token tensors are [rows, L, E, N]
        logits = torch.cat(
            [_forward(model, rows)[:, start : start + segment - 1].float() for rows in ids.split(4)]
        )  # [trials, segment-1, V]
        targets = ids[:, start + 1 : start + segment]  # [trials, segment-1]
        losses[control] = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").double()
        if not control:
            correct = float((logits.argmax(-1) == targets).float().mean())
    saved = losses[True] - losses[False]  # [trials * (segment-1)]
    return CopyScore(correct, float(saved.mean()), float(saved.std() / saved.numel() ** 0.5))


def heldout_perplexity(model, ids: list[int], window: int = 256, stride: int = 128) -> float:
    """`lessons.perplexity.perplexity` of ids (the same ids for both models: they share a tokenizer)."""
    from decodelab.lessons.perplexity import perplexity

    return perplexity(Chunked(model), ids, window=window, stride=stride)

"""Checks for notebook 15, state_space: the selective scan twice (`selective_step`, one token, and
`selective_scan`, a prompt in chunks), one Mamba mixer written out (`mixer_forward`) and decoding that
carries the fixed-size state (`generate_with_state`).

Each ``check_*`` takes the function under test (the library's reference in CI, a kept buggy version
in CI's negative tests, the learner's own in a notebook's hidden-test cell) and returns None or raises
``AssertionError`` naming the behaviour, the expected and the actual result.

The oracles: the step against the recurrence written here (h <- exp(Δ A) h + Δ B x, y = C h); the
chunked scan against `model.mamba.selective_step` run token by token (the two forms must agree within
1e-5), for chunk sizes that do and do not divide the length, from a zero and a given state; the mixer
against the library's `MambaMixer` (whose logits `tests/test_mamba.py` holds to transformers'
MambaForCausalLM), plus causality (a later token cannot move an earlier output); the decoding against
`generate_without_cache` (the whole sequence recomputed each step), with the calls counted so the
state must really be carried (the prompt once, then one token a step).
"""

from __future__ import annotations

import functools

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call
from decodelab.course.exercises import references
from decodelab.decoding.generate import generate_without_cache
from decodelab.lessons.measure import CountingModel
from decodelab.model.mamba import MambaConfig, MambaState, selective_step
from decodelab.model.toy import random_mamba
from decodelab.paths import PACKAGE_DATA

REFERENCES = references("15_state_space")

__all__ = [
    "answer_q_crossover_tokens",
    "answer_q_state_kib",
    "check_generate_with_state",
    "check_mixer_forward",
    "check_q_crossover_tokens",
    "check_q_state_kib",
    "check_selective_scan",
    "check_selective_step",
]

TOL = 1e-5  # float32, values of order 1: the two forms sum in different orders
TRANSFORMER_FOLDER = PACKAGE_DATA / "tiny"
SSM_FOLDER = PACKAGE_DATA / "tiny-mamba"


def _inputs(seed: int, b: int, T: int | None, E: int = 6, N: int = 4, dt_scale: float = 1.0):
    """Random scan inputs: x, Δ (softplus, > 0), A (negative), B, C, a state; T None for one token."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, E) if T is None else (b, T, E)
    x = torch.randn(*shape, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(*shape, generator=g)) * dt_scale
    A = -torch.exp(torch.randn(E, N, generator=g))
    bc = (b, N) if T is None else (b, T, N)
    B, C = torch.randn(*bc, generator=g), torch.randn(*bc, generator=g)
    return x, dt, A, B, C, torch.randn(b, E, N, generator=g)


def _pair(got, what: str):
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise AssertionError(f"{what}: expected a tuple (y, state) of two tensors, got {type(got).__name__}")
    return got


def _expect_close(got: torch.Tensor, want: torch.Tensor, what: str, why: str = "", tol: float = TOL) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: expected shape {list(want.shape)}, got {list(got.shape)}")
    diff = (got.float() - want.float()).abs()
    bound = tol * (1 + want.float().abs())
    if not bool((diff <= bound).all()) or not bool(torch.isfinite(got).all()):
        where = tuple(int(i) for i in torch.nonzero(~(diff <= bound))[0]) if bool((diff > bound).any()) else ()
        raise AssertionError(
            f"{what}: differs from the expected by up to {float(diff.nan_to_num(float('inf')).max()):.3g} "
            f"(tolerance {tol:g}, first at index {where})" + (f"; {why}" if why else "")
        )


# --------------------------------------------------------------------------- selective_step
def check_selective_step(selective_step_fn) -> None:
    """One token: new state exp(Δ A) h + Δ B x, y = sum over N of the new state times C."""
    cases = [
        ("a zero state", 0, 0.0, 1.0),
        ("a random state", 1, 1.0, 1.0),
        ("a random state, large Δ (the old state nearly forgotten)", 2, 1.0, 6.0),
        ("a random state, small Δ (the old state nearly kept)", 3, 1.0, 0.02),
    ]
    for desc, seed, keep, dt_scale in cases:
        x, dt, A, B, C, h = _inputs(seed, 2, None, dt_scale=dt_scale)
        h = h * keep
        decay = torch.exp(dt[..., None] * A)  # [b, E, N]
        want_state = decay * h + dt[..., None] * B[:, None, :] * x[..., None]
        want_y = (want_state * C[:, None, :]).sum(-1)
        what = f"selective_step ({desc}; b=2, E=6, N=4)"
        y, state = _pair(call(what, selective_step_fn, h.clone(), x, dt, A, B, C), what)
        _expect_close(
            state,
            want_state,
            f"{what}: the new state",
            "it is exp(Δ·A)·h + Δ·B·x: the old state decayed by exp(Δ·A) (A is negative), plus the input scaled by Δ",
        )
        _expect_close(y, want_y, f"{what}: y", "y = the new state times C, summed over the N state entries")


# --------------------------------------------------------------------------- selective_scan
def _step_loop(x, dt, A, B, C, state):
    """The oracle: the library's one-token step, T times."""
    b, T, E = x.shape
    h = torch.zeros(b, E, A.shape[-1]) if state is None else state
    ys = []
    for t in range(T):
        y, h = selective_step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    return torch.stack(ys, 1), h


def check_selective_scan(selective_scan_fn) -> None:
    """The chunked scan equals the step run token by token, for any chunk size, from zeros or a state."""
    for desc, seed, T, chunk, with_state in [
        ("37 tokens, chunk_size 16 (not a divisor), zero start", 10, 37, 16, False),
        ("37 tokens, chunk_size 16, from a given state", 11, 37, 16, True),
        ("20 tokens, chunk_size 4, from a given state", 12, 20, 4, True),
        ("9 tokens, chunk_size 1", 13, 9, 1, True),
        ("5 tokens, chunk_size 16 (one short chunk)", 14, 5, 16, False),
    ]:
        x, dt, A, B, C, h = _inputs(seed, 2, T, dt_scale=0.5)
        start = h if with_state else None
        want_y, want_h = _step_loop(x, dt, A, B, C, start)
        what = f"selective_scan ({desc}; b=2, E=6, N=4)"
        got = call(what, selective_scan_fn, x, dt, A, B, C, None if start is None else start.clone(), chunk_size=chunk)
        y, last = _pair(got, what)
        why = (
            "each chunk must start from the state the previous chunk ended in (and the first from the given state), "
            "and inside a chunk h_t = exp(a_s+1 + ... + a_t) h_s + the inputs after s, decayed the same way"
        )
        _expect_close(y, want_y, f"{what}: y against selective_step token by token", why)
        _expect_close(last, want_h, f"{what}: the last state against selective_step token by token", why)


# --------------------------------------------------------------------------- mixer_forward
MIXER_WHY = (
    "Δ = softplus(dt_proj(the first R of x_proj(x))) for each token, A = -exp(A_log), the conv keeps its "
    "first T outputs (causal), then y = scan + D·x, times SiLU(z), through out_proj"
)


def check_mixer_forward(mixer_forward_fn) -> None:
    """The mixer on a prompt equals the library's MambaMixer (transformers' arithmetic), and is causal."""
    model = random_mamba(seed=15, hidden_size=32, state_size=8)
    g = torch.Generator().manual_seed(150)
    for layer, T in ((0, 13), (1, 21)):
        mixer = model.backbone.layers[layer].mixer
        h = torch.randn(2, T, 32, generator=g)
        what = f"mixer_forward (layer {layer} of a random Mamba, h [2, {T}, 32])"
        with torch.no_grad():
            want = mixer(h)
            got = call(what, mixer_forward_fn, mixer, h)
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__}")
        _expect_close(got, want, f"{what} against the library's MambaMixer", MIXER_WHY, tol=1e-4)
        later = h.clone()
        later[:, 9:] = torch.randn(2, T - 9, 32, generator=g)
        with torch.no_grad():
            moved = call(what, mixer_forward_fn, mixer, later)
        if not torch.allclose(moved[:, :9], got[:, :9], atol=1e-5, rtol=1e-5):
            raise AssertionError(
                f"{what}: changing tokens 9.. moved the outputs of tokens 0..8: the mixer must be causal "
                "(the conv sees only the current and earlier tokens: keep its first T outputs)"
            )


# --------------------------------------------------------------------------- generate_with_state
def check_generate_with_state(generate_fn) -> None:
    """Greedy ids equal recomputing the whole sequence; the prompt goes in once, then one token a step."""
    model = random_mamba(seed=16, vocab_size=61, max_position_embeddings=128)
    for prompt, n in (([5, 17, 3, 40, 22, 8, 9], 12), ([31], 6), (list(range(2, 22)), 9)):
        what = f"generate_with_state(a random Mamba, prompt of {len(prompt)} tokens, {n} new)"
        want = generate_without_cache(model, prompt, n)
        counting = CountingModel(model)
        got = call(what, generate_fn, counting, prompt, n)
        if not isinstance(got, list) or [int(t) for t in got] != want:
            raise AssertionError(
                f"{what}: expected the ids of recomputing the whole sequence each step {want}, got {got}: the "
                "state must be carried from the prompt through every step (one MambaState, passed as kv_cache=)"
            )
        fed = counting.calls
        expected = [(len(prompt), True)] + [(1, True)] * (n - 1)
        if fed != expected:
            raise AssertionError(
                f"{what}: expected the prompt once ({len(prompt)} tokens) with the state, then one token a step "
                f"with the state, {n} calls; the model was called with (tokens, state passed) {fed}"
            )
    got = call("generate_with_state(prompt [3, 4], 0 new)", generate_fn, model, [3, 4], 0)
    if list(got) != []:
        raise AssertionError(f"generate_with_state(prompt [3, 4], 0 new): expected [], got {got}")


# --------------------------------------------------------------------------- predictions
@functools.lru_cache(maxsize=None)
def _configs():
    from decodelab.config import ModelConfig

    return ModelConfig.from_file(TRANSFORMER_FOLDER / "config.json"), MambaConfig.from_file(SSM_FOLDER / "config.json")


def answer_q_state_kib() -> float:
    """tiny-mamba's MambaState in float32, batch 1, in KiB: the conv inputs and the scan state of every layer."""
    return MambaState(_configs()[1], 1).nbytes() / 1024


def check_q_state_kib(value) -> None:
    expect_answer(
        "q_state_kib",
        value,
        answer_q_state_kib(),
        "per layer E x (K-1) conv inputs and E x N scan values, 4 bytes each, for any context length",
    )


def answer_q_crossover_tokens() -> float:
    """The shortest context at which tiny's K and V (float32, batch 1) take more bytes than tiny-mamba's state."""
    transformer, ssm = _configs()
    per_token = 2 * transformer.num_hidden_layers * transformer.num_key_value_heads * transformer.head_dim * 4
    return float(MambaState(ssm, 1).nbytes() // per_token + 1)


def check_q_crossover_tokens(value) -> None:
    expect_answer(
        "q_crossover_tokens",
        value,
        answer_q_crossover_tokens(),
        "tiny's K and V take 2 x layers x KV heads x head_dim x 4 bytes per token; divide the state's bytes by that",
    )

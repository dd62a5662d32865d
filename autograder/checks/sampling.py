"""Checks for notebook 02, `decodelab.decoding.sampling`: temperature, top-k, top-p, repetition penalty, sampling;
and `decodelab.lessons.beam_search` (``check_beam_search``).

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and either
returns None or raises ``AssertionError`` whose message gives the input, the expected and the
actual result.

Two kinds of expected results:

* Hand-made cases whose answers are computed here by small plain-torch references (``_ref_*``,
  in float64). They never call ``decodelab.decoding.sampling``, so a bug in the library is caught too,
  and they run whether or not ``transformers`` is installed.
* Random logits with several leading dims, compared with the Hugging Face logits processors
  (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, RepetitionPenaltyLogitsProcessor)
  when ``transformers`` is importable, else with the plain-torch references.

Sampling tolerance (``check_sample``). N draws from an exact distribution p (computed here in
float64): the count of token i is Binomial(N, p_i), so its frequency f_i has standard error
s_i = sqrt(p_i (1 - p_i) / N), and by the normal approximation (every N p_i (1 - p_i) >= 100
here) P(|f_i - p_i| > z s_i) ~= 2 (1 - Phi(z)). Testing K categories at once with a total
false-alarm rate ALPHA, Bonferroni gives the per-category bound z = Phi^-1(1 - ALPHA / (2 K)):
a correct sampler, whatever order it consumes random numbers in, fails with probability at
most ~ALPHA = 1e-6. Tokens with probability exactly 0 (filtered out) must never be drawn.
"""

from __future__ import annotations

import functools
import math
import types
from statistics import NormalDist

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises, format_values
from decodelab.course.exercises import references

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("02_sampling")

__all__ = [
    "check_top_k_filter",
    "check_top_p_filter",
    "check_repetition_penalty",
    "check_process_logits",
    "check_sample",
    "check_beam_search",
    "check_q_top_p_uniform_kept",
    "check_q_frequency_std_error",
]

NEG_INF = float("-inf")
ALPHA = 1e-6  # total false-alarm probability of one check_sample frequency test
N_DRAWS = 20_000  # draws per frequency test
TOP_P_AMBIGUOUS = 1e-5  # |cumulative mass - p| below this: float32 rounding may decide either way


# --------------------------------------------------------------------------- Hugging Face


@functools.lru_cache(maxsize=None)
def _load_hf():
    """The four Hugging Face processors, or None when transformers is not importable."""
    try:
        from transformers import (
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )
    except Exception:  # not installed, or an install that fails to import: analytic cases only
        return None
    return types.SimpleNamespace(
        temperature=TemperatureLogitsWarper,
        top_k=TopKLogitsWarper,
        top_p=TopPLogitsWarper,
        repetition=RepetitionPenaltyLogitsProcessor,
    )


def _hf_apply(processor, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Run a Hugging Face processor (which wants [B, V] scores, [B, n] ids) on [..., V] logits."""
    vocab = logits.shape[-1]
    scores = logits.reshape(-1, vocab).clone()
    if token_ids is None:
        ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    else:
        ids = token_ids.reshape(scores.shape[0], -1).long()
    return processor(ids, scores).reshape(logits.shape)


# --------------------------------------------------------------------------- references


def _ref_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits.double() / temperature


def _ref_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep every logit >= the k-th largest (so ties with the k-th are kept)."""
    x = logits.double()
    k = min(k, x.shape[-1])
    kth = x.sort(dim=-1, descending=True).values[..., k - 1 : k]
    return x.masked_fill(x < kth, NEG_INF)


def _top_p_keep_counts(row: torch.Tensor, p: float) -> tuple[int, set[int]]:
    """For one 1-D row: (n, allowed) where n is the size of the smallest set of most likely
    tokens with mass >= p (float64), and allowed the counts float32 rounding may also give."""
    finite = row.double()[torch.isfinite(row)]
    if finite.numel() == 0:
        return 0, {0}
    if p >= 1:
        return finite.numel(), {finite.numel()}
    probs = finite.softmax(dim=-1).sort(descending=True).values
    cum = probs.cumsum(dim=-1).tolist()
    n = next((i + 1 for i, c in enumerate(cum) if c >= p), len(cum))
    allowed = {n}
    if n >= 2 and p - cum[n - 2] < TOP_P_AMBIGUOUS:
        allowed.add(n - 1)
    if cum[n - 1] - p < TOP_P_AMBIGUOUS and n < len(cum):
        allowed.add(n + 1)
    return n, allowed


def _ref_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens with mass >= p (float64; no ties expected)."""
    x = logits.double()
    rows = x.reshape(-1, x.shape[-1])
    out = torch.full_like(rows, NEG_INF)
    for r, row in enumerate(rows):
        n, _ = _top_p_keep_counts(row, p)
        keep = row.sort(descending=True).indices[:n]
        out[r, keep] = row[keep]
    return out.reshape(x.shape)


def _ref_repetition(logits: torch.Tensor, token_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    x = logits.double()
    seen = torch.zeros(x.shape, dtype=torch.bool)
    if token_ids.shape[-1] > 0:
        seen = seen.scatter(-1, token_ids.long(), True)
    penalized = torch.where(x < 0, x * penalty, x / penalty)
    return torch.where(seen, penalized, x)


def _ref_sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The exact distribution to sample from: temperature, then top-k, then top-p, softmax."""
    x = logits.double()
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[-1]).double()
    x = _ref_temperature(x, temperature)
    if top_k >= 1:
        x = _ref_top_k(x, top_k)
    if top_p < 1:
        x = _ref_top_p(x, top_p)
    return x.softmax(dim=-1)


# --------------------------------------------------------------------------- message helpers


def _row_name(index: int, lead_shape: torch.Size) -> str:
    if len(lead_shape) == 0:
        return ""
    coords = []
    for size in reversed(lead_shape):
        coords.append(index % size)
        index //= size
    coords = coords[0] if len(coords) == 1 else tuple(reversed(coords))
    return f" in row {coords} of a batch with leading dims {list(lead_shape)}"


def _check_tensor(desc: str, got, like: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(
            f"{desc} returned {type(got).__name__}; expected a torch.Tensor of shape {list(like.shape)}"
        )
    if got.shape != like.shape:
        raise AssertionError(
            f"{desc} returned shape {list(got.shape)}; expected {list(like.shape)} (the shape of the logits)"
        )
    if not got.is_floating_point():
        raise AssertionError(f"{desc} returned dtype {got.dtype}; expected floating-point logits")


def _check_unchanged(desc: str, before: torch.Tensor, after: torch.Tensor) -> None:
    if not torch.equal(before, after):
        raise AssertionError(
            f"{desc} modified its input logits in place: {format_values(before)} became {format_values(after)}; "
            "return a new tensor instead (the caller may still need the original logits)"
        )


def _compare(
    desc: str,
    x: torch.Tensor,
    expected: torch.Tensor,
    got,
    *,
    source: str,
    note: str = "",
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """got must equal expected: the same entries at -inf, the others close."""
    _check_tensor(desc, got, x)
    vocab = x.shape[-1]
    xs = x.detach().double().reshape(-1, vocab)
    es = expected.detach().double().reshape(-1, vocab)
    gs = got.detach().cpu().double().reshape(-1, vocab)
    e_removed, g_removed = es == NEG_INF, gs == NEG_INF
    both_finite = ~e_removed & ~g_removed
    close = torch.isclose(gs, es, rtol=rtol, atol=atol) | (e_removed & g_removed)
    bad = ~close | (e_removed != g_removed) | torch.isnan(gs) | (both_finite & ~torch.isfinite(gs))
    if not bad.any():
        return
    r = int(bad.any(dim=-1).nonzero()[0])
    lines = [f"{desc}: wrong result{_row_name(r, x.shape[:-1])}."]
    if note:
        lines.append(f"  ({note})")
    n_exp, n_got = int((~e_removed[r]).sum()), int((~g_removed[r]).sum())
    if n_exp != n_got:
        lines.append(f"  kept {n_got} of {vocab} tokens; expected {n_exp}.")
    if (e_removed[r] & ~g_removed[r] & (gs[r] < -1e30)).any():
        lines.append(_NOT_MINUS_INF)
    if vocab <= 16:
        lines += [
            f"  input:    {format_values(xs[r])}",
            f"  expected: {format_values(es[r])}   ({source})",
            f"  got:      {format_values(gs[r])}",
        ]
    else:
        lines.append(f"  expected from {source}; wrong tokens:")
        for i in bad[r].nonzero().flatten()[:6].tolist():
            lines.append(
                f"    token {i}: input {format_values(xs[r, i].item())}, "
                f"expected {format_values(es[r, i].item())}, got {format_values(gs[r, i].item())}"
            )
    raise AssertionError("\n".join(lines))


_NOT_MINUS_INF = "  (filtered entries must be exactly float('-inf'), not a large negative number)"


def _random_logits(shape, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# --------------------------------------------------------------------------- top-k


def check_top_k_filter(fn) -> None:
    """fn(logits [..., V], k) keeps the k largest and every logit tied with the k-th; others -inf."""
    hf = _load_hf()
    tie_note = "every token tied with the k-th largest is kept"
    cases = [
        ([3.0, 1.0, 2.0, 2.0, 0.5], 2, f"tie at the boundary: {tie_note}, so 3 tokens stay"),
        ([1.0, 1.0, 1.0, 1.0], 1, f"all tied: {tie_note}, so all 4 stay"),
        ([0.5, -1.0, 2.0, 0.0], 1, "k = 1 keeps only the largest"),
        ([0.5, -1.0, 2.0], 3, "k = vocabulary size keeps everything"),
        ([0.5, -1.0, 2.0], 10, "k > vocabulary size keeps everything"),
        ([1e4, NEG_INF, -1e4, 0.0, NEG_INF], 2, "extreme values, -inf already present"),
        ([1e4, NEG_INF, -1e4, 0.0, NEG_INF], 4, "k reaches the -inf entries: all finite ones stay"),
        ([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 3.0, 1.0]], 2, f"each row on its own; {tie_note}"),
        ([[[0.1, 0.4, 0.2]], [[0.3, 0.3, 0.9]]], 2, "leading dims [2, 1]"),
    ]
    for values, k, note in cases:
        x = torch.tensor(values)
        before = x.clone()
        desc = f"top_k_filter(logits, k={k})"
        got = call(f"{desc} on logits {format_values(x)}", fn, x, k)
        _check_unchanged(desc, before, x)
        _compare(desc, x, _ref_top_k(x, k), got, source="keep logits >= the k-th largest", note=note)
    randoms = [((9,), 3, 2.0), ((4, 13), 1, 2.0), ((4, 13), 5, 2.0), ((2, 3, 50), 10, 2.0), ((2, 3, 50), 50, 2.0)]
    for i, (shape, k, scale) in enumerate(randoms):
        x = _random_logits(shape, seed=200 + i, scale=scale)
        _top_k_random(fn, hf, x, k, f"random logits of shape {list(shape)}")
    g = torch.Generator().manual_seed(250)
    ties = torch.randint(-3, 4, (4, 20), generator=g).float()  # many ties at every boundary
    for k in (1, 4, 9):
        _top_k_random(fn, hf, ties, k, "random integer logits [4, 20] (many ties)")
    x = torch.tensor([1.0, 2.0, 3.0])
    for k in (0, -1):
        expect_raises(f"top_k_filter(logits, k={k})", ValueError, "k must be an integer >= 1", fn, x, k)


def _top_k_random(fn, hf, x, k, what):
    desc = f"top_k_filter(logits, k={k}) on {what}"
    got = call(desc, fn, x.clone(), k)
    if hf is not None:
        expected, source = _hf_apply(hf.top_k(k), x), "Hugging Face TopKLogitsWarper"
    else:
        expected, source = _ref_top_k(x, k), "keep logits >= the k-th largest"
    _compare(desc, x, expected, got, source=source, note="every token tied with the k-th largest is kept")


# --------------------------------------------------------------------------- top-p


def _validate_top_p(
    desc: str, x: torch.Tensor, p: float, got, *, note: str = "", hf_expected: torch.Tensor | None = None
) -> None:
    """Kept entries unchanged, the rest -inf, the kept set a top set of the right size."""
    _check_tensor(desc, got, x)
    vocab = x.shape[-1]
    xs = x.detach().double().reshape(-1, vocab)
    gs = got.detach().cpu().double().reshape(-1, vocab)
    hs = None if hf_expected is None else hf_expected.double().reshape(-1, vocab)
    for r in range(xs.shape[0]):
        row, out = xs[r], gs[r]
        where = _row_name(r, x.shape[:-1])
        shown = f"logits {format_values(row)}" if vocab <= 16 else f"random logits of shape {list(x.shape)}"
        removed = out == NEG_INF
        kept = ~removed
        n_got = int((kept & torch.isfinite(row)).sum())
        n_exp, allowed = _top_p_keep_counts(row, p)

        def fail(msg: str):
            lines = [f"{desc}{where}: {msg}"]
            if note:
                lines.append(f"  ({note})")
            if vocab <= 16:
                probs = row.softmax(dim=-1)
                lines += [
                    f"  input:         {format_values(row)}",
                    f"  probabilities: {format_values([round(v, 4) for v in probs.tolist()])}",
                    f"  expected:      {format_values(_ref_top_p(row, p))}",
                    f"  got:           {format_values(out)}",
                ]
            raise AssertionError("\n".join(lines))

        if torch.isnan(out).any():
            fail("the result contains NaN")
        if (torch.isfinite(out) & (out < -1e30) & (row > -1e30)).any():
            fail("filtered entries must be exactly float('-inf'), not a large negative number")
        changed = kept & ~torch.isclose(out, row, rtol=1e-6, atol=0.0)
        if changed.any():
            i = int(changed.nonzero()[0])
            fail(
                f"kept token {i} must keep its logit {format_values(row[i].item())} unchanged, "
                f"got {format_values(out[i].item())} "
                "(filtered tokens become -inf, the others stay as they are)"
            )
        if n_exp >= 1 and n_got == 0:
            fail(f"kept 0 tokens for p={p}; top-p always keeps at least the most likely token")
        if n_got not in allowed:
            fail(
                f"top_p_filter kept {n_got} tokens for p={p} on {shown}; the smallest set of most likely "
                f"tokens with mass >= {p} has {n_exp}"
            )
        if kept.any() and removed.any() and torch.isfinite(row[removed]).any():
            lowest_kept, highest_removed = row[kept].min().item(), row[removed].max().item()
            if highest_removed > lowest_kept:
                fail(
                    f"removed a token with logit {format_values(highest_removed)} but kept one with "
                    f"{format_values(lowest_kept)}; top-p keeps the MOST likely tokens"
                )
        ordered = row[torch.isfinite(row)].sort(descending=True).values
        tie_at_boundary = 0 < n_exp < ordered.numel() and ordered[n_exp - 1] == ordered[n_exp]
        if hs is not None and len(allowed) == 1 and not tie_at_boundary:
            h_kept = hs[r] != NEG_INF
            if not torch.equal(h_kept, kept):
                fail(
                    f"kept tokens {kept.nonzero().flatten().tolist()}; Hugging Face TopPLogitsWarper keeps "
                    f"{h_kept.nonzero().flatten().tolist()}"
                )


def check_top_p_filter(fn) -> None:
    """fn(logits [..., V], p) keeps the smallest set of most likely tokens with mass >= p; others -inf."""
    hf = _load_hf()
    cases = [
        ([2.0, 1.0, 0.5, -1.0], 0.9, "probabilities 0.61, 0.22, 0.14, 0.03: the first two hold only 0.83 < 0.9"),
        ([2.0, 1.0, 0.5, -1.0], 0.8, "the first two hold 0.83 >= 0.8"),
        ([2.0, 1.0, 0.5, -1.0], 0.5, "the most likely token alone holds 0.61 >= 0.5"),
        ([-1.0, 0.5, 2.0, 1.0], 0.9, "same logits shuffled: the result must follow the tokens back to their places"),
        ([1.0, 0.9, 0.8], 1e-6, "tiny p: top-p keeps at least the most likely token"),
        ([10.0, 0.0, 0.0, 0.0], 0.9, "one dominant token (probability 0.99986)"),
        ([10.0, 0.0, 0.0, 0.0], 0.999, "one dominant token (probability 0.99986)"),
        ([2.0, 1.0, -1.0, -3.0, NEG_INF], 1.0, "p = 1 keeps every token (-inf stays -inf)"),
        (
            [0.0, -20.0],
            1.0,
            "p = 1 keeps every token, even one of probability 2e-9; in float32 the mass "
            "before it can round to exactly 1.0, so treat p = 1 as 'no filtering'",
        ),
        ([1e4, 0.0, -1e4, NEG_INF], 0.5, "extreme values, -inf already present"),
        ([1e4, 1e4, -1e4, NEG_INF], 0.6, "two tied dominant tokens of probability 0.5 each: both are needed"),
        ([1e4, 1e4, -1e4, NEG_INF], 0.4, "two tied dominant tokens: either one alone holds 0.5 >= 0.4"),
        ([[2.0, 1.0, 0.5, -1.0], [-1.0, 0.5, 1.0, 2.0]], 0.9, "each row on its own"),
        ([[[3.0, 0.0, 0.0]], [[0.0, 0.0, 3.0]]], 0.5, "leading dims [2, 1]"),
    ]
    for values, p, note in cases:
        x = torch.tensor(values)
        before = x.clone()
        desc = f"top_p_filter(logits, p={p})"
        got = call(f"{desc} on logits {format_values(x)}", fn, x, p)
        _check_unchanged(desc, before, x)
        _validate_top_p(desc, x, p, got, note=note)
    randoms = [((9,), 0.5), ((4, 13), 0.1), ((4, 13), 0.9), ((2, 3, 40), 0.97), ((2, 3, 40), 0.7)]
    for i, (shape, p) in enumerate(randoms):
        x = _random_logits(shape, seed=300 + i, scale=2.0)
        desc = f"top_p_filter(logits, p={p}) on random logits of shape {list(shape)}"
        got = call(desc, fn, x.clone(), p)
        hf_expected = _hf_apply(hf.top_p(p), x) if hf is not None else None
        _validate_top_p(desc, x, p, got, hf_expected=hf_expected)
    x = torch.tensor([1.0, 2.0, 3.0])
    for p in (0.0, -0.1, 1.5):
        expect_raises(f"top_p_filter(logits, p={p})", ValueError, "p must be in (0, 1]", fn, x, p)


# --------------------------------------------------------------------------- repetition penalty


def check_repetition_penalty(fn) -> None:
    """fn(logits [..., V], token_ids [..., n], penalty): the sign-aware repetition penalty (Hugging Face's and
    vLLM's: a positive logit divided, a negative one multiplied) once per distinct id."""
    hf = _load_hf()
    once = "each distinct id is penalized once, however often it occurs"
    cases = [
        (
            [2.0, -2.0, 0.5, 1.0, 0.0],
            [0, 0, 1, 1, 1, 4],
            2.0,
            (
                f"positive logits are divided by the penalty, negative ones multiplied (the sign-aware rule of Hugging "
                f"Face and vLLM: dividing a negative logit, as the CTRL paper's formula does, would raise it); {once}"
            ),
        ),
        ([2.0, -2.0, 0.5, 1.0, 0.0], [0, 0, 1, 1, 1, 4], 0.5, f"penalty < 1 rewards repeats; {once}"),
        ([2.0, -2.0, 0.5], [2, 1, 2], 1.0, "penalty 1 changes nothing"),
        ([2.0, -2.0, 0.5], [], 3.0, "no history: nothing changes"),
        ([1e4, -1e4, NEG_INF, 1.0], [0, 1, 2, 2], 1.5, "extreme values; -inf stays -inf"),
        (
            [[1.0, -1.0, 3.0], [1.0, -1.0, 3.0]],
            [[0, 0], [1, 2]],
            1.5,
            "leading dims [B, n]: each row uses only its own history",
        ),
        ([[[1.0, -1.0, 3.0, 2.0]], [[-4.0, 2.0, 0.5, 1.0]]], [[[3, 3, 1]], [[0, 0, 0]]], 1.25, "leading dims [2, 1]"),
    ]
    for values, ids, penalty, note in cases:
        x = torch.tensor(values)
        token_ids = torch.tensor(ids, dtype=torch.long).reshape(*x.shape[:-1], -1)
        before = x.clone()
        desc = f"apply_repetition_penalty(logits, token_ids={format_values(token_ids)}, penalty={penalty})"
        got = call(f"{desc} on logits {format_values(x)}", fn, x, token_ids, penalty)
        _check_unchanged(desc, before, x)
        _compare(
            desc,
            x,
            _ref_repetition(x, token_ids, penalty),
            got,
            source="x / penalty if x > 0 else x * penalty, for every id in token_ids",
            note=note,
        )
    randoms = [((30,), 12, 1.3), ((4, 30), 20, 2.0), ((2, 3, 40), 25, 0.7), ((2, 3, 40), 60, 1.1)]
    for i, (shape, n, penalty) in enumerate(randoms):
        g = torch.Generator().manual_seed(400 + i)
        x = torch.randn(*shape, generator=g) * 3
        token_ids = torch.randint(0, shape[-1], (*shape[:-1], n), generator=g)  # with duplicates
        desc = (
            f"apply_repetition_penalty(logits, token_ids, penalty={penalty}) on random logits of shape "
            f"{list(shape)}, token_ids of shape {list(token_ids.shape)} (with repeated ids)"
        )
        got = call(desc, fn, x.clone(), token_ids.clone(), penalty)
        if hf is not None:
            expected = _hf_apply(hf.repetition(float(penalty)), x, token_ids)
            source = "Hugging Face RepetitionPenaltyLogitsProcessor"
        else:
            expected, source = _ref_repetition(x, token_ids, penalty), "the sign-aware rule once per id"
        _compare(desc, x, expected, got, source=source, note=once)
    x, token_ids = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0, 1])
    for penalty in (0.0, -1.0):
        expect_raises(
            f"apply_repetition_penalty(logits, token_ids, penalty={penalty})",
            ValueError,
            "the penalty must be > 0",
            fn,
            x,
            token_ids,
            penalty,
        )


# --------------------------------------------------------------------------- sampling


# (logits, temperature, top_k, top_p): the frequency tests. Case A is sensitive to the order of
# the filters (top-k first, then top-p on the renormalised top-k distribution, keeps 2 tokens;
# top-p first would keep 3) and to a missing filter; case B (no filters) to the temperature.
_FREQUENCY_CASES = [
    ([2.0, 1.6, 1.1, 0.5, -0.3, -1.2], 0.8, 3, 0.75),
    ([2.0, 1.6, 1.1, 0.5, -0.3, -1.2], 1.5, 0, 1.0),
]


# --------------------------------------------------------------------------- the batch pipeline


def _ref_process_row(row: torch.Tensor, params, history) -> torch.Tensor:
    """One row through the processors in vLLM's order, in float64."""
    x = row.double()
    if history is not None and len(history) and params.repetition_penalty != 1:
        x = _ref_repetition(x, torch.as_tensor(history).long(), params.repetition_penalty)
    if params.temperature == 0:
        return x
    x = _ref_temperature(x, params.temperature)
    if params.top_k >= 1:
        x = _ref_top_k(x, params.top_k)
    if params.top_p < 1:
        x = _ref_top_p(x, params.top_p)
    return x


def _describe_params(p) -> str:
    parts = [f"temperature={p.temperature:g}"]
    parts += [f"top_k={p.top_k}"] if p.top_k >= 1 else []
    parts += [f"top_p={p.top_p:g}"] if p.top_p < 1 else []
    parts += [f"repetition_penalty={p.repetition_penalty:g}"] if p.repetition_penalty != 1 else []
    return "SamplingParams(" + ", ".join(parts) + ")"


def _expect_processed(fn, x: torch.Tensor, params: list, histories, what: str, note: str = "") -> None:
    before = x.clone()
    desc = f"process_logits({what})"
    got = call(desc, fn, x, params, histories)
    _check_unchanged(desc, before, x)
    _check_tensor(desc, got, x)
    for r, p in enumerate(params):
        history = None if histories is None else histories[r]
        row_desc = f"{desc}, row {r} with {_describe_params(p)}" + (f" and history {list(history)}" if history else "")
        _compare(
            row_desc,
            x[r],
            _ref_process_row(x[r], p, history),
            got[r],
            source="repetition penalty, temperature, top-k, top-p, in that order",
            note=note,
        )


def check_process_logits(fn) -> None:
    """fn(logits [B, V], params: B SamplingParams, histories: None or B id lists) -> [B, V]: each row's own
    repetition penalty, temperature, top-k and top-p, in that order; greedy rows get the penalty only."""
    from decodelab.params import SamplingParams as P

    # the order: the penalty before top-k (token 0 loses its place), temperature before top-p
    x = torch.tensor([[3.0, 2.9, 1.0, -1.0, 0.5], [2.0, 1.0, 0.5, -1.0, -3.0]])
    _expect_processed(
        fn,
        x,
        [P(temperature=1.0, top_k=1, repetition_penalty=2.0), P(temperature=0.5, top_p=0.8)],
        [[0], []],
        "two rows of 5 logits",
        note="the penalty comes first, so top-k=1 sees token 0 at 1.5 and keeps token 1; top-p "
        "measures mass after the temperature (at T=0.5 one token holds 0.84 of it)",
    )
    # greedy rows: the penalty, and no division by 0
    x = torch.tensor([[1.0, 4.0, -2.0, 3.0], [1.0, 4.0, -2.0, 3.0], [1.0, 4.0, -2.0, 3.0]])
    _expect_processed(
        fn,
        x,
        [P(temperature=0, repetition_penalty=2.0), P(temperature=0, top_k=1), P(temperature=4.0)],
        [[1, 2], [], [1]],
        "three rows: two greedy, one at temperature 4",
        note="a greedy row (temperature 0) gets the repetition penalty only: never divide by 0; "
        "each row uses its own params",
    )
    # a batch of random rows, every combination, each row its own settings
    params = [
        P(temperature=0.7, top_k=5),
        P(temperature=1.3, top_p=0.8),
        P(temperature=1.0, top_k=10, top_p=0.5),
        P(temperature=0.9, top_k=3, repetition_penalty=1.3),
        P(temperature=2.0),
        P(temperature=0, repetition_penalty=1.5),
        P(temperature=0.6, top_p=0.95, repetition_penalty=1.2),
    ]
    x = _random_logits((len(params), 64), seed=700)
    g = torch.Generator().manual_seed(701)
    histories = [torch.randint(0, 64, (9,), generator=g).tolist() for _ in params]
    _expect_processed(fn, x, params, histories, f"random logits [{len(params)}, 64], one setting per row")
    _expect_processed(fn, x[:3], params[:3], None, "random logits [3, 64], no histories (None)")
    for args, what in (
        ((x, params[:2], None), "logits with 7 rows and 2 params"),
        ((x[:2], params[:2], histories[:1]), "2 rows and 1 history"),
    ):
        expect_raises(f"process_logits({what})", ValueError, "each row needs its own params (and history)", fn, *args)


def _params(temperature: float, top_k: int = 0, top_p: float = 1.0):
    from decodelab.params import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _params_str(temperature, top_k=0, top_p=1.0) -> str:
    return f"SamplingParams(temperature={temperature}, top_k={top_k}, top_p={top_p})"


def _check_ids(desc: str, ids, lead_shape: torch.Size, vocab: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise AssertionError(
            f"{desc} returned {type(ids).__name__}; expected a tensor of token ids of shape {list(lead_shape)}"
        )
    if ids.shape != lead_shape:
        raise AssertionError(
            f"{desc} returned shape {list(ids.shape)}; expected {list(lead_shape)} "
            "(one id per row: the logits' shape without the vocabulary dim)"
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise AssertionError(f"{desc} returned dtype {ids.dtype}; expected integer token ids (torch.int64)")
    ids = ids.detach().cpu().long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
        raise AssertionError(
            f"{desc} returned id {int(ids.min() if ids.min() < 0 else ids.max())}, outside the vocabulary [0, {vocab})"
        )
    return ids


def _z_bound(categories: int) -> float:
    """Per-category number of standard errors: Bonferroni over `categories` at total ALPHA."""
    return NormalDist().inv_cdf(1 - ALPHA / (2 * categories))


def check_sample(fn) -> None:
    """fn(logits [..., V], params, generator) -> ids [...]: draws from the filtered distribution,
    greedy (lowest id among ties) at temperature 0, repeatable with the same generator seed."""
    # Temperature 0: argmax, lowest id among exact ties, whatever top_k / top_p say.
    greedy_cases = [
        ([[0.5, 3.0, 3.0, -1.0], [4.0, 4.0, 1.0, NEG_INF]], [1, 0]),
        ([[[0.0, 7.0, 7.0]], [[-1.0, -1.0, -2.0]]], [[1], [0]]),
        ([0.0, 7.0, 7.0, 6.5], 1),
    ]
    for values, want in greedy_cases:
        x, want = torch.tensor(values), torch.tensor(want)
        for top_k, top_p in ((0, 1.0), (2, 0.5)):
            desc = f"sample(logits, {_params_str(0.0, top_k, top_p)}, generator) on logits {format_values(x)}"
            got = _check_ids(
                desc,
                call(desc, fn, x.clone(), _params(0.0, top_k, top_p), torch.Generator().manual_seed(0)),
                x.shape[:-1],
                x.shape[-1],
            )
            if not torch.equal(got, want):
                raise AssertionError(
                    f"{desc}: expected {format_values(want)}, got {format_values(got)} "
                    "(temperature 0 is greedy: the argmax, and the lowest id among tied maxima)"
                )

    # top_k = 1 leaves one token per row: each row must get its own argmax (no mixing of rows).
    x = _random_logits((2, 3, 17), seed=500)
    desc = f"sample(logits, {_params_str(0.8, 1)}, generator) on random logits of shape [2, 3, 17]"
    got = _check_ids(
        desc, call(desc, fn, x.clone(), _params(0.8, 1), torch.Generator().manual_seed(1)), x.shape[:-1], 17
    )
    want = x.argmax(dim=-1)
    if not torch.equal(got, want):
        raise AssertionError(
            f"{desc}: top_k=1 leaves only each row's largest logit, so expected ids "
            f"{format_values(want)}, got {format_values(got)}"
        )

    # Frequencies over N draws against the exact distribution.
    exact = [_ref_sampling_probs(torch.tensor(v), t, k, p) for v, t, k, p in _FREQUENCY_CASES]
    categories = sum(int((q > 0).sum()) for q in exact)
    z = _z_bound(categories)
    for (values, t, k, p), q in zip(_FREQUENCY_CASES, exact):
        if any(0 < qi and N_DRAWS * qi * (1 - qi) < 100 for qi in q.tolist()):
            raise RuntimeError("internal: a frequency case is too small for the normal approximation")
        x = torch.tensor(values)
        desc = f"sample(logits, {_params_str(t, k, p)}, generator) on logits {format_values(x)}, drawn {N_DRAWS} times"
        batch = x.repeat(N_DRAWS, 1)
        ids = _check_ids(
            desc,
            call(desc, fn, batch, _params(t, k, p), torch.Generator().manual_seed(2024)),
            batch.shape[:-1],
            x.shape[-1],
        )
        counts = torch.bincount(ids, minlength=x.shape[-1]).double()
        freq = counts / N_DRAWS
        table = (
            f"exact probabilities {format_values([round(v, 4) for v in q.tolist()])}, "
            f"drawn frequencies {format_values([round(v, 4) for v in freq.tolist()])}"
        )
        for i, qi in enumerate(q.tolist()):
            if qi == 0 and counts[i] > 0:
                raise AssertionError(
                    f"{desc}: drew token {i} {int(counts[i])} times, but after temperature, top-k and top-p "
                    f"(in that order) its probability is 0; {table}"
                )
        for i, (qi, fi) in enumerate(zip(q.tolist(), freq.tolist())):
            bound = z * math.sqrt(qi * (1 - qi) / N_DRAWS)
            if qi > 0 and abs(fi - qi) > bound:
                raise AssertionError(
                    f"{desc}: token {i} was drawn with frequency {fi:.4f}, but its exact probability is {qi:.4f} "
                    f"(allowed: +/- {bound:.4f} = {z:.2f} standard errors); {table}"
                )

    # One row at a time: a 0-d id per call, always inside the support.
    values, t, k, p = _FREQUENCY_CASES[0]
    x = torch.tensor(values)
    support = set((exact[0] > 0).nonzero().flatten().tolist())
    g = torch.Generator().manual_seed(7)
    desc = f"sample(logits, {_params_str(t, k, p)}, generator) on 1-D logits {format_values(x)}"
    for _ in range(20):
        i = int(_check_ids(desc, call(desc, fn, x.clone(), _params(t, k, p), g), torch.Size([]), x.shape[-1]))
        if i not in support:
            raise AssertionError(f"{desc}: drew token {i}, which the filters remove (possible: {sorted(support)})")

    # The generator decides: same seed -> same ids (even if the global RNG moved), other seed -> other ids.
    batch = x.repeat(2000, 1)
    params = _params(t, k, p)
    desc = f"sample(logits, {_params_str(t, k, p)}, generator) on logits {format_values(x)} x 2000 rows"
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(11)
        first = call(desc, fn, batch.clone(), params, torch.Generator().manual_seed(1234))
        torch.manual_seed(22)
        again = call(desc, fn, batch.clone(), params, torch.Generator().manual_seed(1234))
        other = call(desc, fn, batch.clone(), params, torch.Generator().manual_seed(4321))
    finally:
        torch.random.set_rng_state(state)
    first, again, other = (_check_ids(desc, v, batch.shape[:-1], x.shape[-1]) for v in (first, again, other))
    if not torch.equal(first, again):
        n, row = int((first != again).sum()), int((first != again).nonzero()[0, 0])
        raise AssertionError(
            f"{desc}: two calls with generators seeded 1234 gave different ids ({n} of 2000 rows "
            f"differ, the first at row {row}: {int(first[row])}, then {int(again[row])}); draw every "
            "random number from the `generator` argument "
            "(e.g. torch.multinomial(..., generator=generator))"
        )
    if torch.equal(first, other):
        raise AssertionError(
            f"{desc}: generators seeded 1234 and 4321 gave exactly the same 2000 ids; "
            "the draws must come from the `generator` argument"
        )


# --------------------------------------------------------------------------- beam search

# (prompt text, num_beams, max_new_tokens, EOS token text or None, length_penalty), on the tiny model.
# The EOS is a token the model writes often, so hypotheses finish at several lengths: the newline
# ends a line of code, " _" ends the third case early (there each beam's own top B misses a beam).
BEAM_CASES = [
    ("def add(a, b):\n", 4, 16, "\n", 1.0),
    ("import os\nimport ", 4, 12, "\n", 1.0),
    ("class Stack:\n    def push(self, item):\n", 3, 12, " _", 1.0),
    ("def add(a, b):\n", 2, 16, "\n", 0.6),
    ("for i in range(", 4, 10, None, 2.0),
    ("print(", 2, 12, ",", 1.0),  # 'x,' ends ranked 4th of 4 at step 2: if it finished, the search would stop there
    ("return ", 2, 12, ",", 1.0),  # an EOS ranked 4th of 4 at step 5
]
BEAM_SCORE_TOL = 1e-4  # float32 sums of up to 16 log-probabilities, the same model


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from decodelab.model.registry import load

    return load("tiny", device="cpu")


def _beam_result(desc: str, got) -> tuple[list[int], float]:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise AssertionError(f"{desc} returned {type(got).__name__}; expected a pair (new token ids, score)")
    ids, score = got
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise AssertionError(f"{desc} returned ids {ids!r}; expected a list of int token ids (the new tokens only)")
    try:
        score = float(score)
    except (TypeError, ValueError):
        raise AssertionError(f"{desc} returned score {score!r}; expected a number") from None
    return list(ids), score


def check_beam_search(fn) -> None:
    """fn(model, prompt_ids, num_beams, max_new_tokens, eos_token_id, length_penalty) -> (new ids, score):
    the same tokens and score as the library's beam search (transformers' num_beams, early_stopping=True)
    on the tiny model; one beam is greedy; num_beams < 1 is a ValueError."""
    from decodelab.decoding.generate import generate_with_cache
    from decodelab.lessons.beam_search import beam_search, sequence_logprob

    model, tokenizer = _tiny_model()
    for text, num_beams, max_new, eos_text, penalty in BEAM_CASES:
        prompt = tokenizer.encode(text)
        eos = None if eos_text is None else tokenizer.encode(eos_text)
        if eos is not None and len(eos) != 1:
            raise RuntimeError(f"internal: EOS text {eos_text!r} is not one token of the tiny model")
        eos = None if eos is None else eos[0]
        desc = (
            f"beam_search(tiny model, prompt {text!r}, num_beams={num_beams}, max_new_tokens={max_new}, "
            f"eos_token_id={eos}{'' if eos is None else f' ({eos_text!r})'}, length_penalty={penalty})"
        )
        want_ids, want_score = beam_search(model, prompt, num_beams, max_new, eos, penalty)
        ids, score = _beam_result(desc, call(desc, fn, model, list(prompt), num_beams, max_new, eos, penalty))
        if ids == want_ids and abs(score - want_score) <= BEAM_SCORE_TOL:
            continue
        lines = [
            f"{desc}: wrong result.",
            f"  expected ids {want_ids} = {tokenizer.decode(want_ids)!r}, score {want_score:.5f} (the library's beam "
            "search: the best 2 x num_beams candidates a step, of which only the first num_beams may finish, "
            "hypotheses scored sum_logprob / len(new ids) ** length_penalty, stop once num_beams are finished)",
            f"  got      ids {ids} = {tokenizer.decode([i for i in ids if 0 <= i < model.config.vocab_size])!r}, "
            f"score {score:.5f}",
        ]
        if ids and all(0 <= i < model.config.vocab_size for i in ids):
            true_score = sequence_logprob(model, prompt, ids) / len(ids) ** penalty
            if abs(true_score - score) > BEAM_SCORE_TOL:
                lines.append(
                    f"  your ids, scored by one forward pass without a cache, give {true_score:.5f}, not "
                    f"{score:.5f}: did every beam's cache row follow its parent (cache.reorder), is the length "
                    "the new ids only, and is the penalty applied to finished hypotheses only?"
                )
        raise AssertionError("\n".join(lines))
    prompt = tokenizer.encode(BEAM_CASES[0][0])
    desc = f"beam_search(tiny model, prompt {BEAM_CASES[0][0]!r}, num_beams=1, max_new_tokens=12)"
    ids, score = _beam_result(desc, call(desc, fn, model, list(prompt), 1, 12, None, 1.0))
    greedy = generate_with_cache(model, prompt, 12)
    if ids != greedy:
        raise AssertionError(
            f"{desc}: expected the greedy continuation {greedy}, got {ids} (one beam, no EOS: "
            "beam search keeps the single best token at every step)"
        )
    expect_raises(
        "beam_search(tiny model, prompt, num_beams=0, max_new_tokens=4)",
        ValueError,
        "num_beams must be >= 1",
        fn,
        model,
        list(prompt),
        0,
        4,
        None,
        1.0,
    )


# --------------------------------------------------------------------------- predictions


def answer_q_top_p_uniform_kept() -> float:
    """Tokens top-p 0.9 keeps from 1,000 equally likely ones (the library's top_p_filter counts them)."""
    from decodelab.decoding.sampling import top_p_filter

    return int(torch.isfinite(top_p_filter(torch.zeros(1000), 0.9)).sum())


def check_q_top_p_uniform_kept(value) -> None:
    """Graded q_top_p_uniform_kept (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_top_p_uniform_kept",
        value,
        answer_q_top_p_uniform_kept(),
        "top-p 0.9 over 1,000 tokens of probability 0.001 each keeps the smallest set with mass >= 0.9",
    )


def answer_q_frequency_std_error() -> float:
    """Standard deviation of a drawn frequency: p = 0.1, n = 10,000 draws, sqrt(p (1 - p) / n)."""
    p, n = 0.1, 10_000
    return math.sqrt(p * (1 - p) / n)


def check_q_frequency_std_error(value) -> None:
    """Graded q_frequency_std_error (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_frequency_std_error",
        value,
        answer_q_frequency_std_error(),
        "the standard deviation of the frequency of a token of probability 0.1 over 10,000 draws, "
        "sqrt(0.1 x 0.9 / 10,000)",
    )

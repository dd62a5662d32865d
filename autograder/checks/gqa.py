"""Checks for notebook 05, grouped-query attention: `repeat_kv`, `group_query_attention`, `pool_kv_heads`.

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and either
returns None or raises ``AssertionError`` whose message gives the input, the expected and the
actual result.

The expected results never come from `decodelab`: they are written out here head by head and
query by query in float64 (``_ref_*``), from the definitions:

* query head h reads KV head h // (H / H_kv) (consecutive query heads share one KV head, as in
  Llama and `transformers`: tests/test_gqa_checks.py holds the loop oracle against
  `transformers`' own ``repeat_kv``; the check does not import transformers, which would cost a
  learner seconds per run);
* query t of T sits at position q_offset + t and sees keys 0 .. q_offset + t, softmax(q.k / sqrt(D));
* pooled head i is the mean of old heads i*g .. i*g + g - 1, g = H_kv / H_new.
"""
from __future__ import annotations

import math

import torch

from autograder.checks.calling import call

# exercise function -> the library's reference it is graded against (tests/notebooks.py reads this)
REFERENCES = {
    "repeat_kv": "decodelab.model.attention:repeat_kv",
    "group_query_attention": "decodelab.lessons.gqa:group_query_attention",
    "pool_kv_heads": "decodelab.lessons.gqa:pool_kv_heads",
}

__all__ = ["check_repeat_kv", "check_group_query_attention", "check_pool_kv_heads"]


def _expect_tensor(desc: str, got, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{desc}: expected a torch.Tensor of shape {list(shape)}, got {type(got).__name__}")
    if tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{desc}: expected shape {list(shape)}, got shape {list(got.shape)}")
    if dtype is not None and got.dtype != dtype:
        raise AssertionError(f"{desc}: expected dtype {dtype} (the input's), got {got.dtype}")


def _where(index: tuple, names: str) -> str:
    return ", ".join(f"{n}={i}" for n, i in zip(names.split(), index))


# --------------------------------------------------------------------------- repeat_kv


def _ref_repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h_kv, s, d = x.shape
    out = torch.empty(b, h_kv * n, s, d, dtype=x.dtype)
    for h in range(h_kv * n):
        out[:, h] = x[:, h // n]  # query head h reads KV head h // n
    return out


def check_repeat_kv(fn) -> None:
    """repeat_kv(x [B, H_kv, S, D], n) -> [B, H_kv * n, S, D], head h = input head h // n, exactly."""
    torch.manual_seed(10)
    cases = [  # (batch, kv_heads, seq, head_dim, n)
        (1, 2, 3, 4, 4),  # GQA: 8 query heads over 2 KV heads
        (2, 3, 5, 2, 3),  # SmolLM2's grouping: 9 over 3, batch of two
        (1, 1, 4, 3, 6),  # MQA: every query head reads the one KV head
        (2, 4, 3, 2, 1),  # MHA: nothing to repeat
        (1, 4, 1, 8, 2),  # a single position (one decode step)
    ]
    for b, h_kv, s, d, n in cases:
        x = torch.randn(b, h_kv, s, d)
        before = x.clone()
        desc = f"repeat_kv(x of shape [{b}, {h_kv}, {s}, {d}], num_queries_per_kv={n})"
        got = call(desc, fn, x, n)
        _expect_tensor(desc, got, (b, h_kv * n, s, d), x.dtype)
        if not torch.equal(x, before):
            raise AssertionError(f"{desc} changed its input in place; return a new tensor (or x itself for n=1)")
        want = _ref_repeat_kv(x, n)
        for h in range(h_kv * n):
            if not torch.equal(got[:, h], want[:, h]):
                source = next((j for j in range(h_kv) if torch.equal(got[:, h], x[:, j])), None)
                read = f"input head {source}" if source is not None else "no input head unchanged"
                raise AssertionError(f"{desc}: output head {h} should be input head {h // n} (h // n: consecutive "
                                     f"query heads share a KV head), got {read}")
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    got = call("repeat_kv on a float64 x of shape [1, 2, 3, 4], n=2", fn, x, 2)
    _expect_tensor("repeat_kv on a float64 x of shape [1, 2, 3, 4], n=2", got, (1, 4, 3, 4), torch.float64)


# --------------------------------------------------------------------------- group_query_attention


def _ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
                   round_robin: bool = False, mask_offset: int | None = None) -> torch.Tensor:
    """Loops over batch, head and query in float64: the definition, nothing vectorized that could
    hide a slip. round_robin / mask_offset build two classic wrong answers, to name a mistake."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    group = h // h_kv
    mask_offset = q_offset if mask_offset is None else mask_offset
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for i in range(b):
        for head in range(h):
            kv = head % h_kv if round_robin else head // group
            for j in range(t):
                visible = mask_offset + j + 1  # keys 0 .. q_offset + j
                scores = k[i, kv, :visible] @ q[i, head, j] / math.sqrt(d)  # [visible]
                out[i, head, j] = torch.softmax(scores, dim=0) @ v[i, kv, :visible]
    return out


def _diagnose(got: torch.Tensor, q, k, v, q_offset: int) -> str:
    """Which known mistake got matches, as a hint; '' if none."""
    h, h_kv = q.shape[1], k.shape[1]
    if h_kv not in (1, h) and torch.allclose(got.double(), _ref_attention(q, k, v, q_offset, round_robin=True),
                                             atol=1e-5):
        return (f" (this is what query head h reading KV head h % {h_kv} gives: consecutive query heads must "
                f"share a KV head, h // {h // h_kv})")
    if q_offset > 0 and torch.allclose(got.double(), _ref_attention(q, k, v, q_offset, mask_offset=0), atol=1e-5):
        return (" (this is what a causal mask that ignores q_offset gives: query t sits at position "
                "q_offset + t and sees keys 0 .. q_offset + t)")
    return ""


def check_group_query_attention(fn) -> None:
    """Causal GQA over a cache: every case compared with the float64 loop above."""
    torch.manual_seed(11)
    cases = [  # (batch, heads, kv_heads, queries T, q_offset, head_dim, what)
        (1, 8, 2, 5, 0, 16, "GQA, a 5-token prompt"),
        (1, 8, 2, 1, 9, 16, "GQA, one decode step after 9 cached tokens"),
        (2, 8, 4, 3, 6, 8, "GQA, a 3-token chunk after 6 cached tokens, batch of two"),
        (1, 6, 6, 4, 3, 8, "MHA (H_kv = H)"),
        (2, 4, 1, 4, 5, 8, "MQA (H_kv = 1)"),
        (1, 9, 3, 2, 7, 64, "SmolLM2's shape: 9 query heads over 3 KV heads, head_dim 64"),
    ]
    for b, h, h_kv, t, offset, d, what in cases:
        q = torch.randn(b, h, t, d)
        k, v = torch.randn(b, h_kv, offset + t, d), torch.randn(b, h_kv, offset + t, d)
        desc = (f"group_query_attention with q [{b}, {h}, {t}, {d}], k and v [{b}, {h_kv}, {offset + t}, {d}], "
                f"q_offset={offset} ({what})")
        got = call(desc, fn, q, k, v, offset)
        _expect_tensor(desc, got, (b, h, t, d), q.dtype)
        want = _ref_attention(q, k, v, offset)
        err = (got.double() - want).abs()
        if err.max() > 1e-5:
            index = tuple(int(i) for i in (err == err.max()).nonzero()[0])
            hint = _diagnose(got, q, k, v, offset)
            raise AssertionError(f"{desc}: at {_where(index, 'batch head query dim')} expected "
                                 f"{want[index].item():.6g}, got {got[index].item():.6g} "
                                 f"(max difference {err.max().item():.3g}){hint}")
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 5, 8, dtype=torch.bfloat16), torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    desc = "group_query_attention on bfloat16 q [1, 4, 2, 8], k and v [1, 2, 5, 8], q_offset=3"
    got = call(desc, fn, q, k, v, 3)
    _expect_tensor(desc, got, (1, 4, 2, 8), torch.bfloat16)
    err = (got.double() - _ref_attention(q, k, v, 3)).abs().max().item()
    if err > 3e-2:
        raise AssertionError(f"{desc}: differs from the float64 result by {err:.3g} (more than bfloat16 rounding)")


# --------------------------------------------------------------------------- pool_kv_heads


def _ref_pool(weight: torch.Tensor, new: int, head_dim: int) -> torch.Tensor:
    old = weight.shape[0] // head_dim
    group = old // new
    w = weight.double()
    heads = [w[i * head_dim:(i + 1) * head_dim] for i in range(old)]
    pooled = [sum(heads[i * group + j] for j in range(group)) / group for i in range(new)]
    return torch.cat(pooled)


def check_pool_kv_heads(fn) -> None:
    """Mean of consecutive groups of heads, for weights [H_kv * D, E] and biases [H_kv * D]."""
    torch.manual_seed(12)
    head_dim, hidden = 4, 6
    for old, new in [(4, 2), (8, 2), (6, 3), (3, 1), (4, 4)]:
        base = torch.randn(new * head_dim, hidden)
        group = old // new
        copies = base.view(new, 1, head_dim, hidden).expand(new, group, head_dim, hidden).reshape(old * head_dim, hidden)
        desc = (f"pool_kv_heads on a weight of {old} KV heads (head_dim {head_dim}, hidden {hidden}) down to {new}, "
                f"where old heads {group}i .. {group}i+{group - 1} are all copies of head i")
        got = call(desc, fn, copies, new, head_dim)
        _expect_tensor(desc, got, (new * head_dim, hidden), copies.dtype)
        err = (got.double() - base.double()).abs().max().item()
        if err > 1e-6:
            raise AssertionError(f"{desc}: should give the {new} originals back, differs by {err:.3g}")
    for old, new, rest in [(4, 2, (hidden,)), (6, 2, (hidden,)), (6, 3, ()), (9, 3, ())]:
        rows = old * head_dim
        weight = torch.randn(rows, *rest) + torch.arange(rows, dtype=torch.float32).view(rows, *[1] * len(rest))
        kind = f"weight [{rows}, {rest[0]}]" if rest else f"bias [{rows}]"
        desc = f"pool_kv_heads on a {kind} ({old} KV heads of head_dim {head_dim}) down to {new}"
        got = call(desc, fn, weight, new, head_dim)
        _expect_tensor(desc, got, (new * head_dim, *rest), weight.dtype)
        want = _ref_pool(weight, new, head_dim)
        err = (got.double() - want).abs()
        if err.max() > 1e-4:
            index = tuple(int(i) for i in (err == err.max()).nonzero()[0])
            head, group = index[0] // head_dim, old // new
            raise AssertionError(f"{desc}: new head {head} should be the mean of old heads {head * group} .. "
                                 f"{head * group + group - 1}; at index {index[0] if len(index) == 1 else index} "
                                 f"expected {want[index].item():.6g}, got {got[index].item():.6g}")
    weight = torch.randn(4 * head_dim, hidden, dtype=torch.bfloat16)
    desc = "pool_kv_heads on a bfloat16 weight of 4 KV heads down to 2"
    got = call(desc, fn, weight, 2, head_dim)
    _expect_tensor(desc, got, (2 * head_dim, hidden), torch.bfloat16)
    err = (got.double() - _ref_pool(weight, 2, head_dim)).abs().max().item()
    if err > 2e-2:
        raise AssertionError(f"{desc}: differs from the float64 mean by {err:.3g} (more than bfloat16 rounding)")

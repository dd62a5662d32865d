"""Checks for the bonus notebook 11, tiled attention: `online_softmax_update`, `tiled_attention`,
`tiled_causal_attention`, `attention_memory_bytes`, `combine_partial_attention`.

Every ``check_*`` takes the function under test and either returns None or raises
``AssertionError`` whose message gives the input, the expected and the actual result.

The expected results never come from `decodelab`: they follow from the definitions, in float64:

* the online-softmax state after some keys is (m, l, o) with m = the largest score, l = sum of
  exp(score - m), o = sum of exp(score - m) * value: computed here over all the keys at once;
* attention is softmax(q.k / sqrt(D)) @ V per query, head and batch, looped over queries (query
  t at position q_offset + t sees keys 0 .. q_offset + t when causal; query head h reads KV head
  h // (H / H_kv));
* tiled attention must hold no tensor as large as one head's [T, S] score matrix, seen by
  watching every tensor operation (a torch dispatch mode);
* causal tiled attention computes a (query tile, key tile) pair when some query of it sees some
  key of it, and masks it when also some query of it must not see some key of it: counted here on
  the [T, S] causal mask cut into tiles; its matrix products may do no more multiply-adds than
  those pairs need (PyTorch's own FlopCounterMode counts them).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, expect_raises
from decodelab.course.exercises import references

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("11_tiled_attention")

__all__ = [
    "check_online_softmax_update",
    "check_tiled_attention",
    "check_tiled_causal_attention",
    "check_attention_memory_bytes",
    "check_combine_partial_attention",
]


def _first_bad(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple | None:
    """Index of the worst element (NaN counts as worst), or None if all are within tol."""
    err = (got.double() - want).abs().nan_to_num(nan=math.inf)
    both_inf = torch.isinf(want) & (got.double() == want)
    err = torch.where(both_inf, torch.zeros_like(err), err)
    if err.numel() == 0 or err.max() <= tol:
        return None
    return tuple(int(i) for i in (err == err.max()).nonzero()[0])


# --------------------------------------------------------------------------- online_softmax_update


def _state_of(scores: torch.Tensor, values: torch.Tensor):
    """(m, l, o) of the online softmax after seeing these keys, straight from the definition."""
    m = scores.amax(dim=-1)
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    weights = torch.exp(scores - shift[..., None])
    return m, weights.sum(-1), weights @ values


def check_online_softmax_update(fn) -> None:
    """One tile folded into a state that already holds earlier keys: the state must equal the one
    computed over all keys at once (max, sum of exp(score - max), sum of exp(score - max) * value)."""
    gen = torch.Generator().manual_seed(21)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    cases = [  # (leading dims, queries T, keys before, tile, D, shift of old scores, of the tile's, what)
        ((), 3, 0, 4, 2, 0.0, 0.0, "the first tile (state: max -inf, sum 0, out 0)"),
        (
            (2,),
            4,
            5,
            3,
            3,
            0.0,
            4.0,
            "a tile whose scores are larger: the old state must be scaled down by exp(old max - new max)",
        ),
        ((2,), 4, 5, 3, 3, 0.0, -4.0, "a tile whose scores are smaller: the max stays, the new terms are small"),
        ((1, 3), 2, 6, 5, 4, 0.0, 0.0, "leading dims [1, 3] (batch, heads)"),
        ((), 2, 3, 2, 2, 60.0, 60.0, "scores around 60: exp(60) overflows float16, so the max must be subtracted"),
    ]
    for lead, t, before, tile, d, old_shift, shift, what in cases:
        old_scores, old_values = randn(*lead, t, before) + old_shift, randn(*lead, before, d)
        scores_tile, v_tile = randn(*lead, t, tile) + shift, randn(*lead, tile, d)
        if before:
            state = _state_of(old_scores, old_values)
        else:
            state = (
                torch.full((*lead, t), -math.inf, dtype=torch.float64),
                torch.zeros(*lead, t, dtype=torch.float64),
                torch.zeros(*lead, t, d, dtype=torch.float64),
            )
        all_scores = torch.cat([old_scores, scores_tile], -1)
        want = _state_of(all_scores, torch.cat([old_values, v_tile], -2))
        desc = (
            f"online_softmax_update on a state of {before} earlier keys and a tile of {tile} keys, "
            f"{t} queries, D={d}, leading dims {list(lead)} ({what})"
        )
        _compare_state(desc, call(desc, fn, *[s.clone() for s in state], scores_tile, v_tile), want, (*lead, t), d)
    # rows whose tile is entirely masked: the state must not change, and a row that has seen nothing stays (-inf, 0, 0)
    inf = math.inf
    masked = torch.tensor([[-inf, -inf, -inf], [0.5, -inf, 1.0], [-inf, -inf, -inf]], dtype=torch.float64)
    state = (
        torch.tensor([1.0, -inf, -inf], dtype=torch.float64),
        torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64),
        torch.tensor([[1.0, -1.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64),
    )
    v_tile = randn(3, 2)
    fresh = _state_of(masked[1:2], v_tile)
    want = tuple(torch.cat([s[:1], f, s[2:]]) for s, f in zip(state, fresh))
    desc = (
        "online_softmax_update on 3 queries: query 0 has max 1, sum 2, out [1, -1] and a tile of all -inf "
        "(masked); query 1 has seen nothing (max -inf, sum 0, out 0) and gets scores [0.5, -inf, 1]; query 2 "
        "has seen nothing and gets only -inf (it must stay max -inf, sum 0, out 0)"
    )
    _compare_state(desc, call(desc, fn, *[s.clone() for s in state], masked, v_tile), want, (3,), 2)


def _compare_state(desc: str, got, want, rows: tuple, d: int) -> None:
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(g, torch.Tensor) for g in got)):
        raise AssertionError(f"{desc}: expected a tuple of 3 tensors (new_max, new_sum, new_out), got {got!r:.200}")
    names = ("new_max", "new_sum", "new_out")
    for name, g, w, shape in zip(names, got, want, (rows, rows, (*rows, d))):
        if tuple(g.shape) != tuple(shape):
            raise AssertionError(f"{desc}: {name} should have shape {list(shape)}, got {list(g.shape)}")
        if torch.isnan(g).any():
            raise AssertionError(
                f"{desc}: {name} contains NaN (expected {w.flatten()[:6].tolist()}); exp(-inf - (-inf)) "
                f"is NaN, so a row with nothing visible yet needs care"
            )
        bad = _first_bad(g, w, 1e-9 * max(1.0, float(w.abs().nan_to_num(posinf=0, neginf=0).max())))
        if bad is not None:
            hint = ""
            if name == "new_sum" and torch.allclose(g.double(), w * torch.exp(want[0]), rtol=1e-6):
                hint = " (this is sum of exp(score) without subtracting the max)"
            elif name == "new_out":
                hint = " (the old out must be multiplied by exp(old max - new max) like the old sum)"
            raise AssertionError(
                f"{desc}: {name} at index {list(bad)} should be {w[bad].item():.6g}, got {g[bad].item():.6g}{hint}"
            )


# --------------------------------------------------------------------------- tiled_attention


def _ref_attention(q, k, v, causal: bool, q_offset: int) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    b, h, t, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for head in range(h):
        kv = head // group
        for j in range(t):
            visible = q_offset + j + 1 if causal else k.shape[2]
            scores = k[:, kv, :visible] @ q[:, head, j, :, None] / math.sqrt(d)  # [B, visible, 1]
            out[:, head, j] = (torch.softmax(scores[..., 0], dim=-1)[:, None, :] @ v[:, kv, :visible])[:, 0]
    return out


class _Largest(TorchDispatchMode):
    """Remembers the largest tensor any operation produced."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape, self.op = 0, (), ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.numel:
                self.numel, self.shape, self.op = tensor.numel(), tuple(tensor.shape), str(func)
        return out


def check_tiled_attention(fn) -> None:
    """Matches softmax attention to 1e-5 in float32 (1e-10 in float64) on ragged tiles, offsets, GQA and
    non-causal attention, and never creates a tensor as large as one head's [T, S] score matrix."""
    gen = torch.Generator().manual_seed(22)
    cases = [  # (batch, heads, kv_heads, T, q_offset, D, tile, causal, what)
        (1, 2, 2, 10, 0, 8, 4, True, "a 10-token prompt in tiles of 4: the last tile holds only 2 keys"),
        (2, 4, 2, 3, 9, 8, 5, True, "3 queries after 9 cached tokens, GQA, batch of two"),
        (1, 3, 1, 1, 20, 16, 8, True, "one decode step after 20 cached tokens, MQA"),
        (1, 9, 3, 6, 7, 16, 64, True, "a tile larger than the whole sequence, SmolLM2's 9 over 3 heads"),
        (1, 2, 1, 7, 0, 4, 1, True, "tiles of a single key"),
        (1, 2, 2, 4, 0, 8, 3, False, "non-causal: 4 queries over 11 keys, every key visible"),
    ]
    for b, h, h_kv, t, offset, d, tile, causal, what in cases:
        s = offset + t if causal else 11
        q = torch.randn(b, h, t, d, generator=gen)
        k, v = torch.randn(b, h_kv, s, d, generator=gen), torch.randn(b, h_kv, s, d, generator=gen)
        desc = (
            f"tiled_attention(q [{b}, {h}, {t}, {d}], k and v [{b}, {h_kv}, {s}, {d}], tile_size={tile}, "
            f"causal={causal}, q_offset={offset}) ({what})"
        )
        got = call(desc, fn, q, k, v, tile_size=tile, causal=causal, q_offset=offset)
        _expect_output(desc, got, q)
        want = _ref_attention(q, k, v, causal, offset)
        bad = _first_bad(got, want, 1e-5)
        if bad is not None:
            raise AssertionError(
                f"{desc}: at [batch, head, query, dim] = {list(bad)} expected {want[bad].item():.6g}, "
                f"got {got[bad].item():.6g} (max difference "
                f"{(got.double() - want).abs().max().item():.3g})"
            )
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64, generator=gen)
    k, v = (
        torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=gen),
        torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=gen),
    )
    desc = "tiled_attention on float64 q [1, 4, 5, 8], k and v [1, 2, 12, 8], tile_size=5, q_offset=7"
    got = call(desc, fn, q, k, v, tile_size=5, causal=True, q_offset=7)
    _expect_output(desc, got, q)
    err = (got - _ref_attention(q, k, v, True, 7)).abs().max().item()
    if err > 1e-10:
        raise AssertionError(
            f"{desc}: differs from the exact result by {err:.3g}; float64 input should be "
            f"computed in float64 (within 1e-10)"
        )
    # memory: no tensor may reach the size of one head's [T, S] scores
    b, h, h_kv, t, offset, d, tile = 1, 4, 2, 64, 256, 8, 32
    q = torch.randn(b, h, t, d, generator=gen)
    k, v = torch.randn(b, h_kv, offset + t, d, generator=gen), torch.randn(b, h_kv, offset + t, d, generator=gen)
    desc = (
        f"tiled_attention(q [{b}, {h}, {t}, {d}], k and v [{b}, {h_kv}, {offset + t}, {d}], tile_size={tile}, "
        f"q_offset={offset})"
    )
    watch = _Largest()
    with torch.inference_mode(), watch:
        got = call(desc, fn, q, k, v, tile_size=tile, causal=True, q_offset=offset)
    _expect_output(desc, got, q)
    limit = t * (offset + t)
    if watch.numel >= limit:
        raise AssertionError(
            f"{desc} created a tensor of shape {list(watch.shape)} ({watch.numel:,} numbers, by "
            f"{watch.op}): as large as one head's full [T, S] = [{t}, {offset + t}] score matrix (or "
            f"mask). Tiled attention holds scores for one tile of keys at a time, [B, H, T, "
            f"tile_size] = [{b}, {h}, {t}, {tile}]"
        )
    bad = _first_bad(got, _ref_attention(q, k, v, True, offset), 1e-5)
    if bad is not None:
        raise AssertionError(f"{desc}: wrong result at [batch, head, query, dim] = {list(bad)}")


def _expect_output(desc: str, got, q: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{desc}: expected a torch.Tensor of shape {list(q.shape)}, got {type(got).__name__}")
    if tuple(got.shape) != tuple(q.shape):
        raise AssertionError(f"{desc}: expected shape {list(q.shape)}, got {list(got.shape)}")
    if got.dtype != q.dtype:
        raise AssertionError(f"{desc}: expected dtype {q.dtype} (q's), got {got.dtype}")


# --------------------------------------------------------------------------- tiled_causal_attention


def _causal_tiles(num_queries: int, q_offset: int, tile: int, batch_heads_dim: int) -> tuple[int, int, int, int]:
    """(tiles computed, tiles masked, tiles in the grid, FLOPs of the computed tiles) from the [T, S]
    causal mask cut into tile x tile pairs. A computed pair of tq queries and tk keys needs two
    products of tq * tk * D multiply-adds per batch row and head (scores, then weights @ values)."""
    num_keys = q_offset + num_queries
    visible = torch.arange(num_keys)[None, :] <= torch.arange(q_offset, num_keys)[:, None]  # [T, S]
    computed = masked = grid = flops = 0
    for a in range(0, num_queries, tile):
        for b in range(0, num_keys, tile):
            block = visible[a : a + tile, b : b + tile]
            grid += 1
            if block.any():
                computed += 1
                masked += int(not block.all())
                flops += 2 * 2 * batch_heads_dim * block.numel()
    return computed, masked, grid, flops


def _expect_count(desc: str, got, want: int, name: str, of: str, why: str) -> None:
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        raise AssertionError(f"{desc}: {name} should be an int ({want}{of}), got {got!r:.100}")
    if got != want:
        raise AssertionError(f"{desc}: expected {name} = {want}{of}, got {got}{why}")


def check_tiled_causal_attention(fn) -> None:
    """Matches causal softmax attention to 1e-5 in float32 (1e-10 in float64) on ragged tiles, offsets that do
    and do not fall on a tile boundary, decode steps and GQA, without NaN; counts the computed and the masked
    (query tile, key tile) pairs; does no more than 1.25 times the multiply-adds the computed pairs need."""
    gen = torch.Generator().manual_seed(31)
    cases = [  # (batch, heads, kv_heads, T, q_offset, D, tile, what)
        (1, 2, 2, 10, 0, 8, 4, "a 10-token prompt in tiles of 4: query tiles 0-3, 4-7 and 8-9"),
        (1, 2, 1, 9, 0, 8, 4, "a 9-token prompt: query 8 is a tile of its own, and key tile 8 starts at its position"),
        (
            2,
            4,
            2,
            7,
            5,
            8,
            4,
            "7 queries at positions 5 to 11 after 5 cached tokens, GQA, batch of two: "
            "queries 5, 6 and 7 see no key of the diagonal tile 8-11",
        ),
        (1, 3, 1, 1, 16, 16, 8, "one decode step at position 16: the last key tile starts at the query's own position"),
        (1, 9, 3, 1, 21, 16, 8, "one decode step at position 21, SmolLM2's 9 over 3 heads"),
        (1, 2, 2, 6, 7, 16, 64, "a tile larger than the whole sequence"),
        (1, 2, 1, 5, 0, 4, 1, "tiles of one query by one key: no tile crosses the diagonal, so none needs a mask"),
        (1, 2, 2, 20, 16, 8, 8, "a chunk of 20 after 16 cached tokens, on tile boundaries"),
    ]
    for b, h, h_kv, t, offset, d, tile, what in cases:
        s = offset + t
        q = torch.randn(b, h, t, d, generator=gen)
        k, v = torch.randn(b, h_kv, s, d, generator=gen), torch.randn(b, h_kv, s, d, generator=gen)
        desc = (
            f"tiled_causal_attention(q [{b}, {h}, {t}, {d}], k and v [{b}, {h_kv}, {s}, {d}], tile_size={tile}, "
            f"q_offset={offset}) ({what})"
        )
        with FlopCounterMode(display=False) as flop_counter:
            got = call(desc, fn, q, k, v, tile_size=tile, q_offset=offset)
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            raise AssertionError(f"{desc}: expected a tuple (out, tiles_computed, tiles_masked), got {got!r:.200}")
        out, computed, masked = got
        _expect_output(desc, out, q)
        if torch.isnan(out).any():
            raise AssertionError(
                f"{desc}: the output contains NaN. In a tile that crosses the diagonal a query can "
                f"have every key in its future: its scores there are all -inf, and exp(-inf - (-inf)) "
                f"is NaN. Such a row must add nothing to its running state"
            )
        want = _ref_attention(q, k, v, True, offset)
        bad = _first_bad(out, want, 1e-5)
        if bad is not None:
            raise AssertionError(
                f"{desc}: at [batch, head, query, dim] = {list(bad)} expected {want[bad].item():.6g}, "
                f"got {out[bad].item():.6g} (max difference {(out.double() - want).abs().max().item():.3g}); "
                f"query {bad[2]} sits at position {offset + bad[2]} and sees keys 0 to {offset + bad[2]}"
            )
        want_computed, want_masked, grid, want_flops = _causal_tiles(t, offset, tile, b * h * d)
        _expect_count(
            desc,
            computed,
            want_computed,
            "tiles_computed",
            f" of the {grid} (query tile, key tile) pairs",
            ": a key tile that starts after a query tile's last position is skipped, and not counted"
            if computed == grid
            else "",
        )
        _expect_count(
            desc,
            masked,
            want_masked,
            "tiles_masked",
            f" of the {want_computed} computed",
            ": only a tile that crosses the diagonal needs the mask; one whose last key is at or before the "
            "query tile's first position needs none"
            if masked > want_masked
            else "",
        )
        flops = flop_counter.get_total_flops()
        if flops > 1.25 * want_flops:
            raise AssertionError(
                f"{desc}: the matrix products did {flops:,} FLOPs, the {want_computed} computed tiles "
                f"need {want_flops:,}: a tile in every query's future must be skipped before its "
                f"scores are computed, not computed and thrown away"
            )
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64, generator=gen)
    k, v = (
        torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=gen),
        torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=gen),
    )
    desc = "tiled_causal_attention on float64 q [1, 4, 5, 8], k and v [1, 2, 12, 8], tile_size=5, q_offset=7"
    got = call(desc, fn, q, k, v, tile_size=5, q_offset=7)
    _expect_output(desc, got[0] if isinstance(got, (tuple, list)) else got, q)
    err = (got[0] - _ref_attention(q, k, v, True, 7)).abs().max().item()
    if err > 1e-10:
        raise AssertionError(
            f"{desc}: differs from the exact result by {err:.3g}; float64 input should be "
            f"computed in float64 (within 1e-10)"
        )
    q, kv = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 5, 4)
    expect_raises(
        "tiled_causal_attention(q [1, 1, 3, 4], k and v [1, 1, 5, 4], q_offset=0)",
        ValueError,
        "5 keys are not q_offset + T = 3",
        fn,
        q,
        kv,
        kv,
        tile_size=4,
        q_offset=0,
    )
    expect_raises(
        "tiled_causal_attention(q [1, 1, 3, 4], k and v [1, 1, 5, 4], tile_size=0, q_offset=2)",
        ValueError,
        "a tile holds at least 1 query and 1 key",
        fn,
        q,
        kv,
        kv,
        tile_size=0,
        q_offset=2,
    )


# --------------------------------------------------------------------------- attention_memory_bytes


def check_attention_memory_bytes(fn) -> None:
    """B * H * T * w * bytes, w = S for plain attention and min(tile, S) for tiled attention."""
    cases = [  # (T, S, H, B, tile, bytes per value)
        (4096, 4096, 32, 1, None, 4),
        (4096, 4096, 32, 1, 128, 4),
        (1, 1000, 9, 1, None, 2),
        (1, 1000, 9, 1, 64, 2),
        (100, 300, 4, 3, 512, 4),
        (100, 300, 4, 3, 300, 4),
        (7, 9, 2, 5, 4, 0.5),
    ]
    for t, s, h, b, tile, size in cases:
        desc = (
            f"attention_memory_bytes(num_queries={t}, num_keys={s}, num_heads={h}, batch_size={b}, "
            f"tile_size={tile}, bytes_per_value={size})"
        )
        got = call(desc, fn, t, s, num_heads=h, batch_size=b, tile_size=tile, bytes_per_value=size)
        width = s if tile is None else min(tile, s)
        want = int(b * h * t * width * size)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or got != want:
            why = f"B * H * T * {'S' if tile is None else 'min(tile, S)'} * bytes = {b} * {h} * {t} * {width} * {size}"
            raise AssertionError(f"{desc}: expected {want:,} ({why}), got {got!r}")


# --------------------------------------------------------------------------- combine_partial_attention


def _split_states(scores: torch.Tensor, values: torch.Tensor, bounds: list[int]):
    """maxes [C, ..., T], sums [C, ..., T], outs [C, ..., T, D] of the splits scores[..., a:b] (from the
    definition, `_state_of`), for split boundaries bounds = [0, b1, ..., S]."""
    states = [_state_of(scores[..., a:b], values[..., a:b, :]) for a, b in zip(bounds, bounds[1:])]
    return tuple(torch.stack(part) for part in zip(*states))


def check_combine_partial_attention(fn) -> None:
    """Splits of one softmax merged: the result must be softmax(all scores) @ all values (float64),
    with splits whose maxes differ by up to 1,000 and a split that some query does not see at all."""
    g = torch.Generator().manual_seed(11)
    cases = []  # (what, scores [..., T, S], values [..., S, D], split bounds)
    scores = torch.tensor([[0.0, 0.0, 2.0, 2.0]], dtype=torch.float64)  # one query, 4 keys
    values = torch.tensor([[1.0], [3.0], [5.0], [7.0]], dtype=torch.float64)
    cases.append(
        (
            "one query, keys split [0, 0 | 2, 2] with values [1, 3 | 5, 7]: the second split weighs e^2 "
            "times the first",
            scores,
            values,
            [0, 2, 4],
        )
    )
    scores = torch.randn(2, 3, 4, 10, generator=g, dtype=torch.float64)
    scores[..., 3:7] += 4.0
    cases.append(
        (
            "random scores [2, 3, 4 queries, 10 keys], splits 0:3 | 3:7 (4 higher) | 7:10",
            scores,
            torch.randn(2, 3, 10, 5, generator=g, dtype=torch.float64),
            [0, 3, 7, 10],
        )
    )
    scores = torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64)
    scores[..., 4:] += 1000.0
    cases.append(
        (
            "scores near 0 in split 0:4 and near 1,000 in split 4:8 (exp(1000) overflows: rescale each "
            "split to the largest max of all splits)",
            scores,
            torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64),
            [0, 4, 8],
        )
    )
    scores = torch.randn(1, 1, 3, 9, generator=g, dtype=torch.float64)
    scores[0, 0, 0, 6:] = -math.inf  # query 0 sees nothing of the last split: its state there is (-inf, 0, 0)
    cases.append(
        (
            "3 queries over splits 0:3 | 3:6 | 6:9, query 0 masked out of the last split (max -inf, sum 0, out 0)",
            scores,
            torch.randn(1, 1, 9, 2, generator=g, dtype=torch.float64),
            [0, 3, 6, 9],
        )
    )
    for what, scores, values, bounds in cases:
        maxes, sums, outs = _split_states(scores, values, bounds)
        desc = f"combine_partial_attention(maxes {list(maxes.shape)}, sums {list(sums.shape)}, outs {list(outs.shape)})"
        got = call(f"{desc}, {what}", fn, maxes.clone(), sums.clone(), outs.clone())
        want = torch.softmax(scores, dim=-1) @ values  # [..., T, D]
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            raise AssertionError(
                f"{desc}, {what}: expected a tensor of shape {list(want.shape)} (outs without its "
                f"split axis), got {getattr(got, 'shape', type(got).__name__)}"
            )
        bad = _first_bad(got, want, 1e-9 * max(1.0, float(want.abs().max())))
        if bad is not None:
            raise AssertionError(
                f"{desc}, {what}: at {list(bad)} expected {float(want[bad]):.6g}, got "
                f"{float(got[bad]):.6g}: rescale each split's sum and output by exp(its max - the "
                f"largest max) before adding them, and divide once at the end"
            )
    expect_raises(
        "combine_partial_attention(maxes [2, 3], sums [2, 4], outs [2, 3, 5])",
        ValueError,
        "sums must have the shape of maxes",
        fn,
        torch.zeros(2, 3),
        torch.zeros(2, 4),
        torch.zeros(2, 3, 5),
    )


# --------------------------------------------------------------------------- predictions (q_ cells)


def answer_q_llama_scores_gib() -> float:
    """GiB of one layer's plain score matrix: Llama-3.1-8B (32 query heads), a 16,384-token prompt, fp16."""
    from decodelab.lessons import kv_size, tiled_attention

    heads = kv_size.config_fields("Llama-3.1-8B")["num_attention_heads"]
    return tiled_attention.attention_memory_bytes(16384, 16384, num_heads=heads, bytes_per_value=2) / 2**30


def check_q_llama_scores_gib(value) -> None:
    """Graded q_llama_scores_gib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_llama_scores_gib",
        value,
        answer_q_llama_scores_gib(),
        "one layer's plain scores for Llama-3.1-8B, 16,384 tokens, fp16, in GiB (32 heads x 16,384 x 16,384 x 2 bytes)",
    )


def answer_q_smollm2_scores_mib() -> float:
    """MiB of one layer's plain score matrix: SmolLM2 (9 query heads), a 1,024-token prompt, float32."""
    from decodelab.lessons import kv_size, tiled_attention

    heads = kv_size.config_fields("SmolLM2-135M")["num_attention_heads"]
    return tiled_attention.attention_memory_bytes(1024, 1024, num_heads=heads, bytes_per_value=4) / 2**20


def check_q_smollm2_scores_mib(value) -> None:
    """Graded q_smollm2_scores_mib (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_smollm2_scores_mib",
        value,
        answer_q_smollm2_scores_mib(),
        "one layer's plain scores for SmolLM2, 1,024 tokens, float32, in MiB (9 heads x 1,024 x 1,024 x 4 bytes)",
    )

"""decodelab.lessons.tiled_attention: the online softmax gives plain attention's result to float
tolerance, with grouped heads, offsets and ragged last tiles, and never holds the [T, S] scores;
causal tiling computes about half of a prompt's tiles and masks only the diagonal ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from decodelab.lessons.gqa import group_query_attention
from decodelab.lessons.tiled_attention import (
    attention_memory_bytes,
    measure_tensor_memory,
    online_softmax_update,
    tiled_attention,
    tiled_causal_attention,
)
from decodelab.model.attention import causal_attention, repeat_kv


def _plain(q, k, v, causal=True, q_offset=0):
    """SDPA on expanded heads in float64: the definition, nothing tiled."""
    group = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, group).double(), repeat_kv(v, group).double()
    mask = None
    if causal:
        mask = torch.arange(k.shape[2])[None, :] <= torch.arange(q_offset, q_offset + q.shape[2])[:, None]
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_sdpa(seed):
    gen = torch.Generator().manual_seed(seed)
    pick = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=gen))  # noqa: E731
    kv_heads, group = pick(1, 3), pick(1, 4)
    batch, queries, offset, dim, tile = pick(1, 2), pick(1, 40), pick(0, 70), pick(1, 24), pick(1, 33)
    q = torch.randn(batch, kv_heads * group, queries, dim, generator=gen)
    k = torch.randn(batch, kv_heads, offset + queries, dim, generator=gen)
    v = torch.randn(batch, kv_heads, offset + queries, dim, generator=gen)
    got = tiled_attention(q, k, v, tile_size=tile, q_offset=offset)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), _plain(q, k, v, q_offset=offset), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, causal_attention(q, k, v, q_offset=offset), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tile", [1, 5, 16, 17, 64, 1000])
def test_tile_sizes_including_ragged_and_oversized(tile):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 6, 50, 8), torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 8)  # 50 is no multiple of 16
    torch.testing.assert_close(
        tiled_attention(q, k, v, tile_size=tile), group_query_attention(q, k, v), atol=1e-5, rtol=1e-5
    )


def test_float64_is_exact_to_rounding():
    torch.manual_seed(2)
    q, k, v = (
        torch.randn(1, 4, 9, 16, dtype=torch.float64),
        torch.randn(1, 2, 30, 16, dtype=torch.float64),
        torch.randn(1, 2, 30, 16, dtype=torch.float64),
    )
    got = tiled_attention(q, k, v, tile_size=7, q_offset=21)
    assert got.dtype == torch.float64
    assert (got - _plain(q, k, v, q_offset=21)).abs().max() < 1e-12


def test_non_causal_sees_every_key_and_decode_step():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 23, 8), torch.randn(1, 3, 23, 8)
    torch.testing.assert_close(
        tiled_attention(q, k, v, tile_size=6, causal=False), _plain(q, k, v, causal=False).float(), atol=1e-5, rtol=1e-5
    )
    one = q[:, :, :1]  # one decode step at the end of a 23-token cache
    torch.testing.assert_close(
        tiled_attention(one, k, v, tile_size=4, q_offset=22),
        causal_attention(one, k, v, q_offset=22),
        atol=1e-5,
        rtol=1e-5,
    )


def test_large_scores_do_not_overflow():
    """Scores of several hundred: exp() overflows without the running max."""
    torch.manual_seed(4)
    q, k, v = 30 * torch.randn(1, 2, 12, 8), 30 * torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    got = tiled_attention(q, k, v, tile_size=5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _plain(q, k, v), atol=1e-5, rtol=1e-5)


def test_half_precision_returns_its_dtype():
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    got = tiled_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tile_size=4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), causal_attention(q, k, v), atol=2e-2, rtol=2e-2)


def test_bad_arguments_are_errors():
    q, kv = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 5, 4)
    with pytest.raises(ValueError, match="5 keys for 3 queries at offset 0"):
        tiled_attention(q, kv, kv)
    with pytest.raises(ValueError, match="tile_size must be at least 1"):
        tiled_attention(q, kv, kv, tile_size=0, q_offset=2)
    with pytest.raises(ValueError, match="tile_size must be at least 1"):
        attention_memory_bytes(3, 5, tile_size=0)


def test_online_update_equals_softmax_over_both_tiles():
    torch.manual_seed(6)
    s1, s2 = (
        torch.randn(2, 3, 4, dtype=torch.float64),
        3 + torch.randn(2, 3, 5, dtype=torch.float64),
    )  # tile 2 raises the max
    v1, v2 = torch.randn(2, 4, 6, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
    state = (
        torch.full((2, 3), -math.inf, dtype=torch.float64),
        torch.zeros(2, 3, dtype=torch.float64),
        torch.zeros(2, 3, 6, dtype=torch.float64),
    )
    m, l, o = online_softmax_update(*online_softmax_update(*state, s1, v1), s2, v2)
    scores, values = torch.cat([s1, s2], -1), torch.cat([v1, v2], -2)
    assert torch.equal(m, scores.amax(-1))
    torch.testing.assert_close(l, torch.exp(scores - m[..., None]).sum(-1))
    torch.testing.assert_close(o / l[..., None], torch.softmax(scores, -1) @ values)


def test_online_update_with_all_masked_tile_keeps_state_and_no_nan():
    state = (torch.full((1, 2), -math.inf), torch.zeros(1, 2), torch.zeros(1, 2, 3))
    masked = torch.full((1, 2, 4), -math.inf)
    m, l, o = online_softmax_update(*state, masked, torch.randn(1, 4, 3))
    assert torch.equal(m, state[0]) and torch.equal(l, state[1]) and torch.equal(o, state[2])
    m, l, o = online_softmax_update(
        torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 1.0]]), torch.ones(1, 2, 3), masked, torch.randn(1, 4, 3)
    )
    assert torch.equal(m, torch.tensor([[1.0, 2.0]])) and torch.equal(l, torch.tensor([[2.0, 1.0]]))
    assert torch.equal(o, torch.ones(1, 2, 3))


def test_score_matrix_is_never_materialized():
    torch.manual_seed(7)
    batch, heads, kv_heads, queries, offset, dim, tile = 1, 4, 2, 64, 256, 8, 32
    q = torch.randn(batch, heads, queries, dim)
    k, v = torch.randn(batch, kv_heads, offset + queries, dim), torch.randn(batch, kv_heads, offset + queries, dim)
    out, seen = measure_tensor_memory(tiled_attention, q, k, v, tile_size=tile, q_offset=offset)
    torch.testing.assert_close(out, causal_attention(q, k, v, offset), atol=1e-5, rtol=1e-5)
    assert seen.largest_numel == batch * heads * queries * tile, seen.largest_shape  # the [B, H, T, tile] block
    assert seen.largest_numel < queries * (offset + queries)  # not even one head's [T, S]
    _, plain = measure_tensor_memory(group_query_attention, q, k, v, offset)
    assert plain.largest_shape == (batch, heads, queries, offset + queries)  # the tracker does see a [T, S] block


def test_measured_peak_grows_linearly_for_tiled_and_quadratically_for_plain():
    peaks = {}
    for n in (128, 256, 512):
        q, k, v = torch.randn(1, 2, n, 16), torch.randn(1, 1, n, 16), torch.randn(1, 1, n, 16)
        peaks[n] = (
            measure_tensor_memory(tiled_attention, q, k, v, tile_size=32)[1].peak_bytes,
            measure_tensor_memory(group_query_attention, q, k, v)[1].peak_bytes,
        )
    for n in (128, 256):
        tiled_ratio, plain_ratio = peaks[2 * n][0] / peaks[n][0], peaks[2 * n][1] / peaks[n][1]
        assert 1.8 < tiled_ratio < 2.2, peaks
        assert 3.5 < plain_ratio < 4.2, peaks
    # plain attention holds at least its score matrix, which the formula counts
    assert peaks[512][1] >= attention_memory_bytes(512, 512, num_heads=2)


def test_tracker_frees_dropped_tensors_and_ignores_inputs():
    x = torch.zeros(1000)

    def make_and_drop(x):
        for _ in range(5):
            y = x + 1  # noqa: F841 - 4,000 bytes, dropped at the next iteration
        return x[:10]  # a view of the input: no new memory

    _, seen = measure_tensor_memory(make_and_drop, x)
    assert seen.peak_bytes == 8000  # y and its successor overlap for one moment, never more
    assert seen.largest_shape == (1000,)


def test_tracker_sees_the_copy_inside_a_broadcasting_matmul():
    """torch.matmul flattens a broadcast batch axis by expanding and copying the operand: real memory,
    made inside one call. The tracker runs such composites through their decomposition and counts it,
    while naming the largest tensor by the caller's own shapes."""
    a, b = torch.randn(1, 2, 4, 1, 64), torch.randn(1, 2, 1, 64, 512)  # b broadcast over 4
    out, seen = measure_tensor_memory(torch.matmul, a, b)
    assert out.shape == (1, 2, 4, 1, 512)
    assert seen.peak_bytes >= 2 * 4 * 64 * 512 * 4, seen  # b expanded to [1, 2, 4, 64, 512] and copied
    _, folded = measure_tensor_memory(lambda a, b: a.reshape(1, 2, 4, 64) @ b.squeeze(2), a, b)
    assert folded.peak_bytes == 2 * 4 * 512 * 4, folded  # the result only: b read in place
    x, y = torch.randn(2, 3, 32, 4), torch.randn(2, 3, 4, 32)
    _, plain = measure_tensor_memory(torch.matmul, x, y)
    assert plain.largest_shape == (2, 3, 32, 32)  # the caller's shape, not the bmm's [6, 32, 32]
    assert plain.peak_bytes == 2 * 3 * 32 * 32 * 4


def test_memory_formula():
    assert attention_memory_bytes(4096, 4096, num_heads=32) == 4096 * 4096 * 32 * 4
    assert attention_memory_bytes(4096, 4096, num_heads=32, tile_size=128) == 4096 * 128 * 32 * 4
    assert attention_memory_bytes(10, 20, tile_size=64, bytes_per_value=2, batch_size=3) == 3 * 10 * 20 * 2


def test_explorer_redraws_with_the_first_slider_in_the_title():
    widgets_tiled_nb = pytest.importorskip("decodelab.course.widgets.tiled_attention")
    calls = []

    def update(*args):
        calls.append(1)
        return online_softmax_update(*args)

    box = widgets_tiled_nb.tiled_explorer(update)
    assert calls, "the explorer must run the given update function"
    assert type(box.figure).__name__ == "FigureWidget"  # not a Figure displayed into an Output (nbclient stalls)
    assert box.figure._widget_layout["title"]["text"].startswith("tile size 16")  # views start from the first drawing
    before = box.figure.layout.title.text
    assert before.startswith("tile size 16: tile 1 of 4")
    box.controls["tile_size"].value = 8
    assert box.figure.layout.title.text.startswith("tile size 8: tile 1 of 8")
    box.controls["step"].value = 8
    assert "tile 8 of 8 (keys 56–63)" in box.figure.layout.title.text
    box.controls["tile_size"].value = 32  # fewer tiles: the step is clamped, not out of range
    assert box.controls["step"].max == 2 and "tile 2 of 2" in box.figure.layout.title.text
    running_max = box.figure.data[1].y
    assert list(running_max) == pytest.approx(list(box.figure.data[2].y))  # all tiles seen: the true row max
    assert max(box.figure.data[3].y) < 1e-5  # and the exact output


def test_tiled_cache_generates_the_same_tokens():
    from decodelab.course.widgets.tiled_attention import tiled_cache_class
    from decodelab.decoding.generate import generate_with_cache
    from decodelab.model.toy import random_llama

    model = random_llama(0)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs["tile_size"])
        return tiled_attention(*args, **kwargs)

    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    with torch.inference_mode():
        want = generate_with_cache(model, prompt, 12)
        got = generate_with_cache(model, prompt, 12, cache_class=tiled_cache_class(spy, 4))
    assert got == want
    assert calls and set(calls) == {4}


def test_combined_splits_equal_softmax_over_all_keys():
    """Split the keys in three (one split masked for some queries), run online_softmax_update per split, and
    combine_partial_attention: the softmax over all keys, even with scores near 1,000."""
    from decodelab.lessons.tiled_attention import combine_partial_attention

    torch.manual_seed(8)
    scores, values = torch.randn(2, 3, 12, dtype=torch.float64), torch.randn(2, 12, 5, dtype=torch.float64)
    scores[..., 4:8] += 1000.0  # the middle split holds the largest scores
    scores[0, 1, 8:] = -math.inf  # query 1 of row 0 sees nothing of the last split
    states = [
        online_softmax_update(
            torch.full((2, 3), -math.inf, dtype=torch.float64),
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(2, 3, 5, dtype=torch.float64),
            scores[..., a:b],
            values[:, a:b],
        )
        for a, b in ((0, 4), (4, 8), (8, 12))
    ]
    got = combine_partial_attention(*(torch.stack(part) for part in zip(*states)))
    torch.testing.assert_close(got, torch.softmax(scores, -1) @ values)
    with pytest.raises(ValueError, match="must be"):
        combine_partial_attention(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3, 5))


# --------------------------------------------------------------------------- tiled_causal_attention


@pytest.mark.parametrize(
    "queries, offset, tile",
    [
        (64, 0, 16),  # a prompt, the tile divides it
        (50, 0, 16),  # a prompt, the tile does not divide it
        (20, 13, 6),  # a chunk after a prefix, tiles off the boundaries: rows masked whole in diagonal tiles
        (24, 40, 8),  # a chunk after a prefix, on the boundaries
        (1, 40, 8),  # a decode step that starts a new key tile
        (1, 39, 8),  # a decode step at the end of a key tile
        (7, 0, 64),  # one tile larger than everything
        (5, 3, 1),  # tiles of a single query and key
    ],
)
def test_causal_tiles_match_causal_attention(queries, offset, tile):
    torch.manual_seed(queries + offset + tile)
    q = torch.randn(2, 6, queries, 8)
    k, v = torch.randn(2, 2, offset + queries, 8), torch.randn(2, 2, offset + queries, 8)
    out, computed, masked = tiled_causal_attention(q, k, v, tile_size=tile, q_offset=offset)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out, causal_attention(q, k, v, q_offset=offset), atol=1e-5, rtol=1e-5)
    assert 0 <= masked <= computed <= math.ceil(queries / tile) * math.ceil((offset + queries) / tile)


@pytest.mark.parametrize("seed", range(4))
def test_causal_tiles_random_shapes_float64(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=gen))  # noqa: E731
    kv_heads, group, queries, offset, tile = pick(1, 3), pick(1, 3), pick(1, 30), pick(0, 50), pick(1, 20)
    q = torch.randn(1, kv_heads * group, queries, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, kv_heads, offset + queries, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, kv_heads, offset + queries, 8, generator=gen, dtype=torch.float64)
    out, _, _ = tiled_causal_attention(q, k, v, tile_size=tile, q_offset=offset)
    assert out.dtype == torch.float64
    assert (out - _plain(q, k, v, q_offset=offset)).abs().max() < 1e-12


def test_causal_tiles_skip_about_half_a_prompt_and_less_after_a_prefix():
    """n tiles a side: n(n+1)/2 computed, the n diagonal ones masked. A chunk after a prefix computes a larger
    share of its grid the longer the prefix; a decode step computes every key tile and masks none."""
    for n in (1, 4, 16):
        q, kv = torch.randn(1, 1, 8 * n, 4), torch.randn(1, 1, 8 * n, 4)
        assert tiled_causal_attention(q, kv, kv, tile_size=8)[1:] == (n * (n + 1) // 2, n)
    shares = []
    for prefix in (0, 64, 256, 1024):
        q, kv = torch.randn(1, 1, 64, 4), torch.randn(1, 1, prefix + 64, 4)
        computed = tiled_causal_attention(q, kv, kv, tile_size=16, q_offset=prefix)[1]
        shares.append(computed / (4 * math.ceil((prefix + 64) / 16)))
    # a prompt of 4 tiles: 1 + 2 + 3 + 4 of 16; after 1,024 tokens the 4 query tiles need 65, 66, 67 and 68 of 68 key tiles
    assert shares == sorted(shares) and shares[0] == 10 / 16 and shares[-1] == 266 / 272
    q, kv = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 41, 4)
    assert tiled_causal_attention(q, kv, kv, tile_size=8, q_offset=40)[1:] == (6, 0)


def test_causal_tiles_large_scores_and_half_precision():
    torch.manual_seed(9)
    q, k, v = 30 * torch.randn(1, 2, 12, 8), 30 * torch.randn(1, 2, 17, 8), torch.randn(1, 2, 17, 8)
    out = tiled_causal_attention(q, k, v, tile_size=5, q_offset=5)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _plain(q, k, v, q_offset=5), atol=1e-5, rtol=1e-5)
    half = tiled_causal_attention(q.bfloat16() / 30, k.bfloat16() / 30, v.bfloat16(), tile_size=4, q_offset=5)[0]
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), causal_attention(q / 30, k / 30, v, q_offset=5), atol=2e-2, rtol=2e-2)


def test_causal_tiles_bad_arguments_are_errors():
    q, kv = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 5, 4)
    with pytest.raises(ValueError, match="5 keys for 3 queries at offset 0"):
        tiled_causal_attention(q, kv, kv)
    with pytest.raises(ValueError, match="2 keys for 3 queries at offset -1"):
        tiled_causal_attention(q, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), q_offset=-1)
    with pytest.raises(ValueError, match="tile_size must be at least 1"):
        tiled_causal_attention(q, kv, kv, tile_size=0, q_offset=2)

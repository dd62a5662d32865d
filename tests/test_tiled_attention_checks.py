"""The bonus notebook 11's hidden checks: they pass on the library's reference implementations and
catch every kept bug (tests/fixtures/buggy_tiled_attention.py) with a message that names the case."""

from __future__ import annotations

import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import tiled_attention as checks
from decodelab.lessons import tiled_attention as tiled
from decodelab.model.attention import causal_attention

buggy = load_fixture("buggy_tiled_attention")


def test_reference_passes():
    checks.check_online_softmax_update(tiled.online_softmax_update)
    checks.check_tiled_attention(tiled.tiled_attention)
    checks.check_tiled_causal_attention(tiled.tiled_causal_attention)
    checks.check_attention_memory_bytes(tiled.attention_memory_bytes)
    checks.check_combine_partial_attention(tiled.combine_partial_attention)


def test_loop_oracle_agrees_with_sdpa():
    """The check's own float64 loop against causal_attention (SDPA) on a GQA case with an offset."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 6, 4, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    got = checks._ref_attention(q, k, v, True, 5)
    assert (got - causal_attention(q, k, v, 5).double()).abs().max() < 1e-5


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match=r"new_out .*multiplied by exp\(old max - new max\)"):
        checks.check_online_softmax_update(buggy.update_forgets_to_rescale_out)
    with pytest.raises(AssertionError, match=r"new_sum .*without subtracting the max"):
        checks.check_online_softmax_update(buggy.update_without_max)
    with pytest.raises(AssertionError, match=r"contains NaN"):
        checks.check_online_softmax_update(buggy.update_nan_on_empty_rows)
    with pytest.raises(AssertionError, match=r"last tile holds only 2 keys"):
        checks.check_tiled_attention(buggy.tiled_drops_last_partial_tile)
    with pytest.raises(AssertionError, match=r"tensor of shape \[64, 320\].*full \[T, S\]"):
        checks.check_tiled_attention(buggy.tiled_with_full_mask)
    with pytest.raises(AssertionError, match=r"tensor of shape \[1, 4, 64, 320\]"):
        checks.check_tiled_attention(buggy.plain_attention)
    with pytest.raises(AssertionError, match=r"expected 1,440,000 .*min\(tile, S\)"):
        checks.check_attention_memory_bytes(buggy.memory_tile_not_capped)


def test_combine_messages_name_the_case():
    with pytest.raises(AssertionError, match=r"the second split weighs e\^2 times the first.*rescale each split"):
        checks.check_combine_partial_attention(buggy.combine_without_rescaling)
    with pytest.raises(AssertionError, match=r"near 1,000 .*expected .*got nan"):
        checks.check_combine_partial_attention(buggy.combine_to_first_max)


def test_causal_tile_oracle_counts_half_a_prompt():
    """The check's tile counts from the cut-up causal mask: n(n+1)/2 of n^2 tiles for a prompt of n whole tiles, n
    of them masked; a decode step computes every key tile and masks none; two products of tq * tk * D per tile."""
    for tiles in (1, 2, 5, 16):
        assert checks._causal_tiles(8 * tiles, 0, 8, 1)[:3] == (tiles * (tiles + 1) // 2, tiles, tiles**2)
    assert checks._causal_tiles(1, 40, 8, 1)[:3] == (6, 0, 6)
    assert checks._causal_tiles(1, 39, 8, 1)[:3] == (5, 0, 5)  # a decode step sees every key: nothing to mask
    assert checks._causal_tiles(4, 0, 4, 3)[3] == 2 * 2 * 3 * 4 * 4


def test_causal_messages_name_the_case():
    with pytest.raises(AssertionError, match=r"q_offset=5\).*query 2 sits at position 7"):
        checks.check_tiled_causal_attention(buggy.causal_mask_without_offset)
    with pytest.raises(AssertionError, match=r"key tile 8 starts at its position.*query 8 sits at position 8"):
        checks.check_tiled_causal_attention(buggy.causal_skip_off_by_one)
    with pytest.raises(AssertionError, match=r"contains NaN.*exp\(-inf - \(-inf\)\)"):
        checks.check_tiled_causal_attention(buggy.causal_nan_on_masked_rows)
    with pytest.raises(AssertionError, match=r"expected tiles_computed = 6 of the 9 .* got 9: .*skipped"):
        checks.check_tiled_causal_attention(buggy.causal_counts_skipped_tiles)
    with pytest.raises(AssertionError, match=r"expected tiles_masked = 3 of the 6 computed, got 6"):
        checks.check_tiled_causal_attention(buggy.causal_masks_every_tile)
    with pytest.raises(AssertionError, match=r"did 6,400 FLOPs.*need 4,352.*skipped before its scores are computed"):
        checks.check_tiled_causal_attention(buggy.causal_computes_then_discards)


def _notebook_visible_test(gid: str):
    from notebooks import graded_cells, read, solution_path, visible_part

    nb = read(solution_path("11_tiled_attention"))
    setup = next(c.source for c in nb.cells if c.cell_type == "code")
    return setup, visible_part(graded_cells(nb)[gid].source)


@pytest.mark.parametrize(
    "bug", [None] + sorted(bug for bug, (_, check, _) in buggy.BUGS.items() if check == "check_tiled_causal_attention")
)
def test_the_notebooks_visible_tests_catch_each_causal_bug(bug):
    """Not only one bug per exercise (tests/test_notebooks.py): every kept tiled_causal_attention bug fails the
    visible tests a learner runs with an AssertionError, and the reference passes them."""
    import contextlib
    import io

    setup, visible = _notebook_visible_test("test_tiled_causal_attention")
    namespace = {"__name__": "__visible_test__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(setup, "<setup cell>", "exec"), namespace)  # noqa: S102 - our own notebook
        namespace["tiled_causal_attention"] = tiled.tiled_causal_attention if bug is None else buggy.BUGS[bug][0]
        if bug is None:
            exec(compile(visible, "<test_tiled_causal_attention>", "exec"), namespace)  # noqa: S102
            return
        with pytest.raises(AssertionError):
            exec(compile(visible, "<test_tiled_causal_attention>", "exec"), namespace)  # noqa: S102

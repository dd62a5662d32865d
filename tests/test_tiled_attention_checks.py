"""The bonus notebook 11's hidden checks: they pass on the library's reference implementations and
catch every kept bug (tests/fixtures/buggy_tiled_attention.py) with a message that names the case."""
from __future__ import annotations

import pytest
import torch

from autograder.checks import tiled_attention as checks
from decodelab.lessons import tiled_attention as tiled
from decodelab.model.attention import causal_attention
from oracles import expect_bug_caught, load_fixture

buggy = load_fixture("buggy_tiled_attention")


def test_reference_passes():
    checks.check_online_softmax_update(tiled.online_softmax_update)
    checks.check_tiled_attention(tiled.tiled_attention)
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

"""Notebook 05's hidden checks: they pass on the library's reference implementations and catch
every kept bug (tests/fixtures/buggy_gqa.py) with a message that names the case."""

from __future__ import annotations

import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import gqa as checks
from decodelab.lessons import gqa
from decodelab.model.attention import causal_attention

buggy = load_fixture("buggy_gqa")


def test_reference_passes():
    checks.check_broadcast_gqa_attention(gqa.broadcast_gqa_attention)
    checks.check_pool_kv_heads(gqa.pool_kv_heads)
    checks.check_gqa_decode_step(gqa.gqa_decode_step)


def test_loop_oracles_agree_with_transformers():
    """The checks' own float64 loop against transformers' Llama eager attention (its repeat_kv grouping)."""
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    mask = torch.full((4, 4), float("-inf")).triu(1)[None, None]
    module = type("Attn", (torch.nn.Module,), {})()
    module.num_key_value_groups, module.training = 4, False
    want, _ = modeling.eager_attention_forward(module, q, k, v, mask, scaling=16**-0.5)
    got = checks._ref_attention(q, k, v, 0).transpose(1, 2)  # eager returns [B, T, H, D]
    assert (got - want.double()).abs().max() < 1e-5


def test_sdpa_and_repeat_kv_attention_give_the_same_float32_values():
    """The production path (SDPA, grouped heads read in place) and the repeat_kv version meet the
    same definition in float32; the repeat_kv version is then caught as a copy of K and V, while
    SDPA's fused kernel creates no tensor of that size."""
    checks._check_float32_cases(causal_attention, "causal_attention")
    checks._check_float32_cases(gqa.group_query_attention, "group_query_attention")
    with pytest.raises(AssertionError, match=r"K or V was copied to every query head"):
        checks.check_broadcast_gqa_attention(gqa.group_query_attention)
    checks._check_no_copy(causal_attention)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    attention = checks.check_broadcast_gqa_attention
    with pytest.raises(AssertionError, match=r"q_offset=9 .*sees keys 0 \.\. q_offset \+ t"):
        attention(buggy.gqa_mask_ignores_offset)
    with pytest.raises(AssertionError, match=r"5-token prompt.*expected .*, got .*KV head h % 2.*h // 4"):
        attention(buggy.gqa_round_robin)
    with pytest.raises(AssertionError, match=r"right heads in the wrong order"):
        attention(buggy.gqa_heads_wrong_order)
    with pytest.raises(
        AssertionError, match=r"bfloat16 q \[2, 9, 3, 64\].*expected .*within bfloat16 rounding.*got .*float32"
    ):
        attention(buggy.gqa_softmax_in_half)
    for bug in (buggy.gqa_copies_with_repeat_kv, buggy.gqa_copies_with_repeat_interleave, buggy.gqa_matmul_broadcasts):
        with pytest.raises(
            AssertionError,
            match=r"q \[1, 8, 1, 64\], k and v \[1, 2, 2048, 64\].* took [\d.]+ MiB at "
            r"once .*expected at most 2\.00 MiB",
        ):
            attention(bug)
    with pytest.raises(AssertionError, match=r"torch.matmul expands and copies"):
        attention(buggy.gqa_matmul_broadcasts)
    with pytest.raises(AssertionError, match=r"originals back"):
        checks.check_pool_kv_heads(buggy.pool_kv_heads_sum)
    with pytest.raises(AssertionError, match=r"copies of head i: should give the 2 originals back"):
        checks.check_pool_kv_heads(buggy.library_bugs.pool_kv_heads_strided)
    with pytest.raises(AssertionError, match=r"new head \d should be the mean of old heads"):
        checks.check_pool_kv_heads(buggy.pool_kv_heads_first_of_group)
    with pytest.raises(
        AssertionError,
        match=r"should raise ValueError \(4 does not divide the 6 KV heads\); it raised "
        r"RuntimeError",
    ):
        checks.check_pool_kv_heads(buggy.pool_kv_heads_unchecked)


def test_a_stub_is_reported_as_not_written():
    def broadcast_gqa_attention(q, k, v, q_offset=0):
        raise NotImplementedError("replace this line with your code")

    with pytest.raises(AssertionError, match=r"^broadcast_gqa_attention is not written yet"):
        checks.check_broadcast_gqa_attention(broadcast_gqa_attention)


def test_pool_model_uses_the_given_pool():
    """pool_model_kv_heads(pool=...) runs the given function (the notebook passes the learner's)."""
    from decodelab.config import ModelConfig
    from decodelab.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        ModelConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=32,
        )
    ).eval()
    calls = []

    def pool(weight, new, head_dim):
        calls.append(tuple(weight.shape))
        return gqa.pool_kv_heads(weight, new, head_dim)

    pooled = gqa.pool_model_kv_heads(model, 1, pool=pool)
    assert calls == [(16, 32)] * 4  # k and v of two layers
    reference = gqa.pool_model_kv_heads(model, 1)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(pooled(ids), reference(ids))


def test_decode_step_messages_name_the_case():
    with pytest.raises(
        AssertionError,
        match=r"bytes_read expected 3,072 \(2 for K and V x B 2 x H_kv 2 x 6 "
        r"positions x D 16 x 4 bytes\), got 12288",
    ):
        checks.check_gqa_decode_step(buggy.decode_bytes_of_query_heads)
    with pytest.raises(AssertionError, match=r"written at position 3 \(only there\) at positions \[3, 4\]"):
        checks.check_gqa_decode_step(buggy.decode_writes_one_late)
    with pytest.raises(AssertionError, match=r"half of one K repeated to all 8 query heads"):
        checks.check_gqa_decode_step(buggy.decode_with_repeat_kv)

"""The bonus notebook 12's hidden checks: they pass on the library's kernels and launcher (run under
Triton's interpreter on a CPU) and catch every kept bug (tests/fixtures/buggy_gpu_kernel.py) with a
message that names the case."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from oracles import expect_bug_caught, load_fixture  # noqa: E402

from autograder.checks import gpu_kernel as checks  # noqa: E402
from decodelab.lessons import gpu_kernel as gk  # noqa: E402

buggy = load_fixture("buggy_gpu_kernel")


def test_reference_passes():
    checks.check_gather_kv_kernel(gk.gather_kv_kernel)
    checks.check_paged_attention_kernel(gk.paged_attention_kernel)
    checks.check_paged_attention(gk.paged_attention)


def test_definition_oracle_agrees_with_gather_and_sdpa():
    """The check's own float64 loop against the engine's gather_kv + SDPA on a shuffled pool."""
    batch = checks._batch([21, 8, 1], 6, 2, 16, 8, seed=3)
    want = gk.sdpa_by_gather(**batch).double()
    assert (checks._expected_attention(batch) - want).abs().max() < 1e-5


def test_growing_keys_raise_the_max_block_by_block():
    """The check's rescale case really has a running max that grows: in every sequence and head,
    each block's best score (over its valid slots) beats the one before."""
    index = next(i for i, case in enumerate(checks._ATTENTION_CASES) if case[5])
    lengths, h, h_kv, d, block_size, _, _ = checks._ATTENTION_CASES[index]
    batch = checks._batch(lengths, h, h_kv, d, block_size, seed=40 + index, grow=True)
    for b, n in enumerate(lengths):
        table, q, keys = batch["block_tables"][b].tolist(), batch["q"][b], batch["key_cache"]
        for head in range(h):
            best = [
                float((keys[table[j], : min(block_size, n - j * block_size), head * h_kv // h] @ q[head]).max())
                for j in range(-(-n // block_size))
            ]
            assert len(best) > 2 and all(y > x for x, y in zip(best, best[1:])), (b, head, best)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    with pytest.raises(AssertionError, match=r"block_tables\[0, 0\] = \d+, slot"):
        checks.check_gather_kv_kernel(buggy.gather_reads_logical_block)
    with pytest.raises(AssertionError, match=r"should stay zero .*load and store them with a mask"):
        checks.check_gather_kv_kernel(buggy.gather_tail_not_masked)
    with pytest.raises(AssertionError, match=r"attention over whole blocks"):
        checks.check_paged_attention_kernel(buggy.attention_tail_not_masked)
    with pytest.raises(AssertionError, match=r"reads logical block j itself"):
        checks.check_paged_attention_kernel(buggy.attention_reads_logical_block)
    with pytest.raises(AssertionError, match=r"running max grows.*exp\(old max - new max\)\)$"):
        checks.check_paged_attention_kernel(buggy.attention_no_rescale)
    with pytest.raises(AssertionError, match=r"power of 2"):
        checks.check_paged_attention(buggy.launcher_group_not_padded)
    with pytest.raises(AssertionError, match=r"non-contiguous"):
        checks.check_paged_attention(buggy.launcher_strided_q)


def test_a_function_without_triton_jit_is_told_so():
    def gather_kv_kernel(*args, **kwargs):
        pass

    with pytest.raises(AssertionError, match=r"gather_kv_kernel is not a Triton kernel .*@triton.jit"):
        checks.check_gather_kv_kernel(gather_kv_kernel)

"""thread_team: small operations stay on the calling thread while OpenMP's team sleeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodelab.engine import paged_decode_kernel
from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice
from decodelab.model import attention, thread_team
from decodelab.model.attention import ATTENTION_ONE_THREAD_BELOW, masked_attention
from decodelab.model.toy import toy_config

POLICIES = [("PASSIVE", None, True), ("passive", "5000", False), ("ACTIVE", None, False), ("", None, False)]


@pytest.fixture
def policy(monkeypatch):
    """Set OMP_WAIT_POLICY / GOMP_SPINCOUNT as the environment of a process would."""

    def set_policy(wait_policy: str, spincount: str | None) -> None:
        monkeypatch.setenv("OMP_WAIT_POLICY", wait_policy)
        if spincount is None:
            monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        else:
            monkeypatch.setenv("GOMP_SPINCOUNT", spincount)
        thread_team.team_sleeps.cache_clear()

    yield set_policy
    thread_team.team_sleeps.cache_clear()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("wait_policy, spincount, sleeps", POLICIES)
def test_small_work_runs_on_one_thread_only_while_the_team_sleeps(policy, two_threads, wait_policy, spincount, sleeps):
    policy(wait_policy, spincount)
    assert thread_team.team_sleeps() is sleeps
    cpu = torch.device("cpu")
    with thread_team.one_thread_if_small(99, 100, cpu):
        assert torch.get_num_threads() == (1 if sleeps else 2)
    assert torch.get_num_threads() == 2  # restored
    with thread_team.one_thread_if_small(100, 100, cpu):  # not small
        assert torch.get_num_threads() == 2
    with thread_team.one_thread_if_small(99, 100, torch.device("meta")):  # not the CPU's threads
        assert torch.get_num_threads() == 2
    assert thread_team.threads_for(99, 100) == (1 if sleeps else 2)
    assert thread_team.threads_for(100, 100) == 2


def test_the_thread_count_comes_back_when_the_work_raises(policy, two_threads):
    policy("PASSIVE", None)
    with pytest.raises(RuntimeError, match="inside"):
        with thread_team.one_thread_if_small(1, 100, torch.device("cpu")):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def _threads_seen_by_sdpa(monkeypatch) -> list[int]:
    """The thread count at each later call of F.scaled_dot_product_attention (torch.nn.functional's,
    which attention.py and paged_attention.py both call), appended to the list returned."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    return seen


def test_a_decode_tokens_attention_runs_alone_and_gives_the_same_numbers(policy, two_threads, monkeypatch):
    """One query over a short context: below the threshold, on one thread, the team's result up to float32
    rounding (the team may split the keys between its threads); a long context keeps the team."""
    torch.manual_seed(0)
    h, h_kv, d = 9, 3, 64
    short = ATTENTION_ONE_THREAD_BELOW // (h * d) - 1  # keys: the largest context below the threshold
    q = torch.randn(1, h, 1, d)
    k, v = torch.randn(1, h_kv, short, d), torch.randn(1, h_kv, short, d)
    policy("ACTIVE", None)
    team = masked_attention(q, k, v)
    policy("PASSIVE", None)
    seen = _threads_seen_by_sdpa(monkeypatch)
    alone = masked_attention(q, k, v)
    assert seen == [1]
    torch.testing.assert_close(alone, team, rtol=1e-5, atol=1e-6)
    long_k, long_v = torch.randn(1, h_kv, short + 2, d), torch.randn(1, h_kv, short + 2, d)
    masked_attention(q, long_k, long_v)
    assert seen == [1, 2]


def test_the_paged_decode_attention_runs_alone_on_short_contexts(policy, two_threads, monkeypatch):
    """The engine's decode attention (PagedBatch, two sequences) on its torch path (where the C kernel of
    engine.paged_decode_kernel does not run) likewise: alone, and the same numbers."""
    monkeypatch.setattr(paged_decode_kernel, "runs_here", lambda q, keys: False)
    config = toy_config()
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    store = PagedKVStore(config, num_blocks=8, block_size=4)
    torch.manual_seed(0)
    store.keys.normal_()
    store.values.normal_()
    slices = [SequenceSlice(0, 1, 7, [3, 5]), SequenceSlice(1, 1, 3, [1])]
    slot_mapping = torch.tensor([5 * 4 + 2, 1 * 4 + 2])  # each new token's slot: its position in its block
    q, k, v = torch.randn(1, h, 2, d), torch.randn(1, h_kv, 2, d), torch.randn(1, h_kv, 2, d)
    seen = _threads_seen_by_sdpa(monkeypatch)
    policy("ACTIVE", None)
    team = PagedBatch(store, slices, slot_mapping).attend(0, q, k, v)
    policy("PASSIVE", None)
    alone = PagedBatch(store, slices, slot_mapping).attend(0, q, k, v)
    assert seen == [2, 1]
    torch.testing.assert_close(alone, team, rtol=1e-5, atol=1e-6)

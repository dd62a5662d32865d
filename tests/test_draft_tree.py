"""Candidate trees of depth 1 (`decodelab.decoding.draft_tree`): the verify pass equals one plain pass per
candidate, the accepted candidate's cache row is the one kept, the drafter is fed the accepted
path's features, and greedy output equals the target's own; kept bugs (no tree mask, the wrong
row kept, the wrong features fed) fail these checks."""

from __future__ import annotations

import pytest
import torch

from decodelab.decoding import draft_tree
from decodelab.decoding.eagle import FeatureDraftSession
from decodelab.decoding.generate import stream_token_ids
from decodelab.decoding.speculative import speculative_generate
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def plain_pass(target, prefix: list[int], tokens: list[int]) -> tuple[torch.Tensor, KVCache]:
    """Oracle: the target's logits [T, V] over tokens after prefix, and its cache, without a tree."""
    cache = KVCache(target.config, 1, len(prefix) + len(tokens))
    target(torch.tensor([prefix]), kv_cache=cache)
    return target(torch.tensor([tokens]), kv_cache=cache)[0], cache


@torch.inference_mode()
def tree_pass(target, prefix, pending, candidates):
    cache = KVCache(target.config, 1, len(prefix) + 1 + len(candidates))
    target(torch.tensor([prefix]), kv_cache=cache)
    logits, _ = draft_tree.verify_candidates(target, cache, torch.tensor([pending]), torch.tensor(candidates))
    return logits, cache


@torch.inference_mode()
def test_each_row_equals_a_plain_pass_and_the_kept_row_is_the_accepted_ones(tiny_pair):
    target, _, tokenizer = tiny_pair
    prefix = tokenizer.encode("def parse(self, text):\n    lines")
    pending, candidates = 17, [40, 41, 42]
    logits, cache = tree_pass(target, prefix, pending, candidates)
    for row, candidate in enumerate(candidates, start=1):
        plain, plain_cache = plain_pass(target, prefix, [pending, candidate])
        assert (logits[0] - plain[0]).abs().max() < 1e-5
        assert (logits[row] - plain[1]).abs().max() < 1e-5, f"candidate {row} saw another candidate"
    draft_tree.keep_row(cache, 3, len(prefix) + 2)  # candidate 3 accepted
    kept_keys, kept_values = cache.keys[:, :, :, : len(prefix) + 2], cache.values[:, :, :, : len(prefix) + 2]
    assert cache.seq_len == len(prefix) + 2
    assert (kept_keys - plain_cache.keys).abs().max() < 1e-5
    assert (kept_values - plain_cache.values).abs().max() < 1e-5


@torch.inference_mode()
def test_a_pass_without_the_tree_mask_is_caught(tiny_pair, monkeypatch):
    target, _, tokenizer = tiny_pair
    prefix = tokenizer.encode("def parse(self, text):\n    lines")
    monkeypatch.setattr(
        draft_tree,
        "candidate_mask",  # kept bug: plain causal attention
        lambda width, device=None: torch.ones(width + 1, width + 1, dtype=torch.bool).tril(),
    )
    logits, _ = tree_pass(target, prefix, 17, [40, 41])
    plain, _ = plain_pass(target, prefix, [17, 41])
    assert (logits[2] - plain[1]).abs().max() > 1e-3


def test_accept_candidate():
    logits = torch.full((3, 5), -1.0)
    logits[0, 3], logits[1, 0], logits[2, 4] = 1.0, 1.0, 1.0  # after pending: 3; after c_1: 0; after c_2: 4
    tokens, row = draft_tree.accept_candidate(torch.tensor([2, 3]), logits)
    assert tokens.tolist() == [3, 4] and row == 2
    tokens, row = draft_tree.accept_candidate(torch.tensor([1, 2]), logits)
    assert tokens.tolist() == [3] and row == 0


def oracle_candidates(target):
    """Candidates of which exactly one is the target's greedy choice, at a place that rotates, so
    every row of the tree gets accepted in turn. The session is kept in step (catch_up)."""
    places = []  # where the right one went, step by step

    def candidates(session: FeatureDraftSession, ids: list[int], width: int) -> torch.Tensor:
        if len(ids) < 2 or width == 0:
            return torch.empty(0, dtype=torch.long)
        session.catch_up(ids)
        right = int(target(torch.tensor([ids]))[0, -1].argmax())
        vocab = target.config.vocab_size
        wrong = [(right + 1 + i) % vocab for i in range(width - 1)]
        places.append(len(places) % width)
        return torch.tensor(wrong[: places[-1]] + [right] + wrong[places[-1] :])

    candidates.places = places
    return candidates


@pytest.mark.parametrize("width", [2, 3])
def test_greedy_output_equals_target_only_whichever_row_is_accepted(tiny_pair, monkeypatch, width):
    target, drafter, tokenizer = tiny_pair
    prompt = tokenizer.encode("import os\n\ndef main():\n")
    with torch.inference_mode():
        reference = list(stream_token_ids(target, prompt, GREEDY))
    oracle = oracle_candidates(target)
    monkeypatch.setattr("decodelab.decoding.speculative.feature_proposers.top_candidates", oracle)
    output, stats = speculative_generate(target, drafter, prompt, GREEDY, 1, tree_width=width)
    assert output == reference
    assert set(oracle.places) == set(range(width))  # every row was the accepted one at some step
    assert stats.rejected == 0 and stats.accepted == len(oracle.places) and len(oracle.places) >= 15
    monkeypatch.setattr(
        "decodelab.decoding.speculative.feature_proposers.keep_row",  # kept bug: the first candidate's row kept
        lambda cache, row, length: cache.truncate(length),
    )
    buggy, _ = speculative_generate(target, drafter, prompt, GREEDY, 1, tree_width=width)
    assert buggy != reference


def drafter_input_mismatch(monkeypatch, target, drafter, prompt) -> float:
    """Largest difference between the drafter's prediction at every step of a tree generation
    and a teacher-forced drafter pass over the final sequence (its row j predicts f_{j+1})."""
    recorded = []

    class Recording(FeatureDraftSession):
        def catch_up(self, ids):
            feature = super().catch_up(ids)
            recorded.append((len(ids) - 1, feature[0, -1].clone()))
            return feature

    monkeypatch.setattr("decodelab.decoding.speculative.feature_proposers.FeatureDraftSession", Recording)
    monkeypatch.setattr("decodelab.decoding.speculative.feature_proposers.top_candidates", oracle_candidates(target))
    output, _ = speculative_generate(target, drafter, prompt, GREEDY, 1, tree_width=3)
    sequence = torch.tensor([prompt + output])
    with torch.inference_mode():
        teacher_forced = drafter(target.features(sequence)[:, :-1], sequence[:, 1:])[0]  # [T-1, E]
    return max(float((feature - teacher_forced[position - 1]).abs().max()) for position, feature in recorded)


def test_the_drafter_is_fed_the_accepted_paths_features(tiny_pair, monkeypatch):
    target, drafter, tokenizer = tiny_pair
    prompt = tokenizer.encode("class Stack:\n    def")
    assert drafter_input_mismatch(monkeypatch, target, drafter, prompt) < 1e-4
    monkeypatch.setattr(
        "decodelab.decoding.speculative.feature_proposers.path_rows",  # kept bug: the pass's first rows, as a chain's
        lambda row: list(range(2 if row else 1)),
    )
    assert drafter_input_mismatch(monkeypatch, target, drafter, prompt) > 1e-3


def test_bad_tree_arguments_are_refused(tiny_pair):
    target, drafter, tokenizer = tiny_pair
    prompt = tokenizer.encode("import os")
    for width in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tree_width must be an integer"):
            speculative_generate(target, drafter, prompt, GREEDY, 1, tree_width=width)
    sampled = SamplingParams(temperature=0.7, max_tokens=4)
    for args in ((drafter, GREEDY, 2), (drafter, sampled, 1), (lambda ids, k: [], GREEDY, 1)):
        with pytest.raises(ValueError, match="tree_width > 1 needs"):
            speculative_generate(target, args[0], prompt, args[1], args[2], tree_width=2)


@torch.inference_mode()
def test_the_lessons_tree_loop_gives_greedy_output_and_more_tokens_per_call():
    """Notebook 09's tree of any depth (`decodelab.lessons.speculative_decoding`): with the tiny
    draft proposing width 1, 2, 3 branches of depth 3, the output is target-only greedy, the
    proposal is a well-formed tree, and a wider tree never needs more target calls here."""
    from decodelab.lessons.speculative_decoding import propose_tree, tree_generate, tree_layout
    from decodelab.model.registry import load

    target, tokenizer = load("tiny", device="cpu")
    draft, _ = load("tiny-draft", device="cpu")
    prompt = tokenizer.encode("class Stack:\n    def __init__(self):\n        self.items = []\n")
    reference = list(stream_token_ids(target, prompt, GREEDY))
    calls = []
    for width in (1, 2, 3):
        out, n = tree_generate(target, draft, prompt, len(reference), 3, width)
        assert out == reference, width
        calls.append(n)
    assert calls[0] >= calls[1] >= calls[2] and calls[0] > calls[2], calls
    cache = KVCache(draft.config, 1, 64)
    tokens, parents = propose_tree(draft, cache, prompt[:20], 3, 2)
    assert parents == [-1, -1, 0, 1, 2, 3] and cache.seq_len == 20 and len(set(tokens[:2])) == 2
    mask, positions = tree_layout(parents, 19)
    assert positions.tolist() == [19, 20, 20, 21, 21, 22, 22]
    assert mask[5].tolist() == [True, True, False, True, False, True, False]  # node 4: pending, node 0, node 2, itself
    with pytest.raises(ValueError, match="a parent comes before its child"):
        tree_layout([-1, 1], 0)

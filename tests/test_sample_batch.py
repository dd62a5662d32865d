"""Batched sampling (`decoding.sampling.sample_batch`, the engine's): every row with its own settings
and generator gives the token `sample` gives that row alone, so the engine's batched step keeps
greedy and seeded outputs as they were row by row."""

from __future__ import annotations

import pytest
import torch

from decodelab.decoding.sampling import apply_repetition_penalty, filter_logits, process_logits, sample, sample_batch
from decodelab.engine.hooks import EngineHooks, sample_one
from decodelab.engine.llm import LLM
from decodelab.params import SamplingParams

MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=50),
    SamplingParams(temperature=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=0.55, top_k=20, top_p=0.8, repetition_penalty=0.8),
    SamplingParams(temperature=0, repetition_penalty=1.5),
    SamplingParams(temperature=1.0),
]


def one_row(logits, params, generator, history):
    """What the engine did row by row: the penalty over the history, then `sample`."""
    if params.repetition_penalty != 1:
        logits = apply_repetition_penalty(logits, torch.tensor(history), params.repetition_penalty)
    return int(sample(logits, params, generator))


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_batched_tokens_equal_row_by_row_on_the_same_seeds(vocab):
    torch.manual_seed(vocab)
    for trial in range(20):
        logits = torch.randn(len(MIXED), vocab) * 3
        histories = [torch.randint(0, vocab, (5,)).tolist() for _ in MIXED]
        batch_gens = [torch.Generator().manual_seed(100 * trial + i) for i in range(len(MIXED))]
        alone_gens = [torch.Generator().manual_seed(100 * trial + i) for i in range(len(MIXED))]
        got = sample_batch(logits, MIXED, batch_gens, histories).tolist()
        want = [one_row(logits[i], p, alone_gens[i], histories[i]) for i, p in enumerate(MIXED)]
        assert got == want, trial
        for a, b in zip(batch_gens, alone_gens):  # each generator moved exactly as alone
            assert torch.equal(a.get_state(), b.get_state())


def test_process_logits_rows_equal_the_single_request_filters_bit_for_bit():
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED), 4096) * 4
    histories = [[1, 2, 3, 2]] * len(MIXED)
    out = process_logits(logits, MIXED, histories)
    for row, p in enumerate(MIXED):
        penalized = apply_repetition_penalty(logits[row], torch.tensor(histories[row]), p.repetition_penalty)
        want = penalized if p.greedy else filter_logits(penalized, p)
        assert torch.equal(out[row], want), row
    before = logits.clone()
    process_logits(logits, MIXED, histories)
    assert torch.equal(logits, before)


def test_a_row_that_cannot_be_sampled_raises_before_any_draw():
    logits = torch.randn(3, 50)
    logits[2, 0] = float("nan")
    params = [SamplingParams(temperature=0.8)] * 3
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    states = [g.get_state() for g in gens]
    with pytest.raises(RuntimeError, match=r"inf, nan or element < 0 \(row 2"):
        sample_batch(logits, params, gens)
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states)), "no generator may move"
    with pytest.raises(ValueError, match="one entry per row"):
        sample_batch(logits, params, gens[:2])


def test_the_engine_samples_a_batch_as_it_does_row_by_row():
    """The library's sampling (batched) against the same function as a learner's hook (row by row):
    the same tokens for a mixed, seeded batch with n = 2 and greedy rows."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [3, 4]]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, repetition_penalty=1.3, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=12, ignore_eos=True),
    ]
    batched = LLM("tiny", device="cpu")
    row_by_row = LLM("tiny", device="cpu", hooks=EngineHooks(sample=lambda logits, p, g: sample_one(logits, p, g)))
    assert batched.hooks.samples_with_library_code and not row_by_row.hooks.samples_with_library_code
    ids = [[c.token_ids for c in out.outputs] for out in batched.generate(prompts, params, use_tqdm=False)]
    assert ids == [[c.token_ids for c in out.outputs] for out in row_by_row.generate(prompts, params, use_tqdm=False)]
    assert all(len(c) == 12 for sample_ids in ids for c in sample_ids)

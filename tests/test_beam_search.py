"""Beam search (decodelab/lessons/beam_search.py) against transformers' own beam search on the same
weights: `generate(num_beams=B, do_sample=False, length_penalty=L, early_stopping=True)` on the tiny
model and on SmolLM2, float32, the HF-layout folders loaded into `transformers.LlamaForCausalLM`.
Same tokens, and the same score (sum of log-probabilities / length ** length_penalty); the score is
also recomputed from one uncached forward pass over the returned text."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from oracles import quiet_transformers

from decodelab.decoding.generate import generate_with_cache
from decodelab.lessons.beam_search import beam_search, sequence_logprob
from decodelab.model.registry import load, resolve_model

TINY_PROMPTS = [
    "def add(a, b):\n",
    "import os\nimport ",
    "class Stack:\n    def push(self, item):\n",
    "for i in range(",
]
SMOLLM2_QUESTIONS = ["What is gravity?", "Name three prime numbers."]
SCORE_TOL = 2e-5  # float32 sums of ~20 log-probabilities, ours and transformers' kernels


def hf_beam_search(hf_model, prompt_ids, num_beams, max_new_tokens, eos_token_id, length_penalty):
    """transformers' beam search: (new ids, sequences_scores[0])."""
    x = torch.tensor([list(prompt_ids)])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            num_beams=num_beams,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=True,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            top_k=None,
            top_p=None,
            temperature=None,
        )
    return out.sequences[0, x.shape[1] :].tolist(), float(out.sequences_scores[0])


@functools.lru_cache(maxsize=None)
def hf_llama(name: str):
    pytest.importorskip("transformers")
    with quiet_transformers() as transformers:
        return transformers.LlamaForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32).eval()


def expect_same_as_transformers(model, hf_model, prompt_ids, num_beams, max_new_tokens, eos, length_penalty):
    ids, score = beam_search(model, prompt_ids, num_beams, max_new_tokens, eos, length_penalty)
    hf_ids, hf_score = hf_beam_search(hf_model, prompt_ids, num_beams, max_new_tokens, eos, length_penalty)
    case = f"B={num_beams}, length_penalty={length_penalty}, prompt {prompt_ids[-6:]}"
    assert ids == hf_ids, f"{case}: ours {ids}, transformers {hf_ids}"
    assert abs(score - hf_score) <= SCORE_TOL, f"{case}: score {score} vs transformers {hf_score}"
    recomputed = sequence_logprob(model, prompt_ids, ids) / len(ids) ** length_penalty
    assert abs(score - recomputed) <= SCORE_TOL, f"{case}: score {score} vs one uncached pass {recomputed}"
    return ids


@pytest.fixture(scope="module")
def tiny():
    return load("tiny", device="cpu")


@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.6, 2.0])
def test_tiny_matches_transformers(tiny, num_beams, length_penalty):
    """The newline token as EOS: hypotheses finish at different lengths, so the length penalty and early
    stopping decide; some cases end at max_new_tokens instead."""
    model, tokenizer = tiny
    hf_model = hf_llama("tiny")
    newline = tokenizer.encode("\n")[0]
    lengths = {
        len(
            expect_same_as_transformers(model, hf_model, tokenizer.encode(text), num_beams, 20, newline, length_penalty)
        )
        for text in TINY_PROMPTS
    }
    assert len(lengths) >= 2, f"every output had the same length {lengths}: the cases do not test finishing"


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    model, tokenizer = smollm2
    hf_model = hf_llama("smollm2")
    for question in SMOLLM2_QUESTIONS:
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
        for num_beams, length_penalty in ((2, 1.0), (4, 0.6)):
            expect_same_as_transformers(
                model, hf_model, prompt_ids, num_beams, 12, tokenizer.eos_token_id, length_penalty
            )


def test_only_the_first_b_candidates_finish_as_in_transformers(tiny):
    """Notebook 02's cases for the rule that only candidates ranked among the first B may finish (issue 34):
    there a candidate ranked below them ends with the EOS, and transformers drops it as we do."""
    model, tokenizer = tiny
    hf_model = hf_llama("tiny")
    comma = tokenizer.encode(",")[0]
    for text in ("print(", "return "):
        ids = expect_same_as_transformers(model, hf_model, tokenizer.encode(text), 2, 12, comma, 1.0)
        assert len(ids) == 12, f"{text!r}: {ids} (the rule lets the search run to max_new_tokens here)"


def test_one_beam_is_greedy(tiny):
    model, tokenizer = tiny
    prompt_ids = tokenizer.encode(TINY_PROMPTS[0])
    ids, score = beam_search(model, prompt_ids, 1, 15)
    assert ids == generate_with_cache(model, prompt_ids, 15)
    assert abs(score - sequence_logprob(model, prompt_ids, ids) / 15) <= SCORE_TOL


def test_bad_arguments_are_errors(tiny):
    model, tokenizer = tiny
    prompt_ids = tokenizer.encode(TINY_PROMPTS[0])
    for kwargs, message in (
        ({"num_beams": 0}, "num_beams must be an integer >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"num_beams": 600}, "needs a vocabulary of at least 1200 tokens"),
    ):
        args = {"num_beams": 2, "max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=message):
            beam_search(model, prompt_ids, **args)
    with pytest.raises(ValueError, match="exceed the model's context"):
        beam_search(model, prompt_ids, 2, model.config.max_position_embeddings)

"""The shipped `smollm2-draft` (trained by `python -m decodelab.train_draft`): it loads with
SmolLM2's embeddings filled in, shares SmolLM2's vocabulary, greedy speculative decoding with
it reproduces SmolLM2's own greedy output token for token, and it is accepted often enough on
held-out prompts (a floor well below the alpha measured in its TRAINING.md)."""
from __future__ import annotations

import pytest
import torch

from decodelab.generate import stream_token_ids
from decodelab.models import PACKAGE_DATA, load, prepare_smollm2
from decodelab.params import SamplingParams
from decodelab.speculative import SpeculativeStats, speculative_generate

FOLDER = PACKAGE_DATA / "smollm2-draft"
# Held-out prompts (not among train_draft's training prompts; the first two are its evaluation prompts)
PROMPTS = ["Can you describe tornadoes to a ten-year-old?", "List five interesting things about the Cold War."]
MAX_TOKENS = 24
ALPHA_FLOOR = 0.15  # greedy, k=3; TRAINING.md reports the measured alpha (about twice this or more)

pytestmark = pytest.mark.skipif(not (FOLDER / "model.safetensors").exists(),
                                reason="smollm2-draft not built (python -m decodelab.train_draft)")


@pytest.fixture(scope="module")
def pair():
    prepare_smollm2(progress=False)
    target, tokenizer = load("smollm2", device="cpu")
    draft, draft_tokenizer = load("smollm2-draft", device="cpu")
    return target, draft, tokenizer, draft_tokenizer


def test_folder_is_small_and_stores_no_embedding():
    size = sum(f.stat().st_size for f in FOLDER.iterdir())
    assert size <= 20e6, f"smollm2-draft is {size / 1e6:.1f} MB"
    from decodelab.weights import read_state_dict

    names = read_state_dict(FOLDER)
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert all(n.startswith(("model.layers.", "model.norm.")) for n in names)


def test_loads_with_smollm2_vocabulary_and_embeddings(pair):
    target, draft, tokenizer, draft_tokenizer = pair
    assert draft.config.vocab_size == target.config.vocab_size == 49152
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    assert draft_tokenizer.backend.get_vocab() == tokenizer.backend.get_vocab()
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight  # tied, as in SmolLM2


def test_greedy_speculative_equals_target_greedy_and_acceptance_floor(pair):
    target, draft, tokenizer, _ = pair
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    stops = tokenizer.stop_token_ids()
    stats = SpeculativeStats()
    for prompt in PROMPTS:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        with torch.inference_mode():
            reference = list(stream_token_ids(target, ids, params, stops))
        output, s = speculative_generate(target, draft, ids, params, 3, stops)
        assert output == reference
        stats.accepted += s.accepted
        stats.rejected += s.rejected
    assert stats.acceptance_rate >= ALPHA_FLOOR, f"alpha {stats.acceptance_rate:.3f} below {ALPHA_FLOOR}"

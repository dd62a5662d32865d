"""A static batch's padded prefill (decodelab/lessons/padded_batch.py) and the two library pieces it
stands on: `MaskedPass` (one pass without a cache under a given mask, model/attention.py) and
`scramble_rope_` (model/toy.py). The oracles: each prompt run alone, and `transformers`' own
`generate` on the same left-padded batch."""

from __future__ import annotations

import pytest
import torch
from oracles import quiet_transformers

from decodelab.config import ModelConfig
from decodelab.lessons import padded_batch
from decodelab.model.attention import MaskedPass, causal_mask
from decodelab.model.toy import random_llama, scramble_rope_

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9, 3, 4, 4, 8]]


def alone(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt]), last_only=True)[0, -1]  # [V]


@torch.inference_mode()
def test_masked_pass_with_the_causal_mask_is_the_plain_forward():
    model = random_llama(1)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])  # [2, 6]
    plain = model(ids)
    causal = causal_mask(6, 6, 0)
    torch.testing.assert_close(model(ids, kv_cache=MaskedPass(causal)), plain, atol=1e-5, rtol=0)
    per_row = causal.expand(2, 1, 6, 6)  # [B, 1, T, T]
    torch.testing.assert_close(model(ids, kv_cache=MaskedPass(per_row)), plain, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="boolean"):
        MaskedPass(causal.float())
    with pytest.raises(ValueError, match=r"\[B, 1, T, T\]"):
        MaskedPass(causal[None])


@torch.inference_mode()
def test_scrambled_rope_makes_a_uniform_shift_show():
    """RoPE sees distances only: shifting every position by 5 changes the plain model's logits by
    rounding; the scrambled model's by O(1). Its tables are still rotations."""
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    shift = torch.arange(7) + 5
    plain = random_llama(2)
    torch.testing.assert_close(plain(ids, positions=shift), plain(ids), atol=1e-4, rtol=0)
    scrambled = scramble_rope_(random_llama(2))
    assert (scrambled(ids, positions=shift) - scrambled(ids)).abs().max() > 0.1
    torch.testing.assert_close(
        scrambled.rope_cos**2 + scrambled.rope_sin**2, torch.ones_like(scrambled.rope_cos), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize(
    "overrides", [{}, {"sliding_window": 3}, {"num_key_value_heads": 1}], ids=["gqa", "sliding-window", "one-kv-head"]
)
@torch.inference_mode()
def test_each_row_is_its_prompt_alone(overrides):
    for model in (random_llama(3, **overrides), scramble_rope_(random_llama(3, **overrides))):
        logits, fraction = padded_batch.padded_prefill(model, PROMPTS, 0)
        assert logits.shape == (3, model.config.vocab_size) and logits.dtype == torch.float32
        for row, prompt in enumerate(PROMPTS):
            torch.testing.assert_close(logits[row], alone(model, prompt), atol=1e-5, rtol=0)
        assert fraction == pytest.approx(6 / 21)
    same_length, fraction = padded_batch.padded_prefill(model, [[1, 2], [3, 4]], 0)
    assert fraction == 0.0


def test_bad_input_is_an_error():
    model = random_llama(0)
    for prompts, pad_id, message in (
        ([], 0, "at least one prompt"),
        ([[1], []], 0, "at least one token"),
        ([[1]], 97, "pad_id must be in"),
        ([[1, 97]], 0, "token id must be in"),
    ):
        with pytest.raises(ValueError, match=message):
            padded_batch.padded_prefill(model, prompts, pad_id)


def test_transformers_generate_on_the_same_left_padded_batch_gives_the_same_logits():
    """The peer: transformers pads on the left, builds its mask from attention_mask and its positions
    from the mask's cumulative sum inside `generate`; its first step's logits are ours."""
    from decodelab.model.registry import load, resolve_model

    model, tokenizer = load("tiny", device="cpu")
    prompts = [tokenizer.encode(text) for text in ("def add(a, b):", "import os\nprint(os.getcwd())", "x = 1")]
    pad_id = padded_batch.default_pad_id(model.config)
    with torch.inference_mode():
        ours, _ = padded_batch.padded_prefill(model, prompts, pad_id)
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])  # [B, T], left-padded
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with quiet_transformers() as transformers:
        hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=attention_mask,
                max_new_tokens=1,
                do_sample=False,
                pad_token_id=pad_id,
                output_logits=True,
                return_dict_in_generate=True,
                top_p=None,
                top_k=None,
                temperature=None,
            )
    torch.testing.assert_close(ours, out.logits[0].float(), atol=1e-4, rtol=0)


def test_default_pad_id_and_batch_padding_by_hand():
    config = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
    )
    assert padded_batch.default_pad_id(ModelConfig(**config, pad_token_id=2, eos_token_id=3)) == 2
    assert padded_batch.default_pad_id(ModelConfig(**config, eos_token_id=3)) == 3
    assert padded_batch.default_pad_id(ModelConfig(**config, eos_token_id=[4, 3])) == 4
    assert padded_batch.default_pad_id(ModelConfig(**config)) == 0
    model = random_llama(0)
    prompts = [[1, 2], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    # arrival order: [2, 4] pads 2 of 8 slots, [4, 1] pads 3 of 8; by length: [1, 2] 1 of 4, [4, 4] 0 of 8
    assert padded_batch.batch_padding(padded_batch.padded_prefill, model, prompts, 2) == pytest.approx(5 / 16)
    assert padded_batch.batch_padding(padded_batch.padded_prefill, model, prompts, 2, by_length=True) == pytest.approx(
        1 / 12
    )
    with pytest.raises(ValueError, match="batch_size"):
        padded_batch.batch_padding(padded_batch.padded_prefill, model, prompts, 0)

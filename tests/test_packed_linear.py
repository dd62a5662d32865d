"""Prepacked oneDNN weights (CPU, bfloat16): the same products as plain linear layers, the
caller's model left alone, and the engine's greedy output unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import check_greedy_agreement, random_ids, random_model
from torch import nn

from decodelab.decoding.generate import encode_prompt
from decodelab.engine.llm import LLM
from decodelab.model.packed_linear import PackedLinear, can_prepack, prepack_linear_layers, prepacked_copy
from decodelab.params import SamplingParams

needs_packing = pytest.mark.skipif(
    not can_prepack("cpu", torch.bfloat16),
    reason="no oneDNN bfloat16 packing on this CPU and torch (AVX-512 BW/VL/DQ or AVX-NE-CONVERT needed)",
)


class Tokens:
    """What the engine asks of a tokenizer when the prompts are token ids."""

    def stop_token_ids(self):
        return []

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def bf16_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16).eval().requires_grad_(False)


@needs_packing
@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (3, 7, 576), (32, 576), (1, 1, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(shape, bias):
    """Against the float64 product: the packed layer is as close as bfloat16 rounding allows,
    and no further from it than nn.Linear is (a dropped bias or a transposed weight is off by
    orders of magnitude)."""
    linear = bf16_linear(576, 1536, bias, seed=len(shape) + bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    with torch.inference_mode():
        ours, plain = packed(x), linear(x)
    exact = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
    assert ours.shape == plain.shape == (*shape[:-1], 1536) and ours.dtype == torch.bfloat16
    scale = exact.abs().max()
    assert (ours.double() - exact).abs().max() <= 2**-7 * scale  # bf16 has an 8-bit significand
    assert (ours.double() - exact).abs().max() <= 1.01 * (plain.double() - exact).abs().max() + 1e-6


@needs_packing
def test_prepack_keeps_the_models_logits_and_refuses_float32():
    model = random_model(seed=5, vocab_size=300)
    ids = random_ids(12, 300, seed=2)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="bfloat16"):
            prepack_linear_layers(model)  # float32: refused, nothing changed
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        model = model.to(torch.bfloat16)
        before = model(ids)
        linears = sum(type(m) is nn.Linear for m in model.modules())
        assert prepack_linear_layers(model) == linears > 0
        assert not any(type(m) is nn.Linear for m in model.modules())
        assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
        after = model(ids)
    torch.testing.assert_close(after, before, rtol=0, atol=0.05 * before.abs().max().item())


@needs_packing
def test_prepacked_copy_leaves_the_original_and_shares_the_rest():
    model = random_model(seed=6, vocab_size=300).to(torch.bfloat16)
    packed = prepacked_copy(model)
    assert type(model.lm_head) is nn.Linear and isinstance(packed.lm_head, PackedLinear)
    assert packed.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert packed.model.norm.weight.data_ptr() == model.model.norm.weight.data_ptr()


@needs_packing
def test_engine_with_packed_weights_keeps_greedy_output_smollm2(smollm2):
    """SmolLM2 in bfloat16: the packed engine (the default on a CPU) gives the plain engine's
    greedy tokens (a swap allowed only at a near-tie of the plain model's logits)."""
    model, tokenizer = smollm2
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)  # the shared fixture stays float32
    prompts = [
        encode_prompt(tokenizer, p, chat=True)
        for p in ("What is gravity?", "Name three colours.", "Write a haiku about the sea.")
    ]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM((bf16_model, tokenizer), prepack_weights=False).generate(prompts, params, use_tqdm=False)
    packed_llm = LLM((bf16_model, tokenizer))
    assert isinstance(packed_llm.model.lm_head, PackedLinear)  # on by default here
    assert type(bf16_model.lm_head) is nn.Linear  # the caller's model is untouched
    packed = packed_llm.generate(prompts, params, use_tqdm=False)

    def next_logits(ids):
        with torch.inference_mode():
            return bf16_model(torch.tensor([ids]), last_only=True)[0, -1]

    for prompt, a, b in zip(prompts, packed, plain):
        check_greedy_agreement(prompt, a.outputs[0].token_ids, b.outputs[0].token_ids, [next_logits])


def test_prepack_true_where_it_cannot_pack_is_a_clear_error(smollm2):
    model, tokenizer = smollm2  # float32
    with pytest.raises(ValueError, match="bfloat16"):
        LLM((model, tokenizer), prepack_weights=True)


def test_a_bfloat16_engine_runs_on_every_cpu():
    """The engine packs a bfloat16 model only where this CPU's oneDNN can (an AVX2-only CPU
    cannot: the reorder raises there), and gives the plain engine's greedy tokens either way."""
    model = random_model(seed=7, vocab_size=300).to(torch.bfloat16)
    prompts = [random_ids(n, 300, seed=n)[0].tolist() for n in (5, 11)]
    params = SamplingParams(temperature=0, max_tokens=12)
    default_llm = LLM((model, Tokens()))
    assert isinstance(default_llm.model.lm_head, PackedLinear) == can_prepack("cpu", torch.bfloat16)
    ours = default_llm.generate(prompts, params, use_tqdm=False)
    plain = LLM((model, Tokens()), prepack_weights=False).generate(prompts, params, use_tqdm=False)

    def next_logits(ids):
        with torch.inference_mode():
            return model(torch.tensor([ids]), last_only=True)[0, -1]

    for prompt, a, b in zip(prompts, ours, plain):
        assert len(a.outputs[0].token_ids) == 12
        check_greedy_agreement(prompt, a.outputs[0].token_ids, b.outputs[0].token_ids, [next_logits])

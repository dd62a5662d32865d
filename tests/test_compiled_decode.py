"""The compiled decode step and the int8 layer's fused (traced) form: the same greedy tokens as the eager
model, one compiled graph however the context grows, and the int8 product as close to the
float64 product of the dequantized weight as float32 rounding allows."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from decodelab.decoding.compiled import CompiledDecoder
from decodelab.decoding.generate import stream_token_ids
from decodelab.model.fused_int8 import quantize_for_decode
from decodelab.model.kv_cache import KVCache
from decodelab.model.quantization import Int8Linear, QuantizedKVCache
from decodelab.model.registry import load
from decodelab.params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load("tiny", device="cpu")
    return model, tokenizer


def greedy_ids(model, prompt_ids, n):
    return list(stream_token_ids(model, prompt_ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))


def float_linear(in_features, out_features, bias, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).eval().requires_grad_(False)


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 64), (2, 5, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_eager_and_traced_are_the_dequantized_product(shape, bias):
    """Eager and compiled forms against x @ dequantized_weight.T + bias in float64: both within
    float32 rounding (a scale applied per input instead of per output, a dropped bias or a
    transposed weight are off by far more)."""
    layer = Int8Linear.from_linear(float_linear(64, 48, bias))
    layer.block_rows = 32  # two blocks of rows in the eager form
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ layer.dequantized_weight().double().T + (layer.bias.double() if bias else 0)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # traced: takes the fused form
    with torch.inference_mode():
        eager, fused = layer(x), compiled(x)
    tolerance = 1e-5 * exact.abs().max()
    for got in (eager, fused):
        assert got.shape == (*shape[:-1], 48) and got.dtype == torch.float32
        assert (got.double() - exact).abs().max() <= tolerance


def test_int8_linear_rejects_bad_weights_and_inputs():
    with pytest.raises(ValueError, match="int8 matrix"):
        Int8Linear(torch.zeros(4, 8), torch.ones(4, 1))
    with pytest.raises(ValueError, match="int8 matrix"):
        Int8Linear(torch.zeros(4, 8, 2, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"inputs \[\.\.\., 8\]"):
        Int8Linear(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 1))(torch.zeros(1, 7))


def test_quantize_for_decode_swaps_every_linear_and_keeps_the_embedding(tiny):
    model = quantize_for_decode(copy.deepcopy(tiny[0]))
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.model.embed_tokens.weight, tiny[0].model.embed_tokens.weight)


def same_tokens_and_no_recompile(decoder, model, tokenizer, runs):
    """Greedy ids of `decoder` equal the eager model's for every (prompt, n), and runs after the
    first (other prompt and cache lengths) compile nothing. (The first may reuse a graph that
    another test compiled: the weights are inputs of the graph, so models of one shape share it.)"""
    for index, (prompt, n) in enumerate(runs):
        ids = tokenizer.encode(prompt)
        assert greedy_ids(decoder, ids, n) == greedy_ids(model, ids, n), prompt
        if index == 0:
            first = decoder.compiles
            assert first <= 1
    assert decoder.compiles == first


def test_compiled_step_gives_the_eager_tokens_with_one_graph(tiny):
    """Traced without inductor (fast): the slot cache, the mask and the position tensor give
    the eager model's greedy tokens, and caches of other lengths compile nothing new."""
    model, tokenizer = tiny
    same_tokens_and_no_recompile(
        CompiledDecoder(model, backend="eager"),
        model,
        tokenizer,
        [("def add(a, b):", 12), ("import os\nimport sys\n", 20)],
    )


@pytest.mark.slow
def test_compiled_step_compiles_again_when_global_state_changes(tiny):
    """Guards are skipped once the graph exists, but a change inductor's guards catch (the
    thread count) still compiles a graph for it instead of failing or running the first."""
    model, tokenizer = tiny
    decoder = CompiledDecoder(model)
    ids = tokenizer.encode("def f(x):")
    threads = torch.get_num_threads()
    try:
        first = greedy_ids(decoder, ids, 6)
        torch.set_num_threads(1 if threads > 1 else 2)
        assert greedy_ids(decoder, ids, 6) == first == greedy_ids(model, ids, 6)
    finally:
        torch.set_num_threads(threads)
    assert decoder.compiles <= 2


def test_compiled_step_rejects_caches_it_cannot_write(tiny):
    model, tokenizer = tiny
    decoder = CompiledDecoder(model, backend="eager")
    token = torch.tensor([[1]])
    with pytest.raises(TypeError, match="KVCache"):
        decoder(token, kv_cache=QuantizedKVCache(model.config, 1, 8), last_only=True)
    full = KVCache(model.config, 1, 2)
    with torch.inference_mode():
        decoder(torch.tensor([[1, 2]]), kv_cache=full, last_only=True)  # prefill fills both slots
        with pytest.raises(ValueError, match="max_seq_len=2"):
            decoder(token, kv_cache=full, last_only=True)


@pytest.mark.slow
def test_inductor_float32_step_gives_the_eager_tokens(tiny):
    """The real compiler (inductor's C++ code): the same greedy tokens as eager float32, and a
    longer context compiles nothing new."""
    model, tokenizer = tiny
    same_tokens_and_no_recompile(
        CompiledDecoder(model), model, tokenizer, [("def add(a, b):", 16), ("class Stack:\n", 40)]
    )


@pytest.mark.slow
def test_inductor_int8_step_gives_the_eager_int8_tokens(tiny):
    """Compiled (fused dequantization) and eager (a block of rows at a time) int8 layers read the
    same weights: the same greedy tokens."""
    model = quantize_for_decode(copy.deepcopy(tiny[0]))
    same_tokens_and_no_recompile(CompiledDecoder(model), model, tiny[1], [("for i in range(10):", 32), ("x = 1\n", 12)])


@pytest.mark.slow
def test_compiled_step_on_smollm2_gives_the_eager_tokens(smollm2):
    """SmolLM2's real shapes (GQA 9:3 heads, tied lm_head), traced without inductor."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is gravity?"}]))
    decoder = CompiledDecoder(model, backend="eager")
    assert greedy_ids(decoder, ids, 24) == greedy_ids(model, ids, 24)

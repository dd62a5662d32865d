"""Quantization (`decodelab.model.quantization`) and perplexity (`decodelab.lessons.perplexity`).

The ``check_*`` functions take the implementation under test (the library's reference here,
a kept buggy version in the negative tests) and raise AssertionError with the input, the
expected and the actual result. Their expected values come from small plain-torch formulas,
never from `decodelab.model.quantization` itself. The quantizers notebook 06 grades are checked
by its graded checks (autograder/checks/quantization.py), imported here rather than copied; the
functions only the library has (dequantize, pack, unpack, QuantizedLinear) by the checks below.

Error bounds, derived: round-to-nearest puts x / s within 1/2 of its level q, so
|x - q s| <= s / 2 in exact arithmetic. In float32, x / s and q * s each add a relative
rounding error of at most eps / 2 (eps = 2^-23), i.e. at most eps * max|x| in all; the
checks allow s / 2 + 2 eps max|x|.
"""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import load_fixture, random_ids, random_model

from autograder.checks.quantization import (  # the graded checks of notebook 06, not copies of them
    check_quantize_int4_groupwise,
    check_quantize_int8_per_channel,
    check_quantize_int8_per_tensor,
)
from decodelab.decoding.generate import stream_token_ids
from decodelab.lessons.perplexity import heldout_text, perplexity, token_nlls
from decodelab.model import quantization as quant
from decodelab.model.kv_cache import KVCache
from decodelab.params import SamplingParams

EPS = torch.finfo(torch.float32).eps


buggy = load_fixture("library/buggy_quantization")


def _slack(x: torch.Tensor) -> float:
    return 2 * EPS * float(x.abs().max())


def _rows_of_different_magnitude(out_features=16, in_features=256, seed=0) -> torch.Tensor:
    """Rows scaled by 1e-3 .. 10; the largest |w| of the matrix is positive."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    w = w * torch.logspace(-3, 1, out_features)[:, None]
    w[-1, 5] = w.abs().max() * 1.5
    return w


def _ref_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Documented layout: byte j holds column 2j in bits 0-3 and column 2j+1 in bits 4-7."""
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int16)
    return torch.where(nib >= 8, nib - 16, nib)


def _expect_value_error(fn, *args, what: str):
    try:
        fn(*args)
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what}: should raise ValueError, raised {type(e).__name__}: {e}") from None
    raise AssertionError(f"{what}: should raise ValueError, returned normally")


# --------------------------------------------------------------------------- checks: int8


def check_dequantize_int8(fn):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (5, 7), generator=g, dtype=torch.int8)
    for scale in (torch.tensor(0.03), torch.rand(5, 1, generator=g)):
        got = fn(q, scale)
        assert got.dtype == torch.float32, f"expected float32, got {got.dtype}"
        assert torch.allclose(got, q.float() * scale, rtol=1e-6, atol=0), (
            f"expected q * scale for scale shape {tuple(scale.shape)}, got a different result"
        )


# --------------------------------------------------------------------------- checks: int4


ALL_PAIRS = torch.cartesian_prod(torch.arange(-8, 8), torch.arange(-8, 8)).to(torch.int8)  # [256, 2]
ALL_PAIR_BYTES = ((ALL_PAIRS[:, 0].int() & 0xF) | ((ALL_PAIRS[:, 1].int() & 0xF) << 4)).to(torch.uint8)[:, None]


def check_pack_int4(fn):
    got = fn(torch.tensor([[-1, 7, -8, 0]], dtype=torch.int8))
    expected = torch.tensor([[0x7F, 0x08]], dtype=torch.uint8)
    assert got.dtype == torch.uint8, f"packed data must be uint8, got {got.dtype}"
    assert torch.equal(got, expected), (
        f"pack_int4([[-1, 7, -8, 0]]) should be bytes [0x7F, 0x08] (even column in the low nibble, "
        f"4-bit two's complement), got {[hex(b) for b in got.flatten().tolist()]}"
    )
    got = fn(ALL_PAIRS)
    bad = (got != ALL_PAIR_BYTES).flatten().nonzero().flatten()
    assert bad.numel() == 0, (
        f"pair {ALL_PAIRS[bad[0]].tolist()} packed to {hex(int(got[bad[0]]))}, "
        f"expected {hex(int(ALL_PAIR_BYTES[bad[0]]))}"
    )
    _expect_value_error(fn, torch.zeros(2, 3, dtype=torch.int8), what="an odd number of columns")


def check_unpack_int4(fn):
    got = fn(ALL_PAIR_BYTES)
    assert got.dtype == torch.int8 and tuple(got.shape) == (256, 2), (
        f"expected int8 [256, 2] from uint8 [256, 1], got {got.dtype} {tuple(got.shape)}"
    )
    bad = (got != ALL_PAIRS).any(dim=1).nonzero().flatten()
    assert bad.numel() == 0, (
        f"byte {hex(int(ALL_PAIR_BYTES[bad[0]]))} unpacked to {got[bad[0]].tolist()}, expected "
        f"{ALL_PAIRS[bad[0]].tolist()} (a nibble >= 8 is negative: 0xF is -1)"
    )
    got = fn(torch.tensor([[0x21, 0x43]], dtype=torch.uint8))
    assert got.tolist() == [[1, 2, 3, 4]], (
        f"bytes [[0x21, 0x43]] unpacked to {got.tolist()}, expected [[1, 2, 3, 4]] (low nibble first, byte by byte)"
    )


def check_dequantize_int4(fn):
    g = torch.Generator().manual_seed(2)
    levels = torch.randint(-8, 8, (3, 128), generator=g, dtype=torch.int8)
    packed = ((levels[:, 0::2].int() & 0xF) | ((levels[:, 1::2].int() & 0xF) << 4)).to(torch.uint8)  # [3, 64]
    scale = torch.rand(3, 4, generator=g)
    got = fn(packed, scale, 32)
    expected = (levels.float().reshape(3, 4, 32) * scale[..., None]).reshape(3, 128)
    assert got.dtype == torch.float32 and got.shape == expected.shape, (
        f"expected float32 [3, 128], got {got.dtype} {tuple(got.shape)}"
    )
    assert torch.allclose(got, expected, rtol=1e-6, atol=0), "dequantize_int4 differs from level * scale of its group"


def check_quantized_linear(cls):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 128, generator=g)
    for bias in (True, False):
        linear = torch.nn.Linear(128, 40, bias=bias)
        torch.nn.init.normal_(linear.weight, generator=g)
        for bits, group in ((8, None), (4, 32), (4, 128)):
            layer = cls.from_linear(linear, bits=bits, group_size=group or 64)
            w = layer.dequantized_weight()
            got, expected = layer(x), F.linear(x, w, linear.bias)
            assert got.shape == (2, 3, 40) and torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (
                f"bits={bits} bias={bias}: forward differs from F.linear(x, dequantized weight, bias)"
            )
            scale_bytes = 4 * 40 * (1 if bits == 8 else 128 // group)
            expected_bytes = 40 * 128 * bits // 8 + scale_bytes
            assert layer.nbytes == expected_bytes, f"bits={bits}: nbytes {layer.nbytes}, expected {expected_bytes}"
    _expect_value_error(cls.from_linear, torch.nn.Linear(64, 8), 3, what="bits=3")


REFERENCE = {
    "check_quantize_int8_per_tensor": quant.quantize_int8_per_tensor,
    "check_quantize_int8_per_channel": quant.quantize_int8_per_channel,
    "check_dequantize_int8": quant.dequantize_int8,
    "check_pack_int4": quant.pack_int4,
    "check_unpack_int4": quant.unpack_int4,
    "check_quantize_int4_groupwise": quant.quantize_int4_groupwise,
    "check_dequantize_int4": quant.dequantize_int4,
    "check_quantized_linear": quant.QuantizedLinear,
}


CHECKS = {
    check.__name__: check
    for check in (
        check_quantize_int8_per_tensor,
        check_quantize_int8_per_channel,
        check_dequantize_int8,
        check_pack_int4,
        check_unpack_int4,
        check_quantize_int4_groupwise,
        check_dequantize_int4,
        check_quantized_linear,
    )
}


@pytest.mark.parametrize("check_name", sorted(REFERENCE))
def test_reference_passes(check_name):
    CHECKS[check_name](REFERENCE[check_name])


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    fn, check_name, what = buggy.BUGS[bug]
    with pytest.raises(AssertionError) as info:
        CHECKS[check_name](fn)
    assert len(str(info.value)) > 40, f"{bug} ({what}): message too terse to help: {info.value}"


def test_bug_messages_name_the_problem():
    with pytest.raises(AssertionError, match="a level past the range wrapped around"):
        check_quantize_int8_per_tensor(buggy.int8_per_tensor_scale_128)
    with pytest.raises(AssertionError, match=r"scale has shape \(1, 96\), expected \(16, 1\)"):
        check_quantize_int8_per_channel(buggy.int8_per_channel_wrong_axis)
    with pytest.raises(AssertionError, match="0xF is -1"):
        check_unpack_int4(buggy.unpack_int4_unsigned)


@st.composite
def int4_matrices(draw):
    """int8 [rows, 2 * half_width] with every value in [-8, 7], drawn value by value."""
    rows, half_width = draw(st.integers(1, 4)), draw(st.integers(1, 24))
    values = draw(st.lists(st.integers(-8, 7), min_size=rows * 2 * half_width, max_size=rows * 2 * half_width))
    return torch.tensor(values, dtype=torch.int8).reshape(rows, 2 * half_width)


@settings(max_examples=80, deadline=None)
@given(q=int4_matrices())
def test_int4_pack_unpack_identity(q):
    packed = quant.pack_int4(q)
    assert packed.shape == (q.shape[0], q.shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_int4(packed), q)


def test_invalid_arguments_raise_value_error():
    with pytest.raises(ValueError, match="in \\[-8, 7\\]"):
        quant.pack_int4(torch.tensor([8, 0], dtype=torch.int8))
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize_int8_per_tensor(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="expected \\(4, 2\\)"):
        quant.dequantize_int4(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 3), 32)
    model = random_model()
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quant.quantize_model(model, bits=2)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quant.quantize_model(model, bits=4, group_size=48)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        quant.QuantizedKVCache(model.config, kv_dtype="int4")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        quant.QuantizedKVCache(model.config, max_seq_len=10**6)


def test_fp8_kv_cache_without_float8_says_so(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(RuntimeError, match="needs torch.float8_e4m3fn.*use kv_dtype='int8'"):
        quant.QuantizedKVCache(random_model().config, max_seq_len=8, kv_dtype="fp8")


# --------------------------------------------------------------------------- models


def _linear_bytes_formula(layers, bits: int, group_size: int = 64) -> tuple[int, int]:
    """(quantized bytes, fp32 bytes) of all decoder-layer linears: int8 = out*in + 4*out;
    int4 = out*in/2 + 4*out*in/g, with g falling back to the largest allowed divisor of in."""
    quantized = fp32 = 0
    for module in layers.modules():
        if isinstance(module, torch.nn.Linear):
            o, i = module.out_features, module.in_features
            fp32 += 4 * o * i
            if bits == 8:
                quantized += o * i + 4 * o
            else:
                g = max(s for s in quant.GROUP_SIZES if s <= group_size and i % s == 0)
                quantized += o * i // 2 + 4 * o * (i // g)
    return quantized, fp32


def _quantized_bytes(layers) -> int:
    return sum(m.nbytes for m in layers.modules() if isinstance(m, quant.QuantizedLinear))


@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 32), (4, 64), (4, 128)])
def test_quantize_model_random(bits, group_size):
    model = random_model(tie_word_embeddings=True)  # hidden 64, intermediate 96: g64, g128 fall back
    expected_bytes, fp32_bytes = _linear_bytes_formula(model.model.layers, bits, group_size)
    embedding = model.model.embed_tokens.weight
    ids = random_ids(12, model.config.vocab_size)
    with torch.no_grad():
        ref = model(ids)
    assert quant.quantize_model(model, bits=bits, group_size=group_size) is model
    assert _quantized_bytes(model.model.layers) == expected_bytes
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is embedding  # tied, float
    with torch.no_grad():
        logits = model(ids)
    assert (logits - ref).abs().max() < (0.05 if bits == 8 else 0.5) * ref.abs().max()
    out = list(stream_token_ids(model, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    assert len(out) == 4 and all(0 <= t < model.config.vocab_size for t in out)


def test_quantize_model_skip():
    model = quant.quantize_model(random_model(), bits=8, skip=("lm_head", "down_proj", "layers.1.self_attn.q_proj"))
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[1].self_attn.q_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[0].self_attn.q_proj, quant.QuantizedLinear)


def test_quantize_model_with_a_layer_factory():
    """quantize_model(linear=factory) builds every quantized layer with the factory, skips as before,
    and Int8Linear computes what QuantizedLinear(bits=8) computes (scale after the sum: float rounding)."""
    model = random_model(tie_word_embeddings=True)
    ids = random_ids(10, model.config.vocab_size)
    library = quant.quantize_model(copy.deepcopy(model), bits=8)
    made = []

    def factory(linear):
        made.append(linear)
        return quant.Int8Linear.from_linear(linear)

    assert quant.quantize_model(model, bits=8, skip=("lm_head", "down_proj"), linear=factory) is model
    assert len(made) == 6 * model.config.num_hidden_layers  # 7 linears a layer, down_proj kept
    assert all(isinstance(layer.mlp.down_proj, torch.nn.Linear) for layer in model.model.layers)
    assert isinstance(model.model.layers[0].self_attn.q_proj, quant.Int8Linear)
    quant.replace_linears(model, quant.Int8Linear.from_linear)  # down_proj too, now
    with torch.no_grad():
        got, want = model(ids), library(ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_int8_linear_scales_the_output_without_a_float_weight():
    from decodelab.lessons.tiled_attention import measure_module_memory

    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(192, 640)
    torch.nn.init.normal_(linear.weight, generator=g)
    layer = quant.Int8Linear.from_linear(linear)
    assert layer.weight_q.dtype == torch.int8 and layer.nbytes == 640 * 192 + 4 * 640
    x = torch.randn(3, 5, 192, generator=g)
    with torch.no_grad():
        got, exact = layer(x), linear(x)
        assert torch.allclose(got, quant.QuantizedLinear.from_linear(linear, 8)(x), rtol=1e-5, atol=1e-4)
    bound = x.abs() @ (layer.weight_scale.T / 2).expand(192, -1) + 1e-4  # |y - y_float| <= scale_o / 2 * sum|x|
    assert ((got - exact).abs() <= bound).all()
    _, seen = measure_module_memory(layer, x[0])
    assert seen.peak_bytes < 4 * 640 * 192 / 2, seen  # one block of 128 rows in float, not the weight
    _, seen = measure_module_memory(quant.QuantizedLinear.from_linear(linear, 8), x[0])
    assert seen.peak_bytes >= 4 * 640 * 192  # the library's simple layer does make the float copy
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_linear_scales_each_group_without_a_float_weight(group_size):
    """Int4Linear reads the levels QuantizedLinear(bits=4) dequantizes (the same bytes and scales), within
    the group-wise bound of the float layer, one group in float at a time."""
    from decodelab.lessons.tiled_attention import measure_module_memory

    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(512, 640)
    torch.nn.init.normal_(linear.weight, generator=g)
    layer = quant.Int4Linear.from_linear(linear, group_size)
    assert layer.group_size == group_size and layer.nbytes == 640 * 256 + 4 * 640 * 512 // group_size
    for k in range(512 // group_size):
        assert torch.equal(
            layer.unpack_group(k), quant.unpack_int4(layer.weight_q)[:, k * group_size : (k + 1) * group_size]
        )
    x = torch.randn(3, 5, 512, generator=g)
    with torch.no_grad():
        got, exact = layer(x), linear(x)
        assert torch.allclose(got, quant.QuantizedLinear.from_linear(linear, 4, group_size)(x), rtol=1e-5, atol=1e-4)
    bound = x.abs().reshape(3, 5, -1, group_size).sum(-1) @ (layer.weight_scale.T / 2) + 1e-4
    assert ((got - exact).abs() <= bound).all()
    _, seen = measure_module_memory(layer, x[0])
    assert seen.peak_bytes < 4 * 640 * 512 / 4, seen  # one group's levels in float, not the weight
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_int4_linear_in_the_engine_writes_the_library_int4_tokens():
    """LLM("tiny", quantization="int4", hooks=EngineHooks(linear=Int4Linear.from_linear)): every decoder-layer
    linear is an Int4Linear, and greedy decoding writes LLM(quantization="int4")'s tokens (same levels and scales)."""
    from decodelab.engine.llm import LLM, EngineHooks

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for hooks in (None, EngineHooks(linear=quant.Int4Linear.from_linear)):
        llm = LLM("tiny", quantization="int4", num_kv_blocks=64, hooks=hooks)
        if hooks:
            assert all(
                isinstance(m, quant.Int4Linear) for m in llm.model.model.layers.modules() if hasattr(m, "weight_q")
            )
        outputs.append(
            [r.outputs[0].token_ids for r in llm.generate(["def fibonacci(n):", "import os\n"], params, use_tqdm=False)]
        )
    assert outputs[0] == outputs[1]


SMOLLM2_INT8_MIN_AGREEMENT = 0.85  # measured 0.953: 61/64, the 3 misses at top-2 margins < 0.014


def test_smollm2_int8(smollm2):
    """Teacher-forced top-1 agreement and perplexity on 64 held-out tokens, exact bytes, generation."""
    model, tokenizer = smollm2
    ids = tokenizer.encode(heldout_text("en"))[:64]
    int8 = quant.quantize_model(copy.deepcopy(model), bits=8)
    with torch.inference_mode():
        ref, got = model(torch.tensor([ids])), int8(torch.tensor([ids]))
    agreement = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    print(f"SmolLM2 int8: top-1 agreement {agreement:.3f}, max logit diff {float((ref - got).abs().max()):.3f}")
    assert agreement >= SMOLLM2_INT8_MIN_AGREEMENT
    ppl_ref, ppl_int8 = (math.exp(F.cross_entropy(x[0, :-1], torch.tensor(ids[1:])).item()) for x in (ref, got))
    assert abs(ppl_int8 / ppl_ref - 1) < 0.05, f"perplexity {ppl_ref:.2f} -> {ppl_int8:.2f}"
    expected, fp32 = _linear_bytes_formula(model.model.layers, 8)
    assert _quantized_bytes(int8.model.layers) == expected
    assert abs(expected / fp32 - 0.25) < 0.01  # 1/4 + 1/in_features
    out = list(stream_token_ids(int8, ids[:8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    assert len(out) == 3


def test_smollm2_int4_layer_bytes(smollm2):
    """int4 on one SmolLM2 layer (576 inputs: g128 falls back to g64): exact bytes ~ 1/8 + scales."""
    model, _ = smollm2
    for group_size in quant.GROUP_SIZES:
        layers = torch.nn.ModuleList([copy.deepcopy(model.model.layers[0])])
        expected, fp32 = _linear_bytes_formula(layers, 4, group_size)
        quant.quantize_model(types.SimpleNamespace(model=types.SimpleNamespace(layers=layers)), 4, group_size)
        assert _quantized_bytes(layers) == expected
        assert 1 / 8 < expected / fp32 <= 1 / 8 + 1 / 32 + 1e-9  # + 4 scale bytes per group of >= 32 weights
    assert layers[0].self_attn.q_proj.group_size == 64 and layers[0].mlp.down_proj.group_size == 128


TINY_MAX_PPL_RISE = {8: 0.01, 4: 0.10}  # measured on these 256 tokens: int8 +0.0%, int4-g64 +1-2%


def test_tiny_quantized_perplexity():
    """The course's own `tiny` model (plugs in by name once trained): perplexity on held-out code."""
    from decodelab.model.registry import load, resolve_model

    if not (resolve_model("tiny") / "config.json").exists():
        pytest.skip("the tiny model is not trained yet (lib/decodelab/data/tiny/)")
    try:
        text = heldout_text("code")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    model, tokenizer = load("tiny", device="cpu")
    ids = tokenizer.encode(text[:4000])[:256]
    base = perplexity(model, ids, window=128, stride=64)
    for bits in (8, 4):
        quantized = quant.quantize_model(copy.deepcopy(model), bits=bits, group_size=64)
        ppl = perplexity(quantized, ids, window=128, stride=64)
        print(f"tiny int{bits}: perplexity {base:.2f} -> {ppl:.2f}")
        assert ppl / base - 1 < TINY_MAX_PPL_RISE[bits]


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("kv_dtype", quant.KV_DTYPES)
def test_quantized_kv_cache_random(kv_dtype):
    model = random_model()
    cfg = model.config
    ids = random_ids(20, cfg.vocab_size)
    ref_cache, cache = KVCache(cfg, 1, 24), quant.QuantizedKVCache(cfg, 1, 24, kv_dtype=kv_dtype)
    with torch.no_grad():
        ref = torch.cat([model(ids[:, :12], kv_cache=ref_cache), model(ids[:, 12:], kv_cache=ref_cache)], 1)
        prefill = model(ids[:, :12], kv_cache=cache)
        got = torch.cat([prefill] + [model(ids[:, i : i + 1], kv_cache=cache) for i in range(12, 20)], 1)
    assert (got - ref).abs().max() < {"int8": 0.05, "fp8": 0.2, "fp16": 1e-3}[kv_dtype] * ref.abs().max()
    d = cfg.head_dim
    payload, scales = (1, 4) if kv_dtype != "fp16" else (2, 0)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (payload * d + scales)
    assert cache.nbytes() == 20 * per_token
    assert cache.nbytes() / ref_cache.nbytes() == pytest.approx((payload * d + scales) / (4 * d))
    cache.truncate(5)
    with torch.no_grad():
        again = model(ids[:, 5:8], kv_cache=cache)
    assert cache.seq_len == 8 and torch.allclose(again, got[:, 5:8], atol=1e-5)
    with pytest.raises(ValueError, match="KV cache is full"):
        model(random_ids(17, cfg.vocab_size), kv_cache=cache)


@pytest.mark.parametrize("kv_dtype", quant.KV_DTYPES)
def test_quantized_kv_cache_view_is_what_append_returned(kv_dtype):
    """view(layer) dequantizes (it once handed back the raw int8 levels); append returns it in k's dtype."""
    cfg = random_model().config
    cache = quant.QuantizedKVCache(cfg, 2, 8, kv_dtype=kv_dtype)
    shape = (2, cfg.num_key_value_heads, 3, cfg.head_dim)
    k, v = torch.randn(shape, generator=torch.Generator().manual_seed(0)), torch.randn(shape).bfloat16()
    got_k, got_v = cache.append(1, k, v)
    view_k, view_v = cache.view(1)
    assert got_k.dtype == torch.float32 and got_v.dtype == torch.bfloat16 and view_k.dtype == torch.float32
    assert torch.equal(view_k, got_k) and torch.equal(view_v.bfloat16(), got_v)
    assert (view_k - k).abs().max() <= {"int8": 0.5 / 127, "fp8": 0.07, "fp16": 1e-3}[kv_dtype] * k.abs().max()


def test_int8_kv_cache_is_the_int8_quantized_cache():
    cfg = random_model().config
    cache = quant.Int8KVCache(cfg, 1, 8)
    assert isinstance(cache, quant.QuantizedKVCache) and cache.kv_dtype == "int8" and cache.keys.dtype == torch.int8


SMOLLM2_KV_INT8_MAX_LOGIT_DIFF = 1.0  # measured 0.54 (logits span about +-30)


def test_smollm2_int8_kv_cache(smollm2):
    """8 greedy tokens with an int8 KV cache: same tokens as fp32, small logit differences."""
    model, tokenizer = smollm2
    prompt = torch.tensor([tokenizer.encode("The capital of France is a city that")])
    caches = [KVCache(model.config, 1, 32), quant.QuantizedKVCache(model.config, 1, 32, kv_dtype="int8")]
    tokens, max_diff = [[], []], 0.0
    with torch.inference_mode():
        inputs = [prompt, prompt]
        for _ in range(8):
            logits = [model(x, kv_cache=c, last_only=True)[:, -1] for x, c in zip(inputs, caches)]
            max_diff = max(max_diff, float((logits[0] - logits[1]).abs().max()))
            inputs = [x.argmax(-1, keepdim=True) for x in logits]
            for seq, x in zip(tokens, inputs):
                seq.append(int(x))
    print(f"SmolLM2 int8 KV: max logit diff {max_diff:.3f}, bytes ratio {caches[1].nbytes() / caches[0].nbytes():.4f}")
    assert tokens[0] == tokens[1]
    assert max_diff < SMOLLM2_KV_INT8_MAX_LOGIT_DIFF
    d = model.config.head_dim
    assert caches[1].nbytes() / caches[0].nbytes() == pytest.approx((d + 4) / (4 * d))  # 26.6% for D = 64


# --------------------------------------------------------------------------- perplexity


def test_perplexity_windows():
    model = random_model()
    ids = random_ids(40, model.config.vocab_size)[0]
    with torch.no_grad():
        full = F.cross_entropy(model(ids[None])[0, :-1], ids[1:], reduction="none")
    assert perplexity(model, ids, window=64, stride=32) == pytest.approx(math.exp(full.mean().item()), rel=1e-5)
    nll = token_nlls(model, ids.tolist(), window=16, stride=5)  # each token scored exactly once
    assert nll.shape == (39,) and torch.allclose(nll[:15], full[:15], atol=1e-5)
    nll = token_nlls(model, ids, window=16, stride=15)
    assert nll.shape == (39,)
    for kwargs in (dict(window=1), dict(window=16, stride=16), dict(window=16, stride=0), dict(window=10**6)):
        with pytest.raises(ValueError):
            perplexity(model, ids, **kwargs)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, ids[:1])


def test_heldout_text():
    text = heldout_text("en")
    assert 40_000 <= len(text.encode()) <= 60_000 and text.startswith("These equivalences assume")
    with pytest.raises(ValueError, match="which must be one of"):
        heldout_text("fr")
    try:
        code = heldout_text("code")
    except FileNotFoundError as e:
        pytest.skip(f"code held-out text not written yet: {e}")
    assert "def " in code

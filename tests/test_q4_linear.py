"""Q4_1 weights and a Q8_0 lm_head from the GGUF's own blocks (decodelab.model.q4_linear and
q8_linear, issue 30).

Oracles: gguf's own dequantization (`load_gguf_state_dict`, the float32 weights the library
loads) for the blocks, bit for bit; F.linear on the dequantized weight for the kernel, within
the worst-case float32 summation error of a length-K dot product plus, for Q4_1, what reading x as
16-bit integers can move (both derived below); the float32 model's greedy tokens for the Q4 model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from decodelab.decoding.generate import encode_prompt, generate_with_cache
from decodelab.model import q4_kernel, thread_team
from decodelab.model.gguf_tensors import read_gguf_tensors
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import MLP
from decodelab.model.q4_layer import Q4DecoderLayer, use_q4_layers
from decodelab.model.q4_linear import Q4Linear, dequantize_q4_1, q4_1_blocks, use_gguf_q4_weights
from decodelab.model.q4_swiglu import Q4SwiGLU, use_q4_swiglu
from decodelab.model.q8_linear import Q8Linear, dequantize_q8_0, q8_0_blocks
from decodelab.model.toy import random_llama, toy_config

UNIT_ROUNDOFF = 2.0**-24  # float32


def summation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most two float32 evaluations of x @ weight.T can differ by, summing in any order.
    Each is within gamma_K * (|x| @ |W|.T) of the exact value, gamma_K = K u / (1 - K u) (Higham,
    Accuracy and Stability, 3.1), so they are within twice that of each other."""
    k = x.shape[-1]
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    return 2 * gamma * (x.double().abs() @ weight.double().abs().T)


def int16_step(x: torch.Tensor) -> torch.Tensor:
    """[..., K]: the step between the 16-bit integers the Q4_1 kernels read each value of x as (csrc/gguf_gemv.c):
    the largest |x| in its block of 32 values, / 32767."""
    largest = x.double().abs().reshape(*x.shape[:-1], -1, 32).amax(-1)
    return (largest / 32767).repeat_interleave(32, -1)


def q4_1_product_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most the Q4_1 kernel's x @ weight.T can differ from F.linear's: the summation bound, plus
    each value of x rounded to the nearest step (half a step at most) times the |weight| it meets."""
    return summation_bound(x, weight) + (int16_step(x) / 2) @ weight.double().abs().T


def forget_kernel() -> None:
    """The next kernel() builds and loads the library again, under the environment then."""
    q4_kernel.kernel.cache_clear()
    q4_kernel._loaded_or_why.cache_clear()


def require_kernel() -> None:
    if q4_kernel.kernel() is None:
        pytest.skip("the Q4_1 kernel cannot run on this machine (its one line on stderr says why)")


def random_q4(n: int, k: int, seed: int = 0) -> Q4Linear:
    generator = torch.Generator().manual_seed(seed)
    nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    d = torch.rand(n, k // 32, generator=generator) * 0.01
    m = -8 * d * torch.rand(n, k // 32, generator=generator)
    return Q4Linear(nibbles, d, m)


@pytest.fixture(scope="module")
def gguf_tensors(smollm2_gguf):
    return read_gguf_tensors(smollm2_gguf)


@pytest.fixture(scope="module")
def q4_smollm2(smollm2, smollm2_gguf):
    """(SmolLM2 with its Q4_1 linears swapped for Q4Linear, the float32 model it came from)."""
    model, _ = smollm2
    return use_gguf_q4_weights(copy.deepcopy(model), smollm2_gguf), model


def test_blocks_are_gguf_dequantization_bit_for_bit(q4_smollm2):
    q4, float_model = q4_smollm2
    weights = dict(float_model.named_parameters())
    swapped = {name: module for name, module in q4.named_modules() if isinstance(module, Q4Linear)}
    assert len(swapped) == 7 * q4.config.num_hidden_layers  # q, k, v, o, gate, up, down
    for name, module in swapped.items():
        assert torch.equal(module.dequantized_weight(), weights[name + ".weight"]), name
    assert isinstance(q4.lm_head, Q8Linear), "lm_head is tied to the Q8_0 token_embd: its blocks"
    assert torch.equal(q4.lm_head.dequantized_weight(), float_model.lm_head.weight)
    assert torch.equal(q4.model.embed_tokens.weight, weights["model.embed_tokens.weight"]), "lookups stay float32"


def random_q8(n: int, k: int, seed: int = 0) -> Q8Linear:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    return Q8Linear(q, torch.rand(n, k // 32, generator=generator) * 0.01)


def test_q8_0_is_a_signed_byte_times_its_blocks_scale():
    q = torch.zeros(1, 64, dtype=torch.int8)
    q[0, 5], q[0, 40] = -128, 127
    weight = dequantize_q8_0(q, torch.tensor([[0.5, 2.0]]))
    expected = torch.zeros(1, 64)
    expected[0, 5], expected[0, 40] = -64.0, 254.0
    assert torch.equal(weight, expected)


def test_q8_without_the_kernel_is_the_reference(monkeypatch):
    layer = random_q8(n=7, k=32)
    x = torch.randn(2, 32, dtype=torch.float64)
    assert not layer.uses_kernel(x)
    assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight().double()))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Linear(torch.zeros(2, 33, dtype=torch.int8), torch.zeros(2, 1))


def test_c_dequantization_is_the_torch_reference_bit_for_bit():
    """`dequantized_weight()` runs C where the kernels load; it must be `dequantize_q4_1` / `_q8_0`."""
    require_kernel()
    q4, q8 = random_q4(n=23, k=96, seed=5), random_q8(n=19, k=64, seed=6)
    assert torch.equal(q4.dequantized_weight(), dequantize_q4_1(q4.nibbles, q4.d, q4.m))
    assert torch.equal(q8.dequantized_weight(), dequantize_q8_0(q8.q, q8.d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_dtype_conversion_leaves_the_blocks_in_their_format(dtype):
    """`model.to(dtype)` converts every floating buffer; the blocks are a format (Q4_1's fp16 d and m,
    Q8_0's float32 d), which the C kernels read as such: they stay, and so do the weights."""
    q4, q8 = random_q4(n=9, k=64, seed=8), random_q8(n=5, k=64, seed=9)
    weights = q4.dequantized_weight(), q8.dequantized_weight()
    q4.to(dtype), q8.to(dtype)
    assert [block.dtype for block in q4.blocks()] == [torch.uint8, torch.float16, torch.float16]
    assert [block.dtype for block in q8.blocks()] == [torch.int8, torch.float32]
    assert torch.equal(q4.dequantized_weight(), weights[0]) and torch.equal(q8.dequantized_weight(), weights[1])


def test_the_kernel_refuses_q4_1_blocks_of_another_dtype():
    require_kernel()
    layer = random_q4(n=4, k=32, seed=10)
    with pytest.raises(TypeError, match="d float16, m float16"):
        q4_kernel.q4_1_matmul(torch.randn(1, 32), layer.nibbles, layer.d.float(), layer.m)
    with pytest.raises(TypeError, match="d float16, m float16"):
        q4_kernel.q4_1_dequantize(layer.nibbles, layer.d, layer.m.float())


def test_many_rows_take_the_float_gemm_on_the_same_weights():
    layer = random_q4(n=13, k=64, seed=7)
    x = torch.randn(q4_kernel.KERNEL_MAX_ROWS + 1, 64)
    assert not layer.uses_kernel(x)
    assert torch.equal(layer(x), F.linear(x, dequantize_q4_1(layer.nibbles, layer.d, layer.m)))


def test_nibble_order_low_then_high():
    """Byte j holds weight j (low nibble) and weight j + 16 (high nibble) of its block."""
    nibbles = torch.zeros(1, 16, dtype=torch.uint8)
    nibbles[0, 3] = 0x52  # weight 3 = 2, weight 19 = 5
    weight = dequantize_q4_1(nibbles, torch.ones(1, 1), torch.zeros(1, 1))
    expected = torch.zeros(1, 32)
    expected[0, 3], expected[0, 19] = 2, 5
    assert torch.equal(weight, expected)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, q4_kernel.KERNEL_MAX_ROWS])
@pytest.mark.parametrize("make_layer", [random_q4, random_q8], ids=["q4_1", "q8_0"])
def test_kernel_matches_reference_within_summation_error(make_layer, rows):
    layer = make_layer(n=37, k=160, seed=rows)  # odd N, five blocks
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(1))
    require_kernel()
    assert layer.uses_kernel(x)
    weight = layer.dequantized_weight()
    got, expected = layer(x), F.linear(x, weight)
    assert got.shape == (rows, 37)
    bound = q4_1_product_bound(x, weight) if layer.FORMAT == "Q4_1" else summation_bound(x, weight)
    assert ((got.double() - expected.double()).abs() <= bound).all()


def test_kernel_on_a_smollm2_layer_and_any_leading_shape(gguf_tensors):
    tensor = next(t for t in gguf_tensors if t.name == "blk.3.ffn_down.weight")  # K = 1536
    layer = Q4Linear(*q4_1_blocks(tensor))
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(2))  # [B, T, K]
    require_kernel()
    assert layer.uses_kernel(x)
    weight = layer.dequantized_weight()
    got = layer(x)
    assert got.shape == (2, 5, layer.out_features)
    bound = q4_1_product_bound(x.reshape(-1, layer.in_features), weight).reshape(got.shape)
    assert ((got.double() - F.linear(x, weight).double()).abs() <= bound).all()


def test_bias_and_other_dtypes_take_the_reference_path():
    layer = random_q4(n=9, k=64)
    layer.bias = torch.nn.Parameter(torch.randn(9), requires_grad=False)
    x = torch.randn(4, 64, dtype=torch.float64)
    assert not layer.uses_kernel(x)
    expected = F.linear(x, layer.dequantized_weight().double(), layer.bias.double())
    assert torch.equal(layer(x), expected)


def test_fallback_says_why_once_and_gives_the_reference(monkeypatch, capsys):
    layer = random_q4(n=11, k=64)
    x = torch.randn(3, 64)
    monkeypatch.setenv(q4_kernel.KERNEL_ENV, "0")
    forget_kernel()
    try:
        assert not layer.uses_kernel(x)
        assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight()))
        layer(x)
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == ["decodelab: Q4_1 weights use the pure-torch path (slower): DECODELAB_Q4_KERNEL=0 is set"]
    finally:
        forget_kernel()


def test_a_compiler_that_fails_falls_back_with_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1: the compile "fails"
    forget_kernel()
    try:
        assert q4_kernel.kernel() is None
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "pure-torch path" in err, err
        assert ("compiling the kernels with false failed" in err) or ("CPU" in err), err
    finally:
        forget_kernel()


def test_a_tensor_of_another_type_is_refused(gguf_tensors):
    embedding = next(t for t in gguf_tensors if t.name == "token_embd.weight")
    with pytest.raises(ValueError, match=r"'token_embd.weight' is Q8_0, not Q4_1"):
        q4_1_blocks(embedding)
    down = next(t for t in gguf_tensors if t.name == "blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight' is Q4_1, not Q8_0"):
        q8_0_blocks(down)


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        Q4Linear(torch.zeros(4, 10, dtype=torch.uint8), torch.zeros(4, 1), torch.zeros(4, 1))


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "How do I reverse a list in Python?"]


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_tokens_equal_float32(q4_smollm2, smollm2, prompt):
    q4, float_model = q4_smollm2
    ids = encode_prompt(smollm2[1], [{"role": "user", "content": prompt}], chat=True)
    assert generate_with_cache(q4, ids, 24) == generate_with_cache(float_model, ids, 24)


def test_engine_q4_gives_float32s_greedy_tokens(smollm2_folder):
    from decodelab import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16)
    messages = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS[:2]]
    q4, float32 = LLM("smollm2", device="cpu", quantization="q4"), LLM("smollm2", device="cpu")
    assert sum(isinstance(module, Q4Linear) for module in q4.model.modules()) == 7 * q4.config.num_hidden_layers
    got = [out.outputs[0].token_ids for out in q4.chat(messages, params, use_tqdm=False)]
    assert got == [out.outputs[0].token_ids for out in float32.chat(messages, params, use_tqdm=False)]


def test_engine_refuses_q4_without_a_q4_1_gguf():
    from decodelab.engine.args import EngineArgs

    with pytest.raises(ValueError, match="only model='smollm2' comes from one; got model 'tiny'"):
        EngineArgs(model="tiny", quantization="q4")


def test_cli_refuses_q4_for_tiny(capsys):
    from decodelab.cli import main

    assert main(["generate", "hi", "--model", "tiny", "--q4"]) == 2
    assert "--q4 reads the Q4_1 blocks" in capsys.readouterr().err


def test_q4_pays_for_smollm2_on_a_cpu_in_float32_where_the_kernel_loads(monkeypatch, capsys):
    from decodelab.model.q4_linear import q4_pays

    require_kernel()
    assert q4_pays("smollm2", "cpu", "float32") and q4_pays("smollm2", "cpu", None)
    assert not q4_pays("tiny", "cpu", "float32")  # no GGUF behind it
    assert not q4_pays("smollm2", "cpu", "bfloat16")  # the kernel multiplies float32 activations
    assert not q4_pays("smollm2", "meta", "float32")  # not the CPU
    monkeypatch.setenv(q4_kernel.KERNEL_ENV, "0")
    forget_kernel()
    try:
        assert not q4_pays("smollm2", "cpu", "float32")  # the pure-torch Q4 path is slower than float32
        assert capsys.readouterr().err == ""  # asking says nothing; only a Q4 layer without its kernel does
    finally:
        forget_kernel()


@pytest.mark.parametrize(
    "flags, swapped", [([], True), (["--float"], False), (["--q4"], True), (["--dtype", "bfloat16"], False)]
)
def test_cli_generate_runs_smollm2_on_its_q4_blocks_by_default(smollm2, monkeypatch, capsys, flags, swapped):
    """`generate` on a CPU: SmolLM2's own Q4_1 blocks unless --float (or half precision) says otherwise."""
    from decodelab import cli
    from decodelab.model import q4_linear

    require_kernel()
    calls = []
    swap = q4_linear.use_gguf_q4_weights
    monkeypatch.setattr(q4_linear, "use_gguf_q4_weights", lambda *a: calls.append(a) or swap(*a))
    assert cli.main(["generate", "hi", "--max-new-tokens", "2", "--device", "cpu", "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"]
    assert bool(calls) is swapped


def test_cli_weight_flags_are_one_choice(capsys):
    from decodelab.cli import main

    assert main(["generate", "hi", "--float", "--q4"]) == 2
    assert "--q4 and --float are different weight formats: choose one" in capsys.readouterr().err


def test_small_products_run_on_one_thread_while_the_openmp_team_sleeps(monkeypatch):
    """Waking a passive OpenMP team costs more than a small product saves (bench/q4_products.py)."""
    big, small = q4_kernel.ONE_THREAD_BELOW, q4_kernel.ONE_THREAD_BELOW - 1
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for policy, spincount, small_threads in [("PASSIVE", None, 1), ("passive", "5000", None), ("ACTIVE", None, None)]:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
        if spincount is not None:
            monkeypatch.setenv("GOMP_SPINCOUNT", spincount)
        thread_team.team_sleeps.cache_clear()
        try:
            assert q4_kernel.threads_for(small) == (small_threads or torch.get_num_threads()), policy
            assert q4_kernel.threads_for(big) == torch.get_num_threads(), policy
        finally:
            thread_team.team_sleeps.cache_clear()


def random_q4_mlp(hidden: int = 64, inner: int = 96) -> MLP:
    """A llama.MLP whose gate/up [inner, hidden] and down [hidden, inner] are random Q4Linears
    (inner = 3 blocks: two threads split the hidden units unevenly)."""
    mlp = MLP(toy_config(hidden_size=hidden, intermediate_size=inner))
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = (
        random_q4(inner, hidden, 1),
        random_q4(inner, hidden, 2),
        random_q4(hidden, inner, 3),
    )
    return mlp


@pytest.mark.parametrize("one_thread", [True, False], ids=["one_thread", "team"])
def test_the_fused_swiglu_is_the_three_q4_layers(monkeypatch, one_thread):
    """Q4SwiGLU's one C call equals down(silu(gate(x)) * up(x)) through the three Q4Linears, on one thread and
    split between the team's; beyond SWIGLU_MAX_ROWS it is those three layers. Both read x alike, so gate and
    up agree; silu (C's expf against torch's) can move h by a few units of roundoff, and so a value of h
    by one 16-bit step where down reads it: the bound is a whole step of h, plus that roundoff and the
    summation bound, times |down|."""
    require_kernel()
    mlp = random_q4_mlp()
    fused = Q4SwiGLU(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    monkeypatch.setattr(q4_kernel, "SWIGLU_ONE_THREAD_BELOW", 1 << 62 if one_thread else 0)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    thread_team.team_sleeps.cache_clear()
    try:
        for rows in (1, 2, 3, 4, 5, 9, q4_kernel.SWIGLU_MAX_ROWS):  # 4 rows at a time, and what is left
            x = torch.randn(1, rows, 64)
            assert fused.fused(x)
            expected = mlp(x)
            h = (F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)).reshape(rows, -1)
            down = mlp.down_proj.dequantized_weight().double().abs()
            bound = (int16_step(h) + 8 * UNIT_ROUNDOFF * h.double().abs()) @ down.T + summation_bound(h, down)
            assert ((fused(x) - expected).reshape(rows, -1).double().abs() <= bound).all(), rows
        x = torch.randn(q4_kernel.SWIGLU_MAX_ROWS + 1, 64)
        assert not fused.fused(x) and torch.equal(fused(x), mlp(x))
    finally:
        thread_team.team_sleeps.cache_clear()


def test_use_q4_swiglu_swaps_only_mlps_of_three_q4_layers():
    model = random_llama(seed=0)
    assert use_q4_swiglu(model) == 0  # float linears: nothing to fuse
    mlp = random_q4_mlp()
    model.model.layers[0].mlp = mlp
    assert use_q4_swiglu(model) == 1
    swapped = model.model.layers[0].mlp
    assert isinstance(swapped, Q4SwiGLU) and swapped.down_proj is mlp.down_proj
    with pytest.raises(TypeError, match="three Q4Linear layers"):
        Q4SwiGLU(mlp.gate_proj, torch.nn.Linear(64, 96, bias=False), mlp.down_proj)


def random_q4_llama(seed: int = 0, **config_overrides):
    """The toy Llama (toy_config(**config_overrides)) with every decoder linear a random Q4Linear, its MLPs
    `Q4SwiGLU`s and its layers `Q4DecoderLayer`s (the lm_head stays float)."""
    model = random_llama(seed=seed, **config_overrides)
    for index, (name, linear) in enumerate(list(model.model.layers.named_modules())):
        if isinstance(linear, torch.nn.Linear):
            parent_name, _, child = name.rpartition(".")
            q4 = random_q4(linear.out_features, linear.in_features, seed * 100 + index)
            setattr(model.model.layers.get_submodule(parent_name), child, q4)
    assert use_q4_swiglu(model) == use_q4_layers(model) == model.config.num_hidden_layers
    return model


def unfused(monkeypatch) -> None:
    """Every Q4DecoderLayer runs DecoderLayer.forward (its modules one by one) from now on."""
    monkeypatch.setattr(Q4DecoderLayer, "fused", lambda self, x, cos: False)


@pytest.mark.parametrize("one_thread", [True, False], ids=["one_thread", "team"])
def test_the_fused_layer_is_the_decoder_layers_modules(monkeypatch, one_thread):
    """Q4DecoderLayer's two C calls give the model's logits that its modules give, up to rounding (float32,
    and a 16-bit step where the C RMSNorm's rounding moves a value across one): a 5-token prefill and two decode steps over a KVCache, a batch of 2 x 3 rows, and 16 rows
    (the most it fuses); beyond that, and with a hook on a module, the modules run themselves."""
    require_kernel()
    monkeypatch.setattr(q4_kernel, "ONE_THREAD_BELOW", 1 << 62 if one_thread else 0)
    monkeypatch.setattr(q4_kernel, "SWIGLU_ONE_THREAD_BELOW", 1 << 62 if one_thread else 0)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    thread_team.team_sleeps.cache_clear()
    model = random_q4_llama(seed=1)
    layer = model.model.layers[0]
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))

    def logits_with_decode(ids_row):
        cache = KVCache(model.config, max_seq_len=16)
        outs = [model(ids_row[:, :5], kv_cache=cache)]
        outs += [model(ids_row[:, t : t + 1], kv_cache=cache) for t in (5, 6)]
        return torch.cat(outs, 1)

    try:
        with torch.inference_mode():
            assert layer.fused(torch.zeros(1, 16, 64), model.rope_cos[:16])
            assert not layer.fused(torch.zeros(1, 17, 64), model.rope_cos[:17])
            fused = [logits_with_decode(ids[:1]), model(ids[:, :3]), model(ids[:1, :16]), model(ids[:1, :17])]
            with monkeypatch.context() as patched:
                unfused(patched)
                expected = [logits_with_decode(ids[:1]), model(ids[:, :3]), model(ids[:1, :16]), model(ids[:1, :17])]
        for got, want in zip(fused, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert torch.equal(fused[3], expected[3])  # 17 rows: the modules themselves
    finally:
        thread_team.team_sleeps.cache_clear()


def test_a_hook_on_a_module_of_the_fused_layer_is_honoured():
    require_kernel()
    model = random_q4_llama(seed=2)
    layer = model.model.layers[1]
    x, cos = torch.randn(1, 1, 64), model.rope_cos[:1]
    seen = []
    with torch.inference_mode():
        assert layer.fused(x, cos)
        handle = layer.self_attn.k_proj.register_forward_hook(lambda module, inputs, output: seen.append(output))
        assert not layer.fused(x, cos)
        model(torch.tensor([[3, 4]]))
        handle.remove()
        assert layer.fused(x, cos)
    assert len(seen) == 1 and seen[0].shape == (1, 2, 32)


def test_use_q4_layers_keeps_the_modules_and_their_names():
    model = random_q4_llama(seed=3)
    float_model = random_llama(seed=3)
    assert all(isinstance(layer, Q4DecoderLayer) for layer in model.model.layers)
    assert use_q4_layers(float_model) == 0  # float linears: nothing to fuse
    names = {name.removesuffix(".weight") for name in float_model.state_dict()}
    q4_names = {
        name.rsplit(".", 1)[0] if name.rsplit(".", 1)[1] in ("nibbles", "d", "m") else name.removesuffix(".weight")
        for name in model.state_dict()
    }
    assert q4_names == names
    with pytest.raises(TypeError, match="Q4Linear q/k/v/o projections"):
        Q4DecoderLayer.from_layer(float_model.model.layers[0])


def test_prepared_builds_the_kernels_into_the_cache_or_says_why(monkeypatch, tmp_path):
    """`prepare`'s line: the library built into an empty cache (named by its path), or, where the kernels
    are turned off, why not and that torch runs instead."""
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    forget_kernel()
    try:
        line = q4_kernel.prepared()
        if q4_kernel.kernel_loads():
            built = list((tmp_path / "kernels").glob("gguf_gemv-*.so"))
            assert len(built) == 1 and line.startswith(str(built[0])), line
        monkeypatch.setenv("DECODELAB_Q4_KERNEL", "0")
        forget_kernel()
        assert q4_kernel.prepared() == (
            "the C kernels cannot load here (DECODELAB_Q4_KERNEL=0 is set): q4 and the engine's decode attention run in torch"
        )
    finally:
        forget_kernel()


def test_prepare_builds_the_kernels(smollm2_folder, capsys):
    """`python -m decodelab prepare --no-compile` names the C kernels' library after the model."""
    from decodelab import cli

    assert cli.main(["prepare", "--no-compile"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == q4_kernel.prepared(), lines

"""Calibrated quantization (decodelab.model: groupwise, gptq, awq, outliers, calibrated_linear, calibration),
checked against oracles: a slow, direct GPTQ (one column at a time, the inverse of the remaining columns'
Hessian recomputed at every step), round-to-nearest's layer error, AWQ's loss recomputed by hand for every
alpha, the float product, an int8 x int8 product written out, and the library's own int4 quantizer.

Each check is a function of the implementation it checks, so the kept bugs of
fixtures/library/buggy_calibration.py are run through the same checks and must fail them.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from oracles import load_fixture, random_ids, random_model
from torch import nn

from decodelab.model import awq, gptq, groupwise, outliers
from decodelab.model.calibrated_linear import CalibratedLinear, by_identity
from decodelab.model.calibration import (
    METHODS,
    apply_layers,
    calibrate_model,
    calibration_ids,
    decoder_linears,
    quantize_linear,
    record_inputs,
    text_split,
)
from decodelab.model.quantization import dequantize_int4, quantize_int4_groupwise, replace_linears

buggy = load_fixture("library/buggy_calibration")


def correlated_inputs(tokens: int, features: int, seed: int) -> torch.Tensor:
    """x [tokens, features]: mixed Gaussian features (correlated, as real activations are) with uneven scales."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(features, features, generator=g) / features**0.5 + torch.eye(features)
    scales = torch.exp(torch.randn(features, generator=g))
    return (torch.randn(tokens, features, generator=g) @ mixing) * scales


def random_weight(out: int, inputs: int, seed: int) -> torch.Tensor:
    return torch.randn(out, inputs, generator=torch.Generator().manual_seed(seed + 1000)) / inputs**0.5


# --------------------------------------------------------------------------- the grid


@pytest.mark.parametrize("bits", groupwise.BITS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_round_to_nearest_is_within_half_a_step(bits, symmetric):
    w = random_weight(24, 128, seed=bits) * torch.linspace(0.1, 3, 128)
    grid = groupwise.quantize_groupwise(w, bits, 32, symmetric)
    low, high = (1, 2**bits - 1) if symmetric else (0, 2**bits - 1)
    assert grid.levels.min() >= low and grid.levels.max() <= high
    assert grid.scale.shape == grid.zero.shape == (24, 4)
    step = grid.scale.repeat_interleave(32, dim=1)  # [out, in]
    assert ((grid.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert (groupwise.rtn(torch.zeros(3, 32), bits, 32) == 0).all()  # 0 is on every grid


def test_symmetric_int4_is_the_library_int4_grid():
    """groupwise's symmetric 4-bit grid is quantization.quantize_int4_groupwise's (levels -7..7, absmax)."""
    w = random_weight(16, 256, seed=3)
    for size in (32, 64, 128):
        library = dequantize_int4(*quantize_int4_groupwise(w, size), size)
        torch.testing.assert_close(groupwise.rtn(w, 4, size, symmetric=True), library, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", groupwise.BITS)
def test_packing_round_trips(bits):
    levels = torch.randint(0, 2**bits, (5, 77), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    packed = groupwise.pack_levels(levels, bits)
    assert packed.dtype == torch.int32 and packed.nbytes == groupwise.packed_bytes(5, 77, bits)
    assert torch.equal(groupwise.unpack_levels(packed, bits, 77), levels)


def test_bad_grids_are_refused():
    w = torch.randn(4, 64)
    for call, words in [
        (lambda: groupwise.quantize_groupwise(w, 5, 32), "bits"),
        (lambda: groupwise.quantize_groupwise(w, 4, 48), "group_size"),
        (lambda: groupwise.quantize_groupwise(w[0], 4, 32), "[out, in]"),
        (lambda: groupwise.quantize_groupwise(w.masked_fill(w > 1, math.inf), 4, 32), "inf"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            call()


# --------------------------------------------------------------------------- GPTQ


def gptq_dequantized(w, x, bits, group_size, block_size):
    """The library's GPTQ read back: the signature every GPTQ check takes."""
    return gptq.gptq_quantize(w, gptq.hessian(x), bits, group_size, block_size).dequantize()


def direct_gptq(w, x, bits, group_size, damp=gptq.DAMP):
    """The update written out directly: for each column j in order, quantize it (its group's grid taken
    from the current weights when the group begins), invert H restricted to the columns j.. not yet
    quantized (a fresh inverse every step) and move those columns by -e / [H_F^-1]_00 * [H_F^-1]_0,:."""
    h, dead = gptq.dampened(gptq.hessian(x), damp)
    w = w.double().clone()
    w[:, dead] = 0
    out = torch.zeros_like(w)
    for j in range(w.shape[1]):
        if j % group_size == 0:
            scale, zero = (t.double() for t in groupwise.group_params(w[:, j : j + group_size], bits))
        q = groupwise.round_to_grid(w[:, j : j + 1], scale, zero, bits)  # [out, 1]
        out[:, j : j + 1] = q
        inverse = torch.linalg.inv(h[j:, j:])  # [in - j, in - j]
        w[:, j:] -= (w[:, j : j + 1] - q) / inverse[0, 0] * inverse[0:1, :]
    return out.float()


GPTQ_CASES = [  # (out, in, tokens, bits, group_size, block_size)
    (64, 64, 256, 3, 32, 8),  # square first: a Hessian from the outputs runs, and differs
    (16, 64, 256, 4, 32, 32),
    (24, 64, 256, 3, 32, 64),  # a block of two groups
    (12, 128, 512, 4, 64, 16),  # a group across four blocks
]


def check_gptq_matches_direct(quantize):
    for seed, (out, inputs, tokens, bits, group_size, block_size) in enumerate(GPTQ_CASES):
        w, x = random_weight(out, inputs, seed), correlated_inputs(tokens, inputs, seed)
        got, want = quantize(w, x, bits, group_size, block_size), direct_gptq(w, x, bits, group_size)
        error = float((got - want).abs().max())
        assert error < 1e-4, f"case {seed}: GPTQ differs from the direct update by {error:.3g}"


def test_gptq_matches_the_direct_update():
    check_gptq_matches_direct(gptq_dequantized)


def check_gptq_beats_rtn(quantize, seeds=range(6)):
    """Its layer objective ||XW^T - XŴ^T||^2 on the calibration inputs is never above round-to-nearest's."""
    for seed in seeds:
        for bits in (3, 4):
            w, x = random_weight(32, 128, seed), correlated_inputs(512, 128, seed)
            ours = gptq.layer_objective(w, quantize(w, x, bits, 32, 32), x)
            rtn = gptq.layer_objective(w, groupwise.rtn(w, bits, 32), x)
            assert ours <= rtn, f"seed {seed}, {bits} bits: GPTQ's objective {ours:.4g} above RTN's {rtn:.4g}"


def test_gptq_objective_is_never_above_round_to_nearest():
    check_gptq_beats_rtn(gptq_dequantized)


def check_gptq_survives_few_tokens(quantize):
    """Fewer calibration tokens than inputs, and one input always zero: H is singular. The result must be
    finite and still no worse than round-to-nearest on those tokens."""
    w, x = random_weight(16, 128, seed=7), correlated_inputs(40, 128, seed=7)
    x[:, 5] = 0
    got = quantize(w, x, 4, 32, 32)
    assert torch.isfinite(got).all()
    assert gptq.layer_objective(w, got, x) <= gptq.layer_objective(w, groupwise.rtn(w, 4, 32), x)


def test_gptq_survives_a_singular_hessian():
    check_gptq_survives_few_tokens(gptq_dequantized)


def test_gptq_levels_are_the_grid_it_reports():
    w, x = random_weight(8, 64, 2), correlated_inputs(128, 64, 2)
    grid = gptq.gptq_quantize(w, gptq.hessian(x), 3, 32, 32)
    assert grid.levels.max() <= 7 and grid.scale.shape == (8, 2)
    again = groupwise.GroupwiseWeight(grid.levels, grid.scale, grid.zero, 3, 32).dequantize()
    torch.testing.assert_close(again, direct_gptq(w, x, 3, 32), rtol=0, atol=1e-4)


def test_gptq_refuses_bad_arguments():
    w, h = torch.randn(4, 64), torch.eye(64)
    with pytest.raises(ValueError, match="block_size"):
        gptq.gptq_quantize(w, h, 4, 32, block_size=24)
    with pytest.raises(ValueError, match="h \\[in, in\\]"):
        gptq.gptq_quantize(w, torch.eye(32), 4, 32)
    with pytest.raises(ValueError, match="not positive definite"):
        gptq.gptq_quantize(w, torch.zeros(64, 64) - torch.eye(64), 4, 32, damp=0.0)


# --------------------------------------------------------------------------- AWQ


def salient_inputs(tokens=512, features=128, seed=0):
    """x [tokens, features] with four input channels ten times larger than the rest (as in trained LLMs)."""
    x = correlated_inputs(tokens, features, seed) / torch.exp(
        torch.randn(features, generator=torch.Generator().manual_seed(seed))
    )
    x[:, [3, features // 3, features // 2, features - 5]] *= 10
    return x


def check_float_product_unchanged(scale_pair):
    """(x / s)(W * s)^T = x W^T before any rounding, for AWQ's scales at every alpha."""
    w, x = random_weight(96, 96, 4), salient_inputs(64, 96, seed=4)
    magnitude = awq.input_magnitude(x)
    for alpha in (0.25, 0.5, 1.0):
        s = awq.awq_scales(magnitude, alpha)
        scaled_w, scaled_x = scale_pair(w, x, s)
        torch.testing.assert_close(scaled_x @ scaled_w.T, x @ w.T, rtol=1e-5, atol=1e-5)


def test_scaling_leaves_the_float_product_unchanged():
    check_float_product_unchanged(awq.scale_pair)


def test_awq_alpha_minimises_the_stated_loss_over_the_grid():
    """Each alpha's loss recomputed by hand: s = mean|x|^alpha / sqrt(max * min), round W * s to the grid,
    mean of (x W^T - (x / s) Q(W * s)^T)^2. The search returns those losses and the alpha of the least."""
    w, x = random_weight(48, 128, 5), salient_inputs(seed=5)
    search = awq.search_scales(w, x, 4, 32)
    assert list(search.losses) == list(awq.ALPHAS)
    mean_abs = x.abs().mean(0)
    for alpha in awq.ALPHAS:
        s = mean_abs**alpha
        s = s / (s.max() * s.min()).sqrt()
        loss = float((x @ w.T - (x / s) @ groupwise.rtn(w * s, 4, 32).T).pow(2).mean())
        assert search.losses[alpha] == pytest.approx(loss, rel=1e-4)
    assert search.losses[search.alpha] == min(search.losses.values())
    torch.testing.assert_close(search.scales, awq.awq_scales(mean_abs, search.alpha))


def test_awq_protects_salient_channels_and_alpha_zero_is_rtn():
    w, x = random_weight(48, 128, 6), salient_inputs(seed=6)
    search = awq.search_scales(w, x, 3, 32)
    rtn_loss = awq.output_error(w, groupwise.rtn(w, 3, 32), x)
    assert search.losses[0.0] == pytest.approx(rtn_loss, rel=1e-5)  # s = 1
    assert search.alpha > 0 and search.losses[search.alpha] < 0.9 * rtn_loss


# --------------------------------------------------------------------------- outliers


def outlier_inputs(seed=0):
    """x [400, 64] ~ N(0, 1) with dim 9 at +-20 in 30% of tokens and dim 50 at 8 in 5%."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, 64, generator=g).clamp(-4, 4)
    x[:120, 9] = 20 * torch.sign(torch.randn(120, generator=g))
    x[200:220, 50] = 8
    return x


def test_outlier_stats_find_the_planted_dims():
    stats = outliers.outlier_stats(outlier_inputs(), threshold=6.0)
    assert stats.dims.tolist() == [9, 50] and stats.tokens == 400
    torch.testing.assert_close(stats.max_abs, torch.tensor([20.0, 8.0]))
    torch.testing.assert_close(stats.frequency, torch.tensor([0.3, 0.05]))


def test_model_outliers_find_a_dim_a_norm_blows_up():
    """A norm weight of 200 on hidden dim 5 of layer 1's input norm: the q/k/v inputs of layer 1 carry it,
    those of layer 0 do not."""
    model = random_model(seed=2)
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[5] = 200.0
    found = outliers.model_outliers(model, random_ids(32, model.config.vocab_size, seed=2), threshold=20.0)
    assert set(found) == set(decoder_linears(model))
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert found[f"model.layers.1.self_attn.{proj}"].dims.tolist()[:1] == [5]
        assert 5 not in found[f"model.layers.0.self_attn.{proj}"].dims.tolist()
    assert found["model.layers.1.self_attn.q_proj"].frequency[0] > 0.5


def test_decomposition_with_threshold_zero_is_the_float_product():
    w, x = random_weight(32, 64, 1), outlier_inputs()
    parts = outliers.decompose(w, x, threshold=0.0)
    assert parts.int8_dims.numel() == 0
    torch.testing.assert_close(parts.forward(x), x @ w.T, rtol=1e-5, atol=1e-5)
    assert parts.extra_bytes() == 3 * 32 * 64


def test_decomposition_with_threshold_infinite_is_int8_times_int8():
    w, x = random_weight(32, 64, 2), outlier_inputs()
    parts = outliers.decompose(w, x, threshold=math.inf)
    assert parts.float_dims.numel() == 0 and parts.extra_bytes() == 0
    x_scale = x.abs().amax(1, keepdim=True) / 127  # per token
    w_scale = w.abs().amax(1, keepdim=True) / 127  # per output row
    want = (torch.round(x / x_scale) * x_scale) @ (torch.round(w / w_scale) * w_scale).T
    torch.testing.assert_close(parts.forward(x), want, rtol=1e-5, atol=1e-5)


def test_keeping_the_outlier_dims_in_float_cuts_the_error():
    w, x = random_weight(32, 64, 3), outlier_inputs()
    exact = x @ w.T
    plain = outliers.relative_error(exact, outliers.decompose(w, x, math.inf).forward(x))
    mixed = outliers.decompose(w, x, 6.0)
    assert mixed.float_dims.tolist() == [9, 50] and mixed.extra_bytes() == 3 * 32 * 2
    assert outliers.relative_error(exact, mixed.forward(x)) < plain / 3


# --------------------------------------------------------------------------- the planted bugs


CHECKS = {
    "check_gptq_matches_direct": check_gptq_matches_direct,
    "check_gptq_survives_few_tokens": check_gptq_survives_few_tokens,
    "check_float_product_unchanged": check_float_product_unchanged,
}


@pytest.mark.parametrize("name", sorted(buggy.BUGS))
def test_planted_bug_is_caught(name):
    """Each kept bug fails the check that names it (an assertion, or the error the library raises)."""
    bug, check, _ = buggy.BUGS[name]
    with pytest.raises((AssertionError, ValueError)):
        CHECKS[check](bug)


def test_error_not_propagated_is_plain_round_to_nearest():
    """Without the update GPTQ is RTN: on these inputs real GPTQ is strictly better, so the objective check
    separates them too."""
    w, x = random_weight(32, 128, 0), correlated_inputs(512, 128, 0)
    rtn = gptq.layer_objective(w, groupwise.rtn(w, 4, 32), x)
    assert gptq.layer_objective(w, buggy.gptq_error_not_propagated(w, x, 4, 32, 32), x) == pytest.approx(rtn)
    assert gptq.layer_objective(w, gptq_dequantized(w, x, 4, 32, 32), x) < 0.9 * rtn


# --------------------------------------------------------------------------- the layer and the model


@pytest.mark.parametrize("method", METHODS)
def test_calibrated_linear_computes_what_it_stores(method):
    linear = nn.Linear(64, 24)
    x = salient_inputs(128, 64, seed=1)
    layer = quantize_linear(linear, x, method, bits=4, group_size=32)
    w_hat = layer.dequantized_weight()
    scaled = x if layer.input_scale is None else x / layer.input_scale
    torch.testing.assert_close(layer(x), F.linear(scaled, w_hat, linear.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), x @ layer.effective_weight().T + linear.bias, rtol=1e-4, atol=1e-4)
    extra = 0 if layer.input_scale is None else 64 * 4
    assert layer.nbytes == 24 * 64 // 2 + 24 * 2 * (4 + 1) + extra  # packed levels, scales, zeros, s
    assert (layer.input_scale is not None) == method.startswith("awq")


def test_layer_by_layer_calibrates_on_the_quantized_layers_outputs():
    """The inputs GPTQ sees in layer 1 are those that layer 0, already quantized, produces."""
    model = random_model(seed=3)
    ids = random_ids(24, model.config.vocab_size, seed=3, batch=2)
    seen = {}
    made = calibrate_model(
        model,
        ids,
        "gptq",
        bits=4,
        group_size=32,
        on_layer=lambda i, inputs: seen.setdefault(i, {name: x.clone() for name, x in inputs.items()}),
    )
    assert set(made.layers) == set(decoder_linears(model))
    quantized = apply_layers(copy.deepcopy(model), made.layers)
    with torch.inference_mode():
        cos, sin = model.rope_at(torch.arange(24))
        after_layer0 = quantized.model.layers[0](model.model.embed_tokens(ids), cos, sin)
        want = quantized.model.layers[1].input_layernorm(after_layer0).reshape(-1, model.config.hidden_size)
        float_after = model.model.layers[0](model.model.embed_tokens(ids), cos, sin)
    torch.testing.assert_close(seen[1]["self_attn.q_proj"], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after_layer0, float_after, atol=1e-4)  # so the test tells the two apart
    recorded = record_inputs(model, ids, ["model.layers.0.mlp.down_proj"])
    assert recorded["model.layers.0.mlp.down_proj"].shape == (48, model.config.intermediate_size)


def test_calibration_reduces_the_models_output_error():
    """On a random model, GPTQ's and AWQ+GPTQ's logits are closer to float than RTN's (on the calibration ids)."""
    model = random_model(seed=5)
    ids = random_ids(64, model.config.vocab_size, seed=5, batch=4)
    with torch.inference_mode():
        ref = model(ids)
        errors = {}
        for method in METHODS:
            made = calibrate_model(model, ids, method, bits=3, group_size=32)
            errors[method] = float((apply_layers(copy.deepcopy(model), made.layers)(ids) - ref).pow(2).mean())
    assert errors["gptq"] < errors["rtn"] and errors["awq+gptq"] < errors["rtn"], errors


def test_by_identity_names_a_linear_it_does_not_know():
    model = random_model(seed=1)
    with pytest.raises(KeyError, match="no calibrated layer"):
        replace_linears(model, by_identity(model, {}))


def test_calibration_and_heldout_texts_are_disjoint():
    for which in ("code", "en"):
        split = text_split(which)
        assert split.calibration_name != split.heldout_name
        if which == "en":
            assert not set(split.calibration.split("\n\n")) & set(split.heldout.split("\n\n"))
        else:
            modules = [
                {line for line in text.splitlines() if line.startswith("# ---- file:")}
                for text in (split.calibration, split.heldout)
            ]
            assert modules[0] and modules[1] and not modules[0] & modules[1]
    with pytest.raises(ValueError, match="'code' or 'en'"):
        text_split("fr")


@pytest.mark.slow
def test_calibrated_layers_serve_in_the_engine():
    """LLM(model=(model, tokenizer), quantization="int4", hooks=EngineHooks(linear=by_identity(...))) puts each
    GPTQ layer in place and writes the greedy tokens of the calibrated model itself."""
    from decodelab.decoding.generate import stream_token_ids
    from decodelab.engine.llm import LLM, EngineHooks
    from decodelab.model.registry import load
    from decodelab.params import SamplingParams

    model, tokenizer = load("tiny", device="cpu")
    ids = calibration_ids(tokenizer, text_split("code").calibration, 2, 64)
    made = calibrate_model(model, ids, "awq+gptq", bits=3, group_size=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = tokenizer.encode("def fibonacci(n):\n")
    alone = list(stream_token_ids(apply_layers(copy.deepcopy(model), made.layers), prompt, params))
    llm = LLM(
        model=(model, tokenizer),
        quantization="int4",
        num_kv_blocks=32,
        hooks=EngineHooks(linear=by_identity(model, made.layers)),
    )
    projections = [m for name, m in llm.model.model.layers.named_modules() if name.endswith("_proj")]
    assert len(projections) == 7 * 4 and all(isinstance(m, CalibratedLinear) for m in projections)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == alone

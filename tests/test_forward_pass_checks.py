"""Notebook 01's hidden checks (the forward pass): they pass on the library's references and on
other valid ways to write each part, and catch every kept bug (tests/fixtures/buggy_forward_pass.py)
with a message that names the case."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import forward_pass as checks
from decodelab.lessons import forward_pass as fp
from decodelab.model.attention import causal_attention

buggy = load_fixture("buggy_forward_pass")


def test_references_pass():
    from decodelab.model.gguf_import import load_gguf_state_dict

    checks.check_load_gguf_state_dict(load_gguf_state_dict)
    checks.check_rms_norm(fp.rms_norm)
    checks.check_rope(fp.rope)
    checks.check_attention(fp.attention)
    checks.check_mlp(fp.mlp)
    checks.check_forward(fp.forward)


def test_other_valid_solutions_pass():
    """Behaviour is graded, not the way it is written: a by-hand softmax attention in float32,
    SDPA over the cache, a rope that builds full tables first, an MLP with x @ W.T and sigmoid."""

    def attention_by_hand(cache, layer_index, q, k, v):
        k_all, v_all = cache.append(layer_index, k, v)
        group, offset = q.shape[1] // k_all.shape[1], k_all.shape[2] - k.shape[2]
        k_all, v_all = k_all.repeat_interleave(group, 1).float(), v_all.repeat_interleave(group, 1).float()
        scores = q.float() @ k_all.transpose(-1, -2) / math.sqrt(q.shape[-1])
        allowed = torch.arange(k_all.shape[2])[None, :] <= torch.arange(offset, offset + q.shape[2])[:, None]
        return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v_all).to(q.dtype)

    def attention_sdpa(cache, layer_index, q, k, v):
        offset = cache.view(layer_index)[0].shape[2]
        return causal_attention(q, *cache.append(layer_index, k, v), q_offset=offset)

    def rope_full_tables(x, positions, rope_theta):
        d = x.shape[-1]
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, d, 2).float() / d)
        table = torch.arange(int(positions.max()) + 1).float()[:, None] * inv_freq[None, :]
        angles = torch.cat([table, table], -1)[positions]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        rotated = torch.cat([-x2, x1], -1)
        return x * angles.cos().to(x.dtype) + rotated * angles.sin().to(x.dtype)

    def mlp_by_hand(x, gate_weight, up_weight, down_weight):
        gate, up = x @ gate_weight.T, x @ up_weight.T
        return (gate * torch.sigmoid(gate) * up) @ down_weight.T

    def load_gguf_with_numpy(tensors, config):
        """Dequantized in numpy, all types through one table of block layouts, the rows unpermuted by index."""
        from decodelab.model.gguf_import import hf_tensor_name

        state = {}
        for tensor in tensors:
            data, kind = np.array(tensor.data), tensor.tensor_type.name
            if kind == "F32":
                values = data
            else:
                blocks = data.reshape(-1, {"Q4_1": 20, "Q8_0": 34}[kind])
                d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
                if kind == "Q8_0":
                    values = d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
                else:
                    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
                    q = np.concatenate([blocks[:, 4:] & 15, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
                    values = d * q + m
            weight = torch.from_numpy(values.reshape([int(n) for n in tensor.shape][::-1]))
            name = hf_tensor_name(tensor.name)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                half = weight.shape[0] // heads // 2
                order = [h * 2 * half + 2 * i + j for h in range(heads) for j in (0, 1) for i in range(half)]
                weight = weight[order]
            state[name] = weight
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        return state

    checks.check_load_gguf_state_dict(load_gguf_with_numpy)
    checks.check_attention(attention_by_hand)
    checks.check_attention(attention_sdpa)
    checks.check_rope(rope_full_tables)
    checks.check_mlp(mlp_by_hand)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    expect_bug_caught(checks, buggy.BUGS, bug)


def test_messages_name_the_case():
    cases = [
        ("check_load_gguf_state_dict", buggy.load_gguf_high_nibble_first, "low nibbles are weights 0-15"),
        ("check_load_gguf_state_dict", buggy.load_gguf_dims_not_reversed, "innermost first"),
        ("check_load_gguf_state_dict", buggy.load_gguf_qk_left_permuted, r"k_proj.*rows 2i and 2i \+ 1"),
        ("check_load_gguf_state_dict", buggy.load_gguf_float16_arithmetic, "Q8_0.*in float32"),
        ("check_rms_norm", buggy.rms_norm_half_precision, "float16.*65,504"),
        ("check_rms_norm", buggy.rms_norm_no_eps, r"eps=1e-6.*inside the square root"),
        ("check_rms_norm", buggy.rms_norm_wrong_dim, r"x=\[\[3, 4\]\].*expected 0.848528"),
        ("check_rope", buggy.rope_interleaved_pairs, "i with i \\+ D/2"),
        ("check_rope", buggy.rope_frequencies_in_model_dtype, "bfloat16.*4093"),
        ("check_attention", buggy.attention_no_causal_mask, "q = zeros.*mean of values 0..t"),
        ("check_attention", buggy.attention_mask_not_shifted, "3 new tokens with 5 held before"),
        ("check_attention", buggy.attention_heads_interleaved, "6 query heads, 2 KV heads"),
        ("check_mlp", buggy.mlp_silu_on_up, "GATE branch"),
        ("check_forward", buggy.forward_no_final_norm, "random Llama.*final norm"),
        ("check_forward", buggy.forward_ignores_positions, r"positions=\[4, 5, 6\]"),
    ]
    for check, fn, pattern in cases:
        with pytest.raises(AssertionError, match=pattern):
            getattr(checks, check)(fn)


def test_a_stub_reads_as_not_written_yet():
    def rms_norm(x, weight, eps):
        raise NotImplementedError("replace this line with your code")

    with pytest.raises(AssertionError, match="rms_norm is not written yet"):
        checks.check_rms_norm(rms_norm)


def test_forward_that_skips_attend_is_named():
    """A forward pass that computes attention itself, never through attend, is told so."""

    def forward_without_attend(weights, config, input_ids, attend, positions=None):
        from decodelab.model.kv_cache import KVCache

        return fp.forward(
            weights, config, input_ids, fp.cache_attend(KVCache(config, input_ids.shape[0], 64)), positions
        )

    with pytest.raises(AssertionError, match=r"one call attend\(layer_index, q, k, v\) per layer"):
        checks.check_forward(forward_without_attend)


def test_widgets_run_on_the_references():
    from decodelab.course.widgets import forward_pass as widgets
    from decodelab.model.toy import random_llama

    layers = widgets.layer_by_layer(random_llama(0), torch.tensor([[1, 2, 3, 4]]), fp.decoder_layer, fp.attention)
    assert len(layers["max_diff"]) == 2 and max(layers["max_diff"]) < 1e-5
    assert layers["yours_rms"] == pytest.approx(layers["library_rms"], rel=1e-5)
    assert len(widgets.layers_figure(layers, 1e-6).data) == 5  # 2 RMS curves, per-layer and final differences, seed
    curve = widgets.rope_score_curve(fp.rope, 16, 10000.0, 0, 64)
    shifted = widgets.rope_score_curve(fp.rope, 16, 10000.0, 500, 64)
    assert curve[0] == pytest.approx(1.0) and curve == pytest.approx(shifted, abs=1e-4)
    box = widgets.rope_explorer(fp.rope, max_distance=64)
    box.controls["shift"].value = 1000
    assert "shifting both positions by 1000 moves it by at most" in box.figure.layout.title.text


def test_predictions_are_graded_against_the_library():
    checks.check_q_layer_params(3_540_096)  # the sum of the shapes layer 0 of the real checkpoint prints
    checks.check_q_rope_slowest_period(2 * math.pi * 100000 ** (62 / 64))
    for check, wrong in (
        (checks.check_q_layer_params, 3_540_096 + 2 * 576 * 384),  # k and v counted with 9 heads
        (checks.check_q_rope_slowest_period, 100000 ** (62 / 64)),
    ):  # one radian, not 2 pi
        with pytest.raises(AssertionError, match="you predicted"):
            check(wrong)

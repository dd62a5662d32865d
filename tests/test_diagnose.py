"""`course.diagnose`: a forward pass beside the library's model, the first operation that differs named.

Each kept bug of notebook 01 (tests/fixtures/buggy_forward_pass.py) corrupts one operation; put into a
forward pass the way a notebook holds it (forward and decoder_layer calling rms_norm, rope and mlp by
name), the diagnosis names that operation first, and the mistake. The models: `tiny` (trained, 8 heads
over 8 KV heads, tied embeddings) and the toy of the visible test (4 heads over 2 KV heads, untied).
"""

from __future__ import annotations

import contextlib
import functools
import io
import types

import pytest
import torch
from fixtures import buggy_forward_pass as buggy

from decodelab.course import diagnosis
from decodelab.course.diagnosis import diagnose, diagnose_on_failure
from decodelab.lessons import forward_pass as fp
from decodelab.model.registry import load
from decodelab.model.toy import random_llama


@pytest.fixture(scope="module")
def models():
    ids = {
        "tiny": torch.randint(0, 1024, (2, 9), generator=torch.Generator().manual_seed(0)),
        "toy": torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0)),
    }
    return {"tiny": load("tiny", device="cpu")[0], "toy": random_llama(1)}, ids


def notebook_forward(**learners):
    """The reference forward as a notebook holds it: forward and decoder_layer calling rms_norm, rope
    and mlp by name from one namespace, where `learners` replace some of them."""
    namespace = {**vars(fp), **learners}
    for name in ("decoder_layer", "forward"):
        original = getattr(fp, name)
        namespace[name] = types.FunctionType(original.__code__, namespace, name, original.__defaults__)
    return namespace["forward"]


PREFILL_THEN_TOKENS = dict(chunks=[6, 1, 1, 1])
CASES = {  # kept bug -> (forward, model, diagnose's arguments, the point named first, its layer, words of the message)
    "rms_norm_no_eps": (notebook_forward(rms_norm=buggy.rms_norm_no_eps), "tiny", {}, "input_norm", 0, "eps left out"),
    "rms_norm_std": (notebook_forward(rms_norm=buggy.rms_norm_std), "tiny", {}, "input_norm", 0, "standard deviation"),
    "rms_norm_mean_not_squared": (
        notebook_forward(rms_norm=buggy.rms_norm_mean_not_squared),
        "tiny",
        {},
        "input_norm",
        0,
        "max |diff| NaN",
    ),
    "rms_norm_weight_not_applied": (
        notebook_forward(rms_norm=buggy.rms_norm_weight_not_applied),
        "tiny",
        {},
        "input_norm",
        0,
        "weight not applied",
    ),
    "rms_norm_wrong_dim": (
        notebook_forward(rms_norm=buggy.rms_norm_wrong_dim),
        "tiny",
        {},
        "input_norm",
        0,
        "over the first dimension",
    ),
    "rope_interleaved_pairs": (
        notebook_forward(rope=buggy.rope_interleaved_pairs),
        "tiny",
        {},
        "q_rope",
        0,
        "(position 0 agrees).\nYour values are exactly what this mistake gives: rotating interleaved",
    ),
    "rope_ignores_positions": (
        notebook_forward(rope=buggy.rope_ignores_positions),
        "toy",
        PREFILL_THEN_TOKENS,
        "q_rope",
        0,
        "in the pass over position 6, 6 tokens cached",
    ),
    "mlp_silu_on_up": (notebook_forward(mlp=buggy.mlp_silu_on_up), "tiny", {}, "mlp", 0, "SiLU on the up branch"),
    "mlp_silu_after_product": (
        notebook_forward(mlp=buggy.mlp_silu_after_product),
        "tiny",
        {},
        "mlp",
        0,
        "on the product of both branches",
    ),
    "attention_no_causal_mask": (
        fp.forward,
        "tiny",
        dict(attention=buggy.attention_no_causal_mask),
        "attention",
        0,
        "(position 8 agrees).\nYour values are exactly what this mistake gives: no causal mask",
    ),
    "attention_no_scale": (
        fp.forward,
        "tiny",
        dict(attention=buggy.attention_no_scale),
        "attention",
        0,
        "not divided by sqrt(D)",
    ),
    "attention_heads_interleaved": (
        fp.forward,
        "toy",
        dict(attention=buggy.attention_heads_interleaved),
        "attention",
        0,
        "[0, 1, 0, 1, ...] (repeat)",
    ),
    "attention_mask_not_shifted": (
        fp.forward,
        "toy",
        dict(attention=buggy.attention_mask_not_shifted, **PREFILL_THEN_TOKENS),
        "attention",
        0,
        "mask not shifted",
    ),
    "attention_forgets_cache": (
        fp.forward,
        "toy",
        dict(attention=buggy.attention_forgets_cache, chunks=[6, 3]),
        "attention",
        0,
        "the new tokens only",
    ),
    "forward_no_attention_residual": (
        buggy.forward_no_attention_residual,
        "tiny",
        {},
        "attn_residual",
        0,
        "x = x + o_proj(out)",
    ),
    "forward_no_mlp_residual": (
        buggy.forward_no_mlp_residual,
        "tiny",
        {},
        "layer_output",
        0,
        "x = x + mlp(rms_norm(x))",
    ),
    "forward_no_final_norm": (buggy.forward_no_final_norm, "tiny", {}, "logits", None, "final RMSNorm is missing"),
    "forward_norm_after_layer": (buggy.forward_norm_after_layer, "tiny", {}, "q", 0, "not rms_norm(x)"),
    "forward_ignores_positions": (
        buggy.forward_ignores_positions,
        "toy",
        PREFILL_THEN_TOKENS,
        "q_rope",
        0,
        "instead of by `positions`",
    ),
    "forward_lm_head_is_embedding": (
        buggy.forward_lm_head_is_embedding,
        "toy",
        {},
        "logits",
        None,
        "embedding table used as the lm_head",
    ),
}


@pytest.mark.parametrize("bug", sorted(CASES))
def test_each_kept_bug_is_named_where_it_enters(bug, models):
    forward, model_name, kwargs, point, layer, words = CASES[bug]
    model, ids = models[0][model_name], models[1][model_name]
    found = diagnose(forward, model, ids, **kwargs)
    assert (found.point, found.layer) == (point, layer), f"{bug}:\n{found}"
    assert found.mistake is not None and words in str(found), f"{bug}:\n{found}"
    assert 2 <= len(str(found).splitlines()) <= 4 and not found.agrees


def test_kv_heads_not_repeated_is_named_by_its_error(models):
    found = diagnose(fp.forward, models[0]["toy"], models[1]["toy"], attention=buggy.attention_kv_heads_not_repeated)
    assert (found.point, found.layer) == ("attention", 0) and "RuntimeError" in found.error
    assert "Everything it computed before agrees" in str(found) and "K/V heads not repeated" in str(found)


@pytest.mark.parametrize(
    "model_name, kwargs",
    [("tiny", {}), ("toy", PREFILL_THEN_TOKENS), ("toy", dict(attention=fp.attention, **PREFILL_THEN_TOKENS))],
)
def test_a_right_forward_has_no_difference(model_name, kwargs, models):
    found = diagnose(notebook_forward(), models[0][model_name], models[1][model_name], **kwargs)
    assert found.agrees and str(found).startswith("No difference: all"), str(found)
    layers, passes = models[0][model_name].config.num_hidden_layers, len(kwargs.get("chunks", [1]))
    every = passes * (11 * layers + 3)
    assert f"all {every} points recorded on both sides (of {every}:" in str(found)  # every point of every pass was seen


def test_what_a_forward_computes_inline_is_listed_as_unseen(models):
    """A forward whose helpers are not reachable by name is seen only at attend and the logits: the
    difference shows later than it enters, and the message says what it could not look at."""
    forward = notebook_forward(mlp=buggy.mlp_silu_on_up)
    found = diagnose(functools.partial(forward), models[0]["tiny"], models[1]["tiny"])  # a partial has no __globals__
    assert found.layer == 1 and "so the cause may lie there" in str(found) and "layer 0, the SwiGLU MLP" in str(found)


def test_the_notebooks_helpers_are_put_back(models):
    forward = notebook_forward(rope=buggy.rope_interleaved_pairs)

    def exploding(*args):
        raise NotImplementedError("replace this line with your code")

    namespace = forward.__globals__
    namespace["mlp"] = exploding
    found = diagnose(forward, models[0]["toy"], models[1]["toy"])
    assert namespace["rope"] is buggy.rope_interleaved_pairs and namespace["mlp"] is exploding
    assert found.point == "q_rope" and found.error == "NotImplementedError: replace this line with your code"
    assert str(found).endswith("Later, your forward raised NotImplementedError: replace this line with your code")


def test_bad_chunks_are_refused(models):
    with pytest.raises(ValueError, match=r"chunks \[6, 1\] must be positive lengths adding up to input_ids' 9"):
        diagnose(fp.forward, models[0]["toy"], models[1]["toy"], chunks=[6, 1])


def test_diagnose_on_failure_adds_the_diagnosis_only_to_a_failure(models):
    model, ids = models[0]["toy"], models[1]["toy"]
    with diagnose_on_failure(fp.forward, model, ids):
        pass
    with pytest.raises(AssertionError, match=r"(?s)^logits differ\nThe first difference is at layer 0, the SwiGLU MLP"):
        with diagnose_on_failure(notebook_forward(mlp=buggy.mlp_silu_on_up), model, ids):
            raise AssertionError("logits differ")


def test_the_notebooks_visible_test_names_the_first_operation_that_differs():
    """Notebook 01's test_forward cell, run on the solutions with one of them replaced by a kept bug:
    its failure names the operation; on the solutions themselves it passes."""
    from notebooks import grade_id, read, solution_path, visible_part

    nb = read(solution_path("01_forward_pass"))
    cells = {grade_id(c): c.source for c in nb.cells}
    setup = next(c.source for c in nb.cells if c.cell_type == "code")
    solutions = [cells[f"ex_{name}"] for name in ("rms_norm", "rope", "mlp", "forward")]
    test = visible_part(cells["test_forward"])
    for bug, words in (
        (None, None),
        (buggy.rope_interleaved_pairs, "layer 0, RoPE applied to q: max |diff|"),
        (buggy.rope_ignores_positions, "layer 0, RoPE applied to q (in the pass over position 6"),
    ):
        namespace = {"__name__": "__visible_test__"}
        with contextlib.redirect_stdout(io.StringIO()):
            for source in [setup, *solutions]:
                exec(compile(source, "<cell>", "exec"), namespace)  # noqa: S102 - our own notebook
            if bug is not None:
                namespace["rope"] = bug
            try:
                exec(compile(test, "<test_forward>", "exec"), namespace)  # noqa: S102
            except AssertionError as failure:
                assert words is not None and words in str(failure), str(failure)
                continue
        assert words is None, f"the visible test passes with {bug.__name__}"


def test_the_diagnosis_is_re_exported():
    from decodelab import course

    assert course.diagnose is diagnose and course.diagnose_on_failure is diagnose_on_failure
    assert diagnosis.Diagnosis().agrees

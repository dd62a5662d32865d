"""Notebook 15's hidden checks: they pass on the library's references (`model.mamba.selective_step` and
`selective_scan`, `lessons.state_space.mixer_forward` and `generate_with_state`) and catch every kept bug
(tests/fixtures/buggy_state_space.py) with a message that names the behaviour; plus the lesson's
measurements the notebook leans on, against what they must equal."""

from __future__ import annotations

import pytest
import torch
from oracles import expect_bug_caught, load_fixture

from autograder.checks import state_space as checks
from decodelab.lessons import state_space
from decodelab.model import mamba
from decodelab.model.kv_cache import KVCache
from decodelab.model.toy import random_llama, random_mamba

buggy = load_fixture("buggy_state_space")

# the words each kept bug's hidden failure must contain: the behaviour it breaks
NAMES = {
    "step_decay_not_exponentiated": "exp(Δ·A)",
    "step_input_not_scaled_by_delta": "scaled by Δ",
    "scan_chunks_restart_from_the_start_state": "the state the previous chunk ended in",
    "scan_ignores_the_given_state": "from the given state",
    "mixer_delta_not_input_dependent": "for each token",
    "mixer_A_not_negative": "A = -exp(A_log)",
    "mixer_A_not_exponentiated": "A = -exp(A_log)",
    "mixer_conv_not_causal": "causal",
    "generate_fresh_state_each_token": "the state must be carried",
    "generate_prompt_outside_the_state": "the state must be carried",
    "generate_recomputing_everything": "one token a step",
}


def test_reference_passes():
    checks.check_selective_step(mamba.selective_step)
    checks.check_selective_scan(mamba.selective_scan)
    checks.check_mixer_forward(state_space.mixer_forward)
    checks.check_generate_with_state(state_space.generate_with_state)


@pytest.mark.parametrize("bug", sorted(buggy.BUGS))
def test_bug_is_caught(bug):
    message = expect_bug_caught(checks, buggy.BUGS, bug)
    assert NAMES[bug] in message, message


def test_the_predictions_answers():
    # tiny-mamba: 7 layers x E 512 x ((K-1) 3 conv inputs + N 8 scan values) x 4 bytes
    assert checks.answer_q_state_kib() == pytest.approx(7 * 512 * (3 + 8) * 4 / 1024)
    # tiny: 2 (K and V) x 4 layers x 8 KV heads x 32 x 4 bytes = 8 KiB a token; 154 KiB / 8 KiB = 19.25
    assert checks.answer_q_crossover_tokens() == 20.0
    checks.check_q_crossover_tokens(20)
    with pytest.raises(AssertionError, match="divide the state's bytes"):
        checks.check_q_crossover_tokens(1024)


def test_the_mixer_reference_equals_the_models_mixer_and_bad_input_is_an_error():
    model = random_mamba(seed=3)
    h = torch.randn(1, 7, 32)
    mixer = model.backbone.layers[1].mixer
    torch.testing.assert_close(state_space.mixer_forward(mixer, h), mixer(h), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"h must be \[b, T, 32\]"):
        state_space.mixer_forward(mixer, torch.randn(7, 32))
    with pytest.raises(ValueError, match="prompt is empty"):
        state_space.generate_with_state(model, [], 3)


def test_held_bytes_is_the_state_for_an_ssm_and_grows_with_the_context_for_a_transformer():
    ssm, transformer = random_mamba(seed=4), random_llama(seed=4)
    ids = list(range(3, 40))
    assert state_space.held_bytes(ssm, ids[:5]) == state_space.held_bytes(ssm, ids) == mamba.state_bytes(ssm.config)
    per_token = KVCache(transformer.config, 1, 1).keys.numel() * 4 * 2
    assert state_space.held_bytes(transformer, ids[:5]) == 5 * per_token
    assert state_space.held_bytes(transformer, ids) == len(ids) * per_token


def test_the_copy_task_repeats_its_segment_after_the_gap():
    filler = list(range(100, 400))
    ids, start = state_space.copy_task(filler, vocab_size=50, gap=20, segment=6, trials=3, seed=1)
    assert ids.shape == (3, 16 + 6 + 20 + 6) and start == 16 + 6 + 20
    assert torch.equal(ids[:, 16:22], ids[:, start:])
    assert bool((ids[:, 16:22] < 50).all()) and bool((ids[:, 22:start] >= 100).all())
    with pytest.raises(ValueError, match="filler"):
        state_space.copy_task(filler[:30], vocab_size=50, gap=20, trials=20)


def test_copy_recall_scores_a_model_that_copies_perfectly_and_one_that_never_does():
    class Echo(torch.nn.Module):
        """Predicts the token that followed the latest earlier occurrence of the current token."""

        def __init__(self, vocab_size):
            super().__init__()
            self.config = type("C", (), {"vocab_size": vocab_size})()
            self.device = torch.device("cpu")

        def forward(self, ids):
            b, T = ids.shape
            out = torch.zeros(b, T, int(ids.max()) + 1)
            for r in range(b):
                for t in range(T):
                    seen = [s for s in range(t) if ids[r, s] == ids[r, t]]
                    out[r, t, ids[r, seen[-1] + 1] if seen else 0] = 1
            return out

    filler = list(range(100, 240))  # no filler token among the segment's ids [3, 50): only the copy matches
    ids, _ = state_space.copy_task(filler, 50, gap=30, segment=5, trials=2, seed=1)
    assert all(len(set(row[16:21].tolist())) == 5 for row in ids)  # no repeat inside a segment, for this seed
    score = state_space.copy_recall(Echo(50), filler, gap=30, segment=5, trials=2, seed=1)
    # one-hot logits of 1: the target scores logit 1 after the copy, 0 after the control (which points elsewhere)
    assert score.accuracy == 1.0 and score.nats_saved == pytest.approx(1.0)
    control, _ = state_space.copy_task(filler, 50, gap=30, segment=5, trials=2, seed=1, control=True)
    assert torch.equal(control[:, 22:], ids[:, 22:]) and not torch.equal(control[:, 16:21], ids[:, 16:21])

    class Zero(Echo):
        def forward(self, ids):
            return torch.zeros(*ids.shape, 300)

    assert state_space.copy_recall(Zero(50), filler, gap=30, segment=5, trials=2) == state_space.CopyScore(
        0.0, 0.0, 0.0
    )


def test_the_memory_explorer_draws_both_models_and_follows_its_sliders():
    from decodelab.config import ModelConfig
    from decodelab.course.widgets import state_space as widgets_state_space
    from decodelab.lessons.kv_size import kv_bytes

    transformer, ssm = ModelConfig.from_file(checks.TRANSFORMER_FOLDER / "config.json"), random_mamba().config
    box = widgets_state_space.memory_explorer(transformer, ssm)
    kv, state = box.figure.data
    assert list(kv.x) == [16, 32, 64, 128, 256, 512, 1024]
    assert kv.y[-1] == kv_bytes(transformer, 1024, 1, 4) and set(state.y) == {mamba.state_bytes(ssm)}
    box.controls["batch"].value = 8
    assert box.figure.layout.title.text.startswith("context 1,024, batch 8:")
    assert box.figure.data[1].y[0] == mamba.state_bytes(ssm, 8)

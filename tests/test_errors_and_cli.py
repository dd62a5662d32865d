"""Errors that name the problem, and the command line as a user (or a script) sees it."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from decodelab.config import ConfigError
from decodelab.decoding.generate import PromptTooLongError, stream_token_ids
from decodelab.model.registry import UnknownModelError, resolve_model
from decodelab.params import SamplingParams
from decodelab.model.weights import WeightsError, load_model, save_model
from oracles import check_greedy_agreement, hf_greedy, last_logits_fn, random_model

GOOD_CONFIG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


# ------------------------------------------------------------------ model names
def test_unknown_model_name():
    with pytest.raises(UnknownModelError, match=r"unknown model 'nope': use one of smollm2, tiny"):
        resolve_model("nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(UnknownModelError, match="has no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ConfigError, match="no config.json at"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "absent")


# ------------------------------------------------------------------ config.json
def _broken(**changes):
    raw = {**GOOD_CONFIG, **changes}
    return {k: v for k, v in raw.items() if v is not ...}


@pytest.mark.parametrize("raw, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "config must be a JSON object, got list"),
    (_broken(hidden_size=...), r"missing required field\(s\): hidden_size"),
    (_broken(num_hidden_layers=-2), "num_hidden_layers must be a positive integer, got -2"),
    (_broken(vocab_size="97"), "vocab_size must be a positive integer, got '97'"),
    (_broken(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    (_broken(rms_norm_eps=0), "rms_norm_eps must be > 0"),
    (_broken(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (_broken(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn' is not supported"),
], ids=["bad_json", "not_object", "missing_field", "negative", "wrong_type", "heads_not_divisible",
        "zero_eps", "model_type", "rope_type"])
def test_malformed_config(tmp_path, raw, message):
    (tmp_path / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path)


# ---------------------------------------------------------------------- tensors
@pytest.fixture
def saved_model(tmp_path):
    save_model(random_model(seed=41, tie_word_embeddings=False), tmp_path)
    return tmp_path


def test_good_folder_loads(saved_model):
    assert load_model(saved_model).config.num_hidden_layers == 2  # the cases below differ only as stated


def test_missing_tensor(saved_model):
    state = load_file(saved_model / "model.safetensors")
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, saved_model / "model.safetensors")
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_model(saved_model)


def test_misshaped_tensor(saved_model):
    state = load_file(saved_model / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(state, saved_model / "model.safetensors")
    with pytest.raises(WeightsError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight has shape "
                                           r"\(95, 64\), config expects \(96, 64\)"):
        load_model(saved_model)


def test_no_weights_file(saved_model):
    (saved_model / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(saved_model)


# ----------------------------------------------------------------------- prompts
@pytest.fixture(scope="module")
def short_context_model():
    return random_model(seed=42, max_position_embeddings=16)


def test_prompt_longer_than_context(short_context_model):
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(PromptTooLongError, match="prompt of 20 tokens does not fit the model's context of 16"):
        next(stream_token_ids(short_context_model, list(range(20)), params))
    with pytest.raises(PromptTooLongError, match="prompt of 16 tokens"):  # nothing left to generate
        next(stream_token_ids(short_context_model, list(range(16)), params))
    # 15 tokens fit; generation stops at the context's end instead of failing
    assert len(list(stream_token_ids(short_context_model, list(range(15)), params))) == 1
    with pytest.raises(ValueError, match="position 16 is beyond the model's context of 16 tokens"):
        short_context_model(torch.zeros(1, 17, dtype=torch.long))


def test_bad_prompt_ids(short_context_model):
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="the prompt is empty"):
        next(stream_token_ids(short_context_model, [], params))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 97\): \[97, -1\]"):
        next(stream_token_ids(short_context_model, [1, 97, -1], params))


# ---------------------------------------------------------------------- sampling
@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(top_k=-5), "top_k must be an integer >= 1, or 0 / -1 to disable, got -5"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_sampling_edges():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=1)
    SamplingParams(top_p=1e-6, top_k=0)


# --------------------------------------------------------------------------- CLI
def run_cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "decodelab", *args], capture_output=True, text=True,
                          timeout=timeout)


def cli_json(*args):
    proc = run_cli("generate", *args, "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout must hold exactly one JSON object, got {proc.stdout!r}"
    out = json.loads(lines[0])
    assert set(out) == {"prompt_ids", "output_ids", "text", "finish_reason"}
    return out


@pytest.fixture(scope="module")
def capital_of_france(smollm2_folder):
    return cli_json("What is the capital of France?", "--max-new-tokens", "16")


def test_cli_generate_json(smollm2, hf_gguf_model, capital_of_france):
    model, tok = smollm2
    out = capital_of_france
    expected_prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    assert out["prompt_ids"] == expected_prompt and out["prompt_ids"][0] == 1  # <|im_start|>
    ref = hf_greedy(hf_gguf_model, out["prompt_ids"], 16, eos_token_id=tok.eos_token_id)
    check_greedy_agreement(out["prompt_ids"], out["output_ids"], ref,
                           [last_logits_fn(model), last_logits_fn(hf_gguf_model)])
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    assert "Paris" in out["text"]
    # the model ends its turn itself: the stop token is the last id and not part of the text
    assert out["finish_reason"] == "stop" and out["output_ids"][-1] == tok.eos_token_id
    assert len(out["output_ids"]) < 16 and "<|im_end|>" not in out["text"]


def test_cli_max_new_tokens(capital_of_france, smollm2):
    _, tok = smollm2
    out = cli_json("What is the capital of France?", "--max-new-tokens", "3")
    assert out["output_ids"] == capital_of_france["output_ids"][:3]
    assert out["finish_reason"] == "length"
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("args, message", [
    (["--top-p", "2"], r"top_p must be in \(0, 1\], got 2.0"),
    (["--model", "nope"], "unknown model 'nope'"),
], ids=["top_p", "model"])
def test_cli_bad_flags(args, message):
    proc = run_cli("generate", "hello", *args, "--device", "cpu", "--json")
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert re.search(message, lines[0]), lines[0]


def test_cli_main_in_process_reports_errors(capsys):
    from decodelab.cli import main

    assert main(["generate", "hi", "--max-new-tokens", "0", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == "error: max_tokens must be an integer >= 1, got 0"

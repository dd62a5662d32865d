"""Errors that name the problem, and the command line as a user (or a script) sees it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from notebooks import ROOT
from oracles import check_greedy_agreement, hf_greedy, last_logits_fn, random_model
from safetensors.torch import load_file, save_file

from decodelab.config import ConfigError
from decodelab.decoding.generate import PromptTooLongError, stream_token_ids
from decodelab.model.registry import UnknownModelError, resolve_model
from decodelab.model.weights import WeightsError, load_model, save_model
from decodelab.params import SamplingParams
from decodelab.paths import PACKAGE_DATA

GOOD_CONFIG = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


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


@pytest.mark.parametrize(
    "raw, message",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "config must be a JSON object, got list"),
        (_broken(hidden_size=...), r"missing required field\(s\): hidden_size"),
        (_broken(num_hidden_layers=-2), "num_hidden_layers must be a positive integer, got -2"),
        (_broken(vocab_size="97"), "vocab_size must be a positive integer, got '97'"),
        (_broken(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        (_broken(rms_norm_eps=0), "rms_norm_eps must be > 0"),
        (_broken(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (_broken(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn' is not supported"),
    ],
    ids=[
        "bad_json",
        "not_object",
        "missing_field",
        "negative",
        "wrong_type",
        "heads_not_divisible",
        "zero_eps",
        "model_type",
        "rope_type",
    ],
)
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
    with pytest.raises(
        WeightsError,
        match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight has shape "
        r"\(95, 64\), config expects \(96, 64\)",
    ):
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
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_k=-5), "top_k must be an integer >= 1, or 0 / -1 to disable, got -5"),
        (dict(top_k=2.5), "top_k must be an integer"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    ],
)
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_sampling_edges():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=1)
    SamplingParams(top_p=1e-6, top_k=0)


# --------------------------------------------------------------------------- CLI
def run_cli(*args, timeout=240):
    """`python -m decodelab ARGS` with this checkout's decodelab (args may be bytes: a raw argv)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "decodelab", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


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
    expected_prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    assert out["prompt_ids"] == expected_prompt and out["prompt_ids"][0] == 1  # <|im_start|>
    ref = hf_greedy(hf_gguf_model, out["prompt_ids"], 16, eos_token_id=tok.eos_token_id)
    check_greedy_agreement(
        out["prompt_ids"], out["output_ids"], ref, [last_logits_fn(model), last_logits_fn(hf_gguf_model)]
    )
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


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("decodelab: error: "), stderr
    return lines[0]


# The verbatim command, as a shell runs it: a prompt whose bytes are not UTF-8 (argv as the OS gives
# it), and a command that does not exist. Every other bad input is checked in-process below.
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["generate", b"caf\xe9 \xff", "--model", "tiny", "--device", "cpu", "--json"],
            r"argument prompt: must be UTF-8 text, got byte 0xe9 at byte 3",
        ),
        (["bogus", "--json"], r"unknown command 'bogus': use one of generate, prepare, progress, hints, serve"),
    ],
    ids=["non_utf8_prompt", "unknown_command"],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert re.search(message, one_error_line(proc.stderr))


def tiny_folder_with(tmp_path, name: str, content: bytes) -> str:
    """A copy of the tiny model whose file `name` holds `content` instead."""
    folder = tmp_path / "tiny"
    shutil.copytree(PACKAGE_DATA / "tiny", folder)
    (folder / name).write_bytes(content)
    return str(folder)


NO_CUDA = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
BAD_GENERATE = [  # (flags after `generate PROMPT --model tiny --device cpu --json`, the error line's pattern)
    (["--seed", "1e24"], r"argument --seed: must be an integer in 0\.\.9223372036854775807 .*, got '1e24'"),
    (["--seed", "-1"], r"argument --seed: must be an integer in 0\.\.\d+ .*, got '-1'"),
    (["--seed", str(2**63)], r"argument --seed: .*, got '9223372036854775808'"),
    (["--seed", "1.5"], r"argument --seed: .*, got '1\.5'"),
    (["--temperature", "inf"], r"argument --temperature: must be a finite number >= 0, got 'inf'"),
    (["--temperature", "nan"], r"argument --temperature: must be a finite number >= 0, got 'nan'"),
    (
        ["--temperature", "-0.5"],
        r"argument --temperature: must be >= 0: 0 \(greedy\) or a number in \[1e-08, 1e\+08\].*, got -0\.5",
    ),
    (["--top-p", "0"], r"argument --top-p: must be in \(0, 1\], got 0\.0"),
    (["--top-p", "1.5"], r"argument --top-p: must be in \(0, 1\], got 1\.5"),
    (["--top-k", "-3"], r"argument --top-k: must be an integer >= 1, or 0 / -1 to disable, got -3"),
    (["--top-k", "2.5"], r"argument --top-k: must be an integer >= 1, or 0 / -1 to disable, got '2\.5'"),
    (["--max-new-tokens", "0"], r"argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["--max-new-tokens", "-2"], r"argument --max-new-tokens: must be an integer >= 1, got -2"),
    (["--repetition-penalty", "inf"], r"argument --repetition-penalty: must be a finite number > 0, got 'inf'"),
    (["--device", NO_CUDA], rf"argument --device: device '{NO_CUDA}' asked for, but .*use device='cpu'"),
    (
        ["--device", "tpu"],
        r"argument --device: device 'tpu' is not a torch device name: use 'cpu', 'cuda', 'cuda:N' or 'mps'",
    ),
    (["--model", "nope"], r"unknown model 'nope': use one of smollm2, tiny, tiny-draft, tiny-mamba, or a folder"),
    (["--model", "/no/such/folder"], r"unknown model '/no/such/folder'"),
    (
        ["--model", "{corrupt_weights}"],
        r"tiny/model\.safetensors is not a readable safetensors file .*corrupt or truncated",
    ),
    (["--model", "{corrupt_tokenizer}"], r"tiny/tokenizer\.json is not a readable tokenizer file \(EOF while parsing"),
    (["--model", "{corrupt_config}"], r"config\.json is not valid JSON"),
    (["--dtype", "int3"], r"unknown dtype 'int3'"),
    (["--prompt", "word " * 1100, "--no-chat"], r"prompt of \d+ tokens does not fit the model's context of 1024"),
    (["--prompt", "caf\udce9"], r"argument prompt: must be UTF-8 text, got byte 0xe9 at byte 3"),
]


@pytest.mark.parametrize(
    "flags, message",
    BAD_GENERATE,
    ids=[f"{flags[0].lstrip('-')}={flags[1].strip('{}')[:16]}" for flags, _ in BAD_GENERATE],
)
def test_cli_bad_generate_input(tmp_path, capsys, flags, message):
    from decodelab.cli import main

    corrupt = {
        "{corrupt_weights}": ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"),
        "{corrupt_tokenizer}": ("tokenizer.json", b'{"model": '),
        "{corrupt_config}": ("config.json", b"{"),
    }
    flags = [tiny_folder_with(tmp_path, *corrupt[f]) if f in corrupt else f for f in flags]
    prompt = flags.pop(flags.index("--prompt") + 1) if "--prompt" in flags else "hello"
    flags = [f for f in flags if f != "--prompt"]
    assert main(["generate", prompt, "--model", "tiny", "--device", "cpu", "--json", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert re.search(message, one_error_line(err))


def test_cli_bad_commands_in_process(capsys):
    from decodelab.cli import main

    for argv, message in [
        ([], "no command given: use one of generate, prepare, progress, hints, serve"),
        (["generate"], "the following arguments are required: prompt"),
        (["generate", "hi", "--tempreature", "1"], "unrecognized arguments: --tempreature 1"),
        (
            ["progress", "--course", ".", "--timeout", "0"],
            "argument --timeout: must be a number of seconds > 0, got '0'",
        ),
    ]:
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and one_error_line(err).startswith(f"decodelab: error: {message}")
    assert main(["generate", "--help"]) == 0 and "--top-p P" in capsys.readouterr().out


def test_cli_edge_values_are_accepted(capsys):
    from decodelab.cli import MAX_SEED, main

    assert (
        main(
            [
                "generate",
                "hello",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--json",
                "--max-new-tokens",
                "3",
                "--seed",
                str(MAX_SEED),
                "--temperature",
                "0.7",
                "--top-k",
                "-1",
                "--top-p",
                "1e-6",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and len(json.loads(out)["output_ids"]) == 3, (out, err)

"""The AOT-compiled decode step (decodelab.decoding.packaged): its key says what changes the code, a
missing or foreign package is refused or falls back with one line on stderr, and a package built
once gives the eager model's greedy tokens in a fresh process that loads it in well under a second
(tiny, and SmolLM2 int8 as `prepare` builds it)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from decodelab.cli import main
from decodelab.decoding.compiled import CompiledDecoder
from decodelab.decoding.generate import stream_token_ids
from decodelab.decoding.packaged import (
    PackagedDecoder,
    build_package,
    decoder_for,
    package_key,
    package_path,
)
from decodelab.model.fused_int8 import COMPILE_ENV, quantize_for_decode
from decodelab.model.registry import load
from decodelab.model.toy import random_llama
from decodelab.params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return load("tiny", device="cpu")


def greedy_ids(model, prompt_ids, n):
    return list(stream_token_ids(model, prompt_ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))


def test_key_follows_the_code_not_the_weights(tiny):
    model = tiny[0]
    other_weights = copy.deepcopy(model)
    with torch.no_grad():
        other_weights.model.layers[0].mlp.up_proj.weight.add_(1.0)
    int8 = quantize_for_decode(copy.deepcopy(model))
    bfloat = copy.deepcopy(model).to(torch.bfloat16)
    assert package_key(other_weights) == package_key(model)  # the weights are not in the package
    assert len({package_key(model), package_key(int8), package_key(bfloat)}) == 3
    assert package_key(random_llama()) != package_key(model)


def test_package_lives_in_the_cache(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    path = package_path(tiny[0])
    assert path.parent == tmp_path / "aoti" and path.name == f"decode-{package_key(tiny[0])}.pt2"


def test_no_package_is_refused_or_falls_back_with_one_line(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    model = tiny[0]
    with pytest.raises(FileNotFoundError, match="python -m decodelab prepare"):
        PackagedDecoder(model)
    assert decoder_for(model, compile=False) is model
    assert isinstance(decoder_for(model), CompiledDecoder)  # built lazily: nothing compiles until a step
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "eagerly" in lines[0] and "compiling the decode step" in lines[1]


def test_a_model_that_is_not_a_llama_is_refused():
    with pytest.raises(ValueError, match="Llama-family"):
        PackagedDecoder(torch.nn.Linear(2, 2))


FRESH_PROCESS = """
import json, sys, time
import torch
from decodelab.decoding.generate import stream_token_ids
from decodelab.decoding.packaged import PackagedDecoder
from decodelab.model.fused_int8 import quantize_for_decode
from decodelab.model.registry import load
from decodelab.params import SamplingParams

name, path, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model, tokenizer = load(name, device="cpu")
quantize_for_decode(model)
start = time.perf_counter()
decoder = PackagedDecoder(model, path)
load_seconds = time.perf_counter() - start
params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
ids = tokenizer.encode(prompt)
print(json.dumps({
    "load_seconds": load_seconds,
    "inductor_imported": "torch._inductor" in sys.modules,
    "packaged": list(stream_token_ids(decoder, ids, params)),
    "eager": list(stream_token_ids(model, ids, params)),
}))
"""


def run_fresh(name, path, prompt, n):
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, name, str(path), prompt, str(n)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_tiny_package_gives_the_eager_tokens_in_a_fresh_process(tiny, tmp_path, monkeypatch, capsys):
    """Built here (about 40 s on 2 cores), loaded in a new Python: the greedy ids of 48 tokens equal
    the eager int8 model's, the load takes well under a second and imports no torch._inductor.
    A package built for the int8 model is refused by the float one (another key). The CLI's
    `generate --int8` takes it from the cache, silently, and prints --no-compile's tokens."""
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path))
    model = quantize_for_decode(copy.deepcopy(tiny[0]))
    path = build_package(model)
    assert path == package_path(model) and not list(path.parent.glob("*.partial*"))
    assert path.stat().st_size < 10 << 20  # the code only: the weights stay with the model
    found = run_fresh("tiny", path, "def fibonacci(n):", 48)
    assert found["packaged"] == found["eager"] and len(found["eager"]) == 48
    assert found["load_seconds"] < 0.5 and not found["inductor_imported"]
    with pytest.raises(ValueError, match="built for another model"):
        PackagedDecoder(tiny[0], path)
    # Its cache grows past the example's 64 slots, and a longer cache reuses the same code.
    prompt_ids = tiny[1].encode("import os\n" * 12)
    assert greedy_ids(PackagedDecoder(model, path), prompt_ids, 40) == greedy_ids(model, prompt_ids, 40)

    def cli(*flags):
        argv = ["generate", "def add(a, b):", "--model", "tiny", "--device", "cpu", "--no-chat", "--json", "--int8"]
        assert main([*argv, "--max-new-tokens", "24", *flags]) == 0
        out = capsys.readouterr()
        return json.loads(out.out)["output_ids"], out.err

    monkeypatch.setenv(COMPILE_ENV, "1")
    packaged, told = cli()
    assert "decodelab:" not in told  # no fallback line: the package was used
    assert packaged == cli("--no-compile")[0]


def test_smollm2_int8_package_gives_the_eager_tokens(smollm2):
    """SmolLM2 int8 as `python -m decodelab prepare` builds it (run where it was
    prepared): the same greedy ids as the eager int8 model, loaded in a fresh process."""
    model = quantize_for_decode(copy.deepcopy(smollm2[0]))
    path = package_path(model)
    if not path.is_file():  # minutes to build: CI's `make setup` does not (the tiny test covers the path)
        pytest.skip(f"`python -m decodelab prepare` has not built {path.name} here")
    found = run_fresh("smollm2", path, "What is gravity?", 32)
    assert found["packaged"] == found["eager"] and len(found["eager"]) == 32
    assert found["load_seconds"] < 0.5

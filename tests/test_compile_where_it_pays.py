"""The fast path where users are: `LLM(compile_decode=...)` and `generate --int8 [--no-compile]`.

What compiles is decided once (`EngineArgs.compiles_decode`): int8 weights of the library's own
layers on a CPU, for a model big enough to pay for it, unless DECODELAB_COMPILE=0 (tests/conftest.py sets it, so the suite pays no
compile); compile_decode=True insists. Compiling changes how the int8 products run, not their
levels: greedy tokens equal the eager int8 engine's (the slow test compiles once to show it)."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from decodelab.decoding.generate import encode_prompt, stream_token_ids
from decodelab.engine.args import EngineArgs
from decodelab.engine.hooks import EngineHooks
from decodelab.engine.llm import LLM
from decodelab.model.fused_int8 import COMPILE_ENV, RowCompiledInt8Linear, quantize_for_decode
from decodelab.model.quantization import Int8Linear, QuantizedLinear
from decodelab.model.registry import load
from decodelab.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_compile_decode_is_checked():
    with pytest.raises(ValueError, match="needs quantization='int8'"):
        EngineArgs(model="tiny", compile_decode=True)
    with pytest.raises(ValueError, match="needs quantization='int8'"):
        EngineArgs(
            model="tiny", quantization="int8", compile_decode=True, hooks=EngineHooks(linear=Int8Linear.from_linear)
        )
    with pytest.raises(ValueError, match="compile_decode must be None, True or False, got 'yes'"):
        EngineArgs(model="tiny", compile_decode="yes")


def stand_in(device: str, layer_mib: int):
    """What compiles_decode reads of a model: its device and its decoder layers' parameters (on the
    meta device: sizes without memory)."""
    layers = torch.nn.ModuleList([torch.nn.Linear(1024, layer_mib * 256, bias=False, device="meta")])
    return SimpleNamespace(device=torch.device(device), model=SimpleNamespace(layers=layers))


def test_none_compiles_only_int8_on_a_cpu_where_it_pays_and_when_allowed(monkeypatch):
    int8 = EngineArgs(model="tiny", quantization="int8")
    smollm2_sized, tiny_sized = stand_in("cpu", 405), stand_in("cpu", 12)
    assert not int8.compiles_decode(smollm2_sized), "tests/conftest.py sets DECODELAB_COMPILE=0"
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert int8.compiles_decode(smollm2_sized)
    assert not int8.compiles_decode(tiny_sized), "a few MiB stay in cache: the compile would not pay"
    assert not int8.compiles_decode(stand_in("cuda", 405)) and not int8.compiles_decode(stand_in("mps", 405))
    assert not EngineArgs(model="tiny").compiles_decode(smollm2_sized), "float weights: compiling gained nothing"
    assert not EngineArgs(model="tiny", quantization="int4").compiles_decode(smollm2_sized)
    assert not EngineArgs(
        model="tiny", quantization="int8", hooks=EngineHooks(linear=Int8Linear.from_linear)
    ).compiles_decode(smollm2_sized)
    assert not EngineArgs(model="tiny", quantization="int8", compile_decode=False).compiles_decode(smollm2_sized)
    assert EngineArgs(model="tiny", quantization="int8", compile_decode=True).compiles_decode(tiny_sized)


def test_an_engine_that_does_not_compile_keeps_its_layers(monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "1")  # allowed, but tiny is too small to pay for it
    llm = LLM("tiny", device="cpu", quantization="int8")
    assert llm.compiles_decode is False and llm.args.compile_decode is None
    assert isinstance(llm.model.model.layers[0].mlp.up_proj, QuantizedLinear)


def test_row_compiled_layer_runs_other_shapes_eagerly():
    """More than one row (a prefill, a batched step) never reaches the compiler: the Int8Linear's own
    eager form, exactly; a wrong width is the layer's own error."""
    torch.manual_seed(0)
    layer = RowCompiledInt8Linear.from_linear(torch.nn.Linear(16, 8))
    x = torch.randn(2, 3, 16)
    assert torch.equal(layer(x), layer.layer(x)) and layer(x).shape == (2, 3, 8)
    with pytest.raises(ValueError, match=r"inputs \[\.\.\., 16\]"):
        layer(torch.zeros(1, 15))


def test_cli_no_compile_needs_int8(capsys):
    from decodelab.cli import main

    assert main(["generate", "hi", "--model", "tiny", "--device", "cpu", "--no-compile"]) == 2
    assert "--no-compile goes with --int8" in capsys.readouterr().err


def test_cli_int8_gives_the_int8_models_tokens(capsys):
    """`generate --int8` (eager here: DECODELAB_COMPILE=0) decodes quantize_for_decode's model."""
    from decodelab.cli import main

    assert (
        main(
            [
                "generate",
                "def add(a, b):",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--int8",
                "--json",
                "--max-new-tokens",
                "8",
                "--no-chat",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    model, tokenizer = load("tiny", device="cpu")
    int8 = quantize_for_decode(copy.deepcopy(model))
    ids = tokenizer.encode("def add(a, b):")
    want = list(stream_token_ids(int8, ids, SamplingParams(temperature=0, max_tokens=8)))
    assert out["prompt_ids"] == ids and out["output_ids"] == want


@pytest.mark.slow
def test_compiled_int8_engine_gives_the_eager_int8_engines_greedy_tokens(monkeypatch):
    """torch.compile for real (inductor): LLM(quantization="int8", compile_decode=True) runs its
    decode steps' one-row products compiled and gives the greedy tokens of the eager int8 engine,
    alone and in a batch (whose multi-row products run eagerly)."""
    from decodelab.model import fused_int8

    real, calls = fused_int8.compiled_int8_product, []

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(fused_int8, "compiled_int8_product", counted)
    eager = LLM("tiny", device="cpu", quantization="int8", compile_decode=False)
    compiled = LLM("tiny", device="cpu", quantization="int8", compile_decode=True)
    assert compiled.compiles_decode and isinstance(
        compiled.model.model.layers[0].self_attn.q_proj, RowCompiledInt8Linear
    )
    prompts = [encode_prompt(eager.tokenizer, p, chat=False) for p in ("def add(a, b):", "import os\n")]
    for prompt in prompts:  # batch 1: every decode step's products are one row
        [want] = eager.generate([prompt], GREEDY, use_tqdm=False)
        [got] = compiled.generate([prompt], GREEDY, use_tqdm=False)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    linears = sum(isinstance(m, RowCompiledInt8Linear) for m in compiled.model.modules())
    assert not eager_calls(eager) and len(calls) >= linears * (GREEDY.max_tokens - 1) * len(prompts)
    both = [o.outputs[0].token_ids for o in compiled.generate(prompts, GREEDY, use_tqdm=False)]
    assert both == [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]


def eager_calls(engine) -> int:
    """RowCompiledInt8Linear layers in an engine that does not compile (none)."""
    return sum(isinstance(m, RowCompiledInt8Linear) for m in engine.model.modules())

"""The engine on an accelerator: the same checks run on the CPU here and on CUDA under
`make gpu-check` (a GPU machine with its own torch; only the tiny pair and random weights
travel there, no SmolLM2)."""

from __future__ import annotations

import pytest
import torch
from oracles import check_greedy_agreement, last_logits_fn

from decodelab.decoding.eagle import FeatureDrafter
from decodelab.decoding.generate import stream_token_ids
from decodelab.decoding.speculative import speculative_generate
from decodelab.engine.llm import LLM
from decodelab.model.registry import load
from decodelab.model.toy import random_llama
from decodelab.params import SamplingParams

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def engine_checks(device: str) -> None:
    model, tokenizer = load("tiny", device=device)
    cpu_model, _ = load("tiny", device="cpu")
    prompts = [tokenizer.encode(t) for t in ("def fibonacci(n):", "import os\n", "class Stack:\n    def")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with torch.inference_mode():  # logits on the device agree with the CPU's
        ids = torch.tensor([prompts[0]])
        diff = (model(ids.to(device)).cpu() - cpu_model(ids)).abs().max()
    assert diff < 1e-3, f"{device} logits differ from the CPU's by {diff}"
    singles = [list(stream_token_ids(model, p, params)) for p in prompts]
    llm = LLM((model, tokenizer), num_kv_blocks=64)
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == singles
    draft, _ = load("tiny-draft", device=device)
    spec = LLM((model, tokenizer), num_kv_blocks=64, speculative_model=draft, num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == singles
    assert spec.allocator.num_free == spec.allocator.num_blocks
    torch.manual_seed(0)  # an untrained feature drafter: the greedy output is the target's whatever it guesses
    drafter = FeatureDrafter(model.config).to(device).attach(model).eval()
    for k, width in ((3, 1), (1, 2), (1, 3)):
        output, _ = speculative_generate(model, drafter, prompts[1], params, k, tree_width=width)
        assert output == singles[1], f"feature drafter, k={k}, tree width {width}, on {device}"


def smollm2_shaped_checks(device: str, dtype: torch.dtype) -> None:
    """A random-weight model of SmolLM2's exact shape in half precision: the engine runs and
    matches the single-request path (nothing larger than a few MB needs to travel)."""
    model = random_llama(0, dtype=dtype, **SMOLLM2_SHAPE).to(device)
    _, tokenizer = load("tiny")  # any tokenizer: the engine only needs ids here
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM((model, tokenizer), num_kv_blocks=32)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    single = list(stream_token_ids(model, prompts[0], params))
    # Half precision: batched and single kernels may round differently, so near-ties may swap.
    check_greedy_agreement(prompts[0], outs[0].outputs[0].token_ids, single, [last_logits_fn(model)], tol=0.1)


def test_engine_checks_on_cpu():
    engine_checks("cpu")


@pytest.mark.slow
def test_smollm2_shaped_on_cpu():
    smollm2_shaped_checks("cpu", torch.float32)


@pytest.mark.cuda
def test_engine_checks_on_cuda():
    engine_checks("cuda")


@pytest.mark.cuda
def test_smollm2_shaped_bf16_on_cuda():
    smollm2_shaped_checks("cuda", torch.bfloat16)

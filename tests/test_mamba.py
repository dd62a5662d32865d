"""The Mamba-style model (decodelab.model.mamba) against oracles, not snapshots:

- its logits equal transformers' MambaForCausalLM (the pure-PyTorch path) on the same weights,
  random, and read by `from_pretrained` from a folder written here;
- the recurrent one-token step over a prompt equals the chunked scan, for any chunk size;
- decoding that carries the state gives the ids of decoding that re-runs the whole prefix;
- the state's bytes do not grow with the context while a transformer's KV bytes do;
- `python -m decodelab generate --model <a Mamba folder>` runs as a user runs it; a KV-cache engine
  refuses the model in one line;
- the shipped `tiny-mamba` (data/tiny-mamba, TRAINING.md): transformers reads it and gives our logits,
  it is about `tiny`'s size, it has learned context (its held-out loss beats the training text's
  unigram frequencies, the best a model blind to context can do), and `python -m decodelab generate
  --model tiny-mamba` runs.
The kept bugs in fixtures/library/buggy_mamba.py each make one of these oracles fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from oracles import load_fixture, random_ids

from decodelab.decoding.generate import generate_with_cache, generate_without_cache, stream_token_ids
from decodelab.lessons.kv_size import kv_bytes, tensor_bytes_held
from decodelab.model.kv_cache import KVCache
from decodelab.model.mamba import (
    MambaConfig,
    MambaForCausalLM,
    MambaState,
    load_mamba,
    selective_scan,
    selective_step,
    state_bytes,
)
from decodelab.model.registry import load
from decodelab.params import SamplingParams
from decodelab.paths import PACKAGE_DATA

buggy = load_fixture("library/buggy_mamba")
SHIPPED = PACKAGE_DATA / "tiny-mamba"
HF_TOL = 1e-4  # float32, |logits| ~ 1..10: the two sum in different orders
STEP_TOL = 1e-5


def random_mamba(seed: int = 0, dtype=torch.float32, **fields) -> MambaForCausalLM:
    """A small Mamba with every weight perturbed (A_log too), so no piece is at its initial value."""
    config = MambaConfig(**{"vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, **fields})
    torch.manual_seed(seed)
    model = MambaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.to(dtype).eval()


@pytest.fixture
def mamba_folder(tmp_path):
    """A random Mamba saved with the course's tokenizer (vocab 1024): a model folder a user could pass."""
    from decodelab.model.mamba import save_mamba

    save_mamba(random_mamba(seed=6, vocab_size=1024, max_position_embeddings=256), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(PACKAGE_DATA / "tokenizer" / name, tmp_path / name)
    return tmp_path


def transformers_twin(model: MambaForCausalLM):
    """transformers' MambaForCausalLM with the same config and weights (its slow, pure-PyTorch path)."""
    from transformers import MambaConfig as HFConfig
    from transformers import MambaForCausalLM as HFMamba

    fields = model.config.to_dict()
    for name in ("architectures", "model_type", "max_position_embeddings", "intermediate_size"):
        fields.pop(name)
    twin = HFMamba(HFConfig(**fields))
    twin.load_state_dict(model.state_dict())
    return twin.to(model.dtype).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().nan_to_num(float("inf")))


def transformers_diff(model, ids) -> float:
    with torch.no_grad():
        return max_diff(model(ids), transformers_twin(model)(ids).logits)


def recurrent_diff(model, ids) -> float:
    """Largest |logit| difference, one token at a time through a MambaState vs the whole prompt,
    over the largest |logit| (float32 rounds each sum at ~1e-7 of its size, in a different order)."""
    with torch.no_grad():
        state = MambaState(model.config, ids.shape[0], dtype=model.dtype)
        steps = torch.cat([model(ids[:, t : t + 1], kv_cache=state) for t in range(ids.shape[1])], 1)
        whole = model(ids)
        return max_diff(steps, whole) / float(whole.abs().max())


ORACLES = {"transformers": transformers_diff, "recurrent": recurrent_diff}
ORACLE_TOL = {"transformers": HF_TOL, "recurrent": STEP_TOL}


# ------------------------------------------------------------------ transformers
@pytest.mark.parametrize("fields", [{}, {"conv_kernel": 2, "expand": 1, "time_step_rank": 3}])
def test_logits_equal_transformers_random(fields):
    model = random_mamba(**fields)
    assert transformers_diff(model, random_ids(23, 61, batch=2)) < HF_TOL


def test_logits_equal_transformers_from_a_folder(mamba_folder):
    model = load_mamba(mamba_folder)
    from transformers import MambaForCausalLM as HFMamba

    twin = HFMamba.from_pretrained(mamba_folder, dtype=torch.float32).eval()  # reads our config.json as is
    ids = random_ids(40, model.config.vocab_size, batch=2)
    with torch.no_grad():
        assert max_diff(model(ids), twin(ids).logits) < HF_TOL


def test_a_folder_written_here_loads_back(tmp_path):
    from decodelab.model.mamba import save_mamba

    model = random_mamba(seed=3)
    save_mamba(model, tmp_path)
    ids = random_ids(9, 61)
    with torch.no_grad():
        assert torch.equal(load_mamba(tmp_path)(ids), model(ids))


# --------------------------------------------------------------- the two scans
@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
def test_scan_equals_steps_float64(chunk_size):
    g = torch.Generator().manual_seed(0)
    b, T, E, N = 2, 37, 6, 5
    x, B, C = torch.randn(b, T, E, generator=g), torch.randn(b, T, N, generator=g), torch.randn(b, T, N, generator=g)
    dt = torch.rand(b, T, E, generator=g) * 2  # up to 2: decays down to e^-2A per step
    A = -torch.exp(torch.randn(E, N, generator=g))
    x, B, C, dt, A = (t.double() for t in (x, B, C, dt, A))
    start = torch.randn(b, E, N, generator=g).double()
    y, last = selective_scan(x, dt, A, B, C, start.clone(), chunk_size)
    state, ys = start, []
    for t in range(T):
        out, state = selective_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(out)
    assert max_diff(y, torch.stack(ys, 1)) < STEP_TOL
    assert max_diff(last, state) < STEP_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_recurrent_step_equals_parallel(dtype):
    model = random_mamba(dtype=dtype)
    assert recurrent_diff(model, random_ids(30, 61, batch=2)) < STEP_TOL


def test_prompt_then_steps_equals_whole_sequence():
    """Prefill part of the ids through the state (chunked), then step the rest: the full pass's logits."""
    model, ids = random_mamba(seed=1), random_ids(25, 61)
    with torch.no_grad():
        state = MambaState(model.config)
        parts = [model(ids[:, :11], kv_cache=state, chunk_size=4)]
        parts += [model(ids[:, t : t + 1], kv_cache=state) for t in range(11, 25)]
        whole = model(ids)
        assert max_diff(torch.cat(parts, 1), whole) / float(whole.abs().max()) < STEP_TOL
    assert state.length == 25


# ------------------------------------------------------------------ generation
def test_generate_with_state_equals_rerunning_the_prefix():
    model = random_mamba(seed=2, max_position_embeddings=64)
    prompt = random_ids(7, 61)[0].tolist()
    with_state = generate_with_cache(model, prompt, 20)
    assert with_state == generate_without_cache(model, prompt, 20)
    assert len(set(with_state)) > 1  # not a constant run that any model would give


def test_sampled_generation_is_reproducible_and_carries_the_state():
    model = random_mamba(seed=2, max_position_embeddings=64)
    prompt = random_ids(5, 61)[0].tolist()
    params = SamplingParams(temperature=1.0, max_tokens=15, seed=7, ignore_eos=True)
    first = list(stream_token_ids(model, prompt, params))
    assert first == list(stream_token_ids(model, prompt, params)) and len(first) == 15
    # the same sampler fed logits from re-running the whole prefix picks the same tokens
    from decodelab.decoding.generate import make_generator
    from decodelab.decoding.sampling import sample

    ids, generator = list(prompt), make_generator(7, model.device)
    with torch.no_grad():
        for _ in range(15):
            ids.append(int(sample(model(torch.tensor([ids]), last_only=True)[:, -1], params, generator)))
    assert ids[len(prompt) :] == first


# ------------------------------------------------------------------ memory
def test_state_bytes_are_constant_while_kv_bytes_grow():
    model = random_mamba(seed=4)
    tiny = json.loads((PACKAGE_DATA / "tiny" / "config.json").read_text())
    held = []
    for length in (1, 8, 40):
        state = MambaState(model.config)
        with torch.no_grad():
            model(random_ids(length, 61), kv_cache=state, chunk_size=16)
        held.append(tensor_bytes_held(state))
    E, N, K, L = 64, 8, 4, 2
    assert held == [state_bytes(model.config)] * 3 == [L * E * ((K - 1) * 4 + N * 4)] * 3
    per_token = 2 * tiny["num_hidden_layers"] * tiny["num_key_value_heads"] * tiny["head_dim"] * 4
    assert [kv_bytes(tiny, n, dtype="fp32") for n in (1, 8, 40)] == [per_token * n for n in (1, 8, 40)]


# ------------------------------------------------------------------ the registry, refusals
def test_registry_loads_a_mamba_folder(mamba_folder):
    model, tokenizer = load(mamba_folder, device="cpu")
    assert isinstance(model, MambaForCausalLM) and tokenizer.vocab_size == model.config.vocab_size == 1024
    prompt = tokenizer.encode("def fibonacci(n):")
    assert generate_with_cache(model, prompt, 10) == generate_without_cache(model, prompt, 10)


def test_logits_equal_transformers_shipped():
    from transformers import MambaForCausalLM as HFMamba

    model, tokenizer = load("tiny-mamba", device="cpu")
    twin = HFMamba.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")])
    with torch.no_grad():
        assert max_diff(model(ids), twin(ids).logits) < HF_TOL


def unigram_nats(train: list[int], heldout: list[int], vocab_size: int) -> float:
    """Mean -log p(token) on `heldout` under the training text's add-one token frequencies."""
    counts = torch.bincount(torch.tensor(train), minlength=vocab_size).double() + 1
    return -(counts / counts.sum()).log()[torch.tensor(heldout)].mean().item()


def test_shipped_tiny_mamba_is_tinys_size_and_has_learned_context():
    model, tokenizer = load("tiny-mamba", device="cpu")
    tiny, _ = load("tiny", device="cpu")
    assert 0.8 < model.num_parameters() / tiny.num_parameters() < 1.2
    corpus = PACKAGE_DATA / "corpus"
    train = tokenizer.encode((corpus / "train.txt").read_text(encoding="utf-8")[:400_000])
    heldout = tokenizer.encode((corpus / "heldout.txt").read_text(encoding="utf-8"))[:1025]
    ids = torch.tensor([heldout])
    with torch.no_grad():
        logits = model(ids[:, :-1])
    nats = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    # 1,024 tokens (about 0.1 nats of standard error, their losses being correlated): the margin is ten times that
    assert nats < unigram_nats(train, heldout[1:], tokenizer.vocab_size) - 1.0, nats


def test_a_kv_cache_is_refused_in_one_line():
    model = random_mamba()
    with pytest.raises(TypeError, match="fixed-size MambaState, not a KVCache"):
        model(random_ids(3, 61), kv_cache=KVCache.__new__(KVCache))


def test_llm_refuses_a_state_space_model_in_one_line(mamba_folder):
    from decodelab import LLM

    with pytest.raises(ValueError) as caught:
        LLM(str(mamba_folder), device="cpu")
    assert "paged engine LLM needs a model with a KV cache" in str(caught.value) and "\n" not in str(caught.value)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "decodelab", "generate", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_generates_with_a_mamba_folder(mamba_folder):
    folder = str(mamba_folder)
    greedy = run_cli("def add(a, b):", "--model", folder, "--max-new-tokens", "12", "--json", "--no-chat")
    assert greedy.returncode == 0, greedy.stderr
    out = json.loads(greedy.stdout)
    model, _ = load(folder, device="cpu")
    assert out["output_ids"] == generate_with_cache(model, out["prompt_ids"], len(out["output_ids"]))
    sampled = run_cli("import os", "--model", folder, "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "1")
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr
    refused = run_cli("x", "--model", folder, "--int8")
    assert refused.returncode != 0 and "fixed-size state" in refused.stderr


def test_cli_generates_with_tiny_mamba():
    """The issue's recipe as a user types it."""
    result = run_cli("def add(a, b):", "--model", "tiny-mamba", "--max-new-tokens", "12", "--json", "--no-chat")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    model, _ = load("tiny-mamba", device="cpu")
    assert out["output_ids"] == generate_with_cache(model, out["prompt_ids"], len(out["output_ids"]))


# ------------------------------------------------------------------ kept bugs
@pytest.mark.parametrize("name", sorted(buggy.BUGS))
def test_kept_bug_is_caught(name):
    cls, oracle, _ = buggy.BUGS[name]
    model, ids = random_mamba(seed=5), random_ids(20, 61, batch=2)
    assert ORACLES[oracle](model, ids) < ORACLE_TOL[oracle]  # the reference passes the same oracle
    buggy.install(model, cls)
    assert ORACLES[oracle](model, ids) > 100 * ORACLE_TOL[oracle], f"{name} not caught by the {oracle} oracle"

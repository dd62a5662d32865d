"""Shared fixtures: SmolLM2 as we load it, and the independent oracle — `transformers`
reading the original GGUF file itself (never our converted folder).

Everything heavy is session-scoped: the transformers GGUF load alone takes ~30 s on two cores.
"""
from __future__ import annotations

import os

# Before torch is imported (see decodelab/__init__.py): spinning OpenMP threads make every
# step 5-10x slower when other processes share the two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels (tests/test_gpu_kernel_checks.py) run under Triton's interpreter where no CUDA
# device is; Triton's own library kernels take the mode it had when triton was first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from oracles import memoized_gguf_reading, quiet_transformers  # noqa: E402

# Two cores are shared with other jobs on the course machines; more threads only thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_folder():
    from decodelab.model.registry import prepare_smollm2

    return prepare_smollm2(progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_folder):
    """(our model, our tokenizer) for SmolLM2-135M-Instruct, fp32 on the CPU."""
    from decodelab.model.registry import load

    return load("smollm2", device="cpu")


@pytest.fixture(scope="session")
def smollm2_gguf():
    from decodelab.model.registry import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_gguf):
    """transformers' own reading of the GGUF (its dequantizer, its q/k un-permutation)."""
    pytest.importorskip("transformers")
    with quiet_transformers() as transformers, memoized_gguf_reading():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf):
    pytest.importorskip("transformers")
    with quiet_transformers() as transformers, memoized_gguf_reading():
        return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def tiny_pair():
    """(the tiny target, an untrained feature drafter attached to it, the tokenizer), on the CPU."""
    from decodelab.decoding.eagle import FeatureDrafter
    from decodelab.model.registry import load

    target, tokenizer = load("tiny", device="cpu")
    torch.manual_seed(0)
    drafter = FeatureDrafter(target.config).attach(target).eval()
    return target, drafter, tokenizer


# --------------------------------------------------------------------------- time per test file
_SECONDS_PER_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sum setup + call + teardown seconds per test file (the issues give CI budgets per part)."""
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_PER_FILE:
        return
    terminalreporter.section("seconds per test file (slowest 12)")
    for path, seconds in sorted(_SECONDS_PER_FILE.items(), key=lambda item: -item[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")

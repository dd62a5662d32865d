"""Shared fixtures: SmolLM2 as we load it, and the independent oracle — `transformers`
reading the original GGUF file itself (never our converted folder).

Everything heavy is session-scoped: the transformers GGUF load alone takes ~30 s on two cores.
"""

from __future__ import annotations

import contextlib
import os

# Before torch is imported (see decodelab/__init__.py): spinning OpenMP threads make every
# step 5-10x slower when other processes share the two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.compile costs tens of seconds on two cores: paths that compile where it pays (LLM's int8
# decode, `generate --int8`) run eagerly in the tests, unless a test asks by name (compile_decode=True).
os.environ.setdefault("DECODELAB_COMPILE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels (tests/test_gpu_kernel_checks.py) run under Triton's interpreter where no CUDA
# device is; Triton's own library kernels take the mode it had when triton was first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tiers  # noqa: E402
from oracles import memoized_gguf_reading, quiet_transformers  # noqa: E402

# Two cores are shared with other jobs on the course machines; more threads only thrash.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    for name, description in tiers.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the tiers are what `-m fast` selects on
def pytest_collection_modifyitems(config, items):
    table = tiers.assign(items)
    tiers.heaviest_files_first(items, table)
    config.stash[TIER_TABLE] = table
    for item in items:  # travels with each report, to pytest-xdist's controller too
        item.user_properties.append(("tiers", "+".join(table[item.nodeid]["tiers"])))
    if os.environ.get("DECODELAB_TIERS_OUT"):  # tests/test_tiers.py, on a collection of its own
        import json

        with open(os.environ["DECODELAB_TIERS_OUT"], "w") as out:
            json.dump({"whole": whole_collection(config), "table": table}, out)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


TIER_TABLE = pytest.StashKey[dict]()


def whole_collection(config) -> bool:
    """Whether this run collected every test (so tests/test_tiers.py can check the maps in-process)."""
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    roots = {tests, tests.parent}
    here = config.invocation_params.dir
    return all((here / arg.split("::", 1)[0]).resolve() in roots for arg in config.args) and not any(
        config.getoption(name, None) for name in ("ignore", "ignore_glob", "deselect", "lf")
    )


def _fast(item) -> bool:
    return item.get_closest_marker("fast") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with tiers.guard(item.nodeid) if _fast(item) else contextlib.nullcontext():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with tiers.guard(item.nodeid) if _fast(item) else contextlib.nullcontext():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with tiers.guard(item.nodeid) if _fast(item) else contextlib.nullcontext():
        return (yield)


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
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
        )
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
_SECONDS_PER_TIER: dict[str, tuple[float, set]] = {}


def pytest_runtest_logreport(report):
    """Sum setup + call + teardown seconds per test file (the issues give CI budgets per part)."""
    path = report.nodeid.split("::", 1)[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration
    # Under pytest-xdist this runs in the controller, which collected nothing: the tiers come with the report.
    tier = dict(report.user_properties).get("tiers")
    if tier is not None:
        seconds, nodes = _SECONDS_PER_TIER.get(tier, (0.0, set()))
        _SECONDS_PER_TIER[tier] = (seconds + report.duration, nodes | {report.nodeid})


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS_PER_FILE:
        return
    terminalreporter.section("seconds per test file (slowest 12)")
    for path, seconds in sorted(_SECONDS_PER_FILE.items(), key=lambda item: -item[1])[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    terminalreporter.section("seconds per tier (tests/tiers.py)")
    for tier, (seconds, nodes) in sorted(_SECONDS_PER_TIER.items(), key=lambda item: -item[1][0]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {tier} ({len(nodes)} tests)")

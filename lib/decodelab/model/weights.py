"""Model folders in Hugging Face layout: config.json + model.safetensors (or shards).

`load_model` reads any such folder of a Llama-family checkpoint (ours, or a real one on
local disk) and checks every tensor's name and shape against the config before use;
`save_model` writes a folder that `transformers` loads unchanged.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from decodelab.config import ConfigError, ModelConfig
from decodelab.model.llama import LlamaForCausalLM
from decodelab.model.rope import rope_tables

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class WeightsError(ValueError):
    """Tensors in a model folder that do not fit its config."""


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's .safetensors files: the shards its index names, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [folder / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(
                f'{index} is not a safetensors index (JSON with a "weight_map" of tensor '
                f"name -> file name): {type(exc).__name__}: {exc}"
            ) from None
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    raise WeightsError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def read_state_dict(folder: str | Path, names=None) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, or only those in `names`, on
    the CPU, as stored."""
    tensors = {}
    for file in safetensors_files(Path(folder)):
        if not file.exists():
            raise WeightsError(f"shard {file.name} named in the index is missing from {folder}")
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if names is None or name in names:
                        tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as exc:  # a corrupt or truncated file, unreadable bytes
            raise WeightsError(
                f"{file} is not a readable safetensors file ({exc}): it is corrupt or "
                "truncated; write it again (a converted model: delete its folder to convert "
                "it again)"
            ) from None
    return tensors


def check_state_dict(state: dict[str, torch.Tensor], expected: dict[str, torch.Size], folder) -> None:
    missing = [n for n in expected if n not in state]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise WeightsError(f"{folder}: missing tensor(s) {shown}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise WeightsError(
                f"{folder}: tensor {name} has shape {tuple(state[name].shape)}, config expects {tuple(shape)}"
            )


@contextmanager
def _without_random_init():
    """Build the module tree with uninitialised weights: the checkpoint's replace them right away.
    (Not the meta device: there, nn.init.normal_ and torch.arange run through torch._refs, whose
    first use imports torch._dynamo, about 4 s in every fresh process.)"""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def load_model(
    folder: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = "float32"
) -> LlamaForCausalLM:
    """Build the model that folder/config.json describes and load its weights.

    Raises ConfigError / WeightsError naming the problem for a malformed config or
    missing / mis-shaped tensors.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    config = ModelConfig.from_file(folder / "config.json")
    dtype = resolve_dtype(dtype)
    with _without_random_init():
        model = LlamaForCausalLM(config)  # on the CPU, uninitialised: torch.empty costs nothing until written
    expected = {name: p.shape for name, p in model.named_parameters(remove_duplicate=True)}
    state = read_state_dict(folder)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_state_dict(state, expected, folder)
    state = {name: state[name].to(device=device, dtype=dtype) for name in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    cos, sin = rope_tables(config, device)
    model.rope_cos, model.rope_sin = cos, sin
    return model.eval().requires_grad_(False)


def save_model(model: LlamaForCausalLM, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json and model.safetensors (tied weights stored once, as HF does)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        state[name] = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict()
    raw["torch_dtype"] = str(dtype or model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


__all__ = ["load_model", "save_model", "read_state_dict", "WeightsError", "ConfigError", "resolve_dtype"]

"""The decode step compiled ahead of time: a `.pt2` package built once, loaded in milliseconds.

`CompiledDecoder` compiles its step in every new process: Dynamo traces the model again even when
inductor's on-disk cache holds the code (about ten seconds for SmolLM2 on a small CPU), so a short
run pays more than it gains. Here the same one-token step (`decode_step`: token ids [1, 1], its
position [1] as a tensor, the slot caches keys and values [L, 1, H_kv, S, D], S dynamic) goes
through `torch.export` and AOTInductor once, into a shared library zipped in a `.pt2` file under
the user cache; a new process only opens it.

The weights stay out of the package. It holds the code, and at load the model's own tensors
are handed to it by name (`load_constants(..., user_managed=True)`: pointers, no copy). So the
package is small (a few megabytes, not SmolLM2's 250 MB again), one package serves every model
of the same architecture, and its tokens are the model's by construction: it reads the very
weights the eager model reads. The file name is a digest of what changes the code: the
architecture (config and every weight's name, shape and dtype, which says float or int8), the
batch size (1), torch's version and the CPU's instruction set (`package_key`). The digest is
also stored inside the package and checked at load.

    path = build_package(model)          # minutes on a 2-core CPU; `python -m decodelab prepare`
    decoder = PackagedDecoder(model)     # ~10 ms; raises if no package fits this model
    decoder = decoder_for(model)         # the package if prepared, else torch.compile (one line on stderr)
    ids = list(stream_token_ids(decoder, prompt_ids, params))   # the same ids as with `model`

The loader is torch's C++ `AOTIModelPackageLoader`, the one `torch._inductor.aoti_load_package`
wraps: the wrapper imports `torch._inductor` first (2-4 s on a 2-core CPU), which is the wait
this module exists to remove.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from decodelab.decoding.compiled import CompiledDecoder, decode_step, next_position
from decodelab.model.kv_cache import KVCache
from decodelab.paths import cache_dir

FORMAT = 1  # bump when decode_step's code changes: old packages no longer match
BATCH_SIZE = 1
KEY_FIELD = "decodelab_key"  # the package's metadata entry holding its key


class DecodeStep(nn.Module):
    """`decode_step` as a module, the form `torch.export` takes; its state is the model's, under
    the prefix "model.". forward(input_ids [1, 1], position [1] int64, keys, values [L, 1, H_kv,
    S, D]) -> logits [1, 1, V] float32, with the token's K and V written into slot `position`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position, keys, values):
        return decode_step(self.model, input_ids, position, keys, values)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by its name in `DecodeStep` ("model." + name), tied
    ones under each of their names: the constants a package asks for."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {f"model.{name}": tensor for name, tensor in named}


def package_key(model: nn.Module) -> str:
    """A digest of everything that changes the step's code: the config, every weight's name, shape
    and dtype (float or int8 weights, the model's dtype), the batch size, the format, torch's version
    and the CPU's instruction set. Not the weights' values: the package does not hold them."""
    config = dataclasses.asdict(model.config) if dataclasses.is_dataclass(model.config) else vars(model.config)
    tensors = {name: [list(t.shape), str(t.dtype)] for name, t in sorted(model_tensors(model).items())}
    signature = {
        "format": FORMAT,
        "model": type(model).__qualname__,
        "config": config,
        "tensors": tensors,
        "batch_size": BATCH_SIZE,
        "device": str(model.device),
        "torch": torch.__version__,
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
    }
    return hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()[:20]


def package_path(model: nn.Module) -> Path:
    """Where the package for `model` lives: <cache>/aoti/decode-<key>.pt2 (decodelab.paths)."""
    return cache_dir() / "aoti" / f"decode-{package_key(model)}.pt2"


def check_exportable(model: nn.Module) -> None:
    """ValueError unless `model` is a decoder this step can export: the library's Llama family on a
    CPU (AOTInductor's CPU backend; a CUDA package would need its own key and build)."""
    if getattr(model, "config", None) is None or not hasattr(model, "layers_output"):
        raise ValueError(f"the packaged decode step takes decodelab's Llama-family models, got {type(model).__name__}")
    if torch.device(model.device).type != "cpu":
        raise ValueError(f"the packaged decode step is built for a CPU, and the model is on {model.device}")


def export_step(model: nn.Module, max_seq_len: int = 64) -> torch.export.ExportedProgram:
    """`torch.export` of `DecodeStep(model)` with the slot count S dynamic (2..the model's context);
    `max_seq_len` only sizes the example cache."""
    check_exportable(model)
    cache = KVCache(model.config, batch_size=BATCH_SIZE, max_seq_len=max_seq_len, dtype=model.dtype)
    example = (torch.tensor([[0]]), torch.tensor([1]), cache.keys, cache.values)
    slots = torch.export.Dim("slots", min=2, max=model.config.max_position_embeddings)
    with torch.no_grad():
        return torch.export.export(
            DecodeStep(model), example, dynamic_shapes=({}, {}, {3: slots}, {3: slots}), strict=False
        )


def build_package(model: nn.Module, path: str | os.PathLike | None = None) -> Path:
    """Export and AOT-compile the decode step of `model` into `path` (default `package_path(model)`),
    without its weights; returns the path. Written under a temporary name and renamed, so a reader
    never sees half a file. Minutes on a small CPU (the C++ compiler does most of it)."""
    from torch._inductor import aoti_compile_and_package

    target = Path(path) if path is not None else package_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    program = export_step(model)
    partial = target.with_name(f"{target.stem}.{os.getpid()}.partial.pt2")
    try:
        aoti_compile_and_package(
            program,
            package_path=str(partial),
            inductor_configs={
                "aot_inductor.package_constants_in_so": False,  # the weights come from the model at load
                "aot_inductor.metadata": {KEY_FIELD: package_key(model)},
            },
        )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


class PackagedDecoder:
    """A model whose one-token steps run the AOT-compiled package; call it like the model.

    `decoder(input_ids, kv_cache=cache, last_only=True)` with one new token and a `KVCache` runs
    the package (input_ids [1, 1] -> logits [1, 1, V]); anything else (prefill, no cache) runs the
    model eagerly. The package reads the model's tensors in place, so the model must stay as it is
    (no new parameter objects; `quantize_for_decode` first, then the decoder).
    Raises FileNotFoundError when no package exists at `path`, ValueError when the one there was
    built for another architecture, torch version or CPU.
    """

    compiles = 0  # nothing compiles in this process (CompiledDecoder counts its graphs here)

    def __init__(self, model: nn.Module, path: str | os.PathLike | None = None):
        check_exportable(model)
        self.model, self.config = model, model.config
        self.path = Path(path) if path is not None else package_path(model)
        if not self.path.is_file():
            raise FileNotFoundError(f"no decode package at {self.path} (python -m decodelab prepare builds SmolLM2's)")
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(self.path), "model", False, 1, -1)
        built_for, wanted = self._loader.get_metadata().get(KEY_FIELD), package_key(model)
        if built_for != wanted:
            raise ValueError(f"the decode package {self.path} was built for another model ({built_for}, not {wanted})")
        tensors = model_tensors(model)
        missing = [name for name in self._loader.get_constant_fqns() if name not in tensors]
        if missing:
            raise ValueError(f"the decode package {self.path} asks for tensors the model lacks: {missing[:3]}")
        constants = {name: tensors[name] for name in self._loader.get_constant_fqns()}
        # (constants, use_inactive, check_full_update, user_managed, allow_h2d_copy): pointers, no copy
        self._loader.load_constants(constants, False, True, True, False)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, kv_cache=None, last_only: bool = False
    ) -> torch.Tensor:
        """input_ids [1, 1] with a KVCache -> logits [1, 1, V] from the package; else the model's own
        forward (same arguments, same result)."""
        if kv_cache is None or positions is not None or input_ids.shape != (1, 1):
            return self.model(input_ids, positions=positions, kv_cache=kv_cache, last_only=last_only)
        position = next_position(kv_cache, self.config)
        if kv_cache.keys.dtype != self.model.dtype:
            raise TypeError(f"the package's cache holds {self.model.dtype}, got {kv_cache.keys.dtype}")
        inputs = [input_ids, torch.tensor([position], device=input_ids.device), kv_cache.keys, kv_cache.values]
        [logits] = self._loader.boxed_run(inputs)
        kv_cache.lengths = [position + 1] * len(kv_cache.lengths)
        return logits


def tell(line: str) -> None:
    print(f"decodelab: {line}", file=sys.stderr, flush=True)


def decoder_for(model: nn.Module, compile: bool = True):
    """The fastest decode step for `model` this process can have without a wait: the prepared package
    (`PackagedDecoder`) when one fits; else, with one line on stderr saying why, `CompiledDecoder`
    (compile=True: its first token waits for the compile) or the model itself (compile=False)."""
    try:
        return PackagedDecoder(model)
    except FileNotFoundError:
        why = "no decode package is prepared for this model (python -m decodelab prepare builds SmolLM2's)"
    except (ValueError, RuntimeError) as error:
        why = f"the decode package cannot be used ({' '.join(str(error).split())[:200]})"
    if compile:
        tell(f"{why}: compiling the decode step instead (the first token waits for it)")
        return CompiledDecoder(model)
    tell(f"{why}: decoding eagerly")
    return model

"""`EngineArgs`: every setting of the serving engine in one object, after vLLM's `EngineArgs`.

    from decodelab.engine.args import EngineArgs
    args = EngineArgs(model="tiny", kv_block_size=8, speculative_model="tiny-draft")
    llm = LLM.from_args(args)        # the same engine as LLM(model="tiny", kv_block_size=8, ...)
    llm.args                         # the settings an engine was built from (LLM(...) makes one too)
    dataclasses.replace(args, max_num_seqs=8)   # a variant, checked again

The fields are `LLM`'s keyword arguments, with the same names and defaults. Creating one checks
the values that need no model (counts and sizes in range, switches True or False, `quantization`,
`num_speculative_tokens`): a ValueError naming the value and its range. The checks that need the
model (does `kv_cache_memory` hold one KV block? is `max_model_len` within the context? is the
device there?) run when the engine is built.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from decodelab.validation import check_int

if TYPE_CHECKING:  # name the hooks' type only: a dataclass field needs no import at run time
    from decodelab.engine.hooks import EngineHooks

DEFAULT_KV_CACHE_BYTES = 1 << 30
COMPILE_MIN_LAYER_BYTES = 64 << 20  # compile_decode=None: float bytes of the decoder layers from which it pays
QUANTIZATIONS = (None, "int8", "int4", "q4")


@dataclass(frozen=True, repr=False)
class EngineArgs:
    """The settings of one `LLM` (frozen: an engine's `args` keep saying how it was built).

    model: a registry name ("smollm2", "tiny"), a model folder, or a (model, tokenizer) pair
        that the engine uses as given (quantization, if asked, changes that model in place).
    device, dtype: where and in what precision a named or folder model is loaded (device None:
        cuda if present, else mps or cpu); ignored for a (model, tokenizer) pair.
    quantization: None, or "int8" / "int4" weight-only quantization of the linear layers, or "q4":
        the Q4_1 blocks of the GGUF the model comes from, multiplied by a fused CPU kernel
        (`decodelab.model.q4_linear`; "smollm2" only, the one model that comes from a Q4_1 GGUF).
    kv_block_size: tokens per paged KV block.
    max_num_seqs, max_num_batched_tokens: the scheduler's limits per step (sequences running,
        tokens in one packed forward pass).
    num_kv_blocks: KV blocks to allocate; None: as many as `kv_cache_memory` bytes hold, but no
        more than max_num_seqs full contexts.
    kv_cache_memory: bytes for the KV cache when num_kv_blocks is None.
    enable_prefix_caching: share the KV blocks of identical prompt prefixes.
    speculative_model: None, or a draft model for speculative decoding: a registry name, a
        folder, a (model, tokenizer) pair or a model sharing the target's vocabulary; or a
        feature drafter: a name ("smollm2-eagle") or a `FeatureDrafter` attached to the target.
    num_speculative_tokens: tokens the draft model proposes per step (>= 1 when speculating).
    max_model_len: the longest sequence (prompt + output); None: the model's context.
    mix_decode_with_prefill: running sequences decode in the passes that prefill new ones
        (off while speculating: its decode steps stay apart).
    chunked_prefill: prefill long prompts in slices: each step feeds at most
        max_num_batched_tokens tokens, every running sequence's decode first, then slices of
        prompts (Sarathi-Serve; vLLM's enable_chunked_prefill). Needs mix_decode_with_prefill,
        no speculative_model, and max_num_batched_tokens >= max_num_seqs (room for every decode).
    prepack_weights: None packs the linear layers where it helps (CPU, bfloat16), True always,
        False never (`decodelab.model.packed_linear`).
    compile_decode: run the one-row products of int8 weights compiled (`RowCompiledInt8Linear`,
        `decodelab.model.fused_int8`): a batch-1 decode step then reads the int8 bytes themselves.
        None compiles where it pays: quantization="int8" with the library's layers, on a CPU, for a
        model whose decoder layers hold at least COMPILE_MIN_LAYER_BYTES of float weights (SmolLM2,
        not `tiny`, whose few megabytes stay in cache: a compile there costs more than it saves),
        unless DECODELAB_COMPILE=0 (compiling the float model gained nothing through the engine; with
        SmolLM2 int8, compiled runs 2.25x eager int8 end to end, about float32's speed: its lm_head stays
        float, bench/results/decode_speed_smollm2_cpu_end_to_end.json); True
        insists (it needs quantization="int8" and no `linear` or `forward` hook); False never. The
        first decode step compiles (tens of seconds on a small CPU; inductor caches it on disk).
    hooks: an `EngineHooks` swapping a learner's function in for one stage; None: the library's.
        Its `linear` factory builds the quantized layers, so it needs `quantization` set.
    """

    model: Any = "smollm2"
    device: Any = None
    dtype: Any = "float32"
    quantization: str | None = None
    kv_block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    num_kv_blocks: int | None = None
    kv_cache_memory: int = DEFAULT_KV_CACHE_BYTES
    enable_prefix_caching: bool = True
    speculative_model: Any = None
    num_speculative_tokens: int = 4
    max_model_len: int | None = None
    mix_decode_with_prefill: bool = True
    chunked_prefill: bool = False
    prepack_weights: bool | None = None
    compile_decode: bool | None = None
    hooks: EngineHooks | None = None

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None, 'int8', 'int4' or 'q4', got {self.quantization!r}")
        if self.quantization == "q4":
            self._check_q4()
        if getattr(self.hooks, "linear", None) is not None and self.quantization is None:
            raise ValueError(
                "EngineHooks(linear=...) builds the quantized linear layers, so it needs "
                "quantization='int8' (or 'int4') as well"
            )
        self._check_sizes()
        for name in ("enable_prefix_caching", "mix_decode_with_prefill", "chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.prepack_weights is not None and not isinstance(self.prepack_weights, bool):
            raise ValueError(f"prepack_weights must be None, True or False, got {self.prepack_weights!r}")
        if self.chunked_prefill:
            self._check_chunked_prefill()
        if self.compile_decode is not None and not isinstance(self.compile_decode, bool):
            raise ValueError(f"compile_decode must be None, True or False, got {self.compile_decode!r}")
        if self.compile_decode and (self.quantization != "int8" or getattr(self.hooks, "linear", None) is not None):
            raise ValueError(
                "compile_decode=True compiles the library's int8 products, so it needs "
                "quantization='int8' and no EngineHooks(linear=...)"
            )
        if getattr(self.hooks, "forward", None) is not None:
            if self.quantization is not None:
                raise ValueError(
                    f"EngineHooks(forward=...) reads the float weights by name, and quantization="
                    f"{self.quantization!r} replaces them: use one or the other"
                )
            if self.prepack_weights:
                raise ValueError(
                    "EngineHooks(forward=...) reads the weights by name, and prepack_weights=True "
                    "repacks them: leave prepack_weights at None or False"
                )
        # Only a speculating engine uses k, so only then is a bad one an error (as before EngineArgs).
        if self.speculative_model is not None:
            check_int("num_speculative_tokens", self.num_speculative_tokens, 1, allowed=">= 1")

    def _check_sizes(self) -> None:
        """Every count and size is an integer in range (kv_block_size 0 would divide by zero)."""
        check_int("kv_block_size", self.kv_block_size, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 1, allowed="an integer >= 1, or None (from kv_cache_memory)")
        check_int("kv_cache_memory", self.kv_cache_memory, 1, allowed="a number of bytes >= 1 (an integer)")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1, allowed="an integer >= 1, or None (the model's context)")

    def _check_q4(self) -> None:
        """quantization="q4" reads the Q4_1 blocks of the GGUF the model was converted from."""
        if self.model != "smollm2":
            shown = self.model if isinstance(self.model, (str, os.PathLike)) else type(self.model).__name__
            raise ValueError(
                f"quantization='q4' reads the Q4_1 blocks of the GGUF a model comes from, and only "
                f"model='smollm2' comes from one; got model {shown!r} (use 'int8' or 'int4')"
            )
        if getattr(self.hooks, "linear", None) is not None:
            raise ValueError("quantization='q4' takes its layers from the GGUF: it needs no EngineHooks(linear=...)")

    def _check_chunked_prefill(self) -> None:
        if self.speculative_model is not None:
            raise ValueError(
                "chunked_prefill=True does not run with a speculative_model: speculative decode "
                "steps stay apart from prefills; set one of them only"
            )
        if not self.mix_decode_with_prefill:
            raise ValueError(
                "chunked_prefill=True mixes decodes and prompt slices in every step, so it needs "
                "mix_decode_with_prefill=True"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"with chunked_prefill=True every step decodes each running sequence within the "
                f"token budget, so max_num_batched_tokens must be >= max_num_seqs "
                f"({self.max_num_seqs}), got {self.max_num_batched_tokens}"
            )

    def compiles_decode(self, model) -> bool:
        """Will the engine compile the int8 one-row products of `model` (float, before quantization)?
        compile_decode resolved: None -> int8 weights of the library's own layers, on a CPU, decoder
        layers of at least COMPILE_MIN_LAYER_BYTES, and DECODELAB_COMPILE not 0."""
        if self.compile_decode is not None:
            return self.compile_decode
        from decodelab.model.fused_int8 import compile_by_default

        plain = getattr(self.hooks, "linear", None) is None and getattr(self.hooks, "forward", None) is None
        if not (self.quantization == "int8" and plain and torch.device(model.device).type == "cpu"):
            return False
        layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
        return layer_bytes >= COMPILE_MIN_LAYER_BYTES and compile_by_default()

    @property
    def loads_model(self) -> bool:
        """True when `model` names a model to load; False for a (model, tokenizer) pair."""
        return isinstance(self.model, (str, os.PathLike))

    def as_keywords(self) -> dict[str, Any]:
        """The fields as `LLM`'s keyword arguments (shallow: the model itself is not copied)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={_short_repr(value)}" for name, value in self.as_keywords().items())
        return f"EngineArgs({fields})"


def _short_repr(value: Any) -> str:
    """repr, except that a model is named by its type: its own repr lists every layer."""
    if isinstance(value, nn.Module):
        return f"<{type(value).__name__}>"
    if isinstance(value, tuple):  # a (model, tokenizer) pair
        return "(" + ", ".join(_short_repr(item) for item in value) + ")"
    return repr(value)

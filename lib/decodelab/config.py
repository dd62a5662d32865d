"""Model configuration: the Llama family (Llama 2/3, SmolLM, Qwen2) in Hugging Face's field names.

A `ModelConfig` is read from a model folder's ``config.json`` and written back in the same
layout, so a folder we produce loads in `transformers` unchanged and a real checkpoint on
disk loads here with the same code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from decodelab.validation import check_int

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can run."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Per-layer sliding window (gpt-oss alternates full and windowed layers); None = full attention.
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_int(
                f"config field {name}", getattr(self, name), minimum=1, allowed="a positive integer", error=ConfigError
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )

    # ------------------------------------------------------------- derived
    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @property
    def has_qkv_bias(self) -> bool:
        # Qwen2 always has q/k/v biases; Llama only when attention_bias is set.
        return self.attention_bias or self.model_type == "qwen2"

    # ---------------------------------------------------------------- I/O
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [
            n
            for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if n not in raw
        ]
        if missing:
            raise ConfigError(f"config is missing required field(s): {', '.join(missing)}")
        raw = dict(raw)
        rope = raw.pop("rope_parameters", None)
        if rope is not None:
            # transformers >= 5 writes rope_theta and the scaling together as rope_parameters
            # (and no rope_theta / rope_scaling); read it back into the older fields.
            if not isinstance(rope, dict) or isinstance(rope.get("rope_theta", 0), dict):
                raise ConfigError(f"rope_parameters must be one JSON object, got {rope!r}")
            rope = dict(rope)
            if "rope_theta" in rope:
                raw.setdefault("rope_theta", rope.pop("rope_theta"))
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raw.setdefault("rope_scaling", rope)
        kwargs = {k: v for k, v in raw.items() if k in known}
        if kwargs.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
            kwargs["sliding_window"] = None  # Qwen2 stores a window it does not use
        if kwargs.get("model_type") == "mistral" and kwargs.get("sliding_window") is not None:
            raise ConfigError("mistral checkpoints with a sliding window are not supported")
        extra = {k: v for k, v in raw.items() if k not in known}
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as exc:  # wrong value types reach the dataclass
            raise ConfigError(f"invalid config: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                out[f.name] = getattr(self, f.name)
        architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[
            self.model_type
        ]
        out.setdefault("architectures", [architecture])
        out.setdefault("hidden_act", "silu")
        out.setdefault("torch_dtype", "float32")
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

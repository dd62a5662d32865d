"""How big a KV cache gets, and how many parameters a config holds — from the config alone.

Every layer stores one key and one value vector per KV head for every position it keeps:

    bytes = 2 (K and V) x batch x sum over layers(positions kept) x kv_heads x head_dim x bytes/value

A full-attention layer keeps all seq_len positions; a sliding-window layer (gpt-oss
alternates them with full ones) never needs more than `window` positions. Grouped-query
attention (num_key_value_heads < num_attention_heads) divides the whole thing by the
group size. Figures below use binary units (KiB = 1024 bytes) unless written in GB.

A config is a `ModelConfig`, a dict in Hugging Face config.json field names, or the name
of one of the `PRESETS`, whose values are typed in from the real config.json files.
"""

from __future__ import annotations

import math

import torch

from decodelab.config import ModelConfig
from decodelab.lessons.measure import kv_bytes_per_token
from decodelab.validation import check_int

# The config.json fields we rely on, per model; source repository in the comment above each.
PRESETS: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B, config.json (no head_dim field: 4096 / 32 heads = 128)
    "Llama-3.1-8B": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # Qwen/Qwen3-8B, config.json (use_sliding_window: false; per-head q_norm / k_norm weights)
    "Qwen3-8B": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    # openai/gpt-oss-20b, config.json: layer_types alternate sliding (even layers) and full (odd),
    # sliding_window 128. A mixture-of-experts model: parameter_count does not cover it.
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    # GPT-3 175B has no published config.json: Brown et al. 2020, "Language Models are
    # Few-Shot Learners", Table 2.1 (n_layers 96, d_model 12288, n_heads 96, d_head 128,
    # context 2048), in HF field names. Multi-head attention: one KV head per query head.
    "GPT-3-175B": dict(
        model_type="gpt3",
        num_hidden_layers=96,
        hidden_size=12288,
        num_attention_heads=96,
        num_key_value_heads=96,
        head_dim=128,
        max_position_embeddings=2048,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct, config.json (= the folder `decodelab.model.registry.load("smollm2")` reads)
    "SmolLM2-135M": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # our tiny model: decodelab.training.train_tiny.MODELS["target"] with the 1024-token BPE (data/tiny/config.json)
    "tiny": dict(
        model_type="llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
}
ALIASES = {"smollm2": "SmolLM2-135M", "gpt-3": "GPT-3-175B", "gpt3": "GPT-3-175B"}

BYTES_PER_VALUE = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}


def config_fields(config) -> dict:
    """The config.json fields of a preset name, a `ModelConfig` or a dict, with head_dim and
    num_key_value_heads filled in as `transformers` derives them."""
    if isinstance(config, str):
        name = ALIASES.get(config.lower(), config)
        matches = [key for key in PRESETS if key.lower() == name.lower()]
        if not matches:
            raise ValueError(f"unknown preset {config!r}; presets: {', '.join(PRESETS)}")
        fields = dict(PRESETS[matches[0]])
    elif isinstance(config, ModelConfig):
        fields = config.to_dict()
    elif isinstance(config, dict):
        fields = dict(config)
    else:
        raise ValueError(
            f"config must be a preset name, a ModelConfig or a config.json dict, got {type(config).__name__}"
        )
    for name in ("num_hidden_layers", "num_attention_heads"):
        if name not in fields:
            raise ValueError(f"config has no {name}")
    fields.setdefault("num_key_value_heads", None)
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return fields


def bytes_per_value(dtype) -> float:
    """Bytes of one stored number: a name ('fp16', 'bf16', 'fp8', 'int4', ...), a torch.dtype or a number."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, (int, float)) and not isinstance(dtype, bool) and dtype > 0:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in BYTES_PER_VALUE:
        return BYTES_PER_VALUE[dtype.lower()]
    raise ValueError(
        f"unknown dtype {dtype!r}; use one of {', '.join(BYTES_PER_VALUE)}, a torch.dtype or a positive number of bytes"
    )


def layer_windows(config) -> list[int | None]:
    """Per layer, the most positions it attends to: an int for a sliding-window layer, None for full.

    Hugging Face's `layer_types` ("sliding_attention" / "full_attention") says which layers
    are windowed; without it a `sliding_window` applies to every layer (Mistral, and our engine).
    """
    fields = config_fields(config)
    num_layers, window = fields["num_hidden_layers"], fields.get("sliding_window")
    if fields.get("use_sliding_window") is False:  # Qwen2/3 store a window they do not use
        window = None
    layer_types = fields.get("layer_types")
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def kv_bytes(config_or_preset, seq_len: int, batch: int = 1, dtype="fp16") -> int:
    """Bytes of K and V that `batch` sequences of seq_len tokens need, across all layers.

    config_or_preset: a name from PRESETS, a `ModelConfig` or a config.json dict. A
    full-attention layer holds seq_len positions, a sliding-window layer min(seq_len, window).
    dtype: of the stored K/V (see `bytes_per_value`). E.g. Llama-3.1-8B in fp16:
    2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token, 512 MiB at 4,096 tokens.
    """
    check_int("seq_len", seq_len, minimum=0)
    check_int("batch", batch, minimum=1)
    fields = config_fields(config_or_preset)
    per_layer_position = kv_bytes_per_token(
        1, fields["num_key_value_heads"], fields["head_dim"], bytes_per_value(dtype)
    )  # K and V of one position, one layer
    positions_kept = sum(seq_len if window is None else min(seq_len, window) for window in layer_windows(fields))
    return math.ceil(batch * positions_kept * per_layer_position)


def parameter_count(config) -> int:
    """Parameters of a Llama-family model (what `LlamaForCausalLM(config).num_parameters()` gives).

    embeddings V x E (+ an lm_head V x E unless tied) + per layer: q and o projections
    (E x H x D each), k and v (E x H_kv x D each, GQA), q/k/v biases if any, the SwiGLU MLP
    (3 x E x F) and two RMSNorm weights (E each) + the final norm (E). Qwen3 adds a per-head
    RMSNorm on q and k (D each). Dense Llama-style configs only (not MoE, not GPT-3).
    """
    fields = config_fields(config)
    missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size") if n not in fields]
    if missing or fields.get("model_type", "llama") not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(
            f"parameter_count covers dense Llama-family configs (llama, mistral, qwen2, "
            f"qwen3); got model_type {fields.get('model_type')!r}"
            + (f" without {', '.join(missing)}" if missing else "")
        )
    vocab, hidden, ffn = fields["vocab_size"], fields["hidden_size"], fields["intermediate_size"]
    heads, kv_heads, head_dim = fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]
    qkv_bias = fields.get("attention_bias", False) or fields.get("model_type") == "qwen2"

    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o + k, v
    if qkv_bias:
        attention += (heads + 2 * kv_heads) * head_dim
    if fields.get("model_type") == "qwen3":
        attention += 2 * head_dim  # q_norm and k_norm, shared by all heads of a layer
    mlp = 3 * hidden * ffn  # gate, up, down
    norms = 2 * hidden  # input_layernorm, post_attention_layernorm
    per_layer = attention + mlp + norms
    embeddings = vocab * hidden * (1 if fields.get("tie_word_embeddings", False) else 2)
    return embeddings + fields["num_hidden_layers"] * per_layer + hidden  # + final norm


def tensor_bytes_held(obj) -> int:
    """Bytes of memory behind the tensors an object holds: its attributes, and the tensors in
    lists, tuples and dicts among them. Counts each tensor's whole storage once, so a slice that
    keeps a large buffer alive counts the buffer: what a cache really holds, whatever its layout."""
    storages, found = {}, list(vars(obj).values())
    while found:
        item = found.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[(storage.data_ptr(), item.device)] = storage.nbytes()
        elif isinstance(item, (list, tuple)):
            found.extend(item)
        elif isinstance(item, dict):
            found.extend(item.values())
    return sum(storages.values())


def format_bytes(num_bytes: float, binary: bool = True) -> str:
    """'128 KiB', '16 GiB' (binary=True, powers of 1024) or '9.66 GB' (powers of 1000), 3 significant digits."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB"]) if binary else (1000, ["B", "kB", "MB", "GB", "TB"])
    value, unit = float(num_bytes), units[0]
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            break
        value /= base
    return f"{value:.3g} {unit}"


__all__ = [
    "PRESETS",
    "config_fields",
    "bytes_per_value",
    "layer_windows",
    "kv_bytes",
    "parameter_count",
    "format_bytes",
    "tensor_bytes_held",
]

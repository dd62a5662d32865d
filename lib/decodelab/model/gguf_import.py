"""Convert a llama.cpp GGUF file into an HF-layout model folder (dequantized).

Three things need care:
1. Quantized tensors (Q4_1, Q8_0, ...) are dequantized with the `gguf` package.
2. llama.cpp stores the q and k projections of "llama" models with the rows of every head
   permuted (its RoPE rotates adjacent channel pairs; HF's rotates channel i with i + D/2).
   `unpermute_rows` undoes it, using the query head count for q and the KV head count for k.
   Skip it and the text is wrong from the first tokens (SmolLM2 answers a chat prompt with
   end-of-turn tokens, then repeats itself).
3. The tokenizer is rebuilt from the vocabulary, merges and special-token ids in the
   metadata, with the pre-tokenizer the file names (SmolLM splits every digit).

`load_gguf_state_dict` (the reference of notebook 01's exercise) turns the file's tensors into
the HF-named float32 state dict (`decodelab.model.gguf_tensors` lists them fast).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from decodelab.config import ModelConfig
from decodelab.model.weights import save_model

LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Digits one by one, then GPT-2's split (llama.cpp's "smollm" pre-tokenizer).
DIGIT_SPLIT_PRE_TOKENIZERS = ("smollm",)


class GGUFError(ValueError):
    """A GGUF file we cannot turn into a model folder."""


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    raise GGUFError(f"unexpected tensor {gguf_name!r} in GGUF file")


def permute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF row order -> llama.cpp's: within each head, rows (i, i + D/2) become neighbours."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's row order -> HF's (inverse of `permute_rows`)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_metadata(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    return ModelConfig(
        model_type=arch,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def read_tensor(tensor) -> torch.Tensor:
    """One GGUF tensor, dequantized to float32, in PyTorch's [out, in] order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost-first
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        array = np.asarray(tensor.data)
        array = dequantize(array, tensor.tensor_type) if tensor.tensor_type == GGMLQuantizationType.BF16 else array
    else:
        array = dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a writable copy


def load_gguf_state_dict(tensors, config: ModelConfig, progress: bool = False) -> dict[str, torch.Tensor]:
    """An HF-named float32 state dict from GGUF tensors (`GGUFReader.tensors` or `read_gguf_tensors`).

    Each tensor dequantized (`read_tensor`), renamed (`hf_tensor_name`), and for a "llama" file q
    and k put back in HF's row order; a tied model's ``lm_head.weight`` is its embedding table, as
    in `LlamaForCausalLM.state_dict()`.
    """
    state = {}
    unpermute = config.model_type == "llama"  # llama.cpp permutes q/k only for its "llama" arch
    for tensor in tqdm(tensors, desc="dequantizing", unit="tensor", disable=not progress, file=sys.stderr):
        name = hf_tensor_name(tensor.name)
        weight = read_tensor(tensor)
        if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rows(weight, config.num_attention_heads)
        elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rows(weight, config.num_key_value_heads)
        state[name] = weight
    if config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def tokenizer_files_from_gguf(reader) -> tuple[dict, dict]:
    """(tokenizer.json as a dict, tokenizer_config.json as a dict) from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise GGUFError("only byte-level BPE ('gpt2') GGUF tokenizers are supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _field(reader, "tokenizer.ggml.pre") in DIGIT_SPLIT_PRE_TOKENIZERS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types) if kind == 3]
    backend.add_special_tokens(control)

    def token_of(key):
        index = _field(reader, key)
        return None if index is None else tokens[index]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_of("tokenizer.ggml.bos_token_id"),
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length")),
        "clean_up_tokenization_spaces": False,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return json.loads(backend.to_str()), config


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write config.json, model.safetensors (float32), tokenizer files and generation_config.json.

    Writes into a temporary sibling folder and renames it at the end, so an interrupted
    conversion never leaves a half-written model behind.
    """
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # the gguf package raises bare ValueErrors on bad magic
        raise GGUFError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    config = config_from_metadata(reader)
    state = load_gguf_state_dict(reader.tensors, config, progress)
    from decodelab.model.llama import LlamaForCausalLM
    from decodelab.model.weights import WeightsError, check_state_dict

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    expected = {name: p.shape for name, p in skeleton.named_parameters(remove_duplicate=True)}
    try:  # a missing or mis-shaped tensor would otherwise surface as a meta-tensor error
        check_state_dict(state, expected, gguf_path)
    except WeightsError as exc:
        raise GGUFError(str(exc)) from None
    skeleton.load_state_dict({name: state[name] for name in expected}, strict=False, assign=True)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():  # left behind by a run that was killed
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_model(skeleton, tmp, dtype=torch.float32)
        tokenizer_json, tokenizer_config = tokenizer_files_from_gguf(reader)
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir

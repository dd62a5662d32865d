"""GGUF import: a random tiny llama written the way llama.cpp's converter writes it
(q/k rows permuted per head, F32 tensors, llama.* metadata, a byte-level BPE in
tokenizer.ggml.*) converts back to the very model and tokenizer it came from.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from oracles import random_ids, random_model

import decodelab.model.gguf_import as gguf_import
from decodelab.model.gguf_import import GGUFError, convert_gguf, permute_rows, unpermute_rows
from decodelab.model.gguf_tensors import read_gguf_tensors
from decodelab.model.tokenizer import Tokenizer
from decodelab.model.weights import load_model

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("hypothesis")  # dev extra; `make gpu-check` may run without it
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EPS = 2.0**-17  # exactly representable in float32, as GGUF stores it
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2024, 3))\n",
    "In 1969 people walked on the moon; in 2024 we train language models.",
    "Café, naïve, Zürich: unicode text with accents. 中文 and emoji 🚀.",
    "import os\nfor name in os.listdir('.'):\n    if name.endswith('.py'):\n        print(name)\n",
]
TEXTS = [
    "The lazy fox, 2024 and 3.14159.",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "Zürich 🚀 中文 unseen words xyzzy\t\ttabs",
    "",
]


def byte_level_bpe():
    """A small byte-level BPE trained here; SmolLM-style digit splitting before GPT-2's regex."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Backend(models.BPE(fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_llama_gguf(path, model, tok):
    """The way llama.cpp's convert_hf_to_gguf.py writes a LlamaForCausalLM (F32 everywhere)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("decodelab-test-tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(0)  # ALL_F32

    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_unk_token_id(vocab["<|endoftext|>"])
    writer.add_pad_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    names = {v: k for k, v in gguf_import.GLOBAL_TENSORS.items()}
    layer_names = {v: k for k, v in gguf_import.LAYER_TENSORS.items()}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.detach().float().clone()
        if name.endswith("q_proj.weight"):
            w = permute_rows(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = permute_rows(w, cfg.num_key_value_heads)  # llama.cpp: the KV head count for k
        if name in names:
            gguf_name = names[name]
        else:
            _, _, i, rest = name.split(".", 3)
            gguf_name = f"blk.{i}.{layer_names[rest]}"
        writer.add_tensor(gguf_name, w.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def source_tokenizer():
    return byte_level_bpe()


@pytest.fixture(scope="module", params=["untied", "tied"])
def source(request, tmp_path_factory, source_tokenizer):
    """(source model, its GGUF file): GQA with 4 query and 2 KV heads, random O(1) weights."""
    tied = request.param == "tied"
    model = random_model(
        seed=11,
        vocab_size=source_tokenizer.get_vocab_size(),
        rms_norm_eps=EPS,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, source_tokenizer)
    return model, path


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


def test_converted_model_matches_source(source, tmp_path):
    model, path = source
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    loaded = load_model(out)
    cfg = loaded.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (EPS, 5000.0, 128)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = random_ids(64, cfg.vocab_size, seed=11, batch=2)
    diff = (logits(loaded, ids) - logits(model, ids)).abs().max().item()
    assert diff <= 1e-6, f"max |logit difference| {diff:.3g}"


def test_transformers_reads_our_gguf_as_the_source_model(source, tmp_path):
    """An independent check that the file follows llama.cpp's layout (its q/k row order
    above all): transformers' own GGUF loader un-permutes it back to the source model."""
    model, path = source
    from oracles import memoized_gguf_reading, quiet_transformers

    pytest.importorskip("transformers")
    with quiet_transformers() as tf, memoized_gguf_reading():
        hf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = random_ids(64, model.config.vocab_size, seed=16, batch=2)
    with torch.no_grad():
        diff = (hf.eval()(ids).logits - logits(model, ids)).abs().max().item()
    assert diff <= 1e-5, f"max |logit difference| {diff:.3g}"


def test_skipping_the_unpermute_is_caught(source, tmp_path, monkeypatch):
    model, path = source
    monkeypatch.setattr(gguf_import, "unpermute_rows", lambda w, num_heads: w)
    loaded = load_model(convert_gguf(path, tmp_path / "converted", progress=False))
    ids = random_ids(64, model.config.vocab_size, seed=12)
    assert (logits(loaded, ids) - logits(model, ids)).abs().max() > 1e-2


def test_unpermuting_k_with_the_query_head_count_is_caught(source, tmp_path, monkeypatch):
    """GQA: k must be unpermuted with the KV head count; the query head count is a plausible slip."""
    model, path = source
    real = gguf_import.unpermute_rows
    heads = model.config.num_attention_heads
    monkeypatch.setattr(gguf_import, "unpermute_rows", lambda w, num_heads: real(w, heads))
    loaded = load_model(convert_gguf(path, tmp_path / "converted", progress=False))
    ids = random_ids(64, model.config.vocab_size, seed=13)
    assert (logits(loaded, ids) - logits(model, ids)).abs().max() > 1e-2


def test_converted_tokenizer_encodes_like_source(source, source_tokenizer, tmp_path):
    _, path = source
    out = convert_gguf(path, tmp_path / "converted", progress=False)
    tok = Tokenizer.from_folder(out)
    assert tok.vocab_size == source_tokenizer.get_vocab_size()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == source_tokenizer.encode(text).ids, text
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.encode("2024") == [tok.backend.token_to_id(d) for d in "2024"]  # digits split one by one
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.chat_template == CHAT_TEMPLATE
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


# --------------------------------------------------------------------- permutation
@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 8), half=st.integers(1, 8), cols=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_permute_and_unpermute_are_inverses(heads, half, cols, seed):
    shape = (heads * 2 * half,) + ((cols,) if cols else ())  # weights [rows, in] and biases [rows]
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    p = permute_rows(w, heads)
    assert torch.equal(unpermute_rows(p, heads), w)
    assert torch.equal(permute_rows(unpermute_rows(w, heads), heads), w)
    assert torch.equal(p.sort(dim=0).values, w.sort(dim=0).values)  # a permutation of rows


def test_permute_makes_rotate_half_pairs_adjacent():
    """Within each head, HF's rows (i, i + D/2) become llama.cpp's rows (2i, 2i + 1)."""
    heads, d = 3, 8
    rows = torch.arange(heads * d)
    permuted = permute_rows(rows, heads).view(heads, d)
    for h in range(heads):
        expected = [h * d + i + j * d // 2 for i in range(d // 2) for j in (0, 1)]
        assert permuted[h].tolist() == expected


# ------------------------------------------------------------------------ errors
def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, or anything but GGUF" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        convert_gguf(bogus, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out", progress=False)


def test_truncated_gguf_is_a_clear_error(source, tmp_path):
    _, path = source
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFError):
        convert_gguf(cut, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gguf_missing_a_tensor_is_a_clear_error(source_tokenizer, tmp_path):
    model = random_model(seed=14, vocab_size=source_tokenizer.get_vocab_size(), tie_word_embeddings=True)
    state = model.state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    model.state_dict = lambda: state  # the writer reads the tensors from state_dict()
    path = write_llama_gguf(tmp_path / "broken.gguf", model, source_tokenizer)
    with pytest.raises(GGUFError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_conversion_leaves_no_half_written_folder(source, tmp_path, monkeypatch, existing):
    model, path = source
    target = tmp_path / "model"
    if existing:  # an earlier, complete conversion must survive a failed re-conversion
        convert_gguf(path, target, progress=False)
        before = {p.name: p.read_bytes() for p in target.iterdir()}

    def interrupted(reader):  # weights are already on disk when the tokenizer is written
        assert (tmp_path / "model.partial" / "model.safetensors").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_import, "tokenizer_files_from_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, target, progress=False)
    if existing:
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    else:
        assert not target.exists()
    assert not (tmp_path / "model.partial").exists()
    monkeypatch.undo()
    loaded = load_model(convert_gguf(path, target, progress=False))  # a retry succeeds
    ids = random_ids(16, model.config.vocab_size, seed=15)
    assert torch.equal(logits(loaded, ids), logits(model, ids))


# ------------------------------------------------------------ the tensor table alone
def _same_tensors(fast, slow):
    assert [t.name for t in fast] == [t.name for t in slow]
    for a, b in zip(fast, slow):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type,
            b.shape.tolist(),
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        ), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_read_gguf_tensors_lists_what_gguf_reader_lists(source):
    _, path = source
    _same_tensors(read_gguf_tensors(path), gguf.GGUFReader(str(path)).tensors)


def test_read_gguf_tensors_of_quantized_tensors(tmp_path):
    """Q4_1, Q8_0 and F32 after string, array and scalar metadata, with a non-default alignment."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    path = tmp_path / "quantized.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.data_alignment = 64
    writer.add_uint32("general.alignment", 64)
    writer.add_token_list(["a", "bc", "déf"])
    writer.add_token_types([1, 1, 3])
    writer.add_float32("llama.rope.freq_base", 5000.0)
    rng = np.random.default_rng(0)
    for name, shape, kind in (
        ("blk.0.ffn_up.weight", (8, 64), Q.Q4_1),
        ("token_embd.weight", (5, 96), Q.Q8_0),
        ("blk.0.attn_norm.weight", (64,), Q.F32),
    ):
        values = rng.standard_normal(shape).astype(np.float32)
        data = values if kind == Q.F32 else quantize(values, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fast = read_gguf_tensors(path)
    _same_tensors(fast, gguf.GGUFReader(str(path)).tensors)
    assert [t.tensor_type for t in fast] == [Q.Q4_1, Q.Q8_0, Q.F32]


def test_read_gguf_tensors_refuses_what_is_not_gguf(source, tmp_path):
    _, path = source
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(GGUFError, match="ends inside its GGUF header"):
        read_gguf_tensors(cut)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFError, match="not a little-endian GGUF file"):
        read_gguf_tensors(bogus)

"""Checks for notebook 01, the forward pass: the weights read from the GGUF file, RMSNorm, RoPE,
attention over a KV cache, the SwiGLU MLP, and the decoder layers with the model loop.

Every ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in the notebook's hidden-test cell) and either
returns None or raises ``AssertionError`` naming the input, what was expected and what came back.
Every call of the function under test goes through `autograder.checks.calling.call`.

Oracles, never snapshots:

* the library's own conversion of SmolLM2's GGUF file (`decodelab.model.gguf_import`, which
  dequantizes with the `gguf` package), tensor by tensor on the first two layers, the embedding
  and the final norm, and the greedy tokens of those two layers run on either state dict;

* analytic cases worked out here: RMSNorm of [3, 4]; RoPE at position 0 (no rotation) and of a
  unit vector (cos and sin of position x frequency land in channels i and i + D/2); attention
  with q = 0 (every allowed key weighs the same: the mean of the values so far); SwiGLU with
  one channel;
* the library's model, module by module: `decodelab.model.llama.RMSNorm` and `MLP`, the RoPE
  tables of `decodelab.model.rope` (float32, then cast), `decodelab.model.attention.causal_attention`
  on the keys and values the check itself appended, and `LlamaForCausalLM` on random models from
  `decodelab.model.toy` (grouped-query heads, tied and untied embeddings) for the whole pass,
  with and without a KV cache.
"""

from __future__ import annotations

import torch

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call
from decodelab.config import ModelConfig
from decodelab.course.checking import describe
from decodelab.course.exercises import references
from decodelab.model.attention import causal_attention
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import MLP, RMSNorm
from decodelab.model.rope import apply_rope, rope_tables
from decodelab.model.toy import random_llama, toy_config

# exercise -> the library's reference it is graded against (the course's table of exercises)
REFERENCES = references("01_forward_pass")

__all__ = [
    "check_load_gguf_state_dict",
    "check_rms_norm",
    "check_rope",
    "check_attention",
    "check_mlp",
    "check_forward",
    "check_q_layer_params",
    "check_q_rope_slowest_period",
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=_gen(seed))).to(dtype)


def _expect_tensor(what: str, got, shape, dtype: torch.dtype) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(
            f"{what}: expected a torch.Tensor of shape {list(shape)}, got {type(got).__name__} {describe(got)}"
        )
    if tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{what}: expected shape {list(shape)}, got shape {list(got.shape)}")
    if got.dtype != dtype:
        raise AssertionError(f"{what}: expected dtype {dtype} (the input's), got {got.dtype}")


def _expect_close(what: str, got, expected: torch.Tensor, atol: float, rtol: float = 0.0, why: str = "") -> None:
    """got has expected's shape and dtype and lies within atol + rtol * |expected| of it everywhere."""
    _expect_tensor(what, got, expected.shape, expected.dtype)
    g, e = got.detach().cpu().double(), expected.detach().cpu().double()
    excess = (g - e).abs() - (atol + rtol * e.abs())
    excess = torch.where(torch.isnan(g), torch.full_like(excess, float("inf")), excess)
    if bool((excess > 0).any()):
        index = tuple(int(i) for i in (excess == excess.max()).nonzero()[0])
        detail = f"\n  expected {describe(expected)}\n  got      {describe(got)}" if expected.numel() <= 12 else ""
        raise AssertionError(
            f"{what}: expected {describe(e[index].item())} at index {list(index)}, got {describe(g[index].item())} "
            f"(largest difference {(g - e).abs().nan_to_num(float('inf')).max().item():.3g}, tolerance {atol:g}"
            f"{f' + {rtol:g} x |expected|' if rtol else ''}){f'; {why}' if why else ''}{detail}"
        )


# --------------------------------------------------------------------------- the weights from GGUF

_GGUF_LAYERS = 2  # the layers checked: dequantizing all 30 by hand takes about a second


def _why_gguf(tensor, config) -> str:
    """What a GGUF tensor takes to become its HF tensor, for the message of a mismatch."""
    kind = tensor.tensor_type.name
    why = {
        "Q4_1": "a Q4_1 block of 32 weights is fp16 d, fp16 m, then 16 bytes whose low nibbles are weights 0-15 "
        "and high nibbles weights 16-31; w = d x q + m, computed in float32",
        "Q8_0": "a Q8_0 block of 32 weights is fp16 d, then 32 int8 q; w = d x q, computed in float32",
        "F32": "an F32 tensor is stored as it is",
    }.get(kind, kind)
    if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in tensor.name else config.num_key_value_heads
        why += (
            f"; then llama.cpp's row order is undone within each of the {heads} heads: its rows 2i and 2i + 1 "
            f"are HF's rows i and i + D/2"
        )
    return why


@torch.no_grad()
def check_load_gguf_state_dict(fn) -> None:
    """SmolLM2's GGUF tensors of the first two layers, the embedding (Q8_0, tied to lm_head) and
    the final norm against the library's conversion of the same file, then the greedy tokens of
    those two layers run on both state dicts."""
    import dataclasses

    from decodelab.lessons.forward_pass import greedy_generate
    from decodelab.model.gguf_import import hf_tensor_name
    from decodelab.model.gguf_tensors import read_gguf_tensors
    from decodelab.model.registry import resolve_model, smollm2_gguf_path
    from decodelab.model.weights import read_state_dict

    folder = resolve_model("smollm2")  # the library's conversion of the same file
    config = ModelConfig.from_file(folder / "config.json")
    tensors = [
        t
        for t in read_gguf_tensors(smollm2_gguf_path())
        if t.name in ("token_embd.weight", "output_norm.weight")
        or t.name.split(".")[:2] in (["blk", str(i)] for i in range(_GGUF_LAYERS))
    ]
    expected = read_state_dict(folder, {hf_tensor_name(t.name) for t in tensors})
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]  # SmolLM2 ties them
    what = (
        f"load_gguf_state_dict(SmolLM2's GGUF tensors of layers 0-{_GGUF_LAYERS - 1}, the embedding and the "
        f"final norm: {len(tensors)} of them, SmolLM2's config)"
    )
    got = call(what, fn, tensors, config)
    if not isinstance(got, dict):
        raise AssertionError(f"{what}: expected a dict from HF names to tensors, got {type(got).__name__}")
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        raise AssertionError(
            f"{what}: expected the {len(expected)} HF names {sorted(expected)}; missing {missing}, "
            f"unexpected {extra} (names from GLOBAL_TENSORS and LAYER_TENSORS; a tied model's "
            f"lm_head.weight is its embedding table)"
        )
    by_name = {hf_tensor_name(t.name): t for t in tensors}
    by_name["lm_head.weight"] = by_name["model.embed_tokens.weight"]
    for name, tensor in by_name.items():
        gguf_dims = [int(n) for n in tensor.shape]
        where = f"{what}[{name!r}] (GGUF's {tensor.name}, {tensor.tensor_type.name}, dims {gguf_dims})"
        value = got[name]
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(expected[name].shape):
            raise AssertionError(
                f"{where}: expected shape {list(expected[name].shape)}, got {list(value.shape)}; "
                f"GGUF lists the dimensions innermost first, PyTorch's [out, in] is the reverse"
            )
        if name == "lm_head.weight" and value is got["model.embed_tokens.weight"]:
            continue  # the embedding, checked already
        if not (
            isinstance(value, torch.Tensor)
            and value.dtype == torch.float32
            and (
                torch.equal(value, expected[name])  # fast; _expect_close's message is not
                or torch.allclose(value, expected[name], rtol=1e-6, atol=1e-6)
            )
        ):
            _expect_close(where, value, expected[name], 1e-6, 1e-6, why=_why_gguf(tensor, config))
    small = dataclasses.replace(config, num_hidden_layers=_GGUF_LAYERS)
    prompt = torch.randint(0, config.vocab_size, (16,), generator=_gen(7)).tolist()
    yours, library = (greedy_generate(weights, small, prompt, 4) for weights in (got, expected))
    if yours != library:
        raise AssertionError(
            f"greedy tokens of SmolLM2's first {_GGUF_LAYERS} layers on a random 16-token prompt: "
            f"with the library's weights {library}, with yours {yours}"
        )


# --------------------------------------------------------------------------- RMSNorm


def _library_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def check_rms_norm(fn) -> None:
    """Analytic rows, eps, the last dimension on a 3-d batch, and float16/bfloat16 inputs."""
    x = torch.tensor([[3.0, 4.0]])
    what = "rms_norm(x=[[3, 4]], weight=[1, 1], eps=0)"
    _expect_close(
        what,
        call(what, fn, x, torch.ones(2), 0.0),
        torch.tensor([[3.0, 4.0]]) / 12.5**0.5,
        1e-6,
        why="the mean of the squares is (9 + 16) / 2 = 12.5, so x is divided by sqrt(12.5) = 3.5355",
    )
    what = "rms_norm(x=[[3, 4]], weight=[2, -1], eps=0)"
    _expect_close(
        what,
        call(what, fn, x, torch.tensor([2.0, -1.0]), 0.0),
        torch.tensor([[6.0, -4.0]]) / 12.5**0.5,
        1e-6,
        why="the weight scales each channel after the division",
    )
    tiny = torch.tensor([[1e-3, -1e-3, 1e-3, -1e-3]])
    what = "rms_norm(x=[[0.001, -0.001, 0.001, -0.001]], weight=[1, 1, 1, 1], eps=1e-6)"
    _expect_close(
        what,
        call(what, fn, tiny, torch.ones(4), 1e-6),
        tiny / (1e-6 + 1e-6) ** 0.5,
        1e-6,
        why="eps is added to the mean of squares (1e-6 here) inside the square root: x / sqrt(1e-6 + 1e-6)",
    )
    for seed, shape, eps in ((1, (3, 5, 8), 1e-5), (2, (2, 7), 1e-6), (3, (1, 4, 2, 6), 0.1)):
        x, weight = _randn(*shape, seed=seed, scale=3.0), 1 + 0.3 * _randn(shape[-1], seed=seed + 100)
        what = f"rms_norm(x of shape {list(shape)} (random), weight of shape [{shape[-1]}], eps={eps:g})"
        _expect_close(
            what,
            call(what, fn, x, weight, eps),
            _library_rms_norm(x, weight, eps),
            1e-5,
            1e-5,
            why="normalize each row over the LAST dimension (the hidden size), as the library's RMSNorm does",
        )
    big = torch.tensor([[[300.0, -200.0, 400.0, 100.0], [250.0, 260.0, -270.0, 5.0]]], dtype=torch.float16)
    weight = torch.tensor([1.0, 0.5, 2.0, -1.0], dtype=torch.float16)
    what = (
        "rms_norm(x in float16 = [[[300, -200, 400, 100], [250, 260, -270, 5]]], weight=[1, 0.5, 2, -1] "
        "in float16, eps=1e-5)"
    )
    _expect_close(
        what,
        call(what, fn, big, weight, 1e-5),
        _library_rms_norm(big, weight, 1e-5),
        2e-3,
        2e-3,
        why="300 squared is 90,000, above float16's largest value 65,504: take the mean of squares in "
        "float32 (x.float()), then cast back to x's dtype before multiplying by the weight",
    )
    x, weight = _randn(2, 3, 16, seed=7, dtype=torch.bfloat16, scale=4.0), torch.ones(16, dtype=torch.bfloat16)
    what = "rms_norm(x of shape [2, 3, 16] in bfloat16, weight of ones in bfloat16, eps=1e-5)"
    _expect_close(
        what,
        call(what, fn, x, weight, 1e-5),
        _library_rms_norm(x, weight, 1e-5),
        1e-2,
        1e-2,
        why="the result keeps x's dtype",
    )


# --------------------------------------------------------------------------- RoPE


def _library_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The model's own way: float32 tables for every position, indexed, cast to x's dtype, applied."""
    config = toy_config(head_dim=x.shape[-1], rope_theta=theta, max_position_embeddings=int(positions.max()) + 1)
    cos, sin = rope_tables(config)
    return apply_rope(x, cos[positions].to(x.dtype), sin[positions].to(x.dtype))


def check_rope(fn) -> None:
    """Position 0, unit vectors (pairing and frequencies), random q/k against the model's tables,
    positions that are not 0..T-1, and bfloat16 at positions near 4,096."""
    x = _randn(1, 2, 1, 8, seed=0)
    what = "rope(x of shape [1, 2, 1, 8], positions=[0], rope_theta=10000)"
    _expect_close(
        what,
        call(what, fn, x, torch.tensor([0]), 10000.0),
        x,
        1e-6,
        why="at position 0 every angle is 0: nothing turns",
    )
    positions = torch.tensor([1, 2, 5])
    for channel in (0, 1):
        unit = torch.zeros(1, 1, 3, 4)
        unit[..., channel] = 1.0
        freq = torch.tensor([1.0, 0.01])[channel]  # 10000^(-2i/4) for pair i = 0, 1
        angle = positions.float() * freq
        expected = torch.zeros(1, 1, 3, 4)
        expected[0, 0, :, channel], expected[0, 0, :, channel + 2] = angle.cos(), angle.sin()
        what = f"rope(x = unit vector on channel {channel} of D=4 at positions [1, 2, 5], rope_theta=10000)"
        _expect_close(
            what,
            call(what, fn, unit, positions, 10000.0),
            expected,
            1e-5,
            why=f"channel {channel} pairs with channel {channel + 2} (i with i + D/2, not with i + 1) and "
            f"turns by position x 10000^(-2x{channel}/4) = position x {freq.item():g}: "
            f"[cos, sin] of that angle land in channels {channel} and {channel + 2}",
        )
    cases = [  # (seed, shape [B, heads, T, D], positions, theta)
        (1, (2, 3, 5, 16), torch.arange(7, 12), 10000.0),
        (2, (1, 1, 3, 16), torch.tensor([3, 0, 40]), 10000.0),  # one KV head; positions of a packed batch
        (3, (1, 2, 4, 64), torch.arange(100, 104), 100000.0),  # SmolLM2's head_dim and theta
    ]
    for seed, shape, positions, theta in cases:
        x = _randn(*shape, seed=seed)
        what = f"rope(x of shape {list(shape)} (random), positions={positions.tolist()}, rope_theta={theta:g})"
        _expect_close(
            what,
            call(what, fn, x, positions, theta),
            _library_rope(x, positions, theta),
            1e-5,
            1e-5,
            why="the library's model rotates pairs (i, i + D/2) by position x theta^(-2i/D)",
        )
    x = _randn(1, 3, 4, 64, seed=4, dtype=torch.bfloat16)
    positions = torch.arange(4093, 4097)
    what = "rope(x of shape [1, 3, 4, 64] in bfloat16, positions=[4093, 4094, 4095, 4096], rope_theta=100000)"
    _expect_close(
        what,
        call(what, fn, x, positions, 100000.0),
        _library_rope(x, positions, 100000.0),
        0.05,
        0.02,
        why="compute the frequencies, angles, cos and sin in float32 and cast only cos and sin to x's "
        "dtype: bfloat16 keeps 8 significant bits, so 4093 becomes 4096 and an angle is off by radians",
    )


# --------------------------------------------------------------------------- attention over a cache


def _cache(
    num_kv_heads: int, head_dim: int, batch: int, layers: int = 2, length: int = 16, dtype=torch.float64
) -> KVCache:
    config = ModelConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=layers,
        num_attention_heads=num_kv_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
    )
    return KVCache(config, batch, length, dtype=dtype)


def _uniform_case(fn) -> None:
    cache = _cache(1, 4, 1)
    q = torch.zeros(1, 2, 4, 4, dtype=torch.float64)  # 2 query heads share 1 KV head
    k = _randn(1, 1, 4, 4, seed=10, dtype=torch.float64)
    v = torch.arange(16.0, dtype=torch.float64).reshape(1, 1, 4, 4)
    what = (
        "attention(a fresh cache, layer 0, q = zeros [1, 2, 4, 4], random k [1, 1, 4, 4], "
        "v = [[0..3], [4..7], [8..11], [12..15]])"
    )
    means = v[0, 0].cumsum(0) / torch.arange(1, 5, dtype=torch.float64)[:, None]  # mean of values 0..t
    _expect_close(
        what,
        call(what, fn, cache, 0, q, k, v),
        means.expand(1, 2, 4, 4).clone(),
        1e-6,
        why="with q = 0 every key it may see scores the same, so query t returns the mean of values "
        "0..t (causal); without the mask every query would return the mean of all four",
    )


def _cached_case(fn, num_heads: int, num_kv_heads: int, seed: int, dtype=torch.float64) -> None:
    head_dim, batch, layer = 8, 2, 1
    cache = _cache(num_kv_heads, head_dim, batch, dtype=dtype)
    label = f"{num_heads} query heads, {num_kv_heads} KV heads of dim {head_dim}, batch {batch}, {dtype}"
    keys, values, held = [], [], 0
    for step, num_new in enumerate((5, 3, 1)):
        q = _randn(batch, num_heads, num_new, head_dim, seed=seed + 10 * step, dtype=dtype)
        k = _randn(batch, num_kv_heads, num_new, head_dim, seed=seed + 10 * step + 1, dtype=dtype)
        v = _randn(batch, num_kv_heads, num_new, head_dim, seed=seed + 10 * step + 2, dtype=dtype)
        keys.append(k), values.append(v)
        k_all, v_all = torch.cat(keys, 2), torch.cat(values, 2)
        expected = causal_attention(q, k_all, v_all, q_offset=held)
        what = (
            f"attention(cache, layer_index={layer}, q, k, v) for {num_new} new token{'s' if num_new > 1 else ''} "
            f"with {held} held before ({label})"
        )
        why = (
            f"store k, v with cache.append({layer}, k, v), then let the queries, at positions {held}.."
            f"{held + num_new - 1}, see every held key up to their own position (the mask shifted by {held}); "
            f"query head h reads KV head h // {num_heads // num_kv_heads}"
        )
        tol = 1e-9 if dtype == torch.float64 else 1e-5
        _expect_close(what, call(what, fn, cache, layer, q, k, v), expected, max(tol, 1e-6), 1e-5, why=why)
        held += num_new
        stored = cache.view(layer)[0]
        if stored.shape[2] != held or not torch.equal(stored, k_all):
            raise AssertionError(
                f"after {what}, the cache's layer {layer} should hold the {held} keys appended so far "
                f"(cache.append(layer_index, k, v)); it holds {stored.shape[2]} rows"
                f"{'' if stored.shape[2] != held else ' that differ from them'}"
            )
        if cache.view(0)[0].shape[2] != 0:
            raise AssertionError(f"{what} wrote into layer 0 of the cache; use layer_index ({layer})")


def check_attention(fn) -> None:
    """q = 0 (uniform weights: the causal mask), then prefill / chunk / decode steps through the
    library's KVCache with grouped (6 over 2), multi-query (4 over 1) and multi-head (3 over 3)
    heads, against causal attention on the keys appended; float32 keeps its dtype."""
    _uniform_case(fn)
    _cached_case(fn, 6, 2, seed=20)
    _cached_case(fn, 4, 1, seed=30)
    _cached_case(fn, 3, 3, seed=40)
    _cached_case(fn, 4, 2, seed=50, dtype=torch.float32)


# --------------------------------------------------------------------------- SwiGLU MLP


def check_mlp(fn) -> None:
    """One channel worked by hand, then random weights against the library's MLP."""
    x = torch.tensor([[-1.0], [0.0], [2.0]])
    gate, up, down = torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.tensor([[3.0]])
    expected = 3 * torch.nn.functional.silu(x) * (2 * x)
    what = "mlp(x=[[-1], [0], [2]], gate_weight=[[1]], up_weight=[[2]], down_weight=[[3]])"
    _expect_close(
        what,
        call(what, fn, x, gate, up, down),
        expected,
        1e-6,
        why="down(silu(gate(x)) * up(x)) = 3 x silu(x) x 2x; silu(z) = z x sigmoid(z) goes on the GATE branch only",
    )
    for seed, shape, hidden, inner in ((1, (2, 3, 6), 6, 10), (2, (5, 4), 4, 12)):
        x = _randn(*shape, seed=seed)
        weights = [
            _randn(inner, hidden, seed=seed + 1, scale=0.5),
            _randn(inner, hidden, seed=seed + 2, scale=0.5),
            _randn(hidden, inner, seed=seed + 3, scale=0.5),
        ]
        module = MLP(toy_config(hidden_size=hidden, intermediate_size=inner, head_dim=2))
        with torch.no_grad():
            for linear, weight in zip((module.gate_proj, module.up_proj, module.down_proj), weights):
                linear.weight.copy_(weight)
            expected = module(x)
        what = (
            f"mlp(x of shape {list(shape)} (random), gate_weight and up_weight [{inner}, {hidden}], "
            f"down_weight [{hidden}, {inner}])"
        )
        _expect_close(
            what,
            call(what, fn, x, *weights),
            expected,
            1e-5,
            1e-5,
            why="weights are stored [out, in] as in nn.Linear: gate(x) = x @ gate_weight.T",
        )


# --------------------------------------------------------------------------- the whole pass


class _RecordingAttend:
    """A library KVCache's attend that remembers (layer_index, q shape, k shape) of every call."""

    def __init__(self, cache: KVCache):
        self.cache, self.calls = cache, []

    def __call__(self, layer_index, q, k, v):
        self.calls.append((layer_index, tuple(q.shape), tuple(k.shape)))
        return self.cache.attend(layer_index, q, k, v)


_MODELS = [  # (seed, config overrides, label)
    (1, {}, "4 query heads sharing 2 KV heads"),
    (
        2,
        dict(num_attention_heads=6, num_key_value_heads=1, hidden_size=48, tie_word_embeddings=True),
        "6 query heads sharing 1 KV head, tied embeddings",
    ),
    (
        3,
        dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=40),
        "3 layers, 4 query heads with 4 KV heads of dim 8",
    ),
]


def _expect_attend_calls(what: str, calls: list, config, batch: int, num_new: int) -> None:
    h, h_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    expected = [(i, (batch, h, num_new, d), (batch, h_kv, num_new, d)) for i in range(config.num_hidden_layers)]
    if calls != expected:
        raise AssertionError(
            f"{what}: expected one call attend(layer_index, q, k, v) per layer, in order, with q "
            f"[B, H, T, D] and k [B, H_kv, T, D]: {[(i, list(q), list(k)) for i, q, k in expected]}; "
            f"got {[(i, list(q), list(k)) for i, q, k in calls]}"
        )


@torch.no_grad()
def check_forward(fn) -> None:
    """Random Llamas (grouped heads, tied embeddings, 3 layers): one pass, then prefill, a chunk and
    single tokens through a KV cache, against the library's LlamaForCausalLM."""
    for seed, overrides, label in _MODELS:
        model = random_llama(seed, **overrides)
        config, weights = model.config, model.state_dict()
        batch, length = 2, 9
        ids = torch.randint(0, config.vocab_size, (batch, length), generator=_gen(seed))
        expected = model(ids)  # [B, T, V]
        scale = max(1.0, expected.abs().max().item())
        attend = _RecordingAttend(KVCache(config, batch, length))
        what = (
            f"forward(state dict of a random Llama ({label}, seed {seed}), config, input_ids of shape "
            f"[{batch}, {length}], attend of an empty KVCache)"
        )
        got = call(what, fn, weights, config, ids, attend)
        _expect_attend_calls(what, attend.calls, config, batch, length)
        _expect_close(
            what,
            got,
            expected,
            1e-4 * scale,
            1e-4,
            why="embedding -> every decoder layer (x + attention(norm(x)), then x + mlp(norm(x))) -> "
            "final norm -> lm_head; compared with the library's LlamaForCausalLM",
        )
        attend = _RecordingAttend(KVCache(config, batch, length))
        pieces, held = [], 0
        for num_new in (4, 3, 1, 1):
            positions = torch.arange(held, held + num_new)
            what = (
                f"forward(..., input_ids[:, {held}:{held + num_new}], attend of a KVCache holding {held} tokens, "
                f"positions={positions.tolist()}) on the random Llama ({label}, seed {seed})"
            )
            attend.calls = []
            pieces.append(call(what, fn, weights, config, ids[:, held : held + num_new], attend, positions))
            _expect_attend_calls(what, attend.calls, config, batch, num_new)
            _expect_close(
                what,
                pieces[-1],
                expected[:, held : held + num_new],
                1e-4 * scale,
                1e-4,
                why="the cached pass must give the logits of one pass over the whole sequence: RoPE "
                "turns the new tokens by `positions`, not by 0..T-1",
            )
            held += num_new


def answer_q_layer_params() -> float:
    """Parameters of one SmolLM2-135M decoder layer, counted on the library's DecoderLayer built from its config."""
    from decodelab.lessons.kv_size import config_fields
    from decodelab.model.llama import DecoderLayer

    with torch.device("meta"):  # shapes only: nothing is allocated
        layer = DecoderLayer(ModelConfig.from_dict(config_fields("SmolLM2-135M")), 0)
    return sum(p.numel() for p in layer.parameters())


def check_q_layer_params(value) -> None:
    """Graded q_layer_params (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_layer_params",
        value,
        answer_q_layer_params(),
        "one SmolLM2 decoder layer, q and o 576 x 576, k and v 192 x 576, gate, up and down 1,536 x 576, "
        "two norms of 576",
    )


def answer_q_rope_slowest_period() -> float:
    """Tokens for the slowest RoPE pair of SmolLM2 (theta 100,000, D = 64) to turn 2 pi."""
    import math

    from decodelab.model.rope import plain_inverse_frequencies

    return 2 * math.pi / plain_inverse_frequencies(64, 100000.0).min().item()


def check_q_rope_slowest_period(value) -> None:
    """Graded q_rope_slowest_period (its tolerance: predictions.QUESTIONS)."""
    expect_answer(
        "q_rope_slowest_period",
        value,
        answer_q_rope_slowest_period(),
        "2 pi / 100,000^(-62/64) tokens for SmolLM2's slowest RoPE pair",
    )

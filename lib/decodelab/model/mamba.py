"""A Mamba-style language model: selective state-space blocks instead of attention.

Weight names, shapes and arithmetic follow `transformers`' `MambaForCausalLM` (its pure-PyTorch
path), so a folder written here loads there and gives the same logits, and back.

Each block: RMSNorm -> `in_proj` to x and the gate z (E = expand * hidden each) -> the causal
depthwise `conv1d` over time (kernel K) and SiLU on x -> from x, the input-dependent
Δ (rank R, widened to E by `dt_proj`, softplus), B and C (N each) -> the selective scan with the
diagonal A = -exp(A_log) -> + D * x -> times SiLU(z) -> `out_proj`, added to the residual.

The scan has two forms that compute the same thing:
- `selective_scan`: a whole prompt at once, in chunks of `chunk_size` tokens; inside a chunk every
  state comes from the chunk's start state in closed form (the decays summed in log space), so the
  loop runs once per chunk, not once per token;
- `selective_step`: one token, reading and updating a fixed-size state.
`MambaState` is what decoding carries instead of a KV cache: per layer the last K-1 conv inputs
(transformers keeps K) and the [E, N] scan state; its size does not depend on the context length.

Shapes: b batch, T tokens, H hidden_size, E intermediate_size, N state_size, R time_step_rank,
K conv_kernel, V vocab_size.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from decodelab.validation import check_int

MODEL_TYPE = "mamba"


class MambaConfigError(ValueError):
    """A config.json that cannot describe a Mamba model we can run."""


@dataclass
class MambaConfig:
    """transformers' `MambaConfig` fields (the ones the model reads), in its names."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = 4
    time_step_rank: int | str = "auto"
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | None = 0
    pad_token_id: int | None = 0
    # An SSM has no positional limit; this bounds generation like a transformer's context.
    max_position_embeddings: int = 2048
    model_type: str = MODEL_TYPE

    def __post_init__(self):
        if self.time_step_rank == "auto":
            self.time_step_rank = math.ceil(self.hidden_size / 16)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "state_size",
            "expand",
            "conv_kernel",
            "time_step_rank",
            "max_position_embeddings",
        ):
            check_int(f"config field {name}", getattr(self, name), minimum=1, error=MambaConfigError)
        if self.model_type != MODEL_TYPE:
            raise MambaConfigError(f"model_type {self.model_type!r} is not a Mamba config (expected 'mamba')")
        if self.hidden_act != "silu":
            raise MambaConfigError(f"hidden_act {self.hidden_act!r} is not supported; only 'silu'")

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict) -> "MambaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    @classmethod
    def from_file(cls, path: str | Path) -> "MambaConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["architectures"] = ["MambaForCausalLM"]
        out["intermediate_size"] = self.intermediate_size
        return out


def is_mamba_folder(folder: str | Path) -> bool:
    """Whether the folder's config.json names a Mamba model."""
    config = Path(folder) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


# ------------------------------------------------------------------------ the state
class MambaState:
    """The fixed-size state that decoding carries instead of a KV cache.

    conv[l]: [b, E, K-1], layer l's last K-1 conv inputs (zeros before the first token);
    ssm[l]: [b, E, N] float32, layer l's scan state. `length` counts the tokens seen.
    Built like a KV cache, `MambaState(config, batch, max_seq_len, device=, dtype=)`, so the
    decode loop of `decoding.generate` drives both; max_seq_len is accepted and unused.
    """

    def __init__(
        self, config: MambaConfig, batch_size: int = 1, max_seq_len: int | None = None, device=None, dtype=None
    ):
        if not isinstance(config, MambaConfig):
            raise TypeError(f"MambaState needs a MambaConfig, got {type(config).__name__}")
        dtype = dtype or torch.float32
        E, N, K = config.intermediate_size, config.state_size, config.conv_kernel
        self.config, self.length = config, 0
        self.conv = [
            torch.zeros(batch_size, E, K - 1, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)
        ]
        self.ssm = [
            torch.zeros(batch_size, E, N, device=device, dtype=torch.float32) for _ in range(config.num_hidden_layers)
        ]

    def nbytes(self) -> int:
        """Bytes held, for any context length."""
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)


def state_bytes(config: MambaConfig, batch_size: int = 1, dtype_bytes: int = 4) -> int:
    """MambaState's bytes computed from the config: L * b * E * ((K-1) * dtype_bytes + N * 4)."""
    E, N, K = config.intermediate_size, config.state_size, config.conv_kernel
    return config.num_hidden_layers * batch_size * E * ((K - 1) * dtype_bytes + N * 4)


# -------------------------------------------------------------------- the two scans
def selective_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the scan: h <- exp(Δ A) h + Δ B x;  y = h C.

    state [b, E, N]; x, dt (Δ after softplus) [b, E]; A [E, N] (negative); B, C [b, N].
    Returns (y [b, E], the new state [b, E, N]); the D skip and the gate are the caller's.
    """
    decay = torch.exp(dt[..., None] * A)  # [b, E, N], each in (0, 1]
    state = decay * state + dt[..., None] * B[:, None, :] * x[..., None]
    return (state * C[:, None, :]).sum(-1), state


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over a whole sequence, chunk by chunk: the same outputs as `selective_step` T times.

    x, dt [b, T, E]; A [E, N]; B, C [b, T, N]; state [b, E, N] or None (zeros).
    Inside a chunk of L tokens, with a_r = Δ_r A the log decay of token r,
        h_t = exp(a_{s0+1} + ... + a_t) h_{s0} + sum_{s<=t} exp(a_{s+1} + ... + a_t) Δ_s B_s x_s,
    every exponent a sum of negatives (segment sums [b, L, L, E, N], never a difference of two
    large cumulative sums), so it is stable; memory grows as L^2, time as T / L loop turns.
    chunk_size=1 is the plain recurrence (the cheapest arithmetic; what training on a CPU uses).
    Returns (y [b, T, E], the last state [b, E, N]).
    """
    check_int("chunk_size", chunk_size, minimum=1)
    b, T, E = x.shape
    N = A.shape[-1]
    if state is None:
        state = x.new_zeros(b, E, N)
    if chunk_size == 1:  # token by token, the discretization done for all T at once
        decay = torch.exp(dt[..., None] * A)  # [b, T, E, N]
        inputs = dt[..., None] * B[:, :, None, :] * x[..., None]  # [b, T, E, N]
        states = []
        # unbind, not decay[:, t]: the backward of T slices would write T zero tensors of [b, T, E, N]
        # (quadratic in T: 45x slower backward at T = 256); unbind's backward stacks once
        for decay_t, input_t in zip(decay.unbind(1), inputs.unbind(1)):
            state = decay_t * state + input_t
            states.append(state)
        return (torch.stack(states, 1) * C[:, :, None, :]).sum(-1), state
    outputs = []
    for start in range(0, T, chunk_size):
        end = min(T, start + chunk_size)
        L = end - start
        log_decay = dt[:, start:end, :, None] * A  # [b, L, E, N]
        inputs = dt[:, start:end, :, None] * B[:, start:end, None, :] * x[:, start:end, :, None]  # [b, L, E, N]
        # segment[t, s] = a_{s+1} + ... + a_t for s <= t (0 on the diagonal), -inf above it:
        # a_r placed at [r, s] where r > s, then summed over r up to t
        placed = log_decay[:, :, None].expand(b, L, L, E, N)  # [b, r, s, E, N] = a_r
        after = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)[None, :, :, None, None]  # r > s
        segment = torch.where(after, placed, 0).cumsum(1)  # [b, t, s, E, N]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, :, :, None, None]  # s <= t
        weights = torch.exp(segment.masked_fill(~causal, -math.inf))  # [b, t, s, E, N]
        from_start = torch.exp(log_decay.cumsum(1))  # [b, L, E, N]: decay from the chunk's start to t
        states = from_start * state[:, None] + (weights * inputs[:, None]).sum(2)  # [b, L, E, N]
        outputs.append((states * C[:, start:end, None, :]).sum(-1))  # [b, L, E]
        state = states[:, -1]
    return torch.cat(outputs, 1), state


# -------------------------------------------------------------------------- layers
class MambaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]: computed in float32, cast back before the gain (as transformers)."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class MambaMixer(nn.Module):
    """The selective SSM of one block; parameter names as transformers' `MambaMixer`."""

    def __init__(self, config: MambaConfig, layer_idx: int):
        super().__init__()
        H, E, N, R, K = (
            config.hidden_size,
            config.intermediate_size,
            config.state_size,
            config.time_step_rank,
            config.conv_kernel,
        )
        self.layer_idx, self.E, self.N, self.R, self.K = layer_idx, E, N, R, K
        self.in_proj = nn.Linear(H, 2 * E, bias=config.use_bias)
        self.conv1d = nn.Conv1d(E, E, kernel_size=K, groups=E, padding=K - 1, bias=config.use_conv_bias)
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, E, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1))  # [E, N]
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, H, bias=config.use_bias)

    def causal_conv(self, x: torch.Tensor, state: MambaState | None) -> torch.Tensor:
        """x [b, E, T] -> [b, E, T]: token t sees inputs t-K+1..t only (zeros, or the state's last K-1
        inputs, before them); with a state, its conv inputs are updated."""
        if state is None:  # Conv1d pads K-1 on both sides: keep the first T outputs, the causal ones
            return self.conv1d(x)[..., : x.shape[-1]]
        history = torch.cat([state.conv[self.layer_idx].to(x.dtype), x], dim=-1)  # [b, E, K-1+T]
        state.conv[self.layer_idx] = history[..., history.shape[-1] - (self.K - 1) :].detach().clone()
        return F.conv1d(history, self.conv1d.weight, self.conv1d.bias, groups=self.E)

    def delta(self, rank: torch.Tensor) -> torch.Tensor:
        """Δ per token and channel, from the token's own low-rank projection: rank [b, T, R] -> [b, T, E] > 0."""
        return F.softplus(rank @ self.dt_proj.weight.T + self.dt_proj.bias.float())

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log) [E, N]: negative, so exp(Δ A) decays the state (in (0, 1])."""
        return -torch.exp(self.A_log.float())

    def step(self, state, x, dt, A, B, C):
        """One token: `selective_step` (state [b, E, N]; x, dt [b, E]; B, C [b, N])."""
        return selective_step(state, x, dt, A, B, C)

    def forward(self, h: torch.Tensor, state: MambaState | None = None, chunk_size: int = 16) -> torch.Tensor:
        """h [b, T, H] -> [b, T, H]. With a state, continues from it and leaves it updated."""
        T = h.shape[1]
        x, z = self.in_proj(h).chunk(2, dim=-1)  # [b, T, E] each
        x = F.silu(self.causal_conv(x.transpose(1, 2), state)).transpose(1, 2)  # [b, T, E]
        rank, B, C = self.x_proj(x).split([self.R, self.N, self.N], dim=-1)  # [b, T, R], [b, T, N] x2
        dt, A = self.delta(rank).float(), self.decay_rates()  # [b, T, E], [E, N]
        start = state.ssm[self.layer_idx] if state is not None else None
        if T == 1 and start is not None:
            y, last = self.step(start, x[:, 0].float(), dt[:, 0], A, B[:, 0].float(), C[:, 0].float())
            y = y[:, None]
        else:
            y, last = selective_scan(x.float(), dt, A, B.float(), C.float(), start, chunk_size)
        if state is not None:
            state.ssm[self.layer_idx] = last.detach().clone()  # not a view keeping the chunk alive
        y = (y + x.float() * self.D.float()) * F.silu(z.float())  # [b, T, E]: the D skip, the SiLU gate
        return self.out_proj(y.to(h.dtype))


class MambaBlock(nn.Module):
    def __init__(self, config: MambaConfig, layer_idx: int):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = MambaRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = MambaMixer(config, layer_idx)

    def forward(self, h: torch.Tensor, state: MambaState | None = None, chunk_size: int = 16) -> torch.Tensor:
        """h [b, T, H] -> [b, T, H]: h + mixer(norm(h)), the residual in float32 if configured."""
        residual = h.float() if self.residual_in_fp32 else h
        return residual + self.mixer(self.norm(h.to(self.norm.weight.dtype)), state, chunk_size)


class MambaBackbone(nn.Module):
    def __init__(self, config: MambaConfig):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MambaBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm_f = MambaRMSNorm(config.hidden_size, config.layer_norm_epsilon)


class MambaForCausalLM(nn.Module):
    """The language model: `backbone` (embeddings, blocks, norm_f) and a tied `lm_head`."""

    state_class = MambaState  # what decoding carries instead of a KV cache

    def __init__(self, config: MambaConfig):
        super().__init__()
        self.config = config
        self.backbone = MambaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: MambaState | None = None,
        last_only: bool = False,
        chunk_size: int = 16,
    ) -> torch.Tensor:
        """input_ids [b, T] -> logits [b, T, V] ([b, 1, V] with last_only).

        kv_cache: a `MambaState` to continue from and update (named as the transformer's
        argument so one decode loop drives both); anything else is a TypeError.
        """
        if kv_cache is not None and not isinstance(kv_cache, MambaState):
            raise TypeError(
                f"a Mamba model carries a fixed-size MambaState, not a {type(kv_cache).__name__}: "
                "it has no KV cache to fill"
            )
        h = self.backbone.embeddings(input_ids)  # [b, T, H]
        for block in self.backbone.layers:
            h = block(h, kv_cache, chunk_size)
        if kv_cache is not None:
            kv_cache.length += input_ids.shape[1]
        if last_only:
            h = h[:, -1:]
        h = self.backbone.norm_f(h.to(self.backbone.norm_f.weight.dtype))
        return self.lm_head(h.to(self.lm_head.weight.dtype))


def refuse_state_space(model, what: str) -> None:
    """A one-line ValueError if `model` is a Mamba model and `what` (a KV-cache engine) cannot run it."""
    if isinstance(model, MambaForCausalLM):
        raise ValueError(
            f"{what} needs a model with a KV cache, and this Mamba model carries a fixed-size state "
            "instead: generate with decodelab.decoding.generate "
            "(python -m decodelab generate --model tiny-mamba, or the model's folder)"
        )


# --------------------------------------------------------------------------- folders
def save_mamba(model: MambaForCausalLM, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """config.json (transformers' MambaConfig fields) + model.safetensors (lm_head left out when tied)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["torch_dtype"] = str(dtype or model.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {
        name: (t.to(dtype) if dtype is not None else t).contiguous()
        for name, t in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_mamba(folder: str | Path, device=None, dtype: torch.dtype | None = torch.float32) -> MambaForCausalLM:
    """A Mamba folder -> the model on device, in dtype; every tensor checked by name and shape."""
    from decodelab.model.weights import WeightsError, read_state_dict

    folder = Path(folder)
    config = MambaConfig.from_file(folder / "config.json")
    model = MambaForCausalLM(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = read_state_dict(folder)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k]]
    if missing or unexpected or wrong:
        raise WeightsError(
            f"{folder}: the weights do not fit its Mamba config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}"
        )
    model.load_state_dict(state, strict=False)
    return model.to(device=device, dtype=dtype).eval()

"""Tiled attention with an online softmax: FlashAttention's idea, written out in PyTorch.

Plain attention builds the score matrix q.k^T of every query against every key, [T, S] per
head, before its softmax: memory that grows with the square of the sequence. Dao et al.
(FlashAttention, 2022) never build it. Keys and values arrive in tiles of `tile_size`
positions (on a GPU, tiles that fit the small on-chip SRAM); each query keeps three running
quantities, and every new tile rescales them:

    m   the largest score seen so far                       (running_max)
    l   sum of exp(score - m) over the keys seen so far     (running_sum)
    o   sum of exp(score - m) * value over those keys       (running_out, not yet divided by l)

When a tile raises the maximum from m to m', everything accumulated so far was measured
against the old m, so it is multiplied by exp(m - m') before the tile's own terms are added.
After the last tile, o / l is exactly softmax(scores) @ V, up to float rounding, while the
largest score block ever held is [T, tile_size]: memory O(T * tile) instead of O(T * S).

Causal attention tiles the queries too (`tiled_causal_attention`): a query tile needs no key tile
that lies wholly in its future, so about half of a prompt's tiles are never computed, and only the
tiles that cross the diagonal need a mask.

Shapes: q [B, H, T, D]; k, v [B, H_kv, S, D] with H a multiple of H_kv (grouped-query
attention as in `decodelab.model.attention.causal_attention`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from decodelab.model.attention import repeat_kv


def online_softmax_update(
    running_max: torch.Tensor,
    running_sum: torch.Tensor,
    running_out: torch.Tensor,
    scores_tile: torch.Tensor,
    v_tile: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of keys into the running softmax state; returns (new_max, new_sum, new_out).

    running_max [..., T]: the largest score seen so far per query (-inf before the first tile).
    running_sum [..., T]: sum over the keys seen so far of exp(score - running_max) (0 at first).
    running_out [..., T, D]: sum over those keys of exp(score - running_max) * value (0 at first).
    scores_tile [..., T, tile]: this tile's scaled scores q.k / sqrt(D); -inf where masked.
    v_tile [..., tile, D]: this tile's values.
    The state is rescaled by exp(old max - new max) before the tile's terms are added. A query
    whose scores so far are all -inf keeps max -inf and sum and out 0 (never NaN).
    """
    new_max = torch.maximum(running_max, scores_tile.amax(dim=-1))  # [..., T]
    # Rows with nothing visible yet keep -inf; subtract 0 there so exp() gives 0, not NaN.
    shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
    rescale = torch.exp(running_max - shift)  # [..., T]: exp(old max - new max) <= 1
    weights = torch.exp(scores_tile - shift[..., None])  # [..., T, tile]
    new_sum = running_sum * rescale + weights.sum(dim=-1)
    new_out = running_out * rescale[..., None] + weights @ v_tile  # [..., T, D]
    return new_max, new_sum, new_out


def combine_partial_attention(maxes: torch.Tensor, sums: torch.Tensor, outs: torch.Tensor) -> torch.Tensor:
    """Merge C partial softmax states, each over its own split of the keys, into the attention output.

    maxes [C, ..., T], sums [C, ..., T], outs [C, ..., T, D]: for split c, the (running_max,
    running_sum, running_out) that `online_softmax_update` reaches over the keys of that split alone
    (-inf, 0, 0 where a query sees none of them). With m = max_c maxes[c], each split's sum and
    output were measured against its own max, so both are rescaled by exp(maxes[c] - m) before
    they are added: out = sum_c outs[c] e^(maxes[c] - m) / sum_c sums[c] e^(maxes[c] - m), [..., T, D].
    Every query must see at least one key in some split. This is the last step of split-K
    ("flash decoding"): the splits of one long cache run in parallel, then merge.
    ValueError when the shapes do not line up.
    """
    if maxes.shape != sums.shape or outs.shape[:-1] != maxes.shape:
        raise ValueError(
            f"maxes {tuple(maxes.shape)} and sums {tuple(sums.shape)} must be [C, ..., T] and outs "
            f"{tuple(outs.shape)} [C, ..., T, D]"
        )
    top = maxes.amax(dim=0)  # [..., T]: the largest score of all splits
    shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # no -inf - (-inf)
    scale = torch.exp(maxes - shift)  # [C, ..., T]: 0 for a split a query did not see
    total = (sums * scale).sum(dim=0)  # [..., T]
    return (outs * scale[..., None]).sum(dim=0) / total[..., None]  # [..., T, D]


def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_size: int = 64, causal: bool = True, q_offset: int = 0
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, H_kv, S, D], one tile of keys at a time; [B, H, T, D].

    Never holds a score block larger than [B, H, T, tile_size]. causal=True: query t sits at
    position q_offset + t and sees keys 0 .. q_offset + t (S must equal q_offset + T), tiles
    entirely in every query's future are skipped; causal=False: every query sees every key.
    Scores, softmax and sums in float32 (float64 stays float64); returns q's dtype.
    """
    if tile_size < 1:
        raise ValueError(f"tile_size must be at least 1, got {tile_size}")
    batch, num_heads, num_queries, head_dim = q.shape
    num_keys = k.shape[2]
    if causal and num_keys != q_offset + num_queries:
        raise ValueError(f"causal attention got {num_keys} keys for {num_queries} queries at offset {q_offset}")
    group = num_heads // k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_scaled = q.to(work) / math.sqrt(head_dim)  # [B, H, T, D]
    running_max = torch.full((batch, num_heads, num_queries), float("-inf"), dtype=work, device=q.device)
    running_sum = torch.zeros(batch, num_heads, num_queries, dtype=work, device=q.device)
    running_out = torch.zeros(batch, num_heads, num_queries, head_dim, dtype=work, device=q.device)
    q_pos = torch.arange(q_offset, q_offset + num_queries, device=q.device)[:, None]  # [T, 1]
    last_visible = q_offset + num_queries - 1 if causal else num_keys - 1
    for start in range(0, last_visible + 1, tile_size):
        end = min(start + tile_size, num_keys)
        k_tile = repeat_kv(k[:, :, start:end], group).to(work)  # [B, H, tile, D]
        v_tile = repeat_kv(v[:, :, start:end], group).to(work)
        scores = q_scaled @ k_tile.transpose(-2, -1)  # [B, H, T, tile]: the only score block held
        if causal and end - 1 > q_offset:  # some query of this tile's rows would see its future
            k_pos = torch.arange(start, end, device=q.device)[None, :]  # [1, tile]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        running_max, running_sum, running_out = online_softmax_update(
            running_max, running_sum, running_out, scores, v_tile
        )
    return (running_out / running_sum[..., None]).to(q.dtype)


def tiled_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile_size: int = 64, q_offset: int = 0
) -> tuple[torch.Tensor, int, int]:
    """Causal attention in square tiles, FlashAttention's way; returns (out [B, H, T, D], tiles_computed, tiles_masked).

    q [B, H, T, D] holds the queries at positions q_offset .. q_offset + T - 1; k, v [B, H_kv, S, D]
    the keys 0 .. S - 1 (S = q_offset + T: a prefill chunk after a cached prefix, T = 1 for a decode
    step; H a multiple of H_kv). The queries are cut into tiles of `tile_size` rows and the keys into
    tiles of `tile_size` columns; for each query tile (positions first .. last), a key tile
    start .. end - 1 is
      skipped  when start > last (every key in the future of every query: never computed),
      unmasked when end - 1 <= first (every key visible to every query: no mask needed),
      masked   otherwise (the tile crosses the diagonal).
    A tile is one (query tile, key tile) pair, over all batch rows and heads at once;
    tiles_computed counts those not skipped, tiles_masked those of them that needed the mask.
    Scores and sums in float32 (float64 stays float64); out in q's dtype. ValueError for a
    tile_size below 1 or S != q_offset + T.
    """
    if tile_size < 1:
        raise ValueError(f"tile_size must be at least 1, got {tile_size}")
    batch, num_heads, num_queries, head_dim = q.shape
    num_keys = k.shape[2]
    if q_offset < 0 or num_keys != q_offset + num_queries:
        raise ValueError(f"causal attention got {num_keys} keys for {num_queries} queries at offset {q_offset}")
    group = num_heads // k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(batch, num_heads, num_queries, head_dim, dtype=work, device=q.device)
    computed = masked = 0
    for q_start in range(0, num_queries, tile_size):
        q_end = min(q_start + tile_size, num_queries)
        first, last = q_offset + q_start, q_offset + q_end - 1  # positions of the tile's first and last query
        q_tile = q[:, :, q_start:q_end].to(work) / math.sqrt(head_dim)  # [B, H, tq, D]
        q_pos = torch.arange(first, last + 1, device=q.device)[:, None]  # [tq, 1]
        running_max = torch.full(q_tile.shape[:-1], float("-inf"), dtype=work, device=q.device)  # [B, H, tq]
        running_sum = torch.zeros_like(running_max)
        running_out = torch.zeros_like(q_tile)  # [B, H, tq, D]
        for k_start in range(0, last + 1, tile_size):  # tiles that start after `last` are skipped
            k_end = min(k_start + tile_size, num_keys)
            k_tile = repeat_kv(k[:, :, k_start:k_end], group).to(work)  # [B, H, tk, D]
            v_tile = repeat_kv(v[:, :, k_start:k_end], group).to(work)
            scores = q_tile @ k_tile.transpose(-2, -1)  # [B, H, tq, tk]
            if k_end - 1 > first:  # on the diagonal: some query here must not see some key here
                k_pos = torch.arange(k_start, k_end, device=q.device)[None, :]  # [1, tk]
                scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
                masked += 1
            running_max, running_sum, running_out = online_softmax_update(
                running_max, running_sum, running_out, scores, v_tile
            )
            computed += 1
        out[:, :, q_start:q_end] = running_out / running_sum[..., None]
    return out.to(q.dtype), computed, masked


def attention_memory_bytes(
    num_queries: int,
    num_keys: int,
    num_heads: int = 1,
    batch_size: int = 1,
    tile_size: int | None = None,
    bytes_per_value: float = 4,
) -> int:
    """Bytes of the largest score block one attention call holds: B * H * T * w * bytes_per_value.

    w = num_keys (S) for plain attention (tile_size None: the whole [T, S] matrix per head),
    w = min(tile_size, S) for tiled attention ([T, tile] per head). Grows as T * S for plain
    attention (n^2 for a prompt of n tokens), as T * tile for tiled attention (linear in n).
    """
    if tile_size is not None and tile_size < 1:
        raise ValueError(f"tile_size must be at least 1 (or None for plain attention), got {tile_size}")
    width = num_keys if tile_size is None else min(tile_size, num_keys)
    return int(batch_size * num_heads * num_queries * width * bytes_per_value)


@dataclass
class TensorMemory:
    """What `measure_tensor_memory` saw: the peak of the bytes held by the tensors that the call
    created (its inputs excluded), and the largest single tensor it created."""

    peak_bytes: int = 0
    largest_numel: int = 0
    largest_shape: tuple = ()
    _live: dict = field(default_factory=dict, repr=False)  # storage address -> [bytes, tensors alive]
    _held: int = 0


class _TrackTensors(TorchDispatchMode):
    """Sees the output of every tensor operation; counts a storage from its first tensor until its
    last tensor is garbage (CPython frees at once). Work buffers inside one kernel are not seen.

    An operation that PyTorch writes in terms of others (a composite such as `matmul`, `einsum`,
    `reshape`, `softmax`) is run through its decomposition under this mode, so the tensors it
    makes on the way are counted too: `a @ b` with a broadcast batch dimension expands and copies
    the broadcast operand before its `bmm`, and that copy is real memory."""

    def __init__(self, record: TensorMemory, existing: set[int]):
        super().__init__()
        self.record, self.existing = record, existing
        self.depth = 0  # > 0 inside a composite's decomposition
        self.largest_is_outer = False

    def _note_size(self, tensor: torch.Tensor) -> None:
        """The largest tensor so far; on a tie, a result of the caller's own op names it rather than
        a part inside a composite (matmul's [B*H, T, S] bmm result is the caller's [B, H, T, S])."""
        numel, outer = tensor.numel(), self.depth == 0
        if numel > self.record.largest_numel or (
            numel == self.record.largest_numel and outer and not self.largest_is_outer
        ):
            self.record.largest_numel, self.record.largest_shape = numel, tuple(tensor.shape)
            self.largest_is_outer = outer

    def _forget(self, address: int) -> None:
        entry = self.record._live.get(address)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.record._held -= entry[0]
            del self.record._live[address]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.depth += 1
        try:
            with self:  # a composite op: its parts come back through this mode and are counted there
                out = func.decompose(*args, **kwargs)
        finally:
            self.depth -= 1
        if out is not NotImplemented:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self._note_size(tensor)
            return out
        out = func(*args, **kwargs)
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(tensor, torch.Tensor):
                continue
            self._note_size(tensor)
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address in self.existing or storage.nbytes() == 0:
                continue  # a view of an input (or empty): no new memory
            if address not in self.record._live:
                self.record._live[address] = [storage.nbytes(), 0]
                self.record._held += storage.nbytes()
                self.record.peak_bytes = max(self.record.peak_bytes, self.record._held)
            self.record._live[address][1] += 1
            weakref.finalize(tensor, self._forget, address)
        return out


def measure_tensor_memory(fn, *args, **kwargs) -> tuple[object, TensorMemory]:
    """Run fn(*args, **kwargs) and return (its result, TensorMemory): the peak bytes of the tensors
    it created and held at the same time, and the largest tensor it created (numel and shape).

    Measured on any device by watching every tensor operation (a torch dispatch mode), so it
    sees the tensors Python code makes, and those an operation built from others makes on the way
    (the copy `torch.matmul` makes of a broadcast operand), not the scratch memory inside one fused kernel.
    """
    existing = {a.untyped_storage().data_ptr() for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)}
    record = TensorMemory()
    with torch.inference_mode(), _TrackTensors(record, existing):
        result = fn(*args, **kwargs)
    return result, record


def measure_module_memory(module: torch.nn.Module, *args) -> tuple[object, TensorMemory]:
    """`measure_tensor_memory` of module(*args), with the module's own tensors (parameters,
    buffers, tensor attributes) counted as there before the call, like its inputs: a slice of a
    stored weight is a view of it, not new memory; a converted or dequantized copy is."""
    own = [t for t in (*module.parameters(), *module.buffers(), *vars(module).values()) if isinstance(t, torch.Tensor)]
    return measure_tensor_memory(lambda *inputs: module(*inputs[: len(args)]), *args, *own)


__all__ = [
    "online_softmax_update",
    "combine_partial_attention",
    "tiled_attention",
    "tiled_causal_attention",
    "attention_memory_bytes",
    "measure_tensor_memory",
    "measure_module_memory",
    "TensorMemory",
]

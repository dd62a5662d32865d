"""A preallocated key/value cache, one slab per layer (gpt-fast's static cache).

During generation the keys and values of past tokens never change, so each layer keeps
them instead of recomputing them: a new token costs one row of K and V per layer, not a
pass over the whole sequence again.

Shapes: keys and values are stored as [num_layers, B, H_kv, max_seq_len, D].

`SlidingWindowKVCache` keeps only the last W positions, in a ring of W slots, for models whose
attention looks back at most W positions (Mistral-style sliding windows).
"""

from __future__ import annotations

import torch

from decodelab.config import ModelConfig
from decodelab.model.attention import causal_attention


class KVCache:
    """Per-layer K/V for a batch of B sequences that all have the same length.

    `append(layer, k, v)` writes new rows after the ones that layer already holds and
    returns views of everything held (`view(layer)` gives the same without writing); `truncate(n)`
    forgets all but the first n positions (speculative decoding drops rejected draft tokens this way);
    `reorder(rows)` makes row i a copy of old row rows[i] (beam search: each beam takes its parent's rows).
    Shapes: k, v [B, H_kv, T, D]; what a layer holds [B, H_kv, held, D].
    """

    def __init__(
        self, config: ModelConfig, batch_size: int = 1, max_seq_len: int | None = None, device=None, dtype=torch.float32
    ):
        self.max_seq_len = max_seq_len or config.max_position_embeddings
        if self.max_seq_len > config.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's context of {config.max_position_embeddings} tokens"
            )
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, self.max_seq_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = [0] * config.num_hidden_layers
        self.sliding_window = config.sliding_window

    @property
    def seq_len(self) -> int:
        """Positions held by the last layer, i.e. tokens fully processed by the model."""
        return self.lengths[-1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H_kv, T, D] after this layer's rows; return views [B, H_kv, S + T, D].
        Raises ValueError if S + T would exceed max_seq_len."""
        start, new = self.lengths[layer], k.shape[2]
        end = start + new
        if end > self.max_seq_len:
            raise ValueError(f"KV cache is full: {start} + {new} tokens exceed max_seq_len={self.max_seq_len}")
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        self.lengths[layer] = end
        return self.view(layer)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of the keys and values this layer holds: [B, H_kv, held, D] each."""
        held = self.lengths[layer]
        return self.keys[layer, :, :, :held], self.values[layer, :, :, :held]

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of every layer (0 <= length <= seq_len), else ValueError."""
        if not 0 <= length <= min(self.lengths):
            raise ValueError(f"cannot truncate a cache of {min(self.lengths)} tokens to {length}")
        self.lengths = [length] * len(self.lengths)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i of the batch becomes old row rows[i], in every layer: rows [B'] of indices into the
        old batch, repeats allowed, so the batch size becomes B'. One `index_select` on the batch
        dimension of keys and values [num_layers, B, H_kv, max_seq_len, D]. Beam search calls it after
        each step, rows = each surviving beam's parent. Raises ValueError for an index outside [0, B)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.keys.device)
        batch = self.keys.shape[1]
        if rows.dim() != 1 or rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= batch:
            raise ValueError(f"reorder needs a non-empty 1-D list of rows in [0, {batch}), got {rows.tolist()}")
        self.keys = self.keys.index_select(1, rows)
        self.values = self.values.index_select(1, rows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's hook: cache the new k, v and attend q [B, H, T, D] over all held tokens."""
        offset = self.lengths[layer]
        k_all, v_all = self.append(layer, k, v)
        return causal_attention(q, k_all, v_all, q_offset=offset, sliding_window=self.sliding_window)

    def nbytes(self) -> int:
        """Bytes of K and V currently held (not the preallocated capacity)."""
        per_position = self.keys[:, :, :, :1].numel() * self.keys.element_size() * 2
        return per_position * self.seq_len


class SlidingWindowKVCache:
    """Per-layer K/V of the last W positions only, in a ring of W slots: position p lives in slot
    p % W (Mistral's rolling buffer). Its memory stays W slots however long the sequence grows.

    For a model whose attention looks back at most W positions (`config.sliding_window`, or the
    `window` argument, which wins). `append(layer, k, v)` returns the positions the layer held
    before, in position order, followed by the new rows: a chunk's early queries need keys that
    its own later rows overwrite in the ring. `attend` masks each query to its own window.
    Shapes: k, v [B, H_kv, T, D]; held [B, H_kv, min(S, W), D] after S positions; the ring
    [L, B, H_kv, W, D]. `max_seq_len` is accepted so the class drops in where a `KVCache` is made
    (`cache_class(config, B, max_seq_len, ...)`); a ring never fills, so it is not used.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int = 1,
        max_seq_len: int | None = None,
        device=None,
        dtype=torch.float32,
        window: int | None = None,
    ):
        self.window = config.sliding_window if window is None else window  # W
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(
                f"a sliding-window cache needs a window of at least 1 position, got {self.window!r} "
                "(pass window=W or use a config with sliding_window)"
            )
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, self.window, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H_kv, W, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = [0] * config.num_hidden_layers  # positions each layer has seen (held: at most W)

    @property
    def seq_len(self) -> int:
        """Positions seen by the last layer, i.e. tokens fully processed (all of them, not only the W held):
        the model reads the next token's position, and so its rotary angle, from it."""
        return self.lengths[-1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H_kv, T, D] (only their last W rows survive); return the positions held before
        followed by the new rows, [B, H_kv, min(S, W) + T, D], in position order (copies). ValueError
        for k, v of another shape than the cache's."""
        batch, kv_heads, _, head_dim = self.keys.shape[1:]
        if k.dim() != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (batch, kv_heads, head_dim):
            raise ValueError(
                f"append takes k and v of shape [B={batch}, H_kv={kv_heads}, T, D={head_dim}], "
                f"got {list(k.shape)} and {list(v.shape)}"
            )
        start, new = self.lengths[layer], k.shape[2]
        held_k, held_v = self.view(layer)  # taken before the ring is overwritten
        kept = min(new, self.window)  # a chunk longer than the window overwrites itself
        slots = torch.arange(start + new - kept, start + new, device=self.keys.device) % self.window
        self.keys[layer, :, :, slots] = k[:, :, new - kept :]
        self.values[layer, :, :, slots] = v[:, :, new - kept :]
        self.lengths[layer] = start + new
        return torch.cat([held_k, k], 2), torch.cat([held_v, v], 2)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last min(S, W) positions this layer holds, in position order: [B, H_kv, held, D] each
        (copies: once the ring wraps, slot order is not position order)."""
        seen = self.lengths[layer]
        slots = torch.arange(max(0, seen - self.window), seen, device=self.keys.device) % self.window
        return self.keys[layer, :, :, slots], self.values[layer, :, :, slots]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's hook: cache the new k, v and attend q [B, H, T, D] over each query's last W positions."""
        k_all, v_all = self.append(layer, k, v)  # [B, H_kv, held + T, D]
        held = k_all.shape[2] - k.shape[2]  # the queries sit after the held positions
        return causal_attention(q, k_all, v_all, q_offset=held, sliding_window=self.window)

    def nbytes(self) -> int:
        """Bytes of K and V currently held: min(seq_len, W) positions (the ring itself is W slots)."""
        per_position = self.keys[:, :, :, :1].numel() * self.keys.element_size() * 2
        return per_position * min(self.seq_len, self.window)

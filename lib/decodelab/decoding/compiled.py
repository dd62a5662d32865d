"""A compiled decode step for one request (gpt-fast's recipe, on a CPU with inductor's C++ backend).

Eager decode runs some fifteen small operations per layer, each a trip through Python and the
dispatcher, and a CPU decode step reads every weight once. `torch.compile` fuses the small
operations into a few C++ loops and, with int8 weights (`decodelab.model.fused_int8`), fuses
their dequantization into the matrix-vector products.

A compiled function must see the same shapes at every token, or it compiles again. So the step
attends over every slot of the preallocated `KVCache` (shape [L, 1, H_kv, max_seq_len, D]), with
a mask that hides the slots not yet written, and takes the token's position as a tensor; the
slot count is marked dynamic, so caches of other lengths reuse the same code. Prefill (many
tokens at once, once per request) stays eager.

    decoder = CompiledDecoder(model)
    ids = list(stream_token_ids(decoder, prompt_ids, params))  # same ids as with `model`

The first step compiles (tens of seconds on a small CPU, in every new process: Dynamo traces the
model again even when inductor's on-disk cache holds the code): it pays only for long or many runs.
`decodelab.decoding.packaged` compiles the same step ahead of time into a file instead.
`decoder.compiles` counts the graphs compiled, to show that a growing context compiles nothing.
"""

from __future__ import annotations

import torch

from decodelab.model.attention import masked_attention
from decodelab.model.kv_cache import KVCache


class SlotAttention:
    """The cache as the compiled step sees it: keys and values [L, B, H_kv, S_max, D], the new
    token written at `position` [1] (a tensor), and attention over all S_max slots with the
    unwritten ones (and, with a sliding window, the too-old ones) masked out."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, sliding_window: int | None):
        self.keys, self.values, self.position = keys, values, position
        slots = torch.arange(keys.shape[3], device=keys.device)  # [S_max]
        allowed = slots <= position  # [S_max]
        if sliding_window is not None:
            allowed = allowed & (slots > position - sliding_window)
        self.mask = allowed[None]  # [T=1, S_max]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, 1, D], k, v [B, H_kv, 1, D] -> [B, H, 1, D]; writes k, v into their slot."""
        self.keys[layer].index_copy_(2, self.position, k)
        self.values[layer].index_copy_(2, self.position, v)
        return masked_attention(q, self.keys[layer], self.values[layer], self.mask)


def decode_step(model, input_ids, position, keys, values) -> torch.Tensor:
    """One token through `model` over the slot cache, the step that is compiled (here) or exported
    (`decodelab.decoding.packaged`): input_ids [1, 1], position [1] int64, keys and values
    [L, 1, H_kv, S_max, D] (the token's K and V are written into slot `position`) -> logits [1, 1, V]."""
    slots = SlotAttention(keys, values, position, model.config.sliding_window)
    return model(input_ids, positions=position, kv_cache=slots, last_only=True)


def next_position(kv_cache, config) -> int:
    """The slot the next token goes to in `kv_cache` (a `KVCache` whose layers all hold the same
    count); TypeError for another cache, ValueError when the cache or the model's context is full."""
    if type(kv_cache) is not KVCache:
        raise TypeError(f"the compiled step writes into decodelab's KVCache, got a {type(kv_cache).__name__}")
    position = kv_cache.seq_len
    if min(kv_cache.lengths) != position or position >= kv_cache.max_seq_len:
        raise ValueError(
            f"the cache cannot take a token at position {position} "
            f"(layers hold {sorted(set(kv_cache.lengths))}, max_seq_len={kv_cache.max_seq_len})"
        )
    if position >= config.max_position_embeddings:
        raise ValueError(
            f"position {position} is beyond the model's context of {config.max_position_embeddings} tokens"
        )
    return position


class CompiledDecoder:
    """A model whose one-token steps run compiled; call it like the model.

    `decoder(input_ids, kv_cache=cache, last_only=True)` with one new token and a `KVCache`
    runs the compiled step; anything else (prefill, no cache) runs the model eagerly. The model
    must stay as it is after the first step (its guards are no longer checked: see __call__).
    """

    def __init__(self, model, backend: str = "inductor"):
        self.model, self.config = model, model.config
        # Graphs compiled during this decoder's calls (a recompile adds one). The weights are inputs
        # of the graph, so a second decoder on a model of the same shapes reuses the first one's.
        self.compiles = 0
        self._warm = False  # True once a step has run: its guards are no longer checked
        self._step = torch.compile(self._decode_step, backend=backend, fullgraph=True)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def _decode_step(self, input_ids, position, keys, values):
        return decode_step(self.model, input_ids, position, keys, values)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, kv_cache=None, last_only: bool = False
    ) -> torch.Tensor:
        """input_ids [1, 1] with a KVCache -> logits [1, 1, V] from the compiled step; else the
        model's own forward (same arguments, same result)."""
        if kv_cache is None or positions is not None or input_ids.shape != (1, 1):
            return self.model(input_ids, positions=positions, kv_cache=kv_cache, last_only=last_only)
        position = next_position(kv_cache, self.config)
        from torch._dynamo.utils import counters  # here: importing Dynamo costs ~1.3 s, which the package avoids

        torch._dynamo.mark_dynamic(kv_cache.keys, 3)  # any max_seq_len: one graph for all
        torch._dynamo.mark_dynamic(kv_cache.values, 3)
        before = counters["stats"]["unique_graphs"]
        arguments = (input_ids, torch.tensor([position], device=input_ids.device), kv_cache.keys, kv_cache.values)
        try:
            # Once the one graph exists, checking its guards (a few hundred: every weight's shape,
            # dtype, device) cost ~1-2 ms a token on a 2-core CPU, for nothing: only the cache length
            # changes, and that dimension is dynamic. Hence the model must not change after the
            # first step. A change of global state (torch.set_num_threads) is still caught, and
            # compiles again below.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=self._warm):
                logits = self._step(*arguments)
        except RuntimeError as error:
            if "skip_guard_eval_unsafe" not in str(error):
                raise
            logits = self._step(*arguments)
        self.compiles += counters["stats"]["unique_graphs"] - before
        self._warm = True
        kv_cache.lengths = [position + 1] * len(kv_cache.lengths)
        return logits

"""A static batch: prompts of different lengths run through the model in ONE forward pass, the
way a static-batching server (and `transformers`' `generate` on a padded batch) prefills them.
Notebook 08's exercise `padded_prefill` and the padding-waste measurement after it.

Three prompts of 2, 4 and 3 tokens, left-padded to the longest (T = 4), pads shown as `_`:

    ids         _ _ a b      c d e f      _ f g h
    positions   0 0 0 1      0 1 2 3      0 0 1 2     (0 at each prompt's first real token)
    real        0 0 1 1      1 1 1 1      0 1 1 1

Left padding puts every prompt's last token in the last column, where its next-token logits
are read. Each prompt's first real token gets position 0, as when it runs alone. The mask
[B, 1, T, T] lets query t see key s when s <= t (causal) and s is a real token, so no real
token ever looks at a pad. A pad query sees only itself, so that no row of the mask is empty:
PyTorch's SDPA returns zeros for an empty row since version 2.5, but NaN before it (and so do
many other attention kernels), and a NaN in a pad's values would reach the real tokens in the
next layer, since 0 x NaN is NaN. Each row's logits then equal the prompt's own, alone, up to
float rounding. The price: the pass computes all B x T slots, real or not; the pad fraction
is what was spent on nothing.
"""

from __future__ import annotations

import torch

from decodelab.model.attention import MaskedPass, causal_mask


def padded_prefill(model, prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, float]:
    """Next-token logits of prompts of different lengths from ONE forward pass -> (logits [B, V],
    float32, row b for prompts[b]; the fraction of the B x T token slots that were padding).

    Left-pads to the longest prompt (T tokens) with pad_id, gives each real token its position
    in its own prompt (from 0), and masks the pads out of every real token's attention, laid out
    as the module docstring shows. ValueError for no prompt, an empty prompt, or a pad_id or
    token id outside [0, vocab_size).
    """
    if not prompts:
        raise ValueError("padded_prefill needs at least one prompt")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError(f"every prompt needs at least one token, got lengths {[len(p) for p in prompts]}")
    vocab_size = model.config.vocab_size
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id must be in [0, {vocab_size}), got {pad_id}")
    if any(not 0 <= token < vocab_size for prompt in prompts for token in prompt):
        raise ValueError(f"every token id must be in [0, {vocab_size})")
    device = model.device
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)  # [B]
    batch, longest = len(prompts), int(lengths.max())
    ids = torch.full((batch, longest), pad_id, dtype=torch.long, device=device)  # [B, T]
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=device)
    columns = torch.arange(longest, device=device)  # [T]
    first_real = longest - lengths  # [B]: the column of each prompt's first token
    real = columns[None, :] >= first_real[:, None]  # [B, T]
    positions = (columns[None, :] - first_real[:, None]).clamp(min=0)  # [B, T]
    causal = causal_mask(longest, longest, 0, device, model.config.sliding_window)  # [T, T]
    mask = causal[None] & real[:, None, :]  # [B, T, T]: query t may see key s
    mask |= torch.eye(longest, dtype=torch.bool, device=device)  # a pad query sees itself: no empty row
    logits = model(ids, positions=positions, kv_cache=MaskedPass(mask[:, None]), last_only=True)  # [B, 1, V]
    pad_fraction = 1 - int(lengths.sum()) / (batch * longest)
    return logits[:, -1], pad_fraction


def default_pad_id(config) -> int:
    """The id to pad with: the model's pad token, else its end-of-text token (what `transformers`
    users set as pad_token_id when a tokenizer has none), else 0. Any id would do: pads are masked."""
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    return next(iter(config.eos_token_ids), 0)


@torch.inference_mode()
def batch_padding(prefill, model, prompts: list[list[int]], batch_size: int, by_length: bool = False) -> float:
    """Serve prompts as static batches of batch_size through `prefill` (padded_prefill's signature)
    -> the fraction of all computed token slots that were padding. Batches are formed in the
    given (arrival) order, or after sorting the prompts by length (by_length: bucketing)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(prompts, key=len) if by_length else list(prompts)
    pad_id = default_pad_id(model.config)
    pads = slots = 0.0
    for start in range(0, len(order), batch_size):
        group = order[start : start + batch_size]
        _, fraction = prefill(model, group, pad_id)
        group_slots = len(group) * max(len(p) for p in group)
        pads, slots = pads + fraction * group_slots, slots + group_slots
    return pads / slots


__all__ = ["padded_prefill", "default_pad_id", "batch_padding"]

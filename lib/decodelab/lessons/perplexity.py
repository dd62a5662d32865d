"""Perplexity: how surprised a model is by text it has not seen, exp(mean next-token NLL).

A perplexity of 12 means the model is on average as unsure as a uniform choice among 12
tokens. It is the usual yardstick for "did quantization hurt?": same text, same tokenizer,
compare the numbers (across tokenizers they are not comparable).

Long texts are scored in sliding windows of `window` tokens that start every `stride`
tokens; each token is scored once, in the first window that holds it as a target and
with at least window - stride tokens of context before it (except near the start), as in
the Hugging Face perplexity guide.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from decodelab.paths import PACKAGE_DATA

HELDOUT_FILES = {
    "en": PACKAGE_DATA / "heldout_en.txt",  # English prose from CPython 3.11's reference manual (see data/HELDOUT.md)
    "code": PACKAGE_DATA / "corpus" / "heldout.txt",  # Python source held out from `tiny`'s training
}


def heldout_text(which: str = "en") -> str:
    """Held-out text for perplexity: "en" (English prose, for SmolLM2) or "code" (Python
    source that the `tiny` model never trained on). FileNotFoundError if the file is absent."""
    if which not in HELDOUT_FILES:
        raise ValueError(f"which must be one of {sorted(HELDOUT_FILES)}, got {which!r}")
    path = HELDOUT_FILES[which]
    if not path.exists():
        raise FileNotFoundError(f"held-out text {which!r} is missing: {path} (the training script writes it)")
    return path.read_text(encoding="utf-8")


@torch.inference_mode()
def token_nlls(model, token_ids, window: int = 512, stride: int = 256) -> torch.Tensor:
    """Negative log-likelihood (nats, float32) of each token after the first: [N - 1].

    token_ids: N >= 2 ids (list or 1-D tensor). Each window of up to `window` tokens is one
    forward pass without a KV cache; logits are float32 whatever the model's dtype.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    n = ids.numel()
    context = model.config.max_position_embeddings
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    if not 2 <= window <= context:
        raise ValueError(f"window must be in [2, {context}] (the model's context), got {window}")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be in [1, {window - 1}] (window - 1), got {stride}")
    ids = ids.to(model.device)
    nlls, scored_until = [], 1  # targets are positions 1 .. n-1; positions < scored_until are done
    for start in range(0, n - 1, stride):
        end = min(start + window, n)
        chunk = ids[start:end]  # [L]
        logits = model(chunk[None])[0, :-1].float()  # [L - 1, V]: predicts positions start+1 .. end-1
        nll = F.cross_entropy(logits, chunk[1:], reduction="none")  # [L - 1]
        nlls.append(nll[scored_until - (start + 1) :])
        scored_until = end
        if end == n:
            break
    return torch.cat(nlls).cpu()


def perplexity(model, token_ids, window: int = 512, stride: int = 256) -> float:
    """exp(mean NLL) of every token after the first, scored in sliding windows (see the
    module docstring). The mean is summed in float64 from float32 per-token losses."""
    nll = token_nlls(model, token_ids, window, stride)
    return math.exp(nll.double().mean().item())


__all__ = ["perplexity", "token_nlls", "heldout_text"]

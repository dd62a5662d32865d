"""The theory of speculative decoding (Leviathan et al. 2023): the acceptance rate of a draft
distribution against the target's, the total variation distance it equals one minus, and what
a step yields when each draft is accepted independently: tokens per target call and speed-up.

Shapes: V vocab_size; p and q may carry any leading dimensions.
"""

from __future__ import annotations

import torch

from decodelab.validation import check_int


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - tvd(p, q): the chance that one draft is accepted.
    p, q [..., V] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance 1/2 sum_x |p(x) - q(x)|: p, q [..., V] -> [...]."""
    return 0.5 * (p - q).abs().sum(dim=-1)


def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    check_int("k", k, minimum=0)


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per target call when each draft is accepted
    independently with probability alpha (k+1 at alpha = 1)."""
    _check_alpha_k(alpha, k)
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Leviathan et al., Theorem 3.8: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), the walltime
    gain when a draft step costs c = draft_cost target steps and verifying k+1 tokens costs
    one target step (on real hardware it costs a bit more: measure it)."""
    if not draft_cost >= 0:
        raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
    return expected_tokens_per_call(alpha, k) / (k * draft_cost + 1)

"""When to keep OpenMP's thread team asleep: small operations run on the calling thread alone.

`import decodelab` sets OMP_WAIT_POLICY=PASSIVE (so a shared machine stays usable): between two
parallel regions OpenMP's idle threads sleep, and each region wakes them again, which costs
~30-60 us on a 2-core VM. A decode step is hundreds of small operations (a SmolLM2 layer's
one-row products, one token's attention over a short context), each of which takes less on one
thread than the wake-up costs. So while the team sleeps, an operation below its threshold of
work runs on one thread: the block kernels ask `threads_for`, and torch's own operations run
inside `one_thread_if_small`. With GOMP_SPINCOUNT set (threads spin a while before sleeping) or
another policy, nothing changes. Measured by bench/q4_products.py and bench/attention_threads.py.
"""

from __future__ import annotations

import functools
import os
from contextlib import nullcontext

import torch


@functools.cache
def team_sleeps() -> bool:
    """Does OpenMP put its idle threads to sleep at once? OMP_WAIT_POLICY=PASSIVE without a
    GOMP_SPINCOUNT (which keeps them spinning a while), as the environment says."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    return passive and "GOMP_SPINCOUNT" not in os.environ


def threads_for(work: int, one_thread_below: int) -> int:
    """The threads an operation of `work` gets: one when `work < one_thread_below` while the team
    sleeps, else torch's intra-op thread count."""
    if work < one_thread_below and team_sleeps():
        return 1
    return torch.get_num_threads()


class _OneThread:
    """Torch on one thread (the calling thread's OpenMP count) until the block ends, then as before."""

    def __init__(self, before: int):
        self.before = before

    def __enter__(self) -> None:
        torch.set_num_threads(1)

    def __exit__(self, *_exc_info) -> None:
        torch.set_num_threads(self.before)


def one_thread_if_small(work: int, one_thread_below: int, device: torch.device):
    """A context in which torch's operations run on one thread when `work < one_thread_below`, the
    team sleeps and `device` is the CPU; otherwise (and while torch.compile traces, which must not
    see the thread count) one that changes nothing. torch.set_num_threads sets the calling thread's
    OpenMP count: a thread already running torch keeps its own (a thread whose first torch
    operation falls inside would start with one)."""
    if torch.compiler.is_compiling() or device.type != "cpu" or threads_for(work, one_thread_below) != 1:
        return nullcontext()
    before = torch.get_num_threads()
    return nullcontext() if before == 1 else _OneThread(before)


__all__ = ["one_thread_if_small", "team_sleeps", "threads_for"]

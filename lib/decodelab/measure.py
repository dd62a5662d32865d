"""Measuring on the learner's own machine: timers that respect asynchronous devices,
memory-bandwidth and matmul FLOP/s probes (the two roofs of a roofline), and byte counts.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


def synchronize(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_call(fn, device="cpu", repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of fn(), each timed between device synchronizations."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def median(values) -> float:
    return statistics.median(values)


def memory_bandwidth(device="cpu", megabytes: int = 512, repeats: int = 5, method: str = "read") -> float:
    """Bytes per second streamed from memory, with a buffer larger than the caches.

    method="read": a matrix-vector product over a [rows, 4096] float32 matrix, the access
    pattern of batch-1 decode (each weight byte read once); bytes = the matrix's size.
    method="copy": dst.copy_(src); bytes = read + written.
    """
    device = torch.device(device)
    if method == "read":
        matrix = torch.randn(megabytes * 2**20 // (4 * 4096), 4096, device=device)
        vector = torch.randn(4096, device=device)
        seconds = median(time_call(lambda: matrix @ vector, device, repeats))
        return matrix.numel() * matrix.element_size() / seconds
    if method == "copy":
        src = torch.randn(megabytes * 2**20 // 4, device=device)
        dst = torch.empty_like(src)
        seconds = median(time_call(lambda: dst.copy_(src), device, repeats))
        return 2 * src.numel() * src.element_size() / seconds
    raise ValueError(f"method must be 'read' or 'copy', got {method!r}")


def matmul_flops(device="cpu", size: int = 1024, dtype=torch.float32, repeats: int = 5) -> float:
    """Floating-point operations per second of a square matmul (2 n^3 FLOPs each)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = median(time_call(lambda: a @ b, device, repeats))
    return 2 * size**3 / seconds


def parameter_bytes(model) -> int:
    """Bytes of all distinct parameters: what one decode step must read at batch size 1."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: float) -> float:
    """K and V for one token across all layers: 2 x layers x kv_heads x head_dim x bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value


@dataclass
class Roofline:
    """The two roofs of one machine, and where a workload of given intensity lands."""

    bandwidth: float  # bytes / s
    peak_flops: float  # FLOP / s

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound."""
        return self.peak_flops / self.bandwidth

    def attainable_flops(self, intensity: float) -> float:
        return min(self.peak_flops, intensity * self.bandwidth)

    def decode_tokens_per_second(self, bytes_per_token: float) -> float:
        """Upper bound for batch-1 decode: every weight byte is read once per token."""
        return self.bandwidth / bytes_per_token

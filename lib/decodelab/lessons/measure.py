"""Measuring on the learner's own machine: timers that respect asynchronous devices,
memory-bandwidth and matmul FLOP/s probes (the two roofs of a roofline), and byte counts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from decodelab.validation import check_int, check_positive


def synchronize(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn, device="cpu", clock=time.perf_counter) -> tuple[float, object]:
    """(seconds, fn()) of one call of fn(), timed between device synchronizations. `clock` is
    time.perf_counter (wall seconds) or time.process_time (this process's CPU seconds, steadier
    on a machine that other jobs share)."""
    synchronize(device)
    start = clock()
    result = fn()
    synchronize(device)
    return clock() - start, result


def time_call(fn, device="cpu", repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of fn(), each timed between device synchronizations."""
    for _ in range(warmup):
        fn()
    return [timed(fn, device)[0] for _ in range(repeats)]


def median(values) -> float:
    return statistics.median(values)


def memory_bandwidth(device="cpu", megabytes: int = 512, repeats: int = 5, method: str = "read") -> float:
    """Bytes per second streamed from memory: the fastest of `repeats` timed passes over a buffer
    of `megabytes` MiB (after one untimed pass).

    The fastest pass, as STREAM reports its best rate: other work on the machine (another
    process, a test beside this one) only slows a pass down, so the best one is the nearest to
    what this memory can deliver, and a decode that reads the same bytes cannot beat it. Make
    the buffer at least as large as the bytes the workload you compare with reads: a smaller
    one may sit in a large last-level cache (hundreds of MB on some servers) and measure the
    cache instead.

    method="read": a matrix-vector product over a [rows, 4096] float32 matrix, the access
    pattern of batch-1 decode (each weight byte read once); bytes = the matrix's size.
    method="copy": dst.copy_(src); bytes = read + written.
    """
    check_int("megabytes", megabytes, minimum=1)
    check_int("repeats", repeats, minimum=1)
    device = torch.device(device)
    if method == "read":  # the values do not matter, only the bytes: full() fills faster than randn()
        matrix = torch.full((max(1, megabytes * 2**20 // (4 * 4096)), 4096), 0.5, device=device)
        vector = torch.full((4096,), 0.5, device=device)
        seconds = min(time_call(lambda: matrix @ vector, device, repeats))
        return matrix.numel() * matrix.element_size() / seconds
    if method == "copy":
        src = torch.full((megabytes * 2**20 // 4,), 0.5, device=device)
        dst = torch.empty_like(src)
        seconds = min(time_call(lambda: dst.copy_(src), device, repeats))
        return 2 * src.numel() * src.element_size() / seconds
    raise ValueError(f"method must be 'read' or 'copy', got {method!r}")


def matmul_flops(device="cpu", size: int = 1024, dtype=torch.float32, repeats: int = 5) -> float:
    """Floating-point operations per second of a square matmul (2 n^3 FLOPs each)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = median(time_call(lambda: a @ b, device, repeats))
    return 2 * size**3 / seconds


def parameter_bytes(model) -> int:
    """Bytes of the weights one decode step must read at batch size 1: every distinct tensor of
    the state dict (parameters, and the packed weights and scales of quantized layers), a
    tied embedding counted once."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


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


def decode_tokens_per_second_bound(num_params: float, bytes_per_param: float, bandwidth_bytes_per_s: float) -> float:
    """The most tokens per second batch-1 decode can reach when every weight byte is read once
    per token: bandwidth / (num_params x bytes_per_param). E.g. 70e9 fp16 parameters (2 bytes)
    on 3.35e12 bytes/s: 140 GB per token, 42 ms, about 24 tokens/s."""
    for name, value in (
        ("num_params", num_params),
        ("bytes_per_param", bytes_per_param),
        ("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
    ):
        check_positive(name, value)
    return bandwidth_bytes_per_s / (num_params * bytes_per_param)


def decode_roofline_fraction(
    tokens_per_s: float, batch_size: int, weight_bytes: float, bandwidth_bytes_per_s: float
) -> float:
    """How close a batched decode comes to the memory-bandwidth roofline, as a fraction.

    Each decode step reads every weight byte once and yields one token for each of the
    batch_size sequences, so no decode can beat batch_size x bandwidth / weight_bytes tokens
    per second (KV-cache reads are left out, which makes the bound generous). Returns
    tokens_per_s divided by that bound. Raises ValueError unless tokens_per_s >= 0 and the
    other arguments are > 0.
    """
    check_positive("tokens_per_s", tokens_per_s, allow_zero=True)
    for name, value in (
        ("batch_size", batch_size),
        ("weight_bytes", weight_bytes),
        ("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
    ):
        check_positive(name, value)
    return tokens_per_s / (batch_size * bandwidth_bytes_per_s / weight_bytes)


def decode_speed(model, prompt_ids: list[int], num_tokens: int = 32) -> float:
    """Tokens per second of batch-1 greedy decode after the prompt (the prefill is not counted):
    the steps of `decodelab.decoding.generate.stream_token_ids`, timed between the first and last token."""
    from decodelab.decoding.generate import stream_token_ids
    from decodelab.params import SamplingParams

    check_int("num_tokens", num_tokens, minimum=1)
    params = SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True)
    stamps = []
    for _ in stream_token_ids(model, prompt_ids, params):  # each id is on the host: the step is done
        stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise ValueError("the context is full after the prompt: no decode step to time")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class CountingModel:
    """Wraps a model and records each call: (tokens fed in, whether a KV cache was passed).

    Behaves like the model for generation code: same config, device, dtype and forward."""

    def __init__(self, model):
        self.model, self.calls = model, []

    config = property(lambda self: self.model.config)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)

    def __call__(self, input_ids, *args, **kwargs):
        cache = kwargs.get("kv_cache", args[1] if len(args) > 1 else None)
        self.calls.append((int(input_ids.shape[1]), cache is not None))
        return self.model(input_ids, *args, **kwargs)

    def tokens_fed(self) -> list[int]:
        return [length for length, _ in self.calls]

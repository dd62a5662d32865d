"""What `/metrics` reports, in Prometheus' text format (version 0.0.4), written out by hand.

    decodelab_num_requests_running          requests with a sample in the engine's batch
    decodelab_num_requests_waiting          requests accepted but not yet admitted (the queue --max-queue bounds)
    decodelab_kv_blocks_used / _total       paged KV blocks held by sequences / in the pool
    decodelab_time_to_first_token_seconds   histogram: arrival at the server -> the request's first token
    decodelab_inter_token_latency_seconds   histogram: between two tokens of one sample
    decodelab_request_finished_total{finish_reason="stop"|"length"|"error"|"abort"}   samples (n per request)
    decodelab_requests_rejected_total{reason="queue_full"}                           answered 503
    decodelab_prompt_tokens_total, decodelab_generation_tokens_total

The engine thread observes; the front end renders. One lock covers both, so a scrape never sees a
histogram half updated.
"""

from __future__ import annotations

import threading
from collections import Counter

# seconds; the edges vLLM uses for the same two histograms, trimmed at the ends
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class Histogram:
    """Counts of observations at or below each bucket's upper edge (cumulative, as Prometheus has them)."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.count += 1
        self.sum += value

    def lines(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{edge:g}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        lines += [
            f'{self.name}_bucket{{le="+Inf"}} {self.count}',
            f"{self.name}_sum {self.sum!r}",
            f"{self.name}_count {self.count}",
        ]
        return lines


def metric_lines(name: str, kind: str, help: str, samples: dict[str, float]) -> list[str]:
    """A gauge or counter: `samples` maps a label set ('' or 'key="value"') to its value."""
    lines = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples.items()]
    return lines


class ServingMetrics:
    """The server's counters, gauges and histograms (see the module docstring)."""

    FINISH_REASONS = ("stop", "length", "error", "abort")

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(
            "decodelab_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "decodelab_inter_token_latency_seconds",
            "Seconds between two consecutive tokens of one sample.",
            ITL_BUCKETS,
        )
        self.finished = Counter({reason: 0 for reason in self.FINISH_REASONS})
        self.rejected = Counter({"queue_full": 0})
        self.prompt_tokens = self.generation_tokens = 0
        self.running = self.waiting = self.kv_blocks_used = self.kv_blocks_total = 0

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_tokens(self, num_tokens: int, seconds_since_last: float | None) -> None:
        """num_tokens new tokens of one sample; without a previous token (None) none has an interval.
        Several tokens in one step (speculative decoding) share the interval evenly."""
        with self._lock:
            self.generation_tokens += num_tokens
            if seconds_since_last is not None:
                for _ in range(num_tokens):
                    self.itl.observe(seconds_since_last / num_tokens)

    def observe_finished(self, reason: str, num_samples: int = 1) -> None:
        with self._lock:
            self.finished[reason] += num_samples

    def observe_prompt(self, num_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_tokens

    def observe_rejected(self, reason: str = "queue_full") -> None:
        with self._lock:
            self.rejected[reason] += 1

    def set_engine_state(self, running: int, kv_blocks_used: int, kv_blocks_total: int) -> None:
        with self._lock:
            self.running, self.kv_blocks_used, self.kv_blocks_total = running, kv_blocks_used, kv_blocks_total

    def set_waiting(self, waiting: int) -> None:
        with self._lock:
            self.waiting = waiting

    def render(self) -> str:
        """Everything, in Prometheus' text format."""
        with self._lock:
            lines = [
                *metric_lines(
                    "decodelab_num_requests_running",
                    "gauge",
                    "Requests with a sample in the engine's running batch.",
                    {"": self.running},
                ),
                *metric_lines(
                    "decodelab_num_requests_waiting",
                    "gauge",
                    "Requests accepted but not yet admitted to the batch.",
                    {"": self.waiting},
                ),
                *metric_lines(
                    "decodelab_kv_blocks_used", "gauge", "Paged KV blocks held by sequences.", {"": self.kv_blocks_used}
                ),
                *metric_lines(
                    "decodelab_kv_blocks_total", "gauge", "Paged KV blocks in the pool.", {"": self.kv_blocks_total}
                ),
                *self.ttft.lines(),
                *self.itl.lines(),
                *metric_lines(
                    "decodelab_request_finished_total",
                    "counter",
                    "Samples finished (n per request), by finish reason.",
                    {f'finish_reason="{r}"': n for r, n in self.finished.items()},
                ),
                *metric_lines(
                    "decodelab_requests_rejected_total",
                    "counter",
                    "Requests answered 503, by reason.",
                    {f'reason="{r}"': n for r, n in self.rejected.items()},
                ),
                *metric_lines(
                    "decodelab_prompt_tokens_total",
                    "counter",
                    "Prompt tokens of accepted requests.",
                    {"": self.prompt_tokens},
                ),
                *metric_lines(
                    "decodelab_generation_tokens_total", "counter", "Tokens generated.", {"": self.generation_tokens}
                ),
            ]
        return "\n".join(lines) + "\n"

"""Stalls: what one long prompt does to the requests already decoding, with and without chunked prefill.

A newcomer with a long prompt arrives while a few requests decode. Without chunking, the step
that prefills it feeds its whole prompt (the running requests decode in that same step), so the
step lasts as long as the whole prefill, and every running request waits that long for its next
token: a stall. With chunked prefill (`LLM(chunked_prefill=True)`) the prompt is fed in slices of
at most `max_num_batched_tokens` tokens, one slice per step between decodes: the running
requests' steps grow a little, over several steps, and the newcomer's first token comes a little
later (Sarathi-Serve's trade).

`newcomer_run` drives an engine step by step and records the time of every token; a
`StallResult` gives the inter-token latencies (ITL) of the running requests and the newcomer's
time to first token (TTFT). `compare_stalls` runs the same scenario on several engines,
alternating, and keeps each one's run with the smallest p99 ITL (a busy machine only ever adds time).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from decodelab.params import SamplingParams


def percentile(values, q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of values: the smallest value with at
    least q% of them at or below it. percentile([1, 2, 3, 4], 50) -> 2."""
    ordered = sorted(values)
    if not ordered or not 0 < q <= 100:
        raise ValueError(f"need values and 0 < q <= 100, got {len(ordered)} values and q={q!r}")
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class StallResult:
    label: str
    token_times: list[list[float]]  # per running request: its tokens' times, seconds after the newcomer arrived
    ttft: float  # seconds from the newcomer's arrival to its first token
    steps_to_first_token: int  # engine steps from its arrival to its first token
    step_seconds: list[float]  # every step from the arrival on, until the running requests ended

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies of the running requests (seconds between two consecutive tokens of
        one request) whose later token came after the newcomer arrived."""
        return [b - a for times in self.token_times for a, b in zip(times, times[1:]) if b > 0]

    @property
    def itl_p50(self) -> float:
        return percentile(self.gaps, 50)

    @property
    def itl_p99(self) -> float:
        return percentile(self.gaps, 99)

    def summary(self) -> str:
        return (
            f"{self.label:>24}: running requests' ITL p50 {1000 * self.itl_p50:7.1f} ms, p99 "
            f"{1000 * self.itl_p99:7.1f} ms, max {1000 * max(self.gaps):7.1f} ms | newcomer TTFT "
            f"{1000 * self.ttft:7.1f} ms over {self.steps_to_first_token} steps"
        )


def newcomer_run(
    llm, running_prompts, newcomer_prompt, label: str, decode_tokens: int = 32, arrive_after: int = 4
) -> StallResult:
    """Start every running prompt (greedy, decode_tokens tokens each, no early stop), run
    arrive_after steps, then add newcomer_prompt (one token wanted) and run until all are done.
    The running requests must outlast the newcomer's prefill: decode_tokens > arrive_after + the
    steps it takes."""
    if llm.scheduler.has_unfinished():
        raise ValueError("newcomer_run needs an idle engine: another generate() or stream() is in flight")
    if llm.scheduler.max_num_seqs <= len(running_prompts):
        raise ValueError(
            f"{len(running_prompts)} running prompts fill max_num_seqs={llm.scheduler.max_num_seqs}: "
            "the newcomer needs a sequence slot of its own"
        )
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    for index, prompt in enumerate(running_prompts):
        llm.add_request(prompt, params, index=index)
    newcomer_index, times = len(running_prompts), [[] for _ in running_prompts]
    arrival, first_token, steps, step_seconds = None, None, 0, []
    while llm.scheduler.has_unfinished():
        if steps == arrive_after:
            arrival = time.perf_counter()
            llm.add_request(
                newcomer_prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), index=newcomer_index
            )
        start = time.perf_counter()
        events = llm.step()
        now = time.perf_counter()
        steps += 1
        if arrival is not None and any(e.request_index < newcomer_index for e in events):
            step_seconds.append(now - start)
        for event in events:
            if event.request_index == newcomer_index:
                first_token = first_token or (now, steps - arrive_after)
            else:
                times[event.request_index].append(now)
    if arrival is None or first_token is None:
        raise ValueError(
            f"the running requests ended before the newcomer arrived or started: decode_tokens "
            f"({decode_tokens}) must exceed arrive_after ({arrive_after})"
        )
    if any(len(t) < 2 or t[-1] < first_token[0] for t in times):
        raise ValueError("a running request ended before the newcomer's first token: raise decode_tokens")
    return StallResult(
        label,
        [[t - arrival for t in request] for request in times],
        first_token[0] - arrival,
        first_token[1],
        step_seconds,
    )


def compare_stalls(
    engines: dict, running_prompts, newcomer_prompt, decode_tokens: int = 32, arrive_after: int = 4, rounds: int = 2
) -> dict[str, StallResult]:
    """newcomer_run on every engine ({label: LLM}), `rounds` times in alternating order -> per label
    the run with the smallest p99 ITL. The engines' first run also warms them up. Each engine must
    be built with enable_prefix_caching=False: the rounds repeat the same newcomer, and a prefix
    cache would find its prompt from the second round on."""
    cached = [label for label, llm in engines.items() if llm.args.enable_prefix_caching]
    if cached:
        raise ValueError(
            f"compare_stalls repeats the same prompts: build {', '.join(cached)} with "
            "enable_prefix_caching=False, or the later rounds would find the newcomer cached"
        )
    best: dict[str, StallResult] = {}
    for _ in range(rounds):
        for label, llm in engines.items():
            run = newcomer_run(llm, running_prompts, newcomer_prompt, label, decode_tokens, arrive_after)
            if label not in best or run.itl_p99 < best[label].itl_p99:
                best[label] = run
    return best


def steps_to_first_token(prompt_len: int, budget: int, decoding: int = 4, block_size: int = 16) -> int:
    """Engine steps until a newcomer of prompt_len tokens samples its first token, under the
    library's chunked-prefill step with `decoding` requests decoding and a token budget of `budget`
    a step (no model: `continuous_batching.advance` plays the forward pass and the sampling)."""
    from decodelab.engine import scheduler as reference
    from decodelab.engine.block_allocator import blocks_needed
    from decodelab.lessons.continuous_batching import advance, make_sequence, toy_scheduler

    if prompt_len < 1 or budget <= decoding:
        raise ValueError(f"need prompt_len >= 1 and a budget above the {decoding} decodes, got {prompt_len}, {budget}")
    pool = blocks_needed(prompt_len, block_size) + decoding * blocks_needed(prompt_len + 2, block_size)
    state = toy_scheduler(
        [1] * decoding,
        num_blocks=pool,
        block_size=block_size,
        max_num_seqs=decoding + 1,
        max_num_batched_tokens=budget,
        admitted=True,
    )  # `decoding` requests, each ready to decode
    newcomer = make_sequence(decoding, prompt_len)
    state.add(newcomer)
    for step in range(1, prompt_len + 1):
        if newcomer in advance(reference.schedule_chunked(state)):
            return step
    raise RuntimeError(f"the newcomer sampled nothing in {prompt_len} steps")


__all__ = ["percentile", "StallResult", "newcomer_run", "compare_stalls", "steps_to_first_token"]

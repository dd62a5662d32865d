"""Static vs continuous batching, simulated and measured, with any Scheduler class.

The simulator drives a real `Scheduler` (the library's, or a learner's subclass) and a real
`BlockAllocator` step by step, but instead of running a model it appends a placeholder
token to every scheduled sequence and advances a clock by a step cost:

    seconds of a decode step  = fixed_s + per_seq_s * (sequences in the batch)
    seconds of a prefill step = fixed_s + prefill_token_s * (prompt tokens fed)

`fixed_s` is what every step pays whatever the batch (reading the weights, Python and kernel
launch overhead); `per_seq_s` is the extra work per sequence of a decode step, and
`prefill_token_s` per prompt token of a prefill step. Decode is memory-bound when fixed_s
dominates: then a batch of 32 costs little more than a batch of 1. `measure_step_cost` takes
the numbers from steps measured on the real engine (`serve` + `recording`).

Two policies over a workload of `Request(arrival, prompt_len, output_len)`:
* static (request-level): when the server is idle, the requests that have arrived (up to
  max_num_seqs) form a batch; nobody joins until the whole batch has finished;
* continuous (iteration-level): a request joins the scheduler's queue when it arrives and
  takes a slot at the first step after one frees up.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from decodelab.engine.block_allocator import BlockAllocator, blocks_needed
from decodelab.engine.scheduler import Scheduler
from decodelab.engine.sequence import Sequence
from decodelab.params import SamplingParams

POLICIES = ("static", "continuous")


# --------------------------------------------------------------------------- toy pieces


def make_sequence(seq_id: int, prompt_len: int, max_tokens: int = 16) -> Sequence:
    """A sequence of prompt_len tokens that shares no prefix with another seq_id's."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    prompt = [1000 * (seq_id + 1) + i for i in range(prompt_len)]
    return Sequence(seq_id, seq_id, 0, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def seq_ids(seqs) -> list[int]:
    """[seq.seq_id for seq in seqs]: queues and batches as a test can read them."""
    return [seq.seq_id for seq in seqs]


def toy_scheduler(
    prompt_lens,
    num_blocks: int = 8,
    block_size: int = 4,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    admitted: bool = False,
    scheduler_cls=Scheduler,
):
    """A scheduler on a small pool (no prefix caching) with one waiting sequence per prompt length.

    admitted=True: the library's reference admits them and each gets its first output token,
    as after a prefill step, so the scheduler is ready for a decode step.
    """
    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=False)
    scheduler = scheduler_cls(allocator, max_num_seqs, max_num_batched_tokens)
    for i, n in enumerate(prompt_lens):
        scheduler.add(make_sequence(i, n))
    if admitted:
        from decodelab.engine import scheduler as reference

        for seq in reference.admit(scheduler):
            seq.num_computed_tokens = len(seq)
            seq.output_token_ids.append(7)
    return scheduler


def advance(seqs, token_id: int = 0) -> list[Sequence]:
    """What the engine's forward pass and sampling do to the scheduled sequences, without a model:
    each computes the tokens it feeds this step (seq.num_tokens_this_step), and each whose tokens
    are now all computed appends token_id. -> the sequences that got a token (a slice of a prompt
    gets none)."""
    sampled = []
    for seq in seqs:
        seq.num_computed_tokens += seq.num_tokens_this_step
        seq.num_scheduled_tokens = 0
        if not seq.num_new_tokens:
            seq.output_token_ids.append(token_id)
            sampled.append(seq)
    return sampled


# --------------------------------------------------------------------------- workloads and costs


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds after the start
    prompt_len: int
    output_len: int  # tokens it generates (no early stop)


def mixed_workload(
    num_requests: int, arrival_rate: float, prompt_lens=(16, 128), output_lens=(16, 128), seed: int = 0
) -> list[Request]:
    """Poisson arrivals at arrival_rate requests per second (math.inf: all at time 0), prompt and
    output lengths uniform in the given inclusive ranges."""
    if num_requests < 1 or not arrival_rate > 0:
        raise ValueError(f"need num_requests >= 1 and arrival_rate > 0, got {num_requests}, {arrival_rate}")
    rng = random.Random(seed)
    now, requests = 0.0, []
    for _ in range(num_requests):
        requests.append(Request(now, rng.randint(*prompt_lens), rng.randint(*output_lens)))
        if math.isfinite(arrival_rate):
            now += rng.expovariate(arrival_rate)
    return requests


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step: fixed_s + per_seq_s * sequences (decode), or
    fixed_s + prefill_token_s * tokens (prefill)."""

    fixed_s: float = 0.015  # paid by every step, whatever the batch (weights read, overhead)
    per_seq_s: float = 0.0005  # per sequence in a decode step
    prefill_token_s: float = 0.0002  # per prompt token fed in a prefill step

    def __call__(self, num_seqs: int) -> float:
        """A decode step of num_seqs sequences."""
        return self.fixed_s + self.per_seq_s * num_seqs

    def step(self, num_seqs: int, num_tokens: int, is_prefill: bool) -> float:
        return self.fixed_s + self.prefill_token_s * num_tokens if is_prefill else self(num_seqs)

    @classmethod
    def fit(cls, batch_sizes, decode_seconds, prefill_tokens=(), prefill_seconds=()) -> StepCost:
        """Decode: a Theil-Sen line (median of the pairwise slopes: a busy machine's slow outliers
        do not tilt it) through (batch size, seconds). Prefill: the median per-token cost above fixed_s."""
        xs, ys = list(map(float, batch_sizes)), list(map(float, decode_seconds))
        if len(set(xs)) < 2:
            raise ValueError("fitting a step cost needs decode steps of at least two batch sizes")
        slopes = [
            (ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]
        ]
        slope = max(0.0, statistics.median(slopes))
        fixed = max(1e-6, statistics.median(y - slope * x for x, y in zip(xs, ys)))
        per_token = [max(0.0, (s - fixed) / n) for n, s in zip(prefill_tokens, prefill_seconds) if n > 0]
        return cls(fixed, slope, statistics.median(per_token) if per_token else slope)


# --------------------------------------------------------------------------- results


@dataclass
class StepRecord:
    start: float  # seconds after the start
    seconds: float
    is_prefill: bool
    num_seqs: int  # sequences fed in this step
    num_tokens: int  # tokens fed in this step
    num_running: int  # sequences holding a slot (running) during the step
    num_waiting: int  # arrived requests without a slot
    num_free_blocks: int = 0  # free KV blocks after scheduling the step
    num_preemptions: int = 0  # preemptions so far


@dataclass
class BatchingResult:
    policy: str
    max_num_seqs: int
    steps: list[StepRecord]
    ttft: list[float]  # per request, seconds from arrival to its first token
    latency: list[float]  # per request, seconds from arrival to its last token
    output_tokens: int
    makespan: float  # seconds from the first arrival to the last token
    num_preemptions: int = 0
    outputs: list = field(default_factory=list)  # the engine's RequestOutputs (real runs)

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole run."""
        return self.output_tokens / self.makespan if self.makespan > 0 else 0.0

    @property
    def mean_latency(self) -> float:
        return statistics.fmean(self.latency)

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttft)

    @property
    def occupancy(self) -> float:
        """Fraction of the slots in use, averaged over the time the engine was computing."""
        busy = sum(s.seconds for s in self.steps)
        used = sum(s.seconds * s.num_running for s in self.steps)
        return used / (busy * self.max_num_seqs) if busy > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.policy:>10}: {self.throughput:8.1f} tokens/s, mean latency {self.mean_latency:6.2f} s, "
            f"mean TTFT {self.mean_ttft:6.2f} s, slots in use {100 * self.occupancy:4.0f}%, "
            f"{len(self.steps)} steps, {self.num_preemptions} preemptions"
        )


# --------------------------------------------------------------------------- the simulator


def simulate(
    workload: list[Request],
    policy: str = "continuous",
    scheduler_cls=Scheduler,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 4096,
    num_blocks: int | None = None,
    block_size: int = 16,
    cost: StepCost | None = None,
    chunked_prefill: bool | None = None,
) -> BatchingResult:
    """Serve the workload with scheduler_cls(allocator, max_num_seqs, max_num_batched_tokens),
    no model: each step appends a placeholder token per scheduled sequence whose tokens are all
    computed (a slice of a prompt under chunked_prefill appends none) and costs cost.step(...).
    num_blocks=None: a pool big enough that nothing is ever preempted. chunked_prefill=None: as
    scheduler_cls has it."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    cost = cost or StepCost()
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    longest = max(r.prompt_len + r.output_len for r in workload)
    if num_blocks is None:
        num_blocks = max_num_seqs * blocks_needed(longest, block_size)
    elif blocks_needed(longest, block_size) > num_blocks:
        raise ValueError(f"a request of {longest} tokens does not fit in {num_blocks} blocks of {block_size}")
    scheduler = scheduler_cls(
        BlockAllocator(num_blocks, block_size, enable_prefix_caching=False), max_num_seqs, max_num_batched_tokens
    )
    if chunked_prefill is not None:
        scheduler.chunked_prefill = chunked_prefill
    seqs = [make_sequence(i, r.prompt_len, r.output_len) for i, r in enumerate(workload)]
    first_token, done = [None] * len(workload), [None] * len(workload)
    held: deque[Sequence] = deque()  # static: arrived, waiting for the current batch to end
    steps, now, next_arrival = [], workload[order[0]].arrival, 0
    max_steps = 4 * sum(r.prompt_len + r.output_len for r in workload) + 100  # far more than any scheduler needs
    while next_arrival < len(order) or held or scheduler.has_unfinished():
        if len(steps) > max_steps:
            raise RuntimeError(
                f"{scheduler_cls.__name__} ran {len(steps)} steps without finishing the workload: "
                "does finish() take a sequence out of running?"
            )
        while next_arrival < len(order) and workload[order[next_arrival]].arrival <= now:
            seq = seqs[order[next_arrival]]
            (held.append if policy == "static" else scheduler.add)(seq)
            next_arrival += 1
        if policy == "static" and held and not scheduler.has_unfinished():
            for _ in range(min(max_num_seqs, len(held))):
                scheduler.add(held.popleft())
        if not scheduler.has_unfinished():
            now = workload[order[next_arrival]].arrival  # idle until the next request arrives
            continue
        batch, is_prefill = scheduler.schedule()
        if not batch:
            raise RuntimeError(
                f"the scheduler ran nothing with {len(scheduler.waiting)} waiting and "
                f"{len(scheduler.running)} running: is the pool ({num_blocks} blocks) too small?"
            )
        num_tokens = sum(s.num_tokens_this_step for s in batch)
        seconds = cost.step(len(batch), num_tokens, is_prefill)
        steps.append(
            StepRecord(
                now,
                seconds,
                is_prefill,
                len(batch),
                num_tokens,
                len(scheduler.running),
                len(scheduler.waiting) + len(held),
                scheduler.allocator.num_free,
                scheduler.num_preemptions,
            )
        )
        now += seconds
        for seq in advance(batch):
            first_token[seq.seq_id] = first_token[seq.seq_id] or now
            if len(seq.output_token_ids) >= workload[seq.seq_id].output_len:
                scheduler.finish(seq, "length")
                done[seq.seq_id] = now
    arrivals = [r.arrival for r in workload]
    return BatchingResult(
        policy,
        max_num_seqs,
        steps,
        [f - a for f, a in zip(first_token, arrivals)],
        [d - a for d, a in zip(done, arrivals)],
        sum(r.output_len for r in workload),
        max(done) - min(arrivals),
        scheduler.num_preemptions,
    )


# --------------------------------------------------------------------------- the real engine


def recording(scheduler_cls=Scheduler):
    """A subclass of scheduler_cls whose `log` records every schedule() call as (perf_counter time,
    sequences scheduled, is_prefill, tokens fed, running, waiting, free blocks, preemptions so far)."""

    class Recording(scheduler_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.log = []

        def schedule(self):
            seqs, is_prefill = super().schedule()
            self.log.append(
                (
                    time.perf_counter(),
                    len(seqs),
                    is_prefill,
                    sum(s.num_tokens_this_step for s in seqs),
                    len(self.running),
                    len(self.waiting),
                    self.allocator.num_free,
                    self.num_preemptions,
                )
            )
            return seqs, is_prefill

    Recording.__name__ = Recording.__qualname__ = f"Recording{scheduler_cls.__name__}"
    return Recording


def serve(llm, prompts, params, policy: str = "continuous") -> BatchingResult:
    """Run every prompt through a real `LLM`, all arriving now: in one generate call (continuous),
    or in groups of llm.scheduler.max_num_seqs, each after the previous one ended (static).
    The LLM must be built with EngineHooks(scheduler=recording(...)) so its steps can be timed."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    scheduler = llm.scheduler
    if not hasattr(scheduler, "log"):
        raise ValueError("serve needs an LLM built with EngineHooks(scheduler=recording(YourScheduler))")
    group = scheduler.max_num_seqs if policy == "static" else len(prompts)
    start, steps, outputs, latency, ttft = time.perf_counter(), [], [], [], []
    preempted_before = scheduler.num_preemptions
    for i in range(0, len(prompts), group):
        scheduler.log.clear()
        called = time.perf_counter()
        outs = llm.generate(prompts[i : i + group], params[i : i + group], use_tqdm=False)
        ended = time.perf_counter()
        log = scheduler.log
        for entry, following in zip(log, log[1:] + [(ended,)]):
            at, num_seqs, is_prefill, num_tokens, running, waiting, free, preemptions = entry
            held = len(prompts) - i - group if policy == "static" else 0
            steps.append(
                StepRecord(
                    at - start,
                    following[0] - at,
                    is_prefill,
                    num_seqs,
                    num_tokens,
                    running,
                    waiting + max(0, held),
                    free,
                    preemptions - preempted_before,
                )
            )
        for out in outs:
            latency.append(called - start + out.metrics["latency_s"])
            ttft.append(called - start + out.metrics["ttft_s"])
        outputs += outs
    makespan = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return BatchingResult(
        policy,
        scheduler.max_num_seqs,
        steps,
        ttft,
        latency,
        tokens,
        makespan,
        scheduler.num_preemptions - preempted_before,
        outputs,
    )


def measure_step_cost(llm, batch_sizes, num_tokens: int = 8, prompt_len: int = 8):
    """Time real engine steps of llm (built with EngineHooks(scheduler=recording(...))) at each
    batch size -> (seconds of the fastest decode step per batch size, the fitted StepCost)."""
    decode, prefill_tokens, prefill_seconds = {}, [], []
    for size in batch_sizes:
        if not 1 <= size <= llm.scheduler.max_num_seqs:
            raise ValueError(f"batch size {size} is outside 1..max_num_seqs={llm.scheduler.max_num_seqs} of this LLM")
        prompts = [[(5 + 7 * i + j) % llm.config.vocab_size for j in range(prompt_len)] for i in range(size)]
        params = [SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)] * size
        run = serve(llm, prompts, params, "continuous")
        # The fastest step: other programs on a busy machine only ever make a step slower.
        decode[size] = min(s.seconds for s in run.steps if not s.is_prefill and s.num_seqs == size)
        prefill_tokens += [s.num_tokens for s in run.steps if s.is_prefill]
        prefill_seconds += [s.seconds for s in run.steps if s.is_prefill]
    return decode, StepCost.fit(list(decode), list(decode.values()), prefill_tokens, prefill_seconds)


__all__ = [
    "Request",
    "StepCost",
    "StepRecord",
    "BatchingResult",
    "make_sequence",
    "seq_ids",
    "toy_scheduler",
    "advance",
    "mixed_workload",
    "simulate",
    "recording",
    "serve",
    "measure_step_cost",
    "POLICIES",
]

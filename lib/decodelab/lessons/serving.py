"""Notebook 14's async request loop: one engine, many streaming clients, in one event loop.

    clients (coroutines)                                   the engine loop (one coroutine)
    async for token in stream(server, ids, params):        take the inbox: add_request / abort
        ...   <--- client.tokens (an asyncio.Queue) ---    llm.step(); each client's new tokens
    (a client that goes away: its stream's `finally`)       await asyncio.sleep(0): clients run
        --- ("abort", client) in the inbox --->             LLM.abort: its KV blocks back in the pool

The engine loop is the only caller of `add_request`, `step` and `abort`. Requests join and leave
*between* steps (iteration-level scheduling, Orca): a request that arrives while a step runs waits
for that step only, never for the whole batch. The step itself blocks the event loop (it is CPU
work); the clients run in the gap after it. `decodelab.serving.engine_loop.EngineLoop` is the same
design with the engine on its own thread, which the real server (`python -m decodelab serve`) uses.

The three exercises (their references here): `engine_loop` (join between steps, step, stream each
new token), `stream` (backpressure: refuse when `max_waiting` requests wait; abort on disconnect)
and `serving_metrics` (TTFT, TPOT, goodput under an SLO). `run_load` drives a learner's pair with
Poisson arrivals; `run_sync` runs a coroutine from plain code or from inside Jupyter's running loop.
Sampling is one sample per request here (SamplingParams.n == 1).
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from decodelab.engine.sequence import Request, Status
from decodelab.params import SamplingParams

END = None  # what a client's token queue holds after its last token


class QueueFull(RuntimeError):
    """More requests wait for the engine than the server accepts (`StreamingServer.max_waiting`)."""


@dataclass(eq=False)
class ClientStream:
    """One client's request on its way through the engine loop.

    prompt: token ids [L]; tokens: the queue its stream reads (token ids, then END);
    request: the engine's Request once the loop added it; sent: how many output tokens were put on
    the queue; finish_reason: "stop", "length", "abort", "error" once it ended."""

    prompt: list[int]
    params: SamplingParams
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None
    sent: int = 0
    finish_reason: str | None = None

    def finish(self, reason: str) -> None:
        """Record why it ended and tell its stream (END on the queue)."""
        self.finish_reason = reason
        self.tokens.put_nowait(END)


class StreamingServer:
    """What the engine loop and the clients' streams share.

    inbox: ("submit" | "abort", ClientStream) messages for the loop, oldest first; live: the
    clients whose requests are in the engine; wake: set when the inbox gets a message (the loop
    sleeps on it when the engine has nothing to run); stopped: the loop ends at its next turn."""

    def __init__(self, llm, max_waiting: int = 16):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.llm, self.max_waiting = llm, max_waiting
        self.inbox: deque[tuple[str, ClientStream]] = deque()
        self.live: list[ClientStream] = []
        self.wake = asyncio.Event()
        self.stopped = False

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: submitted but not yet added, or added and still in the engine's
        waiting queue (no step has admitted them)."""
        queued = sum(1 for kind, _ in self.inbox if kind == "submit")
        return queued + sum(
            1
            for c in self.live
            if c.request is not None and c.request.seqs and c.request.seqs[0].status is Status.WAITING
        )

    def send(self, kind: str, client: ClientStream) -> None:
        """Leave a message for the engine loop and wake it."""
        self.inbox.append((kind, client))
        self.wake.set()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()


# --------------------------------------------------------------------------- the exercises' references


def _join(server: StreamingServer) -> None:
    """Take every message in the inbox: add the submitted, abort the withdrawn."""
    while server.inbox:
        kind, client = server.inbox.popleft()
        if kind == "submit":
            client.request = server.llm.add_request(client.prompt, client.params)
            if client.request.error is not None:
                client.finish("error")
            else:
                server.live.append(client)
        elif client in server.live:
            server.llm.abort(client.request)
            server.live.remove(client)
            client.finish("abort")


def _deliver(server: StreamingServer) -> None:
    """Put each live client's new tokens on its queue; finish and drop those the engine finished."""
    for client in list(server.live):
        seq = client.request.seqs[0]
        for token in seq.output_token_ids[client.sent :]:
            client.tokens.put_nowait(token)
        client.sent = len(seq.output_token_ids)
        if seq.is_finished:
            server.live.remove(client)
            client.finish(seq.finish_reason or "stop")


async def engine_loop(server: StreamingServer) -> None:
    """Run the engine for the clients until server.stop(): at each turn take the inbox (requests join
    and leave between steps), run one step if anything is unfinished and stream each client its new
    tokens, then let the clients run (await); with nothing to run, sleep until the inbox wakes it."""
    while not server.stopped:
        _join(server)
        if server.llm.scheduler.has_unfinished():
            server.llm.step()
            _deliver(server)
            await asyncio.sleep(0)  # the clients read their tokens; new requests arrive
        elif not server.inbox:
            server.wake.clear()
            await server.wake.wait()


async def stream(server: StreamingServer, prompt: list[int], params: SamplingParams):
    """Async generator: the token ids the engine generates for prompt, each as soon as its step ends.

    Refuses (QueueFull, at the first `anext`) when server.max_waiting requests already wait. If the
    consumer goes away before the end (its task cancelled, or the generator closed), the request is
    aborted so the engine frees its KV blocks."""
    if server.num_waiting >= server.max_waiting:
        raise QueueFull(f"{server.num_waiting} requests already wait (max_waiting={server.max_waiting}); retry later")
    client = ClientStream(list(prompt), params)
    server.send("submit", client)
    try:
        while True:
            token = await client.tokens.get()
            if token is END:
                return
            yield token
    finally:
        if client.finish_reason is None:
            server.send("abort", client)


def percentile_or_none(values: list[float], q: float) -> float | None:
    """numpy's q-th percentile of values (linear between closest ranks), None for no values."""
    return float(np.percentile(values, q)) if values else None


def serving_metrics(records, duration: float, ttft_slo: float, tpot_slo: float) -> dict:
    """What serving is judged by, from each request's timestamps.

    records: one (sent_at, token_times) per request, in seconds on one clock; token_times: when each
    output token reached the client ([] if none did). duration: seconds the run took.
    TTFT = first token time - sent_at; TPOT = (last - first) / (tokens - 1), for 2 tokens or more.
    A request meets the SLO when it got a token, its TTFT <= ttft_slo and its TPOT <= tpot_slo (one
    token: no TPOT to miss). -> {"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99" (seconds; None
    without values), "throughput" (output tokens / s), "goodput" (requests meeting the SLO / s),
    "completed" (requests with a token), "good" (requests meeting the SLO)}."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ttfts, tpots, good, tokens = [], [], 0, 0
    for sent_at, token_times in records:
        tokens += len(token_times)
        if not token_times:
            continue
        ttft = token_times[0] - sent_at
        ttfts.append(ttft)
        tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
        if tpot is not None:
            tpots.append(tpot)
        if ttft <= ttft_slo and (tpot is None or tpot <= tpot_slo):
            good += 1
    return {
        "ttft_p50": percentile_or_none(ttfts, 50),
        "ttft_p99": percentile_or_none(ttfts, 99),
        "tpot_p50": percentile_or_none(tpots, 50),
        "tpot_p99": percentile_or_none(tpots, 99),
        "throughput": tokens / duration,
        "goodput": good / duration,
        "completed": len(ttfts),
        "good": good,
    }


# --------------------------------------------------------------------------- driving it


def run_sync(make_coroutine, timeout: float = 120.0):
    """Run make_coroutine() to its end and return its result, from plain code (asyncio.run) or from a
    cell of a notebook whose kernel already runs an event loop (on a thread with a loop of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(asyncio.wait_for(make_coroutine(), timeout))
    result: dict = {}

    def body():
        try:
            result["value"] = asyncio.run(asyncio.wait_for(make_coroutine(), timeout))
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=body, name="decodelab-run-sync")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly max_tokens tokens (EOS ignored): the same tokens every run."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def run_clients(loop_fn, stream_fn, llm, prompts, max_tokens, delays, abort_after=None):
    """Run loop_fn on a fresh server and one client per prompt, greedy: client i starts after
    delays[i] seconds and reads its stream_fn(server, prompts[i], ...) of max_tokens[i] tokens; with
    abort_after=(i, k), client i's task is cancelled (it disconnects) once it has k tokens.
    A client whose stream raises re-raises here (the disconnected client's CancelledError does not).
    -> (each client's token ids, or the CancelledError that ended it; the order in which clients finished
    (indices); the engine's Request of each prompt, in the order the loop added them)."""
    server = StreamingServer(llm, max_waiting=64)
    added = []
    add_request = llm.add_request

    def recording_add_request(*args, **kwargs):
        request = add_request(*args, **kwargs)
        added.append(request)
        return request

    llm.add_request = recording_add_request
    loop_task = asyncio.create_task(loop_fn(server))
    order: list[int] = []
    gone = asyncio.Event()

    async def client(i):
        await asyncio.sleep(delays[i])
        got = []
        async for token in stream_fn(server, prompts[i], greedy(max_tokens[i])):
            got.append(token)
            if abort_after is not None and i == abort_after[0] and len(got) == abort_after[1]:
                gone.set()
        order.append(i)
        return got

    tasks = [asyncio.create_task(client(i)) for i in range(len(prompts))]
    clients = asyncio.gather(*tasks, return_exceptions=True)

    async def disconnect():
        await gone.wait()
        tasks[abort_after[0]].cancel()  # the client disconnects while it waits for its next token

    disconnecting = asyncio.create_task(disconnect()) if abort_after is not None else None
    try:
        await asyncio.wait([clients, loop_task], return_when=asyncio.FIRST_COMPLETED)
        if loop_task.done():  # the loop ended (or failed) while clients still wait: they never would finish
            clients.cancel()
            await asyncio.gather(clients, return_exceptions=True)
            failure = loop_task.exception()
            if failure is not None:
                raise failure
            raise RuntimeError("engine_loop returned before server.stop() was called, with clients still waiting")
        results = clients.result()
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:  # a client's stream raised (not the disconnected one's cancellation): say so as it is
            raise failures[0]
        for _ in range(50):  # let the loop take the abort and finish its turn
            await asyncio.sleep(0.01)
            if not server.inbox and not server.live and not llm.scheduler.has_unfinished():
                break
    finally:
        if disconnecting is not None:
            disconnecting.cancel()
        server.stop()
        del llm.add_request
    await asyncio.wait_for(loop_task, 10)
    return results, order, added


def pair_or_reference(loop_fn, stream_fn, llm):
    """(loop_fn, stream_fn), each replaced by the library's reference (with a notice) when it does not
    yet stream two tokens of one request with the other's reference: the cells that only *use* the
    loop keep working while an exercise is unfinished."""
    chosen = []
    for name, fn, reference, pair in (
        ("engine_loop", loop_fn, engine_loop, lambda f: (f, stream)),
        ("stream", stream_fn, stream, lambda f: (engine_loop, f)),
    ):
        try:
            results, _, _ = run_sync(lambda p=pair(fn): run_clients(*p, llm, [[5, 6, 7]], [2], [0.0]), timeout=10)
            if isinstance(results[0], BaseException):
                raise results[0]
            chosen.append(fn)
        except Exception as exc:  # noqa: BLE001 - any failure means: not usable yet
            why = "is not written yet" if isinstance(exc, NotImplementedError) else f"raised {type(exc).__name__}"
            print(f"note: your {name} {why}, so the cells below use the library's reference instead.")
            chosen.append(reference)
    return tuple(chosen)


def run_checked(make_coroutine, what: str, timeout: float = 20.0):
    """run_sync(make_coroutine), with a run that outlasts `timeout` seconds an AssertionError naming
    what usually causes it (for the tests: a hang fails, it does not stall the notebook)."""
    try:
        return run_sync(make_coroutine, timeout=timeout)
    except TimeoutError:
        raise AssertionError(hang_message(what, timeout)) from None


def hang_message(what: str, timeout: float) -> str:
    """What a run that outlasted `timeout` seconds is told, with what usually causes it."""
    return (
        f"{what}: did not finish within {timeout:.0f} s: a stream that never ends (END must follow a "
        "finished request's last token), or a loop that never wakes for a new request"
    )


@dataclass
class PlannedRequest:
    send_at: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


def poisson_workload(num_requests: int, rate: float, seed: int, vocab_size: int, max_len: int = 48) -> list:
    """Poisson arrivals at `rate` requests/s with long-tailed lengths (bench/serving_load.py's
    workload, scaled down: log-normal prompt lengths around 12 tokens, exponential output lengths
    around 16), capped at max_len each. -> list[PlannedRequest], by send time."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need rate > 0 and num_requests >= 1, got rate={rate}, num_requests={num_requests}")
    rng = random.Random(seed)
    clock, planned = 0.0, []
    for _ in range(num_requests):
        clock += rng.expovariate(rate)
        length = min(max_len, max(2, round(rng.lognormvariate(math.log(12), 0.7))))
        max_tokens = min(max_len, 4 + round(-12 * math.log(1 - rng.random())))
        planned.append(PlannedRequest(clock, [rng.randrange(3, vocab_size) for _ in range(length)], max_tokens))
    return planned


async def run_load(llm, planned, loop_fn=engine_loop, stream_fn=stream, max_waiting: int = 64) -> dict:
    """Send each planned request at its time through stream_fn, with loop_fn running the engine, and
    time every token where the client receives it. -> {"records": [(sent_at, token_times)] in plan
    order, "tokens": [[token ids]], "refused": requests refused (QueueFull), "duration": seconds}."""
    server = StreamingServer(llm, max_waiting=max_waiting)
    loop_task = asyncio.create_task(loop_fn(server))
    start = time.perf_counter()
    refused = 0

    async def one(request: PlannedRequest):
        nonlocal refused
        await asyncio.sleep(max(0.0, start + request.send_at - time.perf_counter()))
        sent_at, times, tokens = time.perf_counter(), [], []
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
        try:
            async for token in stream_fn(server, request.prompt, params):
                times.append(time.perf_counter())
                tokens.append(token)
        except QueueFull:
            refused += 1
        return (sent_at, times), tokens

    try:
        results = await asyncio.gather(*(one(r) for r in planned))
    finally:
        server.stop()
        await asyncio.wait_for(loop_task, 60)
    return {
        "records": [r for r, _ in results],
        "tokens": [t for _, t in results],
        "refused": refused,
        "duration": time.perf_counter() - start,
    }

"""Checks for notebook 14, serving: the async request loop of `decodelab.lessons.serving`
(`engine_loop`, `stream`) and what serving is judged by (`serving_metrics`).

Each ``check_*`` takes the function under test (the library's reference in CI, a kept buggy
version in CI's negative tests, the learner's own in a notebook's hidden-test cell) and returns
None or raises ``AssertionError`` naming the behaviour, the expected and the actual result.

The loop and the stream are graded as a pair with the other half the library's reference, on the
course's tiny model, greedy. The oracle for the tokens is the engine itself: `LLM.generate` on the
same prompts, each alone. Clients arrive at staggered times (so they join a running batch), one
goes away mid-stream (its blocks must come back: the allocator's free count and `check_invariants`),
and a long request must not hold back a short one that arrives after it (iteration-level
scheduling: the short one finishes first). Backpressure is checked on a server whose loop has not
started, so "waiting" is exact. Every run has a timeout: a stream that never ends fails, it does not
hang. The metrics are compared with a computation written here from the definitions, on random
records with the edge cases (no token, one token, exactly at the SLO).
"""

from __future__ import annotations

import asyncio
import functools
import random

from autograder.checks.answers import expect_answer
from autograder.checks.calling import call, failure
from decodelab.course.exercises import references
from decodelab.lessons import serving
from decodelab.params import SamplingParams

REFERENCES = references("14_serving")

__all__ = [
    "answer_q_blocks_freed",
    "answer_q_refused_of_10",
    "check_engine_loop",
    "check_q_blocks_freed",
    "check_q_refused_of_10",
    "check_serving_metrics",
    "check_stream",
]

TIMEOUT = 20.0


@functools.lru_cache(maxsize=None)
def _tiny():
    from decodelab.model.registry import load

    return load("tiny", device="cpu")


def _llm(**kwargs):
    from decodelab import LLM

    return LLM(model=_tiny(), kv_block_size=8, **kwargs)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(vocab_size: int, lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def _engine_tokens(prompts, max_tokens) -> list[list[int]]:
    """The oracle: each prompt run alone through a fresh engine's generate."""
    llm = _llm()
    return [llm.generate([p], _params(m))[0].outputs[0].token_ids for p, m in zip(prompts, max_tokens)]


def _blocks_all_back(desc: str, llm) -> None:
    allocator = llm.allocator
    if llm.scheduler.has_unfinished():
        raise AssertionError(f"{desc}: the engine still has unfinished sequences after every client ended")
    if allocator.num_free != allocator.num_blocks:
        raise AssertionError(
            f"{desc}: an abort must free the request's KV blocks: {allocator.num_blocks - allocator.num_free} "
            f"of {allocator.num_blocks} blocks are still held after every client ended"
        )
    try:
        allocator.check_invariants([])
    except AssertionError as e:
        raise AssertionError(f"{desc}: the block pool is inconsistent afterwards: {e}") from None


def _run(desc: str, make):
    """run_checked(make): a hang is the AssertionError that names its usual causes; whatever the
    learner's loop or stream raises is reported as `call` reports it (an unfinished stub by name)."""
    try:
        return serving.run_sync(make, timeout=TIMEOUT)
    except TimeoutError:
        raise AssertionError(serving.hang_message(desc, TIMEOUT)) from None
    except Exception as exc:  # noqa: BLE001 - any exception of the code under test fails the check
        raise failure(desc, exc) from None


def _pair_behaves(what: str, loop_fn, stream_fn) -> None:
    """The shared scenarios, with `what` ("your engine_loop" / "your stream") under test."""
    llm = _llm(max_num_seqs=8)
    vocab = llm.config.vocab_size
    prompts = _prompts(vocab, [5, 11, 3, 17, 8], seed=14)
    max_tokens = [12, 6, 9, 4, 10]
    want = _engine_tokens(prompts, max_tokens)

    desc = f"{what}: five clients arriving at staggered times"
    results, _, _ = _run(
        desc, lambda: serving.run_clients(loop_fn, stream_fn, llm, prompts, max_tokens, [0, 0.0, 0.02, 0.05, 0.1])
    )
    for i, (got, expected) in enumerate(zip(results, want)):
        if isinstance(got, BaseException):
            raise AssertionError(f"{desc}: client {i}'s stream raised {type(got).__name__}: {got}")
        if got != expected:
            raise AssertionError(
                f"{desc}: the stream must equal the engine's tokens: client {i} expected {expected}, got {got}"
            )
    _blocks_all_back(desc, llm)

    desc = f"{what}: a long request, then a short one arriving while it runs"
    long_short = _prompts(vocab, [6, 4], seed=15)
    _, order, _ = _run(desc, lambda: serving.run_clients(loop_fn, stream_fn, llm, long_short, [60, 3], [0, 0.02]))
    if order != [1, 0]:
        raise AssertionError(
            f"{desc}: requests must join between steps, so no request starves: the short one (3 tokens) "
            f"should finish before the long one (60 tokens); finish order was {order} (0 = long, 1 = short)"
        )
    _blocks_all_back(desc, llm)

    desc = f"{what}: three clients, client 1 disconnects after 2 of its 40 tokens"
    trio = _prompts(vocab, [7, 9, 5], seed=16)
    results, _, added = _run(
        desc, lambda: serving.run_clients(loop_fn, stream_fn, llm, trio, [8, 40, 8], [0, 0, 0], (1, 2))
    )
    trio_want = _engine_tokens(trio, [8, 40, 8])
    for i in (0, 2):
        if results[i] != trio_want[i]:
            raise AssertionError(
                f"{desc}: the stream must equal the engine's tokens: client {i} expected {trio_want[i]}, "
                f"got {results[i]}"
            )
    gone = [r for r in added if r.prompt_token_ids == trio[1]]
    reason = gone[0].seqs[0].finish_reason if gone and gone[0].seqs else None
    if reason != "abort":
        raise AssertionError(
            f"{desc}: a client that disconnects must be aborted (LLM.abort) so its KV blocks are freed at "
            f"once; its request ended with finish_reason {reason!r}, expected 'abort'"
        )
    _blocks_all_back(desc, llm)


def check_engine_loop(engine_loop) -> None:
    """engine_loop with the library's stream: tokens, joining between steps, abort frees blocks."""
    _pair_behaves("your engine_loop", engine_loop, serving.stream)


def _backpressure(stream_fn) -> None:
    desc = "your stream: max_waiting=2, two requests already waiting (the loop has not started)"
    llm = _llm()
    prompts = _prompts(llm.config.vocab_size, [4, 4, 4, 4], seed=17)

    async def body():
        server = serving.StreamingServer(llm, max_waiting=2)
        waiting = [stream_fn(server, p, _params(30)) for p in prompts[:2]]
        firsts = [asyncio.create_task(anext(s)) for s in waiting]
        await asyncio.sleep(0.01)
        refused = None
        try:
            await asyncio.wait_for(anext(stream_fn(server, prompts[2], _params(3))), 0.5)
        except serving.QueueFull:
            refused = True
        except TimeoutError:
            refused = False
        submits = [m for m in server.inbox if m[0] == "submit"]
        loop_task = asyncio.create_task(serving.engine_loop(server))
        await asyncio.gather(*firsts)
        # both run now (each has its first token): nothing waits, so a new request is accepted
        try:
            accepted = [t async for t in stream_fn(server, prompts[2], _params(3))]
        except serving.QueueFull:
            accepted = "refused with QueueFull"
        for s in waiting:
            async for _ in s:
                pass
        server.stop()
        await asyncio.wait_for(loop_task, 10)
        return refused, len(submits), accepted

    refused, submits, accepted = _run(desc, body)
    if not refused:
        raise AssertionError(f"{desc}: a third request must be refused with QueueFull (backpressure); it was not")
    if submits != 2:
        raise AssertionError(
            f"{desc}: a refused request must not reach the inbox: {submits} submits queued, expected 2"
        )
    if len(accepted) != 3:
        raise AssertionError(
            f"{desc}: once the two run (running requests do not wait), a new request must be accepted and "
            f"streamed (3 tokens); got {accepted}"
        )


def _closed_early(stream_fn) -> None:
    desc = "your stream: a consumer that stops after 2 of 50 tokens and closes the stream (aclose)"
    llm = _llm()
    [prompt] = _prompts(llm.config.vocab_size, [6], seed=18)
    added = []
    add_request = llm.add_request
    llm.add_request = lambda *a, **k: added.append(add_request(*a, **k)) or added[-1]

    async def body():
        server = serving.StreamingServer(llm, max_waiting=4)
        loop_task = asyncio.create_task(serving.engine_loop(server))
        s = stream_fn(server, prompt, _params(50))
        got = [await anext(s), await anext(s)]
        await s.aclose()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if not server.live and not server.inbox:
                break
        server.stop()
        await asyncio.wait_for(loop_task, 10)
        return got

    try:
        _run(desc, body)
    finally:
        del llm.add_request
    reason = added[0].seqs[0].finish_reason if added and added[0].seqs else None
    if reason != "abort":
        raise AssertionError(
            f"{desc}: closing the stream is a disconnect too: its request must be aborted (its blocks freed); "
            f"it ended with finish_reason {reason!r}, expected 'abort'"
        )
    _blocks_all_back(desc, llm)


def check_stream(stream) -> None:
    """stream with the library's engine_loop: tokens, abort on disconnect and on close, backpressure."""
    _pair_behaves("your stream", serving.engine_loop, stream)
    _closed_early(stream)
    _backpressure(stream)


# --------------------------------------------------------------------------- serving_metrics


def _percentile(values, q):
    """Linear interpolation between closest ranks (numpy's default), written out."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _expected_metrics(records, duration, ttft_slo, tpot_slo):
    ttfts, tpots, good, tokens = [], [], 0, 0
    for sent_at, times in records:
        tokens += len(times)
        if times:
            ttft = times[0] - sent_at
            ttfts.append(ttft)
            ok = ttft <= ttft_slo
            if len(times) >= 2:
                tpot = (times[-1] - times[0]) / (len(times) - 1)
                tpots.append(tpot)
                ok = ok and tpot <= tpot_slo
            good += ok
    return {
        "ttft_p50": _percentile(ttfts, 50),
        "ttft_p99": _percentile(ttfts, 99),
        "tpot_p50": _percentile(tpots, 50),
        "tpot_p99": _percentile(tpots, 99),
        "throughput": tokens / duration,
        "goodput": good / duration,
        "completed": len(ttfts),
        "good": good,
    }


def _records(rng: random.Random, n: int):
    records = []
    for _ in range(n):
        sent = rng.uniform(0, 5)
        k = rng.choice([0, 1, 2, 3, 8, 20])
        first = sent + rng.uniform(0.01, 2.0)
        gap = rng.uniform(0.005, 0.2)
        records.append((sent, [first + j * gap * rng.uniform(0.8, 1.2) for j in range(k)]))
    return records


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def check_serving_metrics(serving_metrics) -> None:
    rng = random.Random(1414)
    cases = [("one request, 5 tokens 0.1 s apart, TTFT 0.5 s", [(0.0, [0.5, 0.6, 0.7, 0.8, 0.9])], 2.0, 0.5, 0.1)]
    cases.append(("a request with one token (no TPOT) and one with none", [(0.0, [0.3]), (0.1, [])], 1.0, 1.0, 0.01))
    cases.append(
        (
            "two requests: one misses the TPOT SLO, one misses the TTFT SLO",
            [(0.0, [0.2, 0.5, 0.8]), (0.0, [1.5, 1.51, 1.52])],
            2.0,
            1.0,
            0.1,
        )
    )
    for k in range(6):
        cases.append((f"random records #{k}", _records(rng, rng.randint(3, 30)), rng.uniform(5, 20), 1.0, 0.1))
    for desc, records, duration, ttft_slo, tpot_slo in cases:
        want = _expected_metrics(records, duration, ttft_slo, tpot_slo)
        got = call(f"serving_metrics ({desc})", serving_metrics, records, duration, ttft_slo, tpot_slo)
        if not isinstance(got, dict):
            raise AssertionError(f"serving_metrics ({desc}): expected a dict, got {type(got).__name__}")
        for key, value in want.items():
            if key not in got:
                raise AssertionError(f"serving_metrics ({desc}): the result lacks {key!r}")
            if not _close(got[key], value):
                raise AssertionError(
                    f"serving_metrics ({desc}): {key} expected {value!r}, got {got[key]!r}" + _why(key)
                )


def _why(key: str) -> str:
    return {
        "tpot_p50": " (TPOT = (last - first) / (tokens - 1): the gaps between tokens, not the tokens)",
        "tpot_p99": " (TPOT = (last - first) / (tokens - 1): the gaps between tokens, not the tokens)",
        "goodput": " (goodput counts only requests meeting both SLOs, per second)",
        "good": " (a request meets the SLO when TTFT <= ttft_slo and TPOT <= tpot_slo)",
        "ttft_p50": " (TTFT = first token's time - the time the request was sent)",
        "ttft_p99": " (TTFT = first token's time - the time the request was sent)",
    }.get(key, "")


# --------------------------------------------------------------------------- predictions


def answer_q_refused_of_10() -> float:
    """Ten clients open a stream on a server with max_waiting=4 whose loop has not run yet: how many
    are refused? Counted with the library's stream (no engine step runs)."""

    async def body():
        server = serving.StreamingServer(llm=None, max_waiting=4)
        refused, opened = 0, []
        for i in range(10):
            s = serving.stream(server, [3 + i], _params(2))
            task = asyncio.create_task(anext(s))
            await asyncio.sleep(0)
            if task.done() and isinstance(task.exception(), serving.QueueFull):
                refused += 1
            else:
                opened.append(task)
        for task in opened:
            task.cancel()
        await asyncio.gather(*opened, return_exceptions=True)
        return refused

    return float(serving.run_sync(body))


def check_q_refused_of_10(value) -> None:
    expect_answer("q_refused_of_10", value, answer_q_refused_of_10(), "only max_waiting requests may wait at once")


def answer_q_blocks_freed() -> float:
    """A 20-token prompt, kv_block_size 8, aborted when its 5th token has reached the client: how many
    blocks does the abort give back? Measured on the engine (prefix caching off)."""
    llm = _llm(enable_prefix_caching=False)
    [prompt] = _prompts(llm.config.vocab_size, [20], seed=19)
    request = llm.add_request(prompt, _params(50))
    while len(request.seqs[0].output_token_ids) < 5:
        llm.step()
    before = llm.allocator.num_free
    llm.abort(request)
    return float(llm.allocator.num_free - before)


def check_q_blocks_freed(value) -> None:
    expect_answer(
        "q_blocks_freed",
        value,
        answer_q_blocks_freed(),
        "the cache holds K/V of the 20 prompt tokens and the first 4 generated ones (the 5th has no slot "
        "until the next step): ceil(24 / 8) blocks",
    )

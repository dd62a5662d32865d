"""One thread owns the engine; the async front end reaches it through queues.

    front end (asyncio, the server's thread)               engine thread (`EngineLoop`)
    ClientRequest(...)  --- inbox (a thread-safe queue) --->  LLM.add_request for each prompt
                                                              LLM.step(), LLM.step(), ...
    async for updates in client.updates()  <--- loop.call_soon_threadsafe --- each step's SampleUpdates
    client.abort()      --- inbox --->                        LLM.abort: its KV blocks back in the pool

Requests join and leave between steps (continuous batching): the thread takes whatever arrived,
runs one step for everything in flight, reports, and blocks only when nothing is left to run.

Why not hand over the engine's StreamEvents as they are: an event does not say why a sample
finished, a sample whose sampling fails ends without one, and a stop string is cut from the text
only once it is complete. So after each step the thread reports every choice that changed: its
whole text so far, its token count, and its finish reason once it has one (`SampleUpdate`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from decodelab.engine.sequence import Request, Sequence, Status
from decodelab.params import SamplingParams
from decodelab.serving.metrics import ServingMetrics

_STOP, _WAKE = "stop", "wake"  # inbox messages beside ("submit" | "abort", submission)


class QueueFullError(RuntimeError):
    """More requests are waiting than the server accepts (`EngineLoop.max_waiting`)."""


class EngineUnavailableError(RuntimeError):
    """The engine thread is not running (not started yet, stopped, or ended by a failure)."""


@dataclass
class SampleUpdate:
    """Where one choice stands after an engine step. Choice i * n + j is sample j of prompt i."""

    choice: int
    text: str  # all of it so far (with a stop string cut off once the sample stops on it)
    num_tokens: int
    finish_reason: str | None = None  # "stop", "length", "error"; None while it runs
    error: str | None = None  # with "error": what went wrong

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Submission:
    """One API call on its way through the engine thread. `deliver(updates)` is called on that
    thread, so it must be thread-safe and quick. The fields below `arrival_time` are the thread's."""

    prompts: list[list[int]]
    params: SamplingParams
    deliver: Callable[[list[SampleUpdate]], None]
    arrival_time: float = field(default_factory=time.perf_counter)
    requests: list[Request] = field(default_factory=list)
    admitted: bool = False  # every prompt's first sample has left the waiting queue
    reported_tokens: dict[int, int] = field(default_factory=dict)  # choice -> tokens reported so far
    last_token_time: dict[int, float] = field(default_factory=dict)
    finished_choices: set[int] = field(default_factory=set)
    first_token_seen: bool = False

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    def choices(self) -> Iterator[tuple[int, Request, Sequence | None]]:
        """(choice index, its request, its sequence; None when the prompt was refused)."""
        n = self.params.n
        for i, request in enumerate(self.requests):
            for j in range(n):
                yield i * n + j, request, (request.seqs[j] if request.seqs else None)


class EngineLoop:
    """The thread that owns `llm`: the only caller of its add_request, step and abort.

    submit() and abort() may be called from any thread; a submission beyond `max_waiting` requests
    not yet admitted is refused with QueueFullError. pause() parks the thread between steps (what
    arrives meanwhile waits, and counts as waiting) until resume()."""

    def __init__(self, llm, max_waiting: int = 256, metrics: ServingMetrics | None = None):
        self.llm, self.max_waiting = llm, max_waiting
        self.metrics = metrics or ServingMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: list[Submission] = []  # the engine thread's own
        self._next_index = 0
        self._num_waiting = 0
        self._waiting_lock = threading.Lock()
        self._resumed, self._parked = threading.Event(), threading.Event()
        self._resumed.set()
        self._thread = threading.Thread(target=self._run, name="decodelab-engine-loop", daemon=True)
        self.failure: BaseException | None = None  # what ended the thread, if anything did

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._publish_engine_state()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread after its current step; whatever is in flight ends with an error."""
        self._resumed.set()
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def submit(self, submission: Submission) -> None:
        """Queue a submission for the engine thread, unless max_waiting are already waiting or the
        thread is not running (nobody would answer)."""
        if not self.is_alive:
            why = f" ({type(self.failure).__name__}: {self.failure})" if self.failure is not None else ""
            raise EngineUnavailableError(f"the engine loop is not running{why}")
        with self._waiting_lock:
            if self._num_waiting >= self.max_waiting:
                self.metrics.observe_rejected("queue_full")
                raise QueueFullError(
                    f"the server is busy: {self._num_waiting} requests are already waiting "
                    f"(--max-queue {self.max_waiting}); retry later"
                )
            self._num_waiting += 1
            self.metrics.set_waiting(self._num_waiting)
        self._inbox.put(("submit", submission))

    def abort(self, submission: Submission) -> None:
        """The client has gone: stop its samples and free their KV blocks (a no-op once it finished)."""
        self._inbox.put(("abort", submission))

    def pause(self, timeout: float = 30.0) -> None:
        """Park the engine thread between steps; returns once it is parked."""
        self._resumed.clear()
        self._inbox.put(_WAKE)  # a thread blocked on an empty inbox wakes up to park
        if not self._parked.wait(timeout):
            raise TimeoutError(f"the engine loop did not pause within {timeout} s")

    def resume(self) -> None:
        self._resumed.set()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while True:
                if not self._resumed.is_set():
                    self._parked.set()
                    self._resumed.wait()
                    self._parked.clear()
                if not self._take_messages(block=not self.llm.scheduler.has_unfinished()):
                    break
                if self.llm.scheduler.has_unfinished():
                    self._step()
                self._report()
        except BaseException as exc:  # noqa: BLE001 - recorded for /health; every client is told below
            self.failure = exc
        finally:
            self._fail_everything(
                "the server is shutting down"
                if self.failure is None
                else f"the engine loop stopped: {type(self.failure).__name__}: {self.failure}"
            )

    def _take_messages(self, block: bool) -> bool:
        """Add what was submitted and abort what was withdrawn; False when told to stop."""
        messages = [self._inbox.get()] if block else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for message in messages:
            if message == _STOP:
                for rest in messages[messages.index(message) + 1 :]:
                    self._inbox.put(rest)  # for _fail_everything to answer
                return False
            if message == _WAKE:
                continue
            kind, submission = message
            if kind == "submit":
                self._add(submission)
            else:
                self._withdraw(submission)
        return True

    def _add(self, submission: Submission) -> None:
        """Queue each prompt of the submission in the engine."""
        self._live.append(submission)
        try:
            for ids in submission.prompts:
                submission.requests.append(self.llm.add_request(ids, submission.params, index=self._next_index))
                self._next_index += 1
        except (TypeError, ValueError) as exc:  # the front end checks first; this is the engine's word
            self._fail(submission, f"the engine refused the request: {exc}")
            return
        self.metrics.observe_prompt(sum(len(ids) for ids in submission.prompts))

    def _withdraw(self, submission: Submission) -> None:
        if submission not in self._live:
            return  # already finished
        for request in submission.requests:
            self.llm.abort(request)
        self.metrics.observe_finished("abort", submission.num_choices - len(submission.finished_choices))
        self._drop(submission)

    def _step(self) -> None:
        """One engine step. If it raises (a bug, memory), every request in flight ends with the error
        and the loop goes on for the next ones."""
        try:
            self.llm.checked_step()
        except Exception as exc:  # noqa: BLE001 - reported to each client in flight
            for submission in list(self._live):
                self._fail(submission, f"the engine failed: {type(exc).__name__}: {exc}")

    def _report(self) -> None:
        """Tell each submission what changed in this step; drop those now finished."""
        now = time.perf_counter()
        for submission in list(self._live):
            if not submission.admitted and all(
                r.error is not None or r.seqs[0].status is not Status.WAITING for r in submission.requests
            ):
                self._mark_admitted(submission)
            updates = self._updates(submission, now)
            if updates:
                self._deliver(submission, updates)
            if len(submission.finished_choices) == submission.num_choices:
                self._drop(submission)
        self._publish_engine_state()

    def _updates(self, submission: Submission, now: float) -> list[SampleUpdate]:
        updates = []
        for choice, request, seq in submission.choices():
            if choice in submission.finished_choices:
                continue
            if seq is None:  # the engine refused the prompt
                updates.append(SampleUpdate(choice, "", 0, "error", request.error))
            else:
                new_tokens = len(seq.output_token_ids) - submission.reported_tokens.get(choice, 0)
                if new_tokens == 0 and not seq.is_finished:
                    continue
                if new_tokens:
                    self._time_tokens(submission, choice, new_tokens, now)
                updates.append(
                    SampleUpdate(
                        choice,
                        seq.text,
                        len(seq.output_token_ids),
                        seq.finish_reason if seq.is_finished else None,
                        seq.error,
                    )
                )
            if updates[-1].finished:
                submission.finished_choices.add(choice)
                self.metrics.observe_finished(updates[-1].finish_reason)
        return updates

    def _time_tokens(self, submission: Submission, choice: int, new_tokens: int, now: float) -> None:
        if not submission.first_token_seen:
            submission.first_token_seen = True
            self.metrics.observe_first_token(now - submission.arrival_time)
        last = submission.last_token_time.get(choice)
        self.metrics.observe_tokens(new_tokens, None if last is None else now - last)
        submission.last_token_time[choice] = now
        submission.reported_tokens[choice] = submission.reported_tokens.get(choice, 0) + new_tokens

    def _deliver(self, submission: Submission, updates: list[SampleUpdate]) -> None:
        try:
            submission.deliver(updates)
        except Exception:  # noqa: BLE001 - the front end is gone (its event loop closed): nobody to tell
            self._withdraw(submission)

    def _fail(self, submission: Submission, message: str) -> None:
        """End every unfinished choice of the submission with finish_reason "error" and `message`."""
        for request in submission.requests:
            self.llm.abort(request)
        failed = [
            SampleUpdate(choice, "", 0, "error", message)
            for choice in range(submission.num_choices)
            if choice not in submission.finished_choices
        ]
        self.metrics.observe_finished("error", len(failed))
        self._drop(submission)
        if failed:
            self._deliver(submission, failed)

    def _drop(self, submission: Submission) -> None:
        if submission in self._live:
            self._live.remove(submission)
        if not submission.admitted:
            self._mark_admitted(submission)
        submission.finished_choices.update(range(submission.num_choices))

    def _mark_admitted(self, submission: Submission) -> None:
        """It no longer waits (it runs, or it has ended): one fewer in the queue --max-queue bounds."""
        submission.admitted = True
        with self._waiting_lock:
            self._num_waiting -= 1
            self.metrics.set_waiting(self._num_waiting)

    def _fail_everything(self, message: str) -> None:
        """The thread is ending: every submission in flight or still in the inbox ends with `message`."""
        for submission in list(self._live):
            self._fail(submission, message)
        while True:
            try:
                message_in_inbox = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message_in_inbox, tuple) and message_in_inbox[0] == "submit":
                self._fail(message_in_inbox[1], message)
        self._publish_engine_state()

    def _publish_engine_state(self) -> None:
        allocator = self.llm.allocator
        running = sum(1 for submission in self._live if submission.admitted)
        self.metrics.set_engine_state(running, allocator.num_blocks - allocator.num_free, allocator.num_blocks)

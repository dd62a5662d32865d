"""The front end's side of one request to the engine thread (`serving.engine_loop`).

    client = ClientRequest(engine_loop, prompts, params)   # in the event loop; QueueFullError when full
    async for updates in client.updates(): ...              # each engine step's SampleUpdates, until done
    client.abort()                                          # the client went away: free its KV blocks

The engine thread hands each step's updates over with `loop.call_soon_threadsafe`, onto an asyncio
queue of this request's own, so the event loop never blocks on the engine and no other request's
tokens can reach it.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from decodelab.params import SamplingParams
from decodelab.serving.engine_loop import EngineLoop, SampleUpdate, Submission


class ClientRequest:
    """The front end's side of one submission: made inside the event loop, it submits at once
    (QueueFullError when the queue is full) and receives each step's updates on an asyncio queue."""

    def __init__(self, engine_loop: EngineLoop, prompts: list[list[int]], params: SamplingParams):
        self._event_loop = asyncio.get_running_loop()
        self._updates: asyncio.Queue = asyncio.Queue()
        self._engine_loop = engine_loop
        self.submission = Submission(prompts, params, deliver=self._deliver_threadsafe)
        self.done = False
        engine_loop.submit(self.submission)

    def _deliver_threadsafe(self, updates: list[SampleUpdate]) -> None:
        """Called on the engine thread: hand the updates to the event loop's queue."""
        self._event_loop.call_soon_threadsafe(self._updates.put_nowait, updates)

    async def updates(self) -> AsyncIterator[list[SampleUpdate]]:
        """Each step's updates, until every choice has finished."""
        finished = 0
        while finished < self.submission.num_choices:
            batch = await self._updates.get()
            finished += sum(update.finished for update in batch)
            yield batch
        self.done = True

    async def final(self) -> list[SampleUpdate]:
        """The last update of every choice, in choice order."""
        last: dict[int, SampleUpdate] = {}
        async for batch in self.updates():
            last.update((update.choice, update) for update in batch)
        return [last[choice] for choice in range(self.submission.num_choices)]

    def abort(self) -> None:
        """Withdraw the submission unless it has finished (the client went away, the response failed)."""
        if not self.done:
            self.done = True
            self._engine_loop.abort(self.submission)

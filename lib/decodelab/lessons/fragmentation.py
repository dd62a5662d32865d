"""Internal and external fragmentation of KV memory, simulated: contiguous reservations against
paged blocks (notebook 07).

A queue of requests of known final lengths is served first come, first served by a pool of
`pool_slots` token slots. A request holds the KV memory of its final length from admission
until it leaves, a random 1..`max_stay` time steps later, drawn independently of its length
(seeded), so that every request weighs alike in the shares below, as in `kv_waste`; the clock
runs until the last request is admitted. Three layouts:

* ``"preallocate"``: every request reserves `max_len` contiguous slots (first fit);
* ``"exact"``: every request reserves exactly its own length, contiguously (first fit): a
  server that knew every final length in advance;
* ``"paged"``: blocks of `block_size` slots from a `BlockAllocator`; any free block serves any
  request.

The pool's memory-time (slots x steps) splits four ways:

* **tokens**: slots holding a token's K/V;
* **internal fragmentation**: slots inside a reservation that hold no token (the never-used
  tail of a max_len reservation; the empty end of a paged request's last block);
* **external fragmentation**: free slots that cannot serve the request at the head of the
  queue, although there are enough of them in total, because no free run is long enough;
* **idle**: the other free slots (the queue is empty, or the next request needs more than
  all of them together).
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import deque
from dataclasses import dataclass

from decodelab.engine.block_allocator import BlockAllocator

LAYOUTS = ("preallocate", "exact", "paged")


@dataclass
class Fragmentation:
    """Shares of the pool's memory-time (they add up to 1) and how many requests ran at once."""

    layout: str
    tokens: float
    internal: float
    external: float
    idle: float
    mean_running: float
    refusals_with_enough_free: int  # admissions refused although the free slots sufficed in total


class _Contiguous:
    """First-fit contiguous reservations in a pool of `size` slots."""

    def __init__(self, size: int):
        self.size = size
        self.starts: list[int] = []  # sorted starts of the live reservations
        self.ends: dict[int, int] = {}

    def reserve(self, need: int) -> int | None:
        previous_end = 0
        for start in self.starts:
            if start - previous_end >= need:
                break
            previous_end = self.ends[start]
        else:
            if self.size - previous_end < need:
                return None
        bisect.insort(self.starts, previous_end)
        self.ends[previous_end] = previous_end + need
        return previous_end

    def release(self, start: int) -> None:
        self.starts.remove(start)
        del self.ends[start]


def simulate(
    lengths,
    layout: str,
    pool_slots: int,
    max_len: int | None = None,
    block_size: int = 16,
    min_stay: int = 1,
    max_stay: int = 1000,
    seed: int = 0,
) -> Fragmentation:
    """Serve `lengths` (final request lengths, in arrival order) under one layout; see the module."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "preallocate" and (max_len is None or max(lengths) > max_len):
        raise ValueError("preallocation needs a max_len at least as long as every request")
    if layout == "paged":
        pool = BlockAllocator(pool_slots // block_size, block_size, enable_prefix_caching=False)
    else:
        pool = _Contiguous(pool_slots)

    def reserved(length: int) -> int:
        if layout == "preallocate":
            return max_len
        if layout == "exact":
            return length
        return pool.blocks_needed(length) * block_size

    def free_slots() -> int:
        return (
            pool.num_free * block_size if layout == "paged" else pool_slots - sum(pool.ends[s] - s for s in pool.starts)
        )

    rng = random.Random(f"stays {seed}")  # not the stream that drew the lengths from the same seed
    stays = [rng.randint(min_stay, max_stay) for _ in lengths]  # the same for every layout
    queue, live = deque(lengths), []  # live: heap of (leave time, id, length, handle)
    now, used, held = 0, 0, 0
    totals = {"tokens": 0, "internal": 0, "external": 0, "idle": 0, "running": 0}
    refusals = 0
    next_id = 0
    while queue:
        while queue:  # admit first come, first served, until one does not fit
            length = queue[0]
            if layout == "paged":
                handle = pool.allocate(range(length))[0] if pool.can_allocate(range(length)) else None
            else:
                handle = pool.reserve(reserved(length))
            if handle is None:
                break
            queue.popleft()
            heapq.heappush(live, (now + stays[next_id], next_id, length, handle))
            next_id += 1
            used, held = used + length, held + reserved(length)
        if not queue:
            break
        if not live:
            raise ValueError(f"a request of {queue[0]} tokens does not fit an empty pool of {pool_slots} slots")
        free = free_slots()
        stranded = free if free >= reserved(queue[0]) else 0
        refusals += stranded > 0
        until = live[0][0]  # the next departure
        span = until - now
        totals["tokens"] += used * span
        totals["internal"] += (held - used) * span
        totals["external"] += stranded * span
        totals["idle"] += (free - stranded) * span
        totals["running"] += len(live) * span
        now = until
        while live and live[0][0] == now:
            _, _, length, handle = heapq.heappop(live)
            if layout == "paged":
                pool.free_sequence(handle)
            else:
                pool.release(handle)
            used, held = used - length, held - reserved(length)
    time_slots = max(1, now) * pool_slots
    return Fragmentation(
        layout,
        totals["tokens"] / time_slots,
        totals["internal"] / time_slots,
        totals["external"] / time_slots,
        totals["idle"] / time_slots,
        totals["running"] / max(1, now),
        refusals,
    )


__all__ = ["LAYOUTS", "Fragmentation", "simulate"]

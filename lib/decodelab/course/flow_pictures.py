"""Pictures of a real object's state, for the flows the notebooks explain in words (re-exported by
`decodelab.course.pictures`):

    kv_cache_flow(cache, previous_length=5)      # notebook 03: rows held, rows just appended, what attention reads
    block_table_picture(allocator, tables)       # notebook 07: each sequence's block table pointing into the pool
    trace = trace_speculative_step(step, target, draft, target_cache, draft_cache, ids, k, params, generator)
    draft_verify_picture(trace)                  # notebook 09: drafted, accepted, rejected, and both caches rolled back

They read the objects, never change them (a traced speculative step runs for real: its caches
and ids move on as they would in the loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodelab.course.svg import Canvas, Picture
from decodelab.lessons.measure import CountingModel

HELD, NEW, EMPTY = "#93c5fd", "#fbbf24", "#ffffff"
ACCEPTED, REJECTED, UNJUDGED, CHOSEN = "#86efac", "#fca5a5", "#e5e7eb", "#c4b5fd"
SEQUENCE_COLORS = ("#2563eb", "#dc2626", "#059669", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f")
MAX_CELLS = 60  # positions or blocks drawn in one row; longer rows show their last MAX_CELLS


def _window(needed: int, capacity: int) -> tuple[int, int]:
    """The positions [start, stop) to draw of a row of `capacity` whose first `needed` matter."""
    stop = min(capacity, max(needed + 4, min(capacity, MAX_CELLS)))
    return max(0, stop - MAX_CELLS), stop


# ---------------------------------------------------------------------------- the KV cache
def kv_cache_flow(cache, previous_length: int | None = None, max_layers: int = 4) -> Picture:
    """A `decodelab.model.kv_cache.KVCache` (its `lengths` per layer and `max_seq_len`): per
    layer, a cell per position: held before (blue), appended since `previous_length` (amber; by
    default the last position, what one decode step writes), free (white); and the read: a new
    token's query attends over every held row through `view(layer)`. Shows the first max_layers - 1
    layers and the last. ValueError if previous_length is not in 0 .. the shortest layer's length."""
    lengths, capacity = list(cache.lengths), int(cache.max_seq_len)
    shortest = min(lengths)
    previous_length = max(0, shortest - 1) if previous_length is None else previous_length
    if not 0 <= previous_length <= shortest:
        raise ValueError(
            f"previous_length must be in 0..{shortest} (the positions every layer holds), got {previous_length}"
        )
    layers = list(range(len(lengths)))
    if len(layers) > max_layers:
        layers = layers[: max_layers - 1] + [layers[-1]]
    start, stop = _window(max(lengths), capacity)
    cell = min(22.0, 760 / (stop - start))
    shape = "x".join(str(n) for n in tuple(cache.keys.shape)[1:]) if hasattr(cache, "keys") else "?"
    title = (
        f"KV cache: {len(lengths)} layers, each K and V [B, H_kv, max_seq_len, D] = [{shape}]; "
        f"{previous_length} positions held before, {max(lengths) - previous_length} appended"
    )
    canvas = Canvas(int(150 + cell * (stop - start) + 40), title)
    canvas.text(10, 20, title, size=12, bold=True)
    every = 1 if cell >= 18 else 5
    for position in range(start, stop):
        if position % every == 0:
            canvas.text(
                130 + cell * (position - start) + cell / 2 - 1,
                44,
                str(position),
                size=8,
                anchor="middle",
                color="#475569",
            )
    canvas.text(10, 44, "position", size=8, color="#475569")
    y = 50.0
    for row, layer in enumerate(layers):
        if row and layer != layers[row - 1] + 1:
            canvas.text(80, y + 12, f"... layers {layers[row - 1] + 1} to {layer - 1} alike", size=10, color="#475569")
            y += 20
        canvas.text(10, y + cell * 0.7, f"layer {layer}: K, V", size=11)
        for position in range(start, stop):
            kind = (
                "new"
                if previous_length <= position < lengths[layer]
                else ("held" if position < lengths[layer] else "empty")
            )
            canvas.box(
                130 + cell * (position - start),
                y,
                cell - 2,
                cell,
                f"kv-{layer}-{position}",
                f"slot {kind}",
                fill={"new": NEW, "held": HELD, "empty": EMPTY}[kind],
                stroke="#64748b",
                tooltip=f"layer {layer}, position {position}: {kind}",
                data={"layer": layer, "position": position},
            )
        y += cell + 8
    _kv_read_and_legend(canvas, y, start, stop, cell, previous_length, min(lengths), capacity)
    return canvas.picture(y + 78)


def _kv_read_and_legend(canvas: Canvas, y, start, stop, cell, previous_length, held, capacity) -> None:
    left, right = 130 + cell * max(0, 0 - start), 130 + cell * (held - start) - 2
    if held > 0:
        canvas.path(f"M {left:.1f} {y} V {y + 8} H {right:.1f} V {y}", arrow=False, cls="read")
        canvas.text(
            (left + right) / 2,
            y + 22,
            f"read: the newest query attends over all {held} rows (view(layer), no copy)",
            size=10,
            anchor="middle",
        )
    if held > previous_length:
        x = 130 + cell * (previous_length - start) + (held - previous_length) * cell / 2
        wrote = f"position {held - 1}" if held - previous_length == 1 else f"positions {previous_length}..{held - 1}"
        canvas.text(x, y + 38, f"append(layer, k, v) wrote {wrote}", size=10, anchor="middle", color="#92400e")
    note = f"{capacity - held} free positions of max_seq_len={capacity}"
    note += f"; positions before {start} not drawn" if start else ""
    canvas.text(
        10, y + 60, f"blue: held before · amber: just appended · white: free ({note})", size=10, color="#475569"
    )


# ---------------------------------------------------------------------------- paged KV
def pool_snapshot(allocator, tables: dict[str, list[int]], label: str) -> dict:
    """The pool at one moment, for `block_table_picture` and notebook 07's `block_table_figure`,
    after checking it: every block's ref_count is the number of the given live tables that hold
    it, and free + held = all (AssertionError naming `label` otherwise).
    -> {"label", "holders": [names per block], "ref_counts", "cached": [bool per block]}."""
    holders = [[] for _ in range(allocator.num_blocks)]
    for name, table in tables.items():
        for block_id in table:
            holders[block_id].append(name)
    refs = [allocator.ref_count(b) for b in range(allocator.num_blocks)]
    for block_id, (ref, who) in enumerate(zip(refs, holders)):
        if ref != len(who):
            raise AssertionError(
                f"{label}: block {block_id} has ref_count {ref} but {len(who)} tables hold it "
                f"({', '.join(who) or 'none'})"
            )
    held = sum(1 for who in holders if who)
    if allocator.num_free + held != allocator.num_blocks:
        raise AssertionError(f"{label}: {allocator.num_free} free + {held} held != {allocator.num_blocks} blocks")
    cached = [not who and allocator.is_cached(b) for b, who in enumerate(holders)]
    return {"label": label, "holders": holders, "ref_counts": refs, "cached": cached}


def block_table_picture(allocator, block_tables: dict[str, list[int]]) -> Picture:
    """A BlockAllocator's pool (anything with its `num_blocks`, `num_free`, `ref_count(id)`,
    `is_cached(id)`) and the live sequences' block tables {name: [block ids]}: one arrow per
    table entry to its block. Pool colours: free (white), free but still named in the prefix
    cache (grey), held by one table (light blue), shared by several (dark blue, with the count).
    ValueError if a table names a block outside the pool or the counts disagree with the tables."""
    if not isinstance(block_tables, dict):
        raise ValueError(f"block_tables must be a dict {{name: [block ids]}}, got {type(block_tables).__name__}")
    for name, table in block_tables.items():
        bad = [b for b in table if not (isinstance(b, int) and 0 <= b < allocator.num_blocks)]
        if bad:
            raise ValueError(f"table {name!r} names blocks {bad}, outside the pool's 0..{allocator.num_blocks - 1}")
    try:
        pool = pool_snapshot(allocator, block_tables, "block_table_picture")
    except AssertionError as error:
        raise ValueError(f"the tables do not match the allocator: {error}") from None
    highest = max((block for table in block_tables.values() for block in table), default=-1)
    start, stop = _window(highest + 1, allocator.num_blocks)  # up to the highest block a table holds
    cell = max(16.0, min(40.0, 880 / (stop - start)))
    title = (
        f"Block tables into a pool of {allocator.num_blocks} blocks of {allocator.block_size} tokens: "
        f"{allocator.num_free} free"
    )
    canvas = Canvas(int(max(560, 100 + cell * (stop - start) + 20)), title)
    canvas.text(10, 20, title, size=12, bold=True)
    pool_y = 48 + 30 * len(block_tables) + 50
    centres = {b: 100 + cell * (b - start) + cell / 2 for b in range(start, stop)}
    for row, (name, table) in enumerate(block_tables.items()):
        _draw_table(canvas, name, table, 40 + 30 * row, pool_y, centres, SEQUENCE_COLORS[row % len(SEQUENCE_COLORS)])
    canvas.text(10, pool_y + cell * 0.65, "pool", size=11, bold=True)
    for block in range(start, stop):
        refs = pool["ref_counts"][block]
        kind = "shared" if refs > 1 else "held" if refs else "cached" if pool["cached"][block] else "free"
        canvas.box(
            centres[block] - cell / 2,
            pool_y,
            cell - 3,
            cell,
            f"block-{block}",
            f"block {kind}",
            label=f"{block}" + (f" x{refs}" if refs > 1 else ""),
            size=9,
            fill={"shared": "#1e40af", "held": "#bfdbfe", "cached": "#d1d5db", "free": "#ffffff"}[kind],
            label_color="#ffffff" if kind == "shared" else "#111827",
            tooltip=f"block {block}: {kind}, held by {', '.join(pool['holders'][block]) or 'no table'}",
            data={"block": block, "ref_count": refs},
        )
    canvas.text(
        10,
        pool_y + cell + 22,
        "white: free · grey: free, still named in the prefix cache (a later prompt "
        "with that prefix finds it) · light blue: one table · dark blue: shared (x count)",
        size=10,
        color="#475569",
    )
    if (start, stop) != (0, allocator.num_blocks):
        canvas.text(
            10,
            pool_y + cell + 38,
            f"blocks {start} to {stop - 1} of the pool's {allocator.num_blocks} drawn",
            size=10,
            color="#475569",
        )
    return canvas.picture(pool_y + cell + 50)


def _draw_table(canvas: Canvas, name, table, y, pool_y, centres, color) -> None:
    """One sequence's block table at y: its entries in order, each with an arrow to its block."""
    canvas.text(10, y + 14, f"{name}", size=11, bold=True, color=color)
    for index, block in enumerate(table):
        x = 40 + 30 * index
        canvas.box(
            x,
            y,
            26,
            20,
            f"entry-{name}-{index}",
            "entry",
            label=str(block),
            size=9,
            stroke=color,
            tooltip=f"{name}: logical block {index} (tokens {index} x block_size ...) is pool block {block}",
            data={"sequence": name, "index": index, "block": block},
        )
        if block in centres:
            canvas.arrow(x + 13, y + 20, centres[block], pool_y - 2, color=color)


# ---------------------------------------------------------------------------- speculative decoding
@dataclass(frozen=True)
class SpeculativeTrace:
    """What one speculative step did. Cache lengths are (before, after propose/verify, after rollback)."""

    pending: int  # the last token of ids, in neither cache when the step starts
    drafted: list[int]  # d_1 .. d_k, as fed to the target's verify pass
    emitted: list[int]  # the accepted drafts, then one token from the target (resampled or bonus)
    target_cache: tuple[int, int, int]
    draft_cache: tuple[int, int, int]

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1


class _RecordingModel(CountingModel):
    """CountingModel that also keeps the token ids of every call."""

    def __init__(self, model):
        super().__init__(model)
        self.fed: list[list[int]] = []

    def __call__(self, input_ids, *args, **kwargs):
        self.fed.append(input_ids[0].tolist())
        return super().__call__(input_ids, *args, **kwargs)


def trace_speculative_step(
    step, target, draft, target_cache, draft_cache, ids: list[int], k: int, params, generator=None
) -> SpeculativeTrace:
    """Run `step` (a `speculative_step`: the library's or the learner's) once for real and record
    it: the drafts are what the target's verify pass was fed after the pending token; the cache
    lengths are read before and after, their peak counted from the tokens each model was fed."""
    recorded_target, recorded_draft = _RecordingModel(target), _RecordingModel(draft)
    before = target_cache.seq_len, draft_cache.seq_len
    with torch.inference_mode():
        emitted = step(recorded_target, recorded_draft, target_cache, draft_cache, ids, k, params, generator)
    if not recorded_target.fed:
        raise ValueError("the step never ran the target, so there is no verify pass to draw")
    verified = recorded_target.fed[-1]
    return SpeculativeTrace(
        pending=int(ids[-1]),
        drafted=verified[1:],
        emitted=[int(t) for t in emitted],
        target_cache=(before[0], before[0] + sum(recorded_target.tokens_fed()), target_cache.seq_len),
        draft_cache=(before[1], before[1] + sum(recorded_draft.tokens_fed()), draft_cache.seq_len),
    )


def draft_verify_picture(trace: SpeculativeTrace, tokenizer=None) -> Picture:
    """One speculative step: the drafts (accepted green, the first rejected red, the ones after it
    grey: never judged), the tokens emitted (the target's own last one purple), and both caches
    growing during propose/verify and cut back by the rollback. With a tokenizer, tokens are shown
    as text. ValueError for a trace that emits nothing or more than k + 1 tokens."""
    k, n = len(trace.drafted), trace.num_accepted
    if not 0 <= n <= k:
        raise ValueError(f"a step with {k} drafts emits 1..{k + 1} tokens, this trace emits {len(trace.emitted)}")
    label = (lambda t: tokenizer.decode([t]).replace(" ", "␣").replace("\n", "\\n")[:8]) if tokenizer else str
    title = f"One speculative step: {k} drafted, {n} accepted, {len(trace.emitted)} tokens for one target pass"
    canvas = Canvas(720, title)
    canvas.text(10, 20, title, size=12, bold=True)
    status = ["accepted"] * n + (["rejected"] if n < k else []) + ["unjudged"] * max(0, k - n - 1)
    _token_row(
        canvas,
        48,
        "propose (draft model, k passes)",
        [("pending", trace.pending)] + [(s, t) for s, t in zip(status, trace.drafted)],
        label,
    )
    canvas.text(
        190,
        98,
        f"verify: ONE target pass over [pending, d1..d{k}] gives p1..p{k + 1}; "
        "accept d_i with probability min(1, p/q), left to right",
        size=10,
        color="#475569",
    )
    last = "bonus" if n == k else "resampled"
    _token_row(
        canvas, 124, "emitted", [("accepted", t) for t in trace.emitted[:-1]] + [(last, trace.emitted[-1])], label
    )
    _cache_bar(canvas, 176, "target cache", trace.target_cache)
    _cache_bar(canvas, 226, "draft cache", trace.draft_cache)
    canvas.text(
        10,
        284,
        "green: accepted · red: rejected (its p/q test failed) · grey: after a rejection, never "
        "judged · purple: the target's token (resampled, or a bonus when all pass)",
        size=10,
        color="#475569",
    )
    canvas.text(
        10,
        300,
        "caches: blue: held before the step · amber: written in the step and kept · red: "
        "written for tokens that are not kept, then truncated",
        size=10,
        color="#475569",
    )
    return canvas.picture(312)


def _token_row(canvas: Canvas, y, caption, tokens, label) -> None:
    canvas.text(10, y + 18, caption, size=11)
    fills = {
        "pending": "#ffffff",
        "accepted": ACCEPTED,
        "rejected": REJECTED,
        "unjudged": UNJUDGED,
        "bonus": CHOSEN,
        "resampled": CHOSEN,
    }
    for index, (kind, token) in enumerate(tokens):
        canvas.text(190 + 62 * index + 29, y - 3, kind, size=8, anchor="middle", color="#475569")
        canvas.box(
            190 + 62 * index,
            y,
            58,
            28,
            f"{caption.split()[0]}-{index}",
            f"token {kind}",
            label=label(token),
            fill=fills[kind],
            stroke="#475569",
            size=10,
            tooltip=f"{kind}: token id {token}",
            data={"token": token, "kind": kind},
        )


def _cache_bar(canvas: Canvas, y, caption, lengths) -> None:
    """A cache in the step: what it held before (one box), then a cell per position written in the
    step: kept (amber) or truncated by the rollback (red)."""
    before, peak, after = lengths
    canvas.text(10, y + 16, caption, size=11)
    canvas.box(
        190,
        y,
        118,
        24,
        None,
        "cache held",
        label=f"0..{before - 1}: held" if before else "empty",
        fill=HELD,
        stroke="#64748b",
        size=10,
    )
    for position in range(before, peak):
        kind = "kept" if position < after else "rolled-back"
        canvas.box(
            312 + 62 * (position - before),
            y,
            58,
            24,
            None,
            f"cache {kind}",
            label=str(position),
            fill=NEW if kind == "kept" else REJECTED,
            stroke="#64748b",
            size=10,
            tooltip=f"{caption}, position {position}: written in the step, {kind.replace('-', ' ')}",
        )
    rows = peak - after
    dropped = f"the rollback truncates {rows} row{'s' if rows != 1 else ''}" if rows else "nothing to roll back"
    canvas.text(
        190,
        y + 38,
        f"{before} positions before, {peak} after propose/verify, {after} after the rollback ({dropped})",
        size=10,
        color="#475569",
    )


__all__ = ["SpeculativeTrace", "block_table_picture", "draft_verify_picture", "kv_cache_flow", "trace_speculative_step"]

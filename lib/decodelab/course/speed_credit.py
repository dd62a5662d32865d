"""Speed on the learner's own machine, as a ratio: each timed part of the learner's engine
(`speed_parts`) beside the library's reference, never an absolute time.

    python -m decodelab progress --course ~/course --bench [--json]

    report = bench_course("~/course", rows)      # rows: progress's, which say what passes
    print(format_report(report))

**Paired, order-alternated runs in fresh processes.** Each round is a fresh Python process
(`speed_worker`, started and ended like progress's notebook subprocesses: `progress_process`)
that loads the learner's notebooks the way `course.parts` does, checks each part's output against
the reference's on that round's inputs, and then times the two sides in pairs, the order
alternating from pair to pair (and the first of each round alternating too), so that a drift of
the machine (another program, the CPU's clock) falls on both sides alike. A pair's ratio is the
learner's time over the library's; the report gives the median over every pair of every round,
with its spread: the quartiles and the extremes. On a busy machine single pairs stray; the median
of many does not.

**The roofline.** This machine's memory bandwidth is measured once, with a large tensor copy
(`lessons.measure.memory_bandwidth(method="copy")`); a part's fraction of the roofline is the least
number of bytes its call must move (from the shapes) divided by its median time, over that
bandwidth. The scheduler step moves no tensors and has none.

Timings use the one timer of the course, `lessons.measure.time_call`. A part is timed only when the
exercises behind it pass their visible tests; the others say why they were not.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from decodelab.course.progress_owner import check_owner
from decodelab.course.progress_plan import PASSING
from decodelab.course.progress_process import run_until
from decodelab.course.speed_parts import PARTS, SIZES, TimedPart, Workload
from decodelab.lessons.measure import memory_bandwidth, time_call

DEFAULT_ROUNDS, DEFAULT_PAIRS = 3, 20
ROUND_TIMEOUT_S = 300.0


@dataclass
class Spread:
    """The median of a sample and how far it spreads: quartiles and extremes."""

    median: float
    q1: float
    q3: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            raise ValueError("no values to summarise")
        if len(values) == 1:
            return cls(values[0], values[0], values[0], values[0], values[0])
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q1, q3, min(values), max(values))


def paired_times(
    learner: Workload, reference: Workload, pairs: int, device="cpu", learner_first: bool = True
) -> tuple[list[float], list[float]]:
    """(learner's seconds per call, reference's), `pairs` samples each, timed in pairs whose
    order alternates (the first pair starts with the learner when learner_first). One warm-up
    sample each first."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    for workload in (learner, reference):
        workload.ready()()
    times: dict[int, list[float]] = {0: [], 1: []}
    sides = (learner, reference)
    collecting = gc.isenabled()
    try:
        for i in range(pairs):
            order = (0, 1) if (i % 2 == 0) == learner_first else (1, 0)
            for side in order:
                run = sides[side].ready()  # built before the clock starts (the scheduler's states)
                gc.disable()  # a collection of the other side's garbage must not land in this sample
                times[side].append(time_call(run, device, repeats=1, warmup=0)[0] / sides[side].calls)
                gc.enable()
    finally:
        if collecting:
            gc.enable()
        else:
            gc.disable()
    return times[0], times[1]


def ratios(learner_s: list[float], reference_s: list[float]) -> list[float]:
    """Each pair's learner time over reference time."""
    return [mine / theirs for mine, theirs in zip(learner_s, reference_s)]


# --------------------------------------------------------------------------- a part's result


@dataclass
class PartResult:
    part: str
    notebook: str
    exercise: str
    status: str  # "timed", or "not timed: why"
    learner_s: list[float] = field(default_factory=list)
    reference_s: list[float] = field(default_factory=list)
    bytes_moved: int | None = None

    @property
    def ratio(self) -> Spread | None:
        return Spread.of(ratios(self.learner_s, self.reference_s)) if self.learner_s else None

    def roofline_fraction(self, bandwidth: float | None, learner: bool = True) -> float | None:
        """The least bytes of one call / its median seconds / the machine's bytes per second."""
        times = self.learner_s if learner else self.reference_s
        if not times or not self.bytes_moved or not bandwidth:
            return None
        return self.bytes_moved / statistics.median(times) / bandwidth


@dataclass
class BenchReport:
    bandwidth: float | None  # bytes per second of this machine's memory (a large tensor copy); None: not measured
    size: str
    rounds: int
    pairs: int
    results: list[PartResult]

    def to_dict(self) -> dict:
        parts = []
        for r in self.results:
            spread = r.ratio
            parts.append(
                {
                    "part": r.part,
                    "notebook": r.notebook,
                    "exercise": r.exercise,
                    "status": r.status,
                    "pairs": len(r.learner_s),
                    "ratio": asdict(spread) if spread else None,
                    "bytes_moved": r.bytes_moved,
                    "roofline_fraction": r.roofline_fraction(self.bandwidth),
                    "reference_roofline_fraction": r.roofline_fraction(self.bandwidth, learner=False),
                }
            )
        return {
            "bandwidth_bytes_per_s": self.bandwidth,
            "size": self.size,
            "rounds": self.rounds,
            "pairs_per_round": self.pairs,
            "parts": parts,
        }


# --------------------------------------------------------------------------- the bench


def why_not_timed(part: TimedPart, statuses: dict[tuple[str, str], str]) -> str | None:
    """Why the learner's part cannot be timed (its notebook is missing or an exercise does not pass)."""
    if not any(notebook == part.notebook for notebook, _ in statuses):
        return f"not timed: no {part.notebook} notebook checked"
    failing = [
        f"{name}: {statuses.get((part.notebook, name), 'not found in the notebook')}"
        for name in part.exercises
        if statuses.get((part.notebook, name)) != PASSING
    ]
    return f"not timed: {'; '.join(failing)}" if failing else None


def bench_course(
    course_dir,
    rows,
    size: str = "small",
    rounds: int = DEFAULT_ROUNDS,
    pairs: int = DEFAULT_PAIRS,
    device: str = "cpu",
    bandwidth: float | None = None,
    parts: tuple[TimedPart, ...] = PARTS,
    on_progress: Callable[[str], None] | None = None,
    timeout: float = ROUND_TIMEOUT_S,
) -> BenchReport:
    """Time the learner's passing parts (progress's `rows` say which pass) against the library's:
    `rounds` fresh processes, `pairs` pairs per part in each. `on_progress(line)` hears a line per
    part as each round ends. `bandwidth` (bytes/s): measured here with a large copy when None and
    a part is timed."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if rounds < 1 or pairs < 1:
        raise ValueError(f"rounds and pairs must be >= 1, got {rounds} and {pairs}")
    folder = Path(course_dir).expanduser()
    statuses = {(row.notebook, row.exercise): row.status for row in rows}
    results = [PartResult(p.name, p.notebook, p.exercise, why_not_timed(p, statuses) or "timed") for p in parts]
    timed = [p for p, r in zip(parts, results) if r.status == "timed"]
    if timed:
        check_owner(folder)
        if bandwidth is None:
            bandwidth = memory_bandwidth(device, megabytes=128 if size == "small" else 512, repeats=5, method="copy")
    for round_index in range(rounds if timed else 0):
        found = _run_round(folder, timed, statuses, size, pairs, device, round_index, timeout)
        for part in timed:
            result = next(r for r in results if r.part == part.name)
            _merge(result, found.get(part.name))
            if on_progress:
                on_progress(_progress_line(result, round_index, rounds))
    return BenchReport(bandwidth, size, rounds, pairs, results)


def _run_round(folder: Path, timed, statuses, size, pairs, device, round_index, timeout) -> dict[str, dict]:
    """One fresh process: part name -> {"learner": [...], "reference": [...], "bytes": n} or {"error": why}."""
    spec = {
        "parent": os.getpid(),
        "course": str(folder.resolve()),
        "parts": [p.name for p in timed],
        "statuses": [[nb, ex, status] for (nb, ex), status in statuses.items()],
        "size": size,
        "pairs": pairs,
        "device": device,
        "seed": 1000 + round_index,
        "learner_first": round_index % 2 == 0,
    }
    with tempfile.TemporaryDirectory(prefix="decodelab-bench-") as tmp:
        spec_path, results_path = Path(tmp) / "spec.json", Path(tmp) / "results.jsonl"
        spec_path.write_text(json.dumps(spec))
        results_path.write_text("")
        returncode, timed_out, output = run_until(
            [sys.executable, "-m", "decodelab.course.speed_worker", str(spec_path), str(results_path)],
            folder,
            time.monotonic() + timeout,
        )
        found = {}
        for line in results_path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            found[event.get("part")] = event
    if timed_out or returncode != 0:
        why = f"timed out after {timeout:g} s" if timed_out else f"exit code {returncode}"
        last = output.strip().splitlines()[-1] if output.strip() else ""
        for part in timed:
            found.setdefault(part.name, {"error": f"the bench's process ended early ({why}) {last}".strip()})
    return found


def _merge(result: PartResult, event: dict | None) -> None:
    """Add one round's pairs; an error in any round (an output unlike the reference's on that
    round's inputs, a crash) leaves the part untimed, whatever other rounds measured."""
    if result.status != "timed":
        return
    if event is None:
        event = {"error": "the bench's process wrote nothing for it"}
    if "error" in event:
        result.status = f"not timed: {event['error']}"
        result.learner_s, result.reference_s = [], []
        return
    result.learner_s += event["learner"]
    result.reference_s += event["reference"]
    result.bytes_moved = event.get("bytes")


def _progress_line(result: PartResult, round_index: int, rounds: int) -> str:
    spread = result.ratio
    so_far = (
        f"{len(result.learner_s)} pairs, median {spread.median:.2f}x the library's time" if spread else result.status
    )
    return f"round {round_index + 1}/{rounds} · {result.part}: {so_far}"


# --------------------------------------------------------------------------- output


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def format_report(report: BenchReport) -> str:
    header = (
        "part",
        "exercise",
        "yours / library",
        "spread: quartiles; min-max",
        "pairs",
        "roofline: yours",
        "library's",
    )
    table = [header]
    for r in report.results:
        spread = r.ratio
        if spread is None:
            table.append((r.part, f"{r.notebook}: {r.exercise}", r.status, "", "", "", ""))
            continue
        table.append(
            (
                r.part,
                f"{r.notebook}: {r.exercise}",
                f"{spread.median:.2f}x",
                f"{spread.q1:.2f}-{spread.q3:.2f}; {spread.low:.2f}-{spread.high:.2f}",
                str(len(r.learner_s)),
                _percent(r.roofline_fraction(report.bandwidth)),
                _percent(r.roofline_fraction(report.bandwidth, learner=False)),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    if not any(r.learner_s for r in report.results):
        lines.append("\nNo part of yours was timed: each line says why.")
        return "\n".join(lines)
    lines.append(
        f"\nA ratio is your time over the library's on the same inputs (above 1: yours is slower): the "
        f"median of {report.rounds} fresh processes x {report.pairs} pairs, each pair run in alternating "
        f"order ({report.size} sizes). Roofline: the least bytes a call moves per second, over this "
        f"machine's {report.bandwidth / 1e9:.1f} GB/s (a large tensor copy)."
    )
    return "\n".join(lines)


def to_json(report: BenchReport) -> str:
    return json.dumps({"bench": report.to_dict()})


__all__ = [
    "BenchReport",
    "PartResult",
    "Spread",
    "bench_course",
    "format_report",
    "paired_times",
    "ratios",
    "to_json",
    "why_not_timed",
]

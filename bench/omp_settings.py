"""How a benchmark run set OpenMP's threads, and on which CPU, recorded beside its figures.

`import decodelab` sets OMP_WAIT_POLICY=PASSIVE (threads sleep between parallel regions) unless the
caller set it; GOMP_SPINCOUNT, set before Python starts, lets them spin that many loops first. Both
move a decode step's time by tens of percent on a small CPU, for us and for llama.cpp's OpenMP
threads alike, so every result names them, and the recorded command carries the spin count.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def omp_settings() -> dict[str, str | None]:
    """{"OMP_WAIT_POLICY": ..., "GOMP_SPINCOUNT": ...} as this process (and the servers it starts) run."""
    return {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def spin_prefix() -> str:
    """`GOMP_SPINCOUNT=N ` when the run let OpenMP's threads spin, to put before the recorded command."""
    spincount = os.environ.get("GOMP_SPINCOUNT")
    return f"GOMP_SPINCOUNT={spincount} " if spincount is not None else ""


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()

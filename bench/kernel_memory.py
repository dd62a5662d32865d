"""Memory per student kernel: the peak RSS of a kernel running each solution notebook top to bottom.

    .venv/bin/python bench/kernel_memory.py [--mode fast|full] [NN_topic ...]
    .venv/bin/python bench/kernel_memory.py --table     # the README's table, from the results

Each notebook runs in a fresh `python3` kernel (nbclient, in a copy of its folder, as the notebook
tests run it), then one appended cell reads the kernel's own peak resident set (VmHWM in
/proc/self/status, the high-water mark over the whole run) and the largest peak of the
subprocesses it waited for (getrusage RUSAGE_CHILDREN). `fast` is DECODELAB_FAST=1, the mode CI
and nbgrader's autograding use; `full` is what a learner's kernel runs. A JupyterHub's per-user
memory limit must cover the largest `full` peak (README, "A hosted class").

Results merge into bench/results/kernel_memory.json (one row per notebook and mode, written after
each notebook so an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
RESULTS = ROOT / "bench" / "results" / "kernel_memory.json"
MARKER = "DECODELAB_KERNEL_MEMORY"
PROBE = f"""\
import resource as _resource
_status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print("{MARKER}", int(_status["VmHWM"].split()[0]) * 1024, int(_status["VmRSS"].split()[0]) * 1024,
      _resource.getrusage(_resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def notebooks() -> list[str]:
    return sorted(p.name for p in SOLUTIONS.iterdir() if (p / f"{p.name}.ipynb").exists())


def kernel_env(mode: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "lib")])
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    env.pop("DECODELAB_FAST", None)
    env.pop("NBGRADER_EXECUTION", None)
    if mode == "fast":
        env["DECODELAB_FAST"] = "1"
    return env


def measure(name: str, mode: str, timeout: int) -> dict:
    """Run solutions/NAME top to bottom in a fresh kernel -> its peak RSS and the run's errors."""
    import nbformat
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix=f"decodelab-memory-{name}-") as tmp:
        folder = Path(tmp) / name
        shutil.copytree(SOLUTIONS / name, folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        nb = nbformat.read(str(folder / f"{name}.ipynb"), as_version=4)
        nb.cells.append(nbformat.v4.new_code_cell(PROBE))
        client = NotebookClient(
            nb, timeout=timeout, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(folder)}}
        )
        started = time.perf_counter()
        client.execute(env=kernel_env(mode), cwd=str(folder))
        took = time.perf_counter() - started
    errors = [
        f"cell {i}: {o.get('ename')}: {o.get('evalue', '')[:200]}"
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    text = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []) if o.get("output_type") == "stream")
    line = next((ln for ln in text.splitlines() if ln.startswith(MARKER)), None)
    if line is None:
        raise RuntimeError(f"{name} ({mode}): the probe cell printed nothing; errors: {errors}")
    peak, rss_at_end, children_peak = (int(v) for v in line.split()[1:])
    return {
        "peak_rss_mib": round(peak / 2**20, 1),
        "rss_at_end_mib": round(rss_at_end / 2**20, 1),
        "children_peak_rss_mib": round(children_peak / 2**20, 1),
        "seconds": round(took, 1),
        "errors": errors,
    }


TABLE_HEAD = (
    "| notebook | peak RSS, fast mode (MiB) | peak RSS, full mode (MiB) | full run (s) |\n|---|---:|---:|---:|\n"
)


def table(results: dict) -> str:
    """The README's table (README, "A hosted class"): one row per notebook, "not measured" where a
    mode has no result."""

    def cell(row: dict | None, key: str) -> str:
        return "not measured" if row is None else f"{row[key]:.0f}"

    rows = []
    for name, modes in sorted(results["notebooks"].items()):
        fast, full = modes.get("fast"), modes.get("full")
        rows.append(
            f"| {name} | {cell(fast, 'peak_rss_mib')} | {cell(full, 'peak_rss_mib')} | {cell(full, 'seconds')} |"
        )
    return TABLE_HEAD + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="notebooks (default: every solution notebook)")
    parser.add_argument("--mode", choices=("fast", "full"), default="fast")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    parser.add_argument("--table", action="store_true", help="print the README's table from the results; run nothing")
    args = parser.parse_args(argv)
    if args.table:
        if not RESULTS.exists():
            parser.error(f"no results yet: {RESULTS} (run this script without --table first)")
        print(table(json.loads(RESULTS.read_text())), end="")
        return 0
    known = notebooks()
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown notebook(s) {unknown}; the solution notebooks are {known}")
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.setdefault("notebooks", {})
    for name in args.names or known:
        row = measure(name, args.mode, args.timeout)
        row["measured"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        results["notebooks"].setdefault(name, {})[args.mode] = row
        results.update(
            command="python bench/kernel_memory.py --mode fast|full [NN_topic ...]",
            machine=platform.platform(),
            cores=os.cpu_count(),
            python=sys.version.split()[0],
        )
        RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"{name} {args.mode}: peak {row['peak_rss_mib']} MiB in {row['seconds']} s, {len(row['errors'])} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's table of memory per student kernel is made from bench/results/kernel_memory.json
(README, "A hosted class"), and that file measured every solution notebook in fast mode."""

from __future__ import annotations

import importlib.util
import json

from notebooks import ROOT, SOLUTIONS


def _bench():
    spec = importlib.util.spec_from_file_location("kernel_memory", ROOT / "bench" / "kernel_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_measured_in_fast_mode_without_errors():
    results = json.loads((ROOT / "bench" / "results" / "kernel_memory.json").read_text())
    solutions = sorted(p.name for p in SOLUTIONS.iterdir() if (p / f"{p.name}.ipynb").exists())
    assert sorted(results["notebooks"]) == solutions
    for name, modes in results["notebooks"].items():
        for mode, row in modes.items():
            assert not row["errors"], (name, mode, row["errors"])
            assert row["peak_rss_mib"] >= row["rss_at_end_mib"] > 0, (name, mode)
        assert "fast" in modes, name


def test_readme_table_is_the_results():
    bench = _bench()
    expected = bench.table(json.loads(bench.RESULTS.read_text()))
    readme = (ROOT / "README.md").read_text()
    assert expected in readme, (
        f"README's kernel memory table is stale: `python bench/kernel_memory.py --table`:\n{expected}"
    )


def test_table_says_what_was_not_measured():
    bench = _bench()
    made = bench.table(
        {
            "notebooks": {
                "00_a": {"fast": {"peak_rss_mib": 1000.4}},
                "01_b": {"fast": {"peak_rss_mib": 1.6}, "full": {"peak_rss_mib": 2048.0, "seconds": 61.2}},
            }
        }
    )
    assert made.splitlines()[2:] == ["| 00_a | 1000 | not measured | not measured |", "| 01_b | 2 | 2048 | 61 |"]

"""tests/tiers.py over the whole collection: every test has a tier (`fast` or heavy ones, never
both), every map entry still gives some test its tier, and the guard stops a fast test that
loads SmolLM2 or starts the grader, nbgrader, a kernel, Dask or a browser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiers
from conftest import TIER_TABLE, whole_collection

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def table(request, tmp_path_factory) -> dict[str, dict]:
    """{nodeid: {"tiers", "keys"}} for every test of the suite: this run's own when it collected
    them all (as `make test` and `make test-fast` do), else a `--collect-only` of its own."""
    config = request.config
    if whole_collection(config):
        return config.stash[TIER_TABLE]
    out = tmp_path_factory.mktemp("tiers") / "tiers.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(TESTS)],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "DECODELAB_TIERS_OUT": str(out)},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["whole"]
    return found["table"]


def test_every_test_has_a_tier(table):
    assert len(table) > 1000, "not the whole suite"
    bad = {
        node: row["tiers"]
        for node, row in table.items()
        if not row["tiers"]
        or ("fast" in row["tiers"] and len(row["tiers"]) > 1)
        or any(t not in (*tiers.HEAVY, tiers.FAST) for t in row["tiers"])
    }
    assert not bad, f"tests without exactly `fast` or heavy tiers: {bad}"


def test_every_map_entry_still_names_a_test(table):
    """A renamed test or moved fixture would leave its entry behind and the test in the fast tier."""
    assert not tiers.stale_entries(table), "entries of tests/tiers.py that give no test its tier"


def test_the_tiers_are_registered_markers(request):
    registered = {line.split(":", 1)[0].strip() for line in request.config.getini("markers")}
    assert set(tiers.MARKERS) | {"slow"} <= registered


def test_the_fast_tier_is_what_is_left(table):
    """Every heavy fixture's users are out of the fast tier; most of the suite is in it."""
    heavy_fixture_users = [
        node
        for node, row in table.items()
        if any(key.split("::")[-1] in ("smollm2", "hf_gguf_model", "chromium") for key in row["keys"])
    ]
    assert heavy_fixture_users and all(
        "model" in table[n]["tiers"] or "browser" in table[n]["tiers"] for n in heavy_fixture_users
    )
    assert sum(row["tiers"] == ["fast"] for row in table.values()) > len(table) / 2


def test_guard_stops_loading_smollm2():
    from decodelab.model.registry import load

    with tiers.guard("tests/x.py::test_y"), pytest.raises(tiers.TierError, match="loads SmolLM2.*`smollm2` fixture"):
        load("smollm2", device="cpu")
    model, _ = load("tiny", device="cpu")  # a tiny model is fine
    assert model.num_parameters() < 10_000_000


@pytest.mark.parametrize(
    "argv, tier",
    [
        ([sys.executable, "-m", "autograder", "grade", "--assignment", "a"], "grader"),
        ([sys.executable, "-m", "nbgrader", "autograde", "a"], "grader"),
        ([sys.executable, "-m", "ipykernel_launcher", "-f", "k.json"], "grader"),
        (["/usr/bin/dask", "worker", "tcp://x"], "grader"),
        ([sys.executable, "-m", "jupyter", "lab"], "browser"),
        ([sys.executable, "-m", "decodelab", "generate", "hi"], "model"),
        ([sys.executable, "-m", "decodelab", "generate", "hi", "--model", "tiny"], None),
        ([sys.executable, "-m", "autograder", "export", "--format", "long"], None),
        ([sys.executable, "-c", "print(1)"], None),
        ("git status", None),
        (f"{sys.executable} -m nbgrader collect a", "grader"),  # a shell command line
    ],
)
def test_guard_knows_heavy_commands(argv, tier):
    found = tiers._command_tier(argv)
    assert (found and found[1]) == tier


def test_guard_stops_starting_the_grader(tmp_path):
    with tiers.guard("tests/x.py::test_y"), pytest.raises(tiers.TierError, match="runs the grader"):
        subprocess.run([sys.executable, "-m", "autograder", "grade", "--assignment", "x"], cwd=tmp_path)
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0  # restored, and others allowed


def test_guard_stops_transformers_loading_smollm2(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    gguf = smollm2_gguf
    with tiers.guard("tests/x.py::test_y"), pytest.raises(tiers.TierError, match="SmolLM2 into transformers"):
        transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)

"""Test tiers: which tests do heavy work, decided in one place (issue 29, item 5).

Every collected test gets markers here, in tests/conftest.py's collection hook:

* ``model``: loads SmolLM2 (our loader) or the independent oracle (`transformers` reading the GGUF);
* ``grader``: runs the grader, nbgrader, a notebook kernel, or Dask;
* ``notebook``: executes a course notebook;
* ``browser``: drives JupyterLab in Chromium (Playwright);
* ``slow``: other heavy work (torch.compile, a large model of random weights, a CPU-bound sweep)
  — the marker the suite already had for "takes more than a few seconds";
* ``fast``: none of those. `make test-fast` runs these (`pytest -m fast`).

A test gets the tier of each heavy fixture it uses (FIXTURE_TIERS), of its file (FILE_TIERS) and
of its node id (NODE_TIERS), each entry with its reason; heavy tiers add up ("grader" and
"model" both), and a test with none is ``fast``. The guard below makes a fast test that loads
SmolLM2 or starts a kernel, the grader, nbgrader, Dask or a browser fail with what to do, and
tests/test_tiers.py checks the maps against the whole collection (every entry still names a
test, every test has a tier), so the maps cannot silently rot.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

HEAVY = ("model", "grader", "notebook", "browser", "slow")
FAST = "fast"
MARKERS = {
    "model": "loads SmolLM2 (our loader) or the transformers oracle of it (tests/tiers.py)",
    "grader": "runs the grader, nbgrader, a notebook kernel or Dask (tests/tiers.py)",
    "notebook": "executes a course notebook (tests/tiers.py)",
    "browser": "drives JupyterLab in Chromium with Playwright (tests/tiers.py)",
    "fast": "none of the heavy tiers: `make test-fast` (tests/tiers.py)",
}

# A fixture -> its tiers. A conftest.py fixture by its name; a test module's own fixture as
# "tests/test_x.py::name" (names like `tiny` or `target` mean different things in different files).
FIXTURE_TIERS: dict[str, tuple[str, str]] = {
    # name: (tiers, reason)
    "smollm2_folder": ("model", "SmolLM2's converted folder: asked for to load SmolLM2 from it"),
    "smollm2": ("model", "loads SmolLM2 (fp32, CPU)"),
    "hf_gguf_model": ("model", "transformers reads SmolLM2's GGUF"),
    "hf_gguf_tokenizer": ("model", "transformers reads SmolLM2's GGUF tokenizer"),
    "tests/test_q4_linear.py::q4_smollm2": ("model", "SmolLM2 with its Q4_1 linears from the GGUF's blocks"),
    "tests/test_browser.py::chromium": ("browser", "Chromium through Playwright"),
    "tests/test_notebooks.py::autograded_solution": ("notebook grader", "nbgrader autogrades every solution"),
    "tests/test_grading.py::graded": ("grader", "grades a class with python -m autograder grade"),
    "tests/test_exchange.py::exchange_class": ("grader", "nbgrader's exchange as OS users"),
    "tests/test_parts.py::filled_course": (
        "notebook model",
        "decodelab progress --serve runs the stage notebooks, then SmolLM2 serves and generates",
    ),
}

# A test file -> its tiers, for files whose tests (nearly all) do that work without a fixture
# saying so; a new test there starts in the heavy tier, which is the safe side.
FILE_TIERS: dict[str, tuple[str, str]] = {
    "tests/test_grading.py": ("grader", "runs python -m autograder grade (its refusals too: a subprocess each)"),
    "tests/test_grading_dask.py": ("grader", "Dask clusters, and the grader's refusals (a subprocess each)"),
    "tests/test_hub.py": ("grader browser", "a JupyterHub, nbgrader's release, a student in Chromium"),
}

# A test -> its tiers: its node id without parameters (all of them), or with; `*` matches any
# text. Measured with --durations on two cores (README, "Tests"): what took 1.5 s or more there,
# or starts a fresh Python (which imports torch again), is out of the fast tier.
NODE_TIERS: dict[str, tuple[str, str]] = {
    # model: SmolLM2 (its weights, its GGUF, its tokenizer) or transformers as the oracle
    "tests/test_beam_search.py::test_tiny_matches_transformers": ("model", "transformers' beam search as the oracle"),
    "tests/test_forward_pass_checks.py::test_messages_name_the_case": ("model", "reads SmolLM2's GGUF (2 layers)"),
    "tests/test_forward_pass_checks.py::test_bug_is_caught[load_gguf_float16_arithmetic]": (
        "model",
        "dequantizes SmolLM2's GGUF tensors in float16",
    ),
    "tests/test_meet_the_model_checks.py::test_bpe_*": ("model", "BPE over SmolLM2's 49k-token tokenizer"),
    "tests/test_tiers.py::test_guard_stops_transformers_loading_smollm2": (
        "model",
        "imports transformers' auto classes",
    ),
    "tests/test_meet_the_model_checks.py::test_bug_is_caught[bpe_from_characters]": (
        "model",
        "BPE over SmolLM2's tokenizer, from characters",
    ),
    # grader: nbgrader (generate_assignment, its gradebook) in-process
    "tests/test_notebooks.py::test_release_in_sync": ("grader", "nbgrader generate_assignment of every notebook"),
    "tests/test_versions.py::test_release_writes_the_version": ("grader", "nbgrader generate_assignment"),
    "tests/test_export.py::test_long_one_row_per_student_and_test_cell": (
        "grader",
        "an nbgrader gradebook (SQLAlchemy)",
    ),
    "tests/test_report.py::test_numbers_of_a_small_class": ("grader", "an nbgrader gradebook (SQLAlchemy)"),
    "tests/test_report.py::test_page_escapes_student_text_and_inlines_plotly": ("grader", "an nbgrader gradebook"),
    "tests/test_report.py::test_cli_writes_json_and_html_and_refuses_bad_input": (
        "grader",
        "an nbgrader gradebook, and python -m autograder report in subprocesses",
    ),
    "tests/test_late.py::test_recorded_in_nbgraders_gradebook_with_extensions": ("grader", "an nbgrader gradebook"),
    # notebook: a notebook's cells run
    "tests/test_notebooks.py::test_visible_tests_pass_on_reference_and_catch_bugs": (
        "notebook",
        "runs each notebook's visible test cells on the reference and on every bug",
    ),
    "tests/test_kept_bugs.py::test_visible_tests_catch_what_the_hidden_checks_catch": (
        "notebook",
        "runs each notebook's visible test cells and hidden checks on every kept bug",
    ),
    "tests/test_progress.py::test_released_*": ("notebook", "python -m decodelab progress runs the notebooks"),
    "tests/test_progress.py::test_a_malformed_notebook_says_so_and_the_rest_still_run": (
        "notebook",
        "python -m decodelab progress runs the notebooks",
    ),
    "tests/test_progress.py::test_crashes_prints_and_mistakes_cost_only_their_rows": (
        "notebook",
        "python -m decodelab progress runs the notebooks",
    ),
    # slow: other heavy work
    "tests/test_architecture.py::test_import_contracts_are_kept": (
        "slow",
        "lint-imports, as make test-fast runs first",
    ),
    "tests/test_architecture.py::test_a_broken_contract_fails_the_lint": ("slow", "lint-imports on a copy, 7 times"),
    "tests/test_architecture.py::test_engine_and_checks_import_without_ipywidgets_or_plotly": (
        "slow",
        "imports the engine and every check in a fresh Python (~12 s)",
    ),
    "tests/test_gpu_kernel.py::test_the_module_imports_without_triton": ("slow", "a fresh Python imports torch"),
    "tests/test_mamba.py::test_logits_equal_transformers_*": ("slow", "imports transformers' Mamba (~8 s)"),
    "tests/test_mamba.py::test_kept_bug_is_caught[delta_not_selective]": ("slow", "transformers' Mamba as the oracle"),
    "tests/test_mamba.py::test_kept_bug_is_caught[a_not_negative_exp]": ("slow", "transformers' Mamba as the oracle"),
    "tests/test_mamba.py::test_kept_bug_is_caught[conv_not_causal]": ("slow", "transformers' Mamba as the oracle"),
    "tests/test_mamba.py::test_cli_generates_with_tiny_mamba": ("slow", "python -m decodelab generate"),
    "tests/test_mamba.py::test_cli_generates_with_a_mamba_folder": (
        "slow",
        "python -m decodelab generate, three times",
    ),
    "tests/test_capstone_engine_checks.py::test_reference_passes": ("slow", "every engine scenario on the tiny pair"),
    "tests/test_serving_checks.py::test_reference_passes": ("slow", "every serving scenario on the tiny model"),
    "tests/test_serving_checks.py::test_bug_is_caught[loop_*]": ("slow", "serving scenarios until caught"),
    "tests/test_serving_checks.py::test_bug_is_caught[stream_*]": ("slow", "serving scenarios until caught"),
    "tests/test_capstone_engine_checks.py::test_loop_scenarios_test_what_they_name": ("slow", "every loop scenario"),
    "tests/test_capstone_engine_checks.py::test_bug_is_caught[loop_*]": ("slow", "engine loop scenarios until caught"),
    "tests/test_capstone_engine_checks.py::test_bug_is_caught[step_*]": ("slow", "engine step scenarios until caught"),
    "tests/test_calling_checks.py::*[capstone_engine.check_*]": ("slow", "the capstone's engine scenarios"),
    "tests/test_speculative_decoding_checks.py::test_reference_passes": ("slow", "acceptance statistics"),
    "tests/test_speculative_decoding_checks.py::test_written_out_step_passes": ("slow", "acceptance statistics"),
    "tests/test_speculative_decoding_checks.py::test_messages_name_the_case": ("slow", "acceptance statistics"),
    "tests/test_speculative_decoding_checks.py::test_bug_is_caught[step_raw_draft_probs]": ("slow", "statistics"),
    "tests/test_speculative_decoding_checks.py::test_top_k_one_part_catches_a_draft_that_ignores_the_filters": (
        "slow",
        "acceptance statistics",
    ),
    "tests/test_chunked_prefill.py::test_chunked_matches_whole_prompt_prefill_tiny[32-30-4-True]": (
        "slow",
        "many small chunks through the engine",
    ),
    "tests/test_chunked_prefill.py::test_chunked_matches_whole_prompt_prefill_tiny[5-30-5-False]": (
        "slow",
        "many small chunks through the engine",
    ),
    "tests/test_chunked_prefill.py::test_random_workloads_chunked_match_whole_prompt": ("slow", "random workloads"),
    "tests/test_compiled_decode.py::test_compiled_step_gives_the_eager_tokens_with_one_graph": (
        "slow",
        "torch.compile",
    ),
    "tests/test_packaged_decode.py::test_tiny_package_gives_the_eager_tokens_in_a_fresh_process": (
        "slow",
        "AOTInductor compiles tiny's decode step (~40 s), then a fresh Python loads it",
    ),
    "tests/test_engine_feature_drafter.py::test_greedy_tokens_are_the_targets_whatever_the_drafter_guesses[200-3]": (
        "slow",
        "200 tokens of tree speculation",
    ),
    "tests/test_parts.py::test_a_part_that_raises_in_the_engine_falls_back_and_the_bill_says_why": (
        "slow",
        "the engine again for each suspect part (1.1-1.8 s)",
    ),
}


def _split(tiers: str) -> tuple[str, ...]:
    found = tuple(tiers.split())
    unknown = [t for t in found if t not in HEAVY]
    if unknown:
        raise ValueError(f"tests/tiers.py: unknown tier(s) {unknown}; use {HEAVY}")
    return found


def node_matches(key: str, nodeid: str) -> bool:
    """A NODE_TIERS key names this test: the same id, or the id without its parameters; `*` any text."""
    if "*" in key:
        return re.fullmatch(".*".join(map(re.escape, key.split("*"))), nodeid) is not None
    return nodeid == key or nodeid.startswith(key + "[") or nodeid.startswith(key + "::")


def _fixture_keys(item) -> list[str]:
    """The FIXTURE_TIERS keys of the fixtures a test uses (its whole closure)."""
    keys = []
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs if info is not None else {}
    path = item.nodeid.split("::", 1)[0]
    for name in item.fixturenames:
        fixturedefs = defs.get(name)
        if not fixturedefs:
            continue
        fixturedef = fixturedefs[-1]  # the one this test sees (a module's own overrides conftest's)
        if getattr(fixturedef.func, "__name__", "") == "get_direct_param_fixture_func":
            continue  # a parametrize argument, not a fixture
        module = getattr(fixturedef.func, "__module__", "")
        keys.append(f"{path}::{name}" if module.startswith("test_") else name)
    return keys


def tiers_of(item) -> tuple[tuple[str, ...], list[str]]:
    """(the test's heavy tiers, or ("fast",); the map keys that gave them)."""
    found: dict[str, None] = {}
    used: list[str] = []
    for key in _fixture_keys(item):
        if key in FIXTURE_TIERS:
            found.update(dict.fromkeys(_split(FIXTURE_TIERS[key][0])))
            used.append(key)
    path = item.nodeid.split("::", 1)[0]
    if path in FILE_TIERS:
        found.update(dict.fromkeys(_split(FILE_TIERS[path][0])))
        used.append(path)
    for key, (tiers, _) in NODE_TIERS.items():
        if node_matches(key, item.nodeid):
            found.update(dict.fromkeys(_split(tiers)))
            used.append(key)
    if item.get_closest_marker("slow") is not None:
        found.setdefault("slow", None)  # the author's own word for it: never in the fast tier
    return (tuple(t for t in HEAVY if t in found) or (FAST,)), used


def assign(items) -> dict[str, dict]:
    """Mark every item with its tiers; returns {nodeid: {"tiers": [...], "keys": [...]}}."""
    table = {}
    for item in items:
        tiers, keys = tiers_of(item)
        for tier in tiers:
            if tier != "slow" or item.get_closest_marker("slow") is None:
                item.add_marker(getattr(pytest.mark, tier))
        table[item.nodeid] = {"tiers": list(tiers), "keys": keys}
    return table


# Rough cost of one test of a tier, in seconds on 2 cores: only to start the costly files first.
COST = {"browser": 30.0, "notebook": 20.0, "grader": 5.0, "model": 2.0, "slow": 5.0, FAST: 0.05}


def heaviest_files_first(items, table: dict[str, dict]) -> None:
    """Reorder `items` in place: whole files, the costliest (by COST of their tests' tiers) first, each
    file's own order kept. Under pytest-xdist's `--dist loadfile` a worker takes a file at a time in this
    order, so a long file does not start last and leave the other worker idle at the end."""
    cost: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        tiers = table.get(item.nodeid, {}).get("tiers") or [FAST]
        cost[path] = cost.get(path, 0.0) + max(COST.get(tier, 0.0) for tier in tiers)
    items.sort(key=lambda item: -cost[item.nodeid.split("::", 1)[0]])


def stale_entries(table: dict[str, dict]) -> list[str]:
    """Map entries that no longer give any collected test its tier (a renamed test, a moved fixture)."""
    used = {key for row in table.values() for key in row["keys"]}
    return [
        f"{name}[{key!r}]"
        for name, mapping in (("FIXTURE_TIERS", FIXTURE_TIERS), ("FILE_TIERS", FILE_TIERS), ("NODE_TIERS", NODE_TIERS))
        for key in mapping
        if key not in used
    ]


# --------------------------------------------------------------------------- the guard
class TierError(RuntimeError):
    """A fast-tier test doing heavy work: give it the fixture, or an entry in tests/tiers.py."""


def _fail(nodeid: str, what: str, tier: str, fix: str) -> None:
    raise TierError(
        f"a fast-tier test {what}: {nodeid}. {fix}, or add it to tests/tiers.py "
        f"(NODE_TIERS, tier {tier!r}) so that `make test-fast` leaves it out"
    )


HEAVY_WEIGHTS_BYTES = 64 * 2**20  # SmolLM2's safetensors are ~540 MB; the tiny models' a few MB
HEAVY_GGUF_ELEMENTS = 100_000_000  # all of SmolLM2: 135 M; its embedding + 2 layers (a check): 35 M


def _folder_bytes(folder) -> int:
    try:
        return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    except OSError:
        return 0


def _is_smollm2_path(path) -> bool:
    try:
        from decodelab.model.registry import SMOLLM2_DIR_NAME, smollm2_gguf_path

        path = Path(path).resolve()
        if path.name == SMOLLM2_DIR_NAME or path.parent.name == SMOLLM2_DIR_NAME:
            return True
        return path in (smollm2_gguf_path().resolve(), smollm2_gguf_path().parent.resolve())
    except Exception:
        return False


# argv -> (what it starts, its tier): the commands a fast test may not start.
def _command_tier(argv) -> tuple[str, str] | None:
    if isinstance(argv, (str, bytes)):  # a shell command line
        try:
            argv = shlex.split(os.fsdecode(argv))
        except ValueError:
            argv = [argv]
    elif isinstance(argv, os.PathLike):
        argv = [argv]
    words = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in argv]
    names = [os.path.basename(w) for w in words]
    module = words[words.index("-m") + 1] if "-m" in words[:-1] else None
    if module == "autograder" and "grade" in words:
        return "runs the grader (python -m autograder grade)", "grader"
    if module == "nbgrader" or names[:1] in (["nbgrader"], ["jupyter-nbgrader"]):
        return "runs nbgrader", "grader"
    if "ipykernel_launcher" in words or module == "ipykernel":
        return "starts a notebook kernel", "grader"
    if module in ("distributed", "dask") or names[:1] == ["dask"] or module and module.startswith("distributed."):
        return "starts Dask", "grader"
    if module == "jupyter" or names[:1] and names[0].startswith("jupyter"):
        return "starts Jupyter", "browser"
    if module == "decodelab" and ({"generate", "prepare"} & set(words)):
        model = words[words.index("--model") + 1] if "--model" in words[:-1] else "smollm2"
        if model == "smollm2" or _is_smollm2_path(model) or _folder_bytes(model) > HEAVY_WEIGHTS_BYTES:
            return "runs SmolLM2 in a subprocess (python -m decodelab)", "model"
    if any("playwright" in w for w in words[:2]) or names[:1] in (["chromium"], ["chrome"]):
        return "starts a browser", "browser"
    return None


@contextlib.contextmanager
def guard(nodeid: str):
    """While a fast test runs (set-up, call, tear-down): loading SmolLM2 or its oracle, and starting
    the grader, nbgrader, a kernel, Dask, Jupyter or a browser raise TierError."""
    import decodelab.model.gguf_import as gguf_import
    import decodelab.model.weights as weights

    saved = []

    def patch(owner, name, wrapper):
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, wrapper)

    read_state_dict = weights.read_state_dict

    def guarded_read_state_dict(folder, names=None):
        if names is None and (_folder_bytes(folder) > HEAVY_WEIGHTS_BYTES or _is_smollm2_path(folder)):
            _fail(nodeid, f"loads SmolLM2's weights ({folder})", "model", "Give it the `smollm2` fixture")
        return read_state_dict(folder, names)

    load_gguf_state_dict = gguf_import.load_gguf_state_dict

    def guarded_load_gguf_state_dict(tensors, config, *args, **kwargs):
        tensors = list(tensors)
        if sum(int(getattr(t, "n_elements", 0)) for t in tensors) > HEAVY_GGUF_ELEMENTS:
            _fail(nodeid, "dequantizes SmolLM2's GGUF", "model", "Give it the `smollm2` fixture")
        return load_gguf_state_dict(tensors, config, *args, **kwargs)

    popen_init = subprocess.Popen.__init__

    def guarded_popen_init(self, args, *rest, **kwargs):
        heavy = _command_tier(args)
        if heavy is not None:
            _fail(
                nodeid,
                f"{heavy[0]} ({' '.join(map(str, args if not isinstance(args, str) else [args]))[:200]})",
                heavy[1],
                "Give it the fixture that does this",
            )
        popen_init(self, args, *rest, **kwargs)

    patch(weights, "read_state_dict", guarded_read_state_dict)
    patch(gguf_import, "load_gguf_state_dict", guarded_load_gguf_state_dict)
    patch(subprocess.Popen, "__init__", guarded_popen_init)
    modeling = _transformers_modeling()
    if modeling is not None:
        from_pretrained = modeling.PreTrainedModel.__dict__["from_pretrained"]

        @classmethod
        def guarded_from_pretrained(cls, *args, **kwargs):
            path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            gguf = kwargs.get("gguf_file")
            if isinstance(path, (str, os.PathLike)) and (
                gguf
                and _is_smollm2_path(Path(path) / gguf)
                or _is_smollm2_path(path)
                or _folder_bytes(path) > HEAVY_WEIGHTS_BYTES
            ):
                _fail(
                    nodeid, f"loads SmolLM2 into transformers ({path})", "model", "Give it the `hf_gguf_model` fixture"
                )
            return from_pretrained.__func__(cls, *args, **kwargs)

        patch(modeling.PreTrainedModel, "from_pretrained", guarded_from_pretrained)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _transformers_modeling():
    """transformers.modeling_utils if a test has imported transformers (importing it costs seconds)."""
    import sys

    if "transformers" not in sys.modules:
        return None
    try:
        import transformers.modeling_utils as modeling
    except Exception:
        return None
    return modeling

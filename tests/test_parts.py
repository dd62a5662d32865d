"""The learner's engine (decodelab.course.parts): the bill of materials from progress's rows, and
`python -m decodelab progress --serve`, whose engine made of the solutions' parts writes the tokens
of `python -m decodelab generate`, and falls back stage by stage to the library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from notebooks import COURSE, ROOT, SOLUTIONS

from decodelab.course import parts, progress
from decodelab.engine.scheduler import Scheduler

PROMPT = "What is gravity?"


def run_module(*args, timeout=600) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), str(ROOT)]))
    run = subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def row(notebook, exercise, status=progress.PASSING):
    return progress.Row(notebook, exercise, progress.PARTS.get((notebook, exercise), ""), status)


def all_passing() -> list[progress.Row]:
    return [row(nb, name) for (nb, name) in progress.PARTS if nb in parts.STAGE_NOTEBOOKS]


# --------------------------------------------------------------------------- the bill, from rows


def test_every_stage_names_exercises_of_its_notebook_and_a_hook():
    from decodelab.engine.llm import EngineHooks

    hooks = EngineHooks()
    for stage in parts.STAGES:
        assert stage.exercises, stage.name
        assert all((stage.notebook, name) in progress.PARTS for name in stage.exercises), stage
        assert hasattr(hooks, stage.hook), stage
    assert len({s.hook for s in parts.STAGES}) == len(parts.STAGES) == len({s.name for s in parts.STAGES})


def test_a_stage_is_yours_only_when_all_its_exercises_pass():
    rows = [r for r in all_passing() if r.notebook != "07_paged_kv"]  # 07 is not in the folder
    rows = [row(r.notebook, r.exercise, "not started") if r.exercise == "rope" else r for r in rows]
    rows = [
        row(r.notebook, r.exercise, "failing: top_p_filter kept 3 tokens") if r.exercise == "top_p_filter" else r
        for r in rows
    ]
    bill = {e.stage.name: e for e in parts.bill_of_materials(rows)}
    assert bill["forward pass"].source == "reference" and bill["forward pass"].why == "rope: not started"
    assert bill["attention"].source == "yours"  # the same notebook, but its own exercise passes
    assert bill["sampling"].why == "top_p_filter: failing: top_p_filter kept 3 tokens"
    assert bill["repetition penalty"].source == "yours"
    assert bill["block allocator"].source == "reference" and "no 07_paged_kv notebook" in bill["block allocator"].why
    assert bill["int8 linear layer"].source == "reference" and "float32" in bill["int8 linear layer"].why
    assert not bill["speculative acceptance"].in_engine and bill["speculative acceptance"].passing
    assert {n for n, e in bill.items() if e.source == "yours"} == {
        "attention",
        "repetition penalty",
        "scheduler",
        "engine step",
    }
    int8 = {e.stage.name: e for e in parts.bill_of_materials(all_passing(), quantization="int8")}
    assert int8["int8 linear layer"].source == "yours" and int8["forward pass"].source == "reference"
    assert "reads float weights" in int8["forward pass"].why
    with pytest.raises(ValueError, match="int4"):
        parts.bill_of_materials(all_passing(), quantization="int4")
    table = parts.format_bill(list(bill.values()))
    assert "rope: not started" in table and "4 of 9 stages are yours" in table


def test_quantization_without_serve_is_a_usage_error():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), str(ROOT)]))
    run = subprocess.run(
        [sys.executable, "-m", "decodelab", "progress", "--course", str(COURSE), "--quantization", "int8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 2 and "--quantization goes with --serve" in run.stderr and run.stdout == ""


def test_without_siblings_or_under_nbgrader_every_stage_is_the_librarys(tmp_path, monkeypatch):
    shutil.copytree(SOLUTIONS / parts.CAPSTONE, tmp_path / parts.CAPSTONE)  # the capstone alone
    alone = parts.your_engine(tmp_path)
    assert {e.source for e in alone.bill} == {"reference"} and "no course notebooks beside" in alone.bill[0].why
    assert alone.hooks.forward is None and alone.hooks.step is None
    shutil.copytree(SOLUTIONS / "07_paged_kv", tmp_path / "07_paged_kv")
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    graded = parts.your_engine(tmp_path)
    assert {e.source for e in graded.bill} == {"reference"} and graded.bill[0].why.startswith("graded")


# --------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def filled_course(tmp_path_factory):
    """The stage notebooks of solutions/ (every exercise filled in), and one --serve run over them."""
    folder = tmp_path_factory.mktemp("course")
    for name in parts.STAGE_NOTEBOOKS:
        shutil.copytree(SOLUTIONS / name, folder / name, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    served = run_module("-m", "decodelab", "progress", "--course", folder, "--serve", PROMPT, "--json")
    generated = run_module("-m", "decodelab", "generate", PROMPT, "--json", "--max-new-tokens", 32)
    return folder, served, generated


@pytest.mark.slow
def test_serve_with_every_part_yours_writes_generates_tokens(filled_course):
    _, run, generated = filled_course
    assert {r["status"] for r in run["exercises"]} == {"passing"}
    served = run["serve"]
    assert served["prompt_ids"] == generated["prompt_ids"]
    assert served["output_ids"] == generated["output_ids"] and len(served["output_ids"]) == 32
    assert served["parts"] == {
        stage.name: "reference" if stage.hook == "linear" else "yours"
        for stage in parts.STAGES
        if stage.hook != "accept_draft_tokens"
    }


LOAD_AND_SERVE = """
import json, sys
from decodelab.course import parts, progress
folder, rows = sys.argv[1], [progress.Row(**r) for r in json.loads(sys.argv[2])]
quantization = sys.argv[4] if len(sys.argv) > 4 else None
engine = parts.assemble(folder, rows, quantization=quantization)
served = parts.serve(engine, sys.argv[3])
if quantization:  # the library's own int8 engine, for comparison
    library = parts.Assembly(parts.reference_bill("the library"), parts.EngineHooks(), quantization)
    served["library_output_ids"] = parts.serve(library, sys.argv[3])["output_ids"]
served["hook_modules"] = {e.stage.name: getattr(getattr(engine.hooks, e.stage.hook), "__module__", None)
                          for e in engine.bill if e.in_engine}
print(json.dumps(served))
"""


@pytest.mark.slow
def test_a_released_notebook_reads_reference_and_the_tokens_stay(filled_course):
    """01 as released: its exercises not started, the forward pass and attention the library's, the
    other stages still the solutions' (loaded from their notebooks), the same tokens. The other
    notebooks' rows are the first run's."""
    folder, run, generated = filled_course
    shutil.rmtree(folder / "01_forward_pass")
    shutil.copytree(COURSE / "01_forward_pass", folder / "01_forward_pass")
    fresh = progress.check_notebook(folder / "01_forward_pass" / "01_forward_pass.ipynb")
    assert {r.status for r in fresh} == {"not started"}
    rows = [r for r in run["exercises"] if r["notebook"] != "01_forward_pass"] + [vars(r) for r in fresh]
    served = run_module("-c", LOAD_AND_SERVE, folder, json.dumps(rows), PROMPT)
    assert served["output_ids"] == generated["output_ids"]
    expected = {
        stage.name: "reference" if stage.hook == "linear" or stage.notebook == "01_forward_pass" else "yours"
        for stage in parts.STAGES
        if stage.hook != "accept_draft_tokens"
    }
    assert served["parts"] == expected
    assert (
        served["why"]["forward pass"] == "rms_norm: not started; rope: not started; mlp: not started; "
        "forward: not started"
    )
    for name, source in expected.items():  # a stage of yours runs code from your notebook's module
        module = served["hook_modules"][name]
        if source == "yours":
            assert module.startswith("_decodelab_yours_"), (name, module)
        else:
            assert module is None or module.startswith("decodelab."), (name, module)


@pytest.mark.slow
def test_int8_serves_your_int8_linear_with_the_library_int8_tokens(filled_course):
    """--quantization int8: the int8 stage is yours (06's Int8Linear builds every decoder-layer
    linear), the forward pass the library's model, and the tokens those of LLM(quantization="int8").
    01's rows are left out, so this holds whichever test ran first."""
    folder, run, _ = filled_course
    rows = [r for r in run["exercises"] if r["notebook"] != "01_forward_pass"]
    served = run_module("-c", LOAD_AND_SERVE, folder, json.dumps(rows), PROMPT, "int8")
    assert served["output_ids"] == served["library_output_ids"]
    assert served["parts"]["int8 linear layer"] == "yours" and served["parts"]["forward pass"] == "reference"
    assert served["hook_modules"]["int8 linear layer"] == "_decodelab_yours_06_quantization"


# --------------------------------------------------------------------------- a part that breaks in the engine

BROKEN_PARTS = """
import torch

def sample(*args, **kwargs):
    raise RuntimeError("this sampler only knows one row")

def apply_repetition_penalty(logits, token_ids, penalty):
    return None  # passes a test that only checks it does not raise; the engine reads its logits
"""


def planted(*stages: str) -> parts.Assembly:
    """An assembly whose `stages` are the learner's, taken from BROKEN_PARTS (02's namespace)."""
    bill = parts.bill_of_materials(all_passing())
    for entry in bill:
        if entry.stage.name not in stages:
            entry.source = "reference"
    sampling = {"__name__": "_decodelab_yours_02_sampling"}
    exec(compile(BROKEN_PARTS, "<02_sampling cells>", "exec"), sampling)
    # an innocent stage: 08's methods, as the library writes them
    scheduling = {
        "__name__": "_decodelab_yours_08",
        **{name: getattr(Scheduler, name) for name in parts.stage_exercises("scheduler")[1]},
    }
    namespaces = {"02_sampling": sampling, "08_continuous_batching": scheduling}
    hooks = parts.EngineHooks()
    for entry in bill:
        if entry.source == "yours":
            setattr(hooks, entry.stage.hook, entry.stage.build(namespaces[entry.stage.notebook]))
    return parts.Assembly(bill, hooks, namespaces=namespaces)


def tiny_run(hooks):
    from decodelab import LLM, SamplingParams

    llm = LLM("tiny", hooks=hooks)
    out = llm.generate(
        [[1, 5, 9, 4]], SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3), use_tqdm=False
    )[0]
    return out.outputs[0].token_ids


def test_a_part_that_raises_in_the_engine_falls_back_and_the_bill_says_why():
    expected = tiny_run(parts.EngineHooks())
    engine = planted("sampling", "repetition penalty", "scheduler")
    assert parts.run_with_fallback(engine, tiny_run) == expected
    bill = {e.stage.name: e for e in engine.bill}
    # the sampler raised in its own frame: named by the traceback
    assert bill["sampling"].source == "reference"
    assert "RuntimeError: this sampler only knows one row" in bill["sampling"].why
    # the penalty returned None and the library failed later: found by replacing one stage at a time
    assert bill["repetition penalty"].source == "reference" and "raised in the engine" in bill["repetition penalty"].why
    assert bill["scheduler"].source == "yours"  # innocent, kept
    assert engine.parts["sampling"] == "reference" and "yours" in parts.format_bill(engine.bill)


def test_an_error_that_is_not_the_learners_is_raised():
    engine = planted("scheduler")

    def broken(hooks):
        raise ValueError("the prompt is too long")

    with pytest.raises(ValueError, match="too long"):
        parts.run_with_fallback(engine, broken)
    assert engine.parts["scheduler"] == "yours"

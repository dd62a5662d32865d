"""Your engine: the stages of `LLM` taken from your own notebooks, and the bill of materials that
says which ones are yours.

    python -m decodelab progress --course ~/course --serve "What is gravity?" [--json] [--quantization int8]

    rows = progress.check_course("~/course", STAGE_NOTEBOOKS)   # visible tests, one subprocess per notebook
    engine = assemble("~/course", rows)                         # the bill, your code loaded, the hooks
    print(format_bill(engine.bill))
    served = serve(engine, "What is gravity?")                  # SmolLM2 in float32 on those hooks
                                                                # (a stage of yours that raises falls back)

**Stages.** Each `Stage` is one `EngineHooks` field, built from the exercises of one notebook whose
code runs in it, as the table of exercises (`course.exercises`, their `stage`) says: the forward
pass is 01's `forward`, which calls your `rms_norm`, `rope` and `mlp`.
A stage is ``yours`` when every one of those exercises passes its visible tests (progress's
statuses); otherwise the library's reference runs it, and the bill says why: the notebook is not in
the folder, an exercise is not started or failing (with progress's message), or this engine does
not use the stage (no draft model; float32 weights for the int8 layer; int8 weights for your
forward pass, which reads float weights by name).

**Loading.** For each notebook with a stage of yours, its first code cell (the imports) and its
exercise cells up to the last one a stage needs run in a fresh module of this process, in the
notebook's folder, with their output captured. The set-up cells that load models do not run, and
neither does a cell whose exercise timed out or killed progress's kernel. This runs your code, as
the notebook does: as `progress` does, it refuses a folder that is not the caller's when run as root.

This module is the course's side of `EngineHooks`: the engine never imports it.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from decodelab.course import progress
from decodelab.course.exercises import stage_exercises
from decodelab.course.speed_parts import your_scheduler
from decodelab.engine.llm import EngineHooks

YOURS, REFERENCE = "yours", "reference"
CAPSTONE = "10_capstone_engine"


@dataclass(frozen=True)
class Stage:
    name: str  # the stage, as the bill and `serve`'s "parts" name it
    hook: str  # the EngineHooks field it fills
    notebook: str
    exercises: tuple[str, ...]  # every exercise whose code runs in the stage
    build: Callable[[dict], Callable]  # the learner's namespace -> the hook's value


def _stage(name: str, hook: str, build: Callable[[dict], Callable]) -> Stage:
    """The stage that fills `hook`: its notebook and exercises come from the table of exercises."""
    notebook, names = stage_exercises(hook)
    return Stage(name, hook, notebook, names, build)


STAGES: tuple[Stage, ...] = (
    _stage("forward pass", "forward", lambda ns: ns["forward"]),  # 01's forward, with its rms_norm, rope, mlp
    _stage("attention", "attention", lambda ns: ns["attention"]),
    _stage("sampling", "sample", lambda ns: ns["sample"]),
    _stage("repetition penalty", "repetition_penalty", lambda ns: ns["apply_repetition_penalty"]),
    _stage("int8 linear layer", "linear", lambda ns: ns["Int8Linear"].from_linear),
    _stage("block allocator", "allocator", lambda ns: ns["BlockAllocator"]),
    _stage("scheduler", "scheduler", your_scheduler),
    _stage("speculative acceptance", "accept_draft_tokens", lambda ns: ns["accept_draft_tokens"]),
    _stage("engine step", "step", lambda ns: ns["engine_step"]),
)
STAGE_NOTEBOOKS: tuple[str, ...] = tuple(sorted({stage.notebook for stage in STAGES}))


@dataclass
class Entry:
    """One line of the bill of materials."""

    stage: Stage
    source: str  # YOURS or REFERENCE
    why: str
    in_engine: bool = True  # False: this engine has no use for the stage (no draft model)
    passing: bool = False  # every exercise behind the stage passes


@dataclass
class Assembly:
    bill: list[Entry]
    hooks: EngineHooks
    quantization: str | None = None
    namespaces: dict[str, dict] = field(default_factory=dict)  # notebook -> the module its cells ran in
    rows: list = field(default_factory=list)  # progress's rows the bill was made from (the bench reads them)

    @property
    def parts(self) -> dict[str, str]:
        """stage name -> "yours" | "reference", for the stages this engine runs."""
        return {e.stage.name: e.source for e in self.bill if e.in_engine}


# --------------------------------------------------------------------------- the bill


def bill_of_materials(
    rows: list[progress.Row], quantization: str | None = None, speculative: bool = False
) -> list[Entry]:
    """One Entry per stage, from progress's rows (a notebook without rows is not in the folder)."""
    if quantization not in (None, "int8"):
        raise ValueError(f"the learner's engine serves float32 or int8 weights, got quantization={quantization!r}")
    status = {(row.notebook, row.exercise): row.status for row in rows}
    checked = {row.notebook for row in rows}
    bill = []
    for stage in STAGES:
        entry = Entry(stage, REFERENCE, "", in_engine=speculative or stage.hook != "accept_draft_tokens")
        problems = [
            f"{name}: {status.get((stage.notebook, name), 'not found in the notebook')}"
            for name in stage.exercises
            if status.get((stage.notebook, name)) != progress.PASSING
        ]
        entry.passing = stage.notebook in checked and not problems and bool(stage.exercises)
        if stage.notebook not in checked:
            entry.why = f"no {stage.notebook} notebook checked in the folder"
        elif problems or not stage.exercises:
            entry.why = "; ".join(problems) or f"{stage.notebook} has no exercise for it"
        elif not entry.in_engine:
            entry.why = "yours passes, but this engine has no draft model to speculate with"
        elif stage.hook == "linear" and quantization is None:
            entry.why = (
                "yours passes, but this engine serves float32 weights (yours builds an int8 one: quantization='int8')"
            )
        elif stage.hook == "forward" and quantization is not None:
            entry.why = "yours passes, but it reads float weights by name: int8 layers run inside the library's model"
        else:
            passes = "your exercise passes" if len(stage.exercises) == 1 else "your exercises pass"
            entry.source, entry.why = YOURS, f"{passes}: {', '.join(stage.exercises)}"
        bill.append(entry)
    return bill


def reference_bill(why: str, speculative: bool = False) -> list[Entry]:
    """Every stage the library's, for one reason (grading, no sibling notebooks)."""
    return [
        Entry(stage, REFERENCE, why, in_engine=speculative or stage.hook != "accept_draft_tokens") for stage in STAGES
    ]


def format_bill(bill: list[Entry]) -> str:
    header = ("stage", "notebook", "source", "why")
    table = [header, *[(e.stage.name, e.stage.notebook, e.source, e.why) for e in bill]]
    widths = [max(len(line[i]) for line in table) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line[:3], widths)) + "  " + line[3] for line in table]
    yours = sum(e.source == YOURS for e in bill)
    lines.append(f"\n{yours} of {len(bill)} stages are yours; the library runs the rest.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- loading your code


@contextlib.contextmanager
def _in_folder(folder: Path):
    before, path_before = os.getcwd(), list(sys.path)
    os.chdir(folder)
    sys.path.insert(0, str(folder))  # as in a kernel: the notebook's folder is importable
    try:
        yield
    finally:
        os.chdir(before)
        sys.path[:] = path_before


def load_notebook(path: Path, needed: set[str], statuses: dict[str, str]) -> dict:
    """Run the notebook's import cell and its exercise cells up to the last one in `needed` in a
    fresh module (the loading rule in the module's docstring); returns the module's namespace."""
    plan = progress.plan_notebook(path)
    if plan.error:
        raise ValueError(f"{path}: {plan.error}")
    module = types.ModuleType(f"_decodelab_yours_{plan.notebook}")
    sys.modules[module.__name__] = module  # classes and dataclasses defined in the cells look it up
    cells = [(f"<{plan.notebook} cell {index}>", source) for index, source in plan.setup[:1]]
    last = max(i for i, (name, _, _) in enumerate(plan.cells) if name in needed)
    for name, index, source in plan.cells[: last + 1]:
        crashed = statuses.get(name, "").startswith(("failing: timed out", "failing: the kernel died"))
        if not crashed:
            cells.append((f"<exercise {name}, cell {index}>", source))
    output = io.StringIO()
    with _in_folder(path.parent), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        for filename, source in cells:
            try:
                exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
            except Exception:  # noqa: BLE001 - that exercise is not passing; no stage of yours needs it
                pass
    return module.__dict__


def assemble(
    course_dir, rows: list[progress.Row], quantization: str | None = None, speculative: bool = False
) -> Assembly:
    """The bill of materials for `rows` (progress's, for the notebooks below course_dir), and the
    EngineHooks with every stage of yours loaded from its notebook."""
    progress.check_owner(course_dir)
    bill = bill_of_materials(rows, quantization, speculative)
    statuses = {(row.notebook, row.exercise): row.status for row in rows}
    namespaces, hooks = {}, EngineHooks()
    loaded = [e for e in bill if e.source == YOURS or (e.passing and not e.in_engine)]
    for notebook in dict.fromkeys(e.stage.notebook for e in loaded):
        needed = {name for e in loaded if e.stage.notebook == notebook for name in e.stage.exercises}
        path = Path(course_dir).expanduser() / notebook / f"{notebook}.ipynb"
        mine = {name: status for (nb, name), status in statuses.items() if nb == notebook}
        namespaces[notebook] = load_notebook(path, needed, mine)
    for entry in bill:
        # a passing stage this engine leaves idle (no draft model) is loaded too: an engine built
        # from the same hooks with a draft model runs it
        if not (entry.source == YOURS or (entry.passing and not entry.in_engine)):
            continue
        try:
            setattr(hooks, entry.stage.hook, entry.stage.build(namespaces[entry.stage.notebook]))
        except Exception as exc:  # noqa: BLE001 - e.g. a name the cells no longer define
            entry.source, entry.passing = REFERENCE, False
            entry.why = f"could not load it: {type(exc).__name__}: {exc}"
    return Assembly(bill, hooks, quantization, namespaces, list(rows))


def your_engine(course_dir, this_notebook: str = CAPSTONE, timeout: float = progress.DEFAULT_TIMEOUT_S) -> Assembly:
    """The capstone's engine: the stages of the notebooks in course_dir (the capstone's ".."),
    checked by progress, yours where they pass. Under nbgrader (NBGRADER_EXECUTION), with no
    notebook beside `this_notebook`, or in a folder progress refuses, every stage is the library's."""
    folder = Path(course_dir).expanduser()
    present = [n for n in STAGE_NOTEBOOKS if (folder / n / f"{n}.ipynb").is_file()]
    siblings = [n for n in present if n != this_notebook]
    if os.environ.get("NBGRADER_EXECUTION"):
        return Assembly(reference_bill("graded: the grader runs this notebook alone"), EngineHooks())
    if not siblings:
        return Assembly(reference_bill(f"no course notebooks beside this one in {folder.resolve()}"), EngineHooks())
    try:
        rows = progress.check_course(folder, present, timeout=timeout)
        return assemble(folder, rows)
    except progress.ProgressError as exc:
        return Assembly(reference_bill(str(exc)), EngineHooks())


# --------------------------------------------------------------------------- falling back


def _culprit(engine: Assembly, exc: BaseException) -> Entry | None:
    """The stage of yours whose code raised `exc`: the innermost frame that runs in a learner's
    notebook module, matched to the stage naming that function (else that notebook's first stage
    of yours). None when no frame of the traceback is the learner's."""
    modules = {id(ns): notebook for notebook, ns in engine.namespaces.items()}
    yours = [e for e in engine.bill if e.source == YOURS and e.in_engine]
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        notebook = modules.get(id(frame.f_globals))
        if notebook is None:
            continue
        mine = [e for e in yours if e.stage.notebook == notebook]
        named = [e for e in mine if frame.f_code.co_name in e.stage.exercises]
        if named or mine:
            return (named or mine)[0]
    return None


def _demote(engine: Assembly, entry: Entry, why: str) -> None:
    entry.source, entry.why = REFERENCE, why
    setattr(engine.hooks, entry.stage.hook, getattr(EngineHooks(), entry.stage.hook))


def run_with_fallback(engine: Assembly, run: Callable[[EngineHooks], object]):
    """`run(engine.hooks)`, and if a stage of yours raises in the engine (it passed its visible
    tests but not the engine's batch), that stage falls back to the library's, the bill says why,
    and the run starts again. A traceback that names no code of yours is searched stage by stage:
    each of yours in turn is replaced alone, and the first whose replacement ends the error (or
    changes it: another part of yours breaks next) is the culprit. An error that no replacement
    changes is not your parts' and is raised."""
    while True:
        try:
            return run(engine.hooks)
        except Exception as exc:  # noqa: BLE001 - a learner's part may raise anything
            failure = f"raised in the engine ({type(exc).__name__}: {exc}); the library's runs it"
            culprit = _culprit(engine, exc)
            if culprit is not None:
                _demote(engine, culprit, failure)
                continue
            if not _replace_the_one_that_raised(engine, run, exc, failure):
                raise


def _replace_the_one_that_raised(engine: Assembly, run, exc: Exception, failure: str) -> bool:
    """Replace each stage of yours alone; the first whose replacement changes the error (or ends it)
    is demoted. False when none does."""
    for entry in [e for e in engine.bill if e.source == YOURS and e.in_engine]:
        hook = getattr(engine.hooks, entry.stage.hook)
        setattr(engine.hooks, entry.stage.hook, getattr(EngineHooks(), entry.stage.hook))
        try:
            run(engine.hooks)
        except Exception as again:  # noqa: BLE001 - another stage of yours, or not this one
            if (type(again), str(again)) == (type(exc), str(exc)):
                setattr(engine.hooks, entry.stage.hook, hook)
                continue
        _demote(engine, entry, failure)
        return True
    return False


# --------------------------------------------------------------------------- serving


def serve(engine: Assembly, prompt: str, max_new_tokens: int = 32, model: str = "smollm2", device=None) -> dict:
    """Greedy, float32, the chat template as `python -m decodelab generate` applies it, on an LLM
    built with the assembly's hooks -> {"prompt_ids", "output_ids", "text", "parts", "why"}.
    Chunked prefill is on (16 tokens a step), so notebook 08's step is the one that schedules."""
    from decodelab.decoding.generate import encode_prompt
    from decodelab.engine.llm import LLM
    from decodelab.params import SamplingParams

    def run(hooks):
        llm = LLM(
            model=model,
            device=device,
            dtype="float32",
            quantization=engine.quantization,
            hooks=hooks,
            max_num_seqs=1,
            chunked_prefill=True,
            max_num_batched_tokens=16,
        )
        prompt_ids = encode_prompt(llm.tokenizer, prompt, chat=True)
        return prompt_ids, llm.generate(
            [prompt_ids], SamplingParams(temperature=0, max_tokens=max_new_tokens), use_tqdm=False
        )[0]

    prompt_ids, out = run_with_fallback(engine, run)
    if out.error:
        raise ValueError(out.error)
    return {
        "prompt_ids": prompt_ids,
        "output_ids": list(out.outputs[0].token_ids),
        "text": out.outputs[0].text,
        "parts": engine.parts,
        "why": {e.stage.name: e.why for e in engine.bill if e.in_engine},
    }


__all__ = [
    "STAGES",
    "STAGE_NOTEBOOKS",
    "Stage",
    "your_scheduler",
    "Entry",
    "Assembly",
    "bill_of_materials",
    "reference_bill",
    "format_bill",
    "load_notebook",
    "assemble",
    "your_engine",
    "run_with_fallback",
    "serve",
]

"""The course notebooks as the tests see them: which are ready, where they live, how to run one.

A notebook joins every notebook test (solution runs clean, release fails exactly on its
exercise tests, autograde gives full marks, release in sync, browser) by adding its name to
READY.

Cell conventions (nbgrader `grade_id`s), checked by tests/test_notebooks.py:
* ``ex_<function>``: a solution cell (``### BEGIN SOLUTION`` / ``### END SOLUTION``) that
  defines ``<function>``; the release keeps its signature and docstring and a stub that raises
  NotImplementedError.
* ``test_<function>``: the graded test cell of that exercise: visible tests, then a
  ``### BEGIN HIDDEN TESTS`` block that only calls ``autograder.run.hidden(check, <function>)``.
  In the release exactly these cells fail, and nothing else.
* ``q_<name>`` and ``test_q_<name>``: a prediction the learner makes before an experiment
  (`decodelab.course.predictions`, whose QUESTIONS row gives its unit and tolerance): an answer
  cell that states them and assigns the number ``q_<name>`` (the release holds ``q_<name> = None``)
  and its graded cell, whose visible part only checks that a
  number was written and whose hidden block calls ``hidden("<topic>.check_q_<name>", q_<name>)``,
  which grades it against the answer with a stated tolerance. In the release these cells pass:
  an unanswered prediction (None) is printed as such, so that Run All goes on, and the hidden
  block, back when graded, scores it 0. Each notebook has at least two, and a "Further reading"
  section.
* any other graded cell (e.g. ``check_<something>``) must pass in the release as well.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat

from decodelab.course.exercises import references

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
COURSE = ROOT / "course"

READY = [
    "00_meet_the_model",
    "01_forward_pass",
    "02_sampling",
    "03_kv_cache",
    "04_prefill_decode",
    "05_gqa",
    "06_quantization",
    "07_paged_kv",
    "08_continuous_batching",
    "09_speculative_decoding",
    "10_capstone_engine",
    "11_tiled_attention",
    "12_gpu_kernel",
    "13_calibrated_quantization",  # a bonus, placed right after 06_quantization
    "14_serving",
    "15_state_space",  # a bonus after the capstone and 14: a selective state-space model beside the transformer
]
# A notebook whose cell displays into an ipywidgets.Output can stall nbclient for the whole cell
# timeout (11's tile explorer did, 300 s): see tests/test_course_helpers.py
# test_no_widget_displays_into_an_output_widget.
# DECODELAB_NOTEBOOKS=03_kv_cache,04_prefill_decode runs the notebook tests on just those (a
# notebook being written, before it joins READY).
if os.environ.get("DECODELAB_NOTEBOOKS"):
    READY = [n.strip() for n in os.environ["DECODELAB_NOTEBOOKS"].split(",") if n.strip()]

# Per exercise: the library's reference implementation ("module:function"), from the course's table
# of exercises (decodelab.course.exercises; each autograder/checks/<topic>.py reads its own from it);
# the hidden cell names the check, tests/fixtures/buggy_*.py hold the plausible bugs each check and
# visible test must catch.
REFERENCES = references()

HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
HIDDEN_CALL = re.compile(r'hidden\("([\w.]+)",\s*(\w+)\)')


def solution_path(name: str) -> Path:
    return SOLUTIONS / name / f"{name}.ipynb"


def release_path(name: str) -> Path:
    return COURSE / name / f"{name}.ipynb"


def read(path: Path):
    return nbformat.read(str(path), as_version=4)


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def graded_cells(nb) -> dict[str, dict]:
    """grade_id -> cell, for the cells nbgrader scores."""
    return {grade_id(c): c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")}


def exercise_test_ids(nb) -> set[str]:
    """The graded cells of the exercises: test_<function> (not the predictions' test_q_<name>)."""
    return {g for g in graded_cells(nb) if g.startswith("test_") and not g.startswith("test_q_")}


def by_hand_points(nb) -> dict[str, float]:
    """grade_id -> points of the written answers a person grades in formgrader (explain_<name>):
    the autograder scores them 0 until a TA does."""
    return {
        g: float(c.metadata.nbgrader["points"])
        for g, c in graded_cells(nb).items()
        if g.startswith("explain_") and c.metadata.nbgrader.get("solution")
    }


def prediction_test_ids(nb) -> set[str]:
    """The graded cells of the predictions: test_q_<name>."""
    return {g for g in graded_cells(nb) if g.startswith("test_q_")}


def hidden_calls(cell_source: str) -> list[tuple[str, str]]:
    """(check name, function name) of each hidden() call in a test cell's hidden block."""
    if HIDDEN_BEGIN not in cell_source:
        return []
    block = cell_source.split(HIDDEN_BEGIN, 1)[1].split(HIDDEN_END, 1)[0]
    return HIDDEN_CALL.findall(block)


def visible_part(cell_source: str) -> str:
    return cell_source.split(HIDDEN_BEGIN, 1)[0]


def reference(function: str):
    """The library's reference implementation of an exercise (REFERENCES: "module:attribute")."""
    import importlib

    module, _, attr = REFERENCES[function].partition(":")
    return getattr(importlib.import_module(module), attr)


def exercise_functions(nb) -> list[str]:
    """The functions (or classes) the notebook's exercises define: ex_<function> cells."""
    return [g.removeprefix("ex_") for c in nb.cells if (g := grade_id(c) or "").startswith("ex_")]


def run_visible(nb, gid: str, function: str, fn) -> Exception | None:
    """Run the visible part of a test cell with `function` bound to fn, in a namespace made by the
    notebook's first code cell (its imports); returns the exception it raised, if any. The notebook's
    other exercises are bound to the library's references, as if the learner had solved them (a
    test cell may use an earlier exercise: 08's schedule_chunked test runs the learner's decode_batch)."""
    import contextlib
    import io
    import warnings

    setup = next(c.source for c in nb.cells if c.cell_type == "code")
    cell = next(c for c in nb.cells if grade_id(c) == gid)
    namespace = {"__name__": "__visible_test__"}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        exec(compile(setup, "<setup cell>", "exec"), namespace)  # noqa: S102 - our own notebook
        for other in exercise_functions(nb):
            if other != function and other in REFERENCES:
                namespace[other] = reference(other)
        namespace[function] = fn
        try:
            exec(compile(visible_part(cell.source), f"<{gid}>", "exec"), namespace)  # noqa: S102
        except Exception as exc:  # noqa: BLE001
            return exc
    return None


def kernel_env(**extra: str) -> dict[str, str]:
    """The environment of a notebook kernel in the tests: CI fast mode, quiet, the repo importable."""
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "lib"), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
            "DECODELAB_FAST": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # debugpy's frozen-modules note on the kernel's stderr
            "JUPYTER_PLATFORM_DIRS": "1",
        }
    )
    env.update(extra)
    return env


@dataclass
class CellError:
    index: int
    label: str  # grade_id, or "cell N" for cells without one
    ename: str
    evalue: str

    def __str__(self) -> str:
        return f"{self.label} (cell {self.index}): {self.ename}: {self.evalue}"


def cell_label(index: int, cell) -> str:
    return grade_id(cell) or f"cell {index}"


def errors(nb) -> list[CellError]:
    found = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append(
                    CellError(i, cell_label(i, cell), output.get("ename", ""), output.get("evalue", "")[:2000])
                )
    return found


def stderr_outputs(nb) -> list[tuple[str, str]]:
    """(cell label, text) of everything a run wrote to stderr: nbgrader scores such a test cell 0."""
    return [
        (cell_label(i, c), o.get("text", "")[:500])
        for i, c in enumerate(nb.cells)
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stderr"
    ]


def execute(path: Path, timeout: int = 300, env: dict | None = None):
    """Run a copy of the notebook top to bottom in its own folder (errors recorded, not raised);
    returns the executed notebook."""
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix=f"decodelab-{path.stem}-") as tmp:
        folder = Path(tmp) / path.parent.name
        shutil.copytree(path.parent, folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        nb = read(folder / path.name)
        client = NotebookClient(
            nb, timeout=timeout, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(folder)}}
        )
        client.execute(env=env or kernel_env(), cwd=str(folder))
    return nb

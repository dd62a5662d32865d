"""The course notebooks, end to end (the ones in tests/notebooks.py READY):

* a solution notebook runs top to bottom with every test cell passing, nothing on stderr, and what its
  markdown says the run shows is what the run printed (tests/claims.py);
* its student release runs with exactly the exercise test cells failing (`test_*`), the
  cells that use an unfinished exercise falling back to the library's reference;
* nbgrader autograde of the solution, submitted as a student, gives full marks;
* course/ is what `make release` generates from solutions/ today, without outputs;
* each visible test passes on the library's reference and fails on at least one kept bug
  (tests/fixtures/buggy_*.py), and every hidden-test call names a check that exists.

Notebooks run with nbclient in a temporary copy, in their own folder, with DECODELAB_FAST=1.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from notebooks import (
    COURSE,
    READY,
    REFERENCES,
    ROOT,
    SOLUTIONS,
    errors,
    execute,
    exercise_test_ids,
    grade_id,
    graded_cells,
    hidden_calls,
    kernel_env,
    prediction_test_ids,
    read,
    release_path,
    run_visible,
    solution_path,
    stderr_outputs,
)

FIXTURES = Path(__file__).parent / "fixtures"
TIMINGS: dict[str, float] = {}


def _timed(label: str, started: float) -> None:
    TIMINGS[label] = time.perf_counter() - started
    print(f"{label}: {TIMINGS[label]:.1f} s")


def _report(problems: list) -> str:
    return "\n  ".join(str(p) for p in problems)


# --------------------------------------------------------------------------- structure (cheap)


# Notebooks whose predictions (q_ cells) and further-reading section are still being written
# (issue 20); each leaves this set when it has both.
LEARNING_SUPPORT_PENDING: set[str] = set()
READING_ENTRY = re.compile(r"^\s*(?:[-*]|\d+\.)\s+(.+)$")
YEAR = re.compile(r"\b(?:19|20)\d\d\b")


def further_reading(nb) -> list[str] | None:
    """The entries of the notebook's "Further reading" section (a markdown cell whose heading says
    so; one list item per source), or None if it has none."""
    for cell in nb.cells:
        lines = cell.source.splitlines() if cell.cell_type == "markdown" else []
        heading = next(
            (i for i, line in enumerate(lines) if line.startswith("#") and "further reading" in line.lower()), None
        )
        if heading is not None:
            entries: list[str] = []
            for line in lines[heading + 1 :]:
                if m := READING_ENTRY.match(line):
                    entries.append(m.group(1))
                elif entries and line.startswith((" ", "\t")) and line.strip():  # an entry's next line
                    entries[-1] += " " + line.strip()
            return entries
    return None


@pytest.mark.parametrize("name", READY)
def test_conventions(name):
    nb = read(solution_path(name))
    answers = {grade_id(c) for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")}
    solutions = {g for g in answers if g.startswith("ex_")}
    predictions = {g for g in answers if g.startswith("q_")}
    by_hand = {g for g in answers if g.startswith("explain_")}
    tests = exercise_test_ids(nb)
    assert 2 <= len(tests) <= 7, f"{name}: {len(tests)} graded exercises; the course wants 2 to 7"
    assert answers == solutions | predictions | by_hand, (
        f"{name}: solution cells must be named ex_<function>, q_<prediction> or explain_<topic>: {sorted(answers)}"
    )
    for gid in sorted(by_hand):  # a written answer a person grades in formgrader (issue 32)
        cell = next(c for c in nb.cells if grade_id(c) == gid)
        role = cell.metadata["nbgrader"]
        assert cell.cell_type == "markdown" and role.get("grade") and role.get("points", 0) > 0, (
            f"{name}/{gid}: a by-hand answer is a graded markdown answer cell with points"
        )
    assert {g.removeprefix("ex_") for g in solutions} == {g.removeprefix("test_") for g in tests}, (
        f"{name}: every ex_<function> needs a test_<function> and back: {sorted(solutions)} vs {sorted(tests)}"
    )
    for gid in sorted(tests):
        cell, function = graded_cells(nb)[gid], gid.removeprefix("test_")
        calls = hidden_calls(cell.source)
        assert calls, f"{name}/{gid}: no `hidden(check, function)` call in a ### BEGIN HIDDEN TESTS block"
        assert all(fn == function for _, fn in calls), f"{name}/{gid}: hidden tests must test {function}: {calls}"
        module, _, check = calls[0][0].rpartition(".")
        assert hasattr(importlib.import_module(f"autograder.checks.{module}"), check), (
            f"{name}/{gid}: autograder.checks.{module} has no {check}"
        )
        assert function in REFERENCES, f"{function}: add its library reference to tests/notebooks.py REFERENCES"
        source = next(c.source for c in nb.cells if grade_id(c) == f"ex_{function}")
        assert f"def {function}(" in source or f"class {function}" in source  # an exercise may be a class (KVCache)
    assert {f"test_{q}" for q in predictions} == prediction_test_ids(nb), (
        f"{name}: every q_<name> needs a graded test_q_<name> and back"
    )
    for q in sorted(predictions):
        answer = next(c.source for c in nb.cells if grade_id(c) == q)
        assert re.search(rf"^{q}\s*=", answer, re.M), f"{name}/{q}: the answer cell must assign {q}"
        calls = hidden_calls(graded_cells(nb)[f"test_{q}"].source)
        assert calls and all(check.endswith(f".check_{q}") and fn == q for check, fn in calls), (
            f'{name}/test_{q}: its hidden block must call hidden("<topic>.check_{q}", {q}), got {calls}'
        )
        module, _, check = calls[0][0].rpartition(".")
        assert hasattr(importlib.import_module(f"autograder.checks.{module}"), check), (
            f"{name}/test_{q}: autograder.checks.{module} has no {check}"
        )
    if name not in LEARNING_SUPPORT_PENDING:
        assert len(predictions) >= 2, f"{name}: {len(predictions)} graded predictions (q_ cells); the course wants 2+"
        reading = further_reading(nb)
        assert reading is not None, f'{name}: no markdown cell with a "Further reading" heading'
        assert len(reading) >= 3, f"{name}: {len(reading)} further-reading entries; the course wants 3 to 6"
        undated = [entry[:60] for entry in reading if not YEAR.search(entry)]
        assert not undated, f"{name}: further-reading entries without a year: {undated}"
    for cell in nb.cells:
        if cell.cell_type == "code" and grade_id(cell) is None:
            assert "autograder" not in cell.source, f"{name}: only hidden-test blocks may use autograder/"
        # a control character is a mangled escape, e.g. "\approx" written through a Python string as BEL + "pprox"
        mangled = sorted({hex(ord(ch)) for ch in cell.source if ord(ch) < 32 and ch not in "\n\t"})
        assert not mangled, f"{name}: cell {cell.get('id')} holds control characters {mangled} (a lost backslash?)"


# Notebooks whose exercise docstrings do not yet name every error their solution raises (issue 34 item 6
# fixed 02, 03 and 06); each leaves this set when its docstrings do.
DOCSTRING_ERRORS_PENDING = {"04_prefill_decode", "07_paged_kv", "09_speculative_decoding", "11_tiled_attention"}


def _unnamed_errors(nb) -> list[str]:
    """`ex_` cell function (or method) -> an exception its solution raises (`raise ValueError(...)`) that its
    docstring does not name; a method without a docstring (an `__init__`) answers through its class's."""
    import ast

    found = []
    for cell in nb.cells:
        if not (grade_id(cell) or "").startswith("ex_"):
            continue
        tree = ast.parse("\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%")))
        owners = {id(f): node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for f in node.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            raised = {
                r.exc.func.id
                for r in ast.walk(node)
                if isinstance(r, ast.Raise) and isinstance(r.exc, ast.Call) and isinstance(r.exc.func, ast.Name)
            } - {"NotImplementedError"}
            doc = ast.get_docstring(node) or (ast.get_docstring(owners[id(node)]) if id(node) in owners else "") or ""
            found += [f"{grade_id(cell)}: {node.name} raises {error}" for error in sorted(raised) if error not in doc]
    return found


@pytest.mark.parametrize("name", READY)
def test_docstrings_name_the_errors_they_raise(name):
    """An exercise's docstring is its contract: the errors its solution raises are in it (the markdown asks for
    them, and the learner writes the function from the docstring)."""
    unnamed = _unnamed_errors(read(solution_path(name)))
    if name in DOCSTRING_ERRORS_PENDING:
        assert unnamed, f"{name}'s docstrings name their errors: remove it from DOCSTRING_ERRORS_PENDING"
        return
    assert not unnamed, f"{name}: docstrings that do not name an error raised: {unnamed}"


def test_learning_support_pending_is_honest():
    """A notebook that has its predictions and reading leaves the pending set (so the rule binds it)."""
    for name in sorted(LEARNING_SUPPORT_PENDING & set(READY)):
        nb = read(solution_path(name))
        done = len(prediction_test_ids(nb)) >= 2 and len(further_reading(nb) or []) >= 3
        assert not done, f"{name} has its predictions and further reading: remove it from LEARNING_SUPPORT_PENDING"


@pytest.mark.parametrize("name", READY)
def test_predictions_are_graded_against_their_answer(name):
    """Each prediction's hidden check passes on the solution's number and fails on None, on a
    string and on twice the number (so no check accepts anything)."""
    from autograder.run import _run

    nb = read(solution_path(name))
    for gid in sorted(prediction_test_ids(nb)):
        q = gid.removeprefix("test_")
        namespace: dict = {}
        exec(compile(next(c.source for c in nb.cells if grade_id(c) == q), f"<{q}>", "exec"), namespace)  # noqa: S102
        check = hidden_calls(graded_cells(nb)[gid].source)[0][0]
        value = namespace[q]
        assert _run(check, value) is None, (
            f"{name}/{q}: the hidden check rejects the solution's {value!r}: {_run(check, value)}"
        )
        for wrong in (None, "a lot", 2 * value + 1):
            assert _run(check, wrong) is not None, f"{name}/{q}: the hidden check accepts {wrong!r}"


@pytest.mark.parametrize("folder", ["solutions", "course"])
@pytest.mark.parametrize("name", READY)
def test_committed_without_outputs(name, folder):
    nb = read((SOLUTIONS if folder == "solutions" else COURSE) / name / f"{name}.ipynb")
    dirty = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, f"{folder}/{name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.parametrize("name", READY)
def test_release_hides_solutions_and_hidden_tests(name):
    text = release_path(name).read_text()
    for marker in ("### BEGIN SOLUTION", "### BEGIN HIDDEN TESTS", "autograder"):
        assert marker not in text, f"course/{name} contains {marker!r}"
    nb = read(release_path(name))
    for cell in nb.cells:
        if (grade_id(cell) or "").startswith("ex_"):
            assert 'raise NotImplementedError("' in cell.source, f"{name}/{grade_id(cell)}: no stub in the release"


def test_release_in_sync(tmp_path):
    """course/ equals a fresh `make release` (nbgrader generate_assignment) of solutions/."""
    from autograder import release

    started = time.perf_counter()
    release.generate(READY, out=tmp_path)
    _timed("release: generate all ready notebooks", started)
    for name in READY:
        fresh, committed = tmp_path / name, COURSE / name
        assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in committed.iterdir()), (
            f"course/{name}: the files differ from a fresh release; run `make release`"
        )
        for file in fresh.iterdir():
            got = (
                json.loads((committed / file.name).read_text())
                if file.suffix == ".ipynb"
                else (committed / file.name).read_bytes()
            )
            want = json.loads(file.read_text()) if file.suffix == ".ipynb" else file.read_bytes()
            assert got == want, f"course/{name}/{file.name} is stale: run `make release` and commit course/"


# --------------------------------------------------------------------------- visible tests vs bugs


def _fixture_bugs(table: str = "BUGS") -> dict[str, list[tuple[str, object]]]:
    """check name (e.g. check_top_k_filter) -> [(bug name, function)] from tests/fixtures/buggy_*.py; with
    table="ACCEPTED", their right answers written another way instead (which every check and visible test passes)."""
    bugs: dict[str, list] = {}
    for path in sorted(FIXTURES.glob("buggy_*.py")):
        spec = importlib.util.spec_from_file_location(f"decodelab_fixture_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:  # noqa: BLE001 - a fixture of a module still being written
            continue
        for bug, (fn, check_name, _what) in getattr(module, table, {}).items():
            bugs.setdefault(check_name, []).append((bug, fn))
    return bugs


def _reference(function: str):
    module, _, attr = REFERENCES[function].partition(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("name", READY)
def test_visible_tests_pass_on_reference_and_catch_bugs(name):
    nb = read(solution_path(name))
    bugs = _fixture_bugs()
    for gid in sorted(exercise_test_ids(nb)):
        function = gid.removeprefix("test_")
        failure = run_visible(nb, gid, function, _reference(function))
        assert failure is None, f"{name}/{gid}: the visible tests fail on the library's reference: {failure!r}"
        check = hidden_calls(graded_cells(nb)[gid].source)[0][0].rpartition(".")[2]
        candidates = bugs.get(check, [])
        assert candidates, f"{name}/{gid}: no kept bug for {check} in tests/fixtures/buggy_*.py"
        caught = [bug for bug, fn in candidates if isinstance(run_visible(nb, gid, function, fn), AssertionError)]
        assert caught, f"{name}/{gid}: the visible tests catch none of {[b for b, _ in candidates]}"


@pytest.mark.parametrize("name", READY)
def test_visible_and_hidden_tests_pass_the_accepted_answers(name):
    """A right answer written another way (a fixture's ACCEPTED, e.g. issue 34's int4 forward that keeps two
    groups alive) passes its exercise's visible tests and its hidden check."""
    from autograder.run import _run

    nb = read(solution_path(name))
    accepted = _fixture_bugs("ACCEPTED")
    for gid in sorted(exercise_test_ids(nb)):
        function, check = gid.removeprefix("test_"), hidden_calls(graded_cells(nb)[gid].source)[0][0]
        for answer, fn in accepted.get(check.rpartition(".")[2], []):
            failure = run_visible(nb, gid, function, fn)
            assert failure is None, f"{name}/{gid}: the visible tests reject the accepted {answer}: {failure!r}"
            assert _run(check, fn) is None, f"{name}/{gid}: {check} rejects the accepted {answer}: {_run(check, fn)}"


# --------------------------------------------------------------------------- executions (slow)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Object of type .* not in session")  # nbgrader's own gradebook code
@pytest.mark.parametrize("name", READY)
def test_solution_runs_clean(name, autograded_solution):
    """The solution, run top to bottom by nbgrader's autograde (one execution serves this test and
    the full-marks one): no cell fails, nothing reaches stderr."""
    nb = autograded_solution(name)["notebook"]
    assert not errors(nb), f"solutions/{name}: cells failed:\n  {_report(errors(nb))}"
    assert not stderr_outputs(nb), (
        f"solutions/{name}: output on stderr (nbgrader scores such a test cell 0):\n  " + _report(stderr_outputs(nb))
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", READY)
def test_release_fails_exactly_on_exercise_tests(name):
    """Only the exercise tests fail in the release; an unanswered prediction (`q_<name> = None`) says so
    in its graded cell and lets Run All go on (its hidden check, back when graded, scores it 0)."""
    started = time.perf_counter()
    nb = execute(release_path(name))
    _timed(f"{name}: release run", started)
    failed = {e.label for e in errors(nb)}
    expected = exercise_test_ids(nb)
    assert failed == expected, (
        f"course/{name}: expected exactly the exercise tests to fail (not the unanswered predictions).\n"
        f"  unexpected failures: {sorted(failed - expected)}\n  tests that passed on a stub: {sorted(expected - failed)}\n"
        f"  errors:\n  {_report(errors(nb))}"
    )
    for cell in nb.cells:
        if grade_id(cell) in prediction_test_ids(nb):
            shown = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")
            assert "is unanswered (still None)" in shown, f"course/{name}/{grade_id(cell)} printed {shown!r}"
    stub_failures = [e for e in errors(nb) if e.ename != "NotImplementedError"]
    assert not stub_failures, (
        f"course/{name}: exercise tests should fail on the stub itself:\n  {_report(stub_failures)}"
    )
    assert not stderr_outputs(nb), f"course/{name}: output on stderr:\n  {_report(stderr_outputs(nb))}"


def autograde(name: str, submission: Path, course_root: Path, student: str = "student"):
    """nbgrader autograde of one submitted notebook in a fresh course folder; returns
    (score, max_score, {grade_id: (score, max)} of the cells that lost points)."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    from autograder.release import ensure_tools_on_path, load_config

    ensure_tools_on_path()
    shutil.copytree(SOLUTIONS / name, course_root / "solutions" / name)
    submitted = course_root / "submitted" / student / name
    submitted.mkdir(parents=True)
    shutil.copy(submission, submitted / f"{name}.ipynb")
    config = load_config()
    config.CourseDirectory.root = str(course_root)
    api = NbGraderAPI(CourseDirectory(config=config), config=config)
    for step, call in (
        ("generate_assignment", lambda: api.generate_assignment(name)),
        ("autograde", lambda: api.autograde(name, student)),
    ):
        result = call()
        assert result["success"], f"nbgrader {step} {name} failed:\n{result.get('error')}\n{result.get('log')}"
    with Gradebook(f"sqlite:///{course_root / 'gradebook.db'}") as gradebook:
        notebook = gradebook.find_submission_notebook(name, name, student)
        lost = {g.name: (g.score, g.max_score) for g in notebook.grades if g.score < g.max_score}
        return notebook.score, notebook.max_score, lost


@pytest.fixture(scope="session")
def autograded_solution(tmp_path_factory):
    """name -> {"score", "max_score", "lost", "notebook"}: nbgrader autograde of the solution
    submitted as a student, run once per notebook and shared by the tests that read it."""
    results: dict[str, dict] = {}

    def run(name: str) -> dict:
        if name not in results:
            old = {k: os.environ.get(k) for k in ("PYDEVD_DISABLE_FILE_VALIDATION", "OMP_WAIT_POLICY")}
            os.environ.update(PYDEVD_DISABLE_FILE_VALIDATION="1", OMP_WAIT_POLICY="PASSIVE")
            try:
                root = tmp_path_factory.mktemp(f"autograde-{name}")
                started = time.perf_counter()
                score, max_score, lost = autograde(name, solution_path(name), root)
                _timed(f"{name}: autograde", started)
            finally:
                for key, value in old.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            notebook = read(root / "autograded" / "student" / name / f"{name}.ipynb")
            results[name] = {"score": score, "max_score": max_score, "lost": lost, "notebook": notebook}
        return results[name]

    return run


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Object of type .* not in session")  # nbgrader's own gradebook code
@pytest.mark.parametrize("name", READY)
def test_autograde_solution_full_marks(name, autograded_solution):
    result = autograded_solution(name)
    assert result["max_score"] > 0
    nb = read(solution_path(name))
    by_hand = {
        grade_id(c): float(c.metadata["nbgrader"]["points"])
        for c in nb.cells
        if (grade_id(c) or "").startswith("explain_") and c.metadata["nbgrader"].get("solution")
    }  # written answers wait for a person: 0 until then
    assert result["score"] == result["max_score"] - sum(by_hand.values()), (
        f"{name}: autograde gave {result['score']} / {result['max_score']}; cells that lost points: {result['lost']}"
    )
    assert set(result["lost"]) == set(by_hand), f"{name}: cells that lost points: {result['lost']}"


ANSWER_LINE = re.compile(r"^(q_\w+): the answer is (-?[\d,.]+(?:e[+-]?\d+)?)\b.*$", re.M)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Object of type .* not in session")  # nbgrader's own gradebook code
@pytest.mark.parametrize("name", READY)
def test_solution_feedback_agrees_with_its_grade(name, autograded_solution):
    """In the autograded solution, each prediction's feedback is printed once (no second copy as the
    cell's value), names the grader's own answer (answer_q_<name>(), to its 4 printed digits) and
    says "it passes", and its graded cell kept its points."""
    from decodelab.course.predictions import QUESTIONS

    result = autograded_solution(name)
    nb = result["notebook"]
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stdout")
    shown_again = [
        c.source[:60]
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.get("output_type") == "execute_result" and ": the answer is" in str(o.get("data", {}))
    ]
    assert not shown_again, f"{name}: feedback shown twice (as a cell's value too): {shown_again}"
    lines = {}
    for match in ANSWER_LINE.finditer(printed):
        assert match.group(1) not in lines, f"{name}: {match.group(1)}'s feedback printed twice"
        lines[match.group(1)] = match
    asked = {g.removeprefix("test_") for g in prediction_test_ids(nb)}
    assert set(lines) == asked, f"{name}: feedback lines for {sorted(lines)}, questions {sorted(asked)}"
    for q, match in lines.items():
        check = hidden_calls(graded_cells(read(solution_path(name)))[f"test_{q}"].source)[0][0]
        topic = importlib.import_module(f"autograder.checks.{check.rpartition('.')[0]}")
        answer = getattr(topic, f"answer_{q}")()
        assert float(match.group(2).replace(",", "")) == pytest.approx(answer, rel=1e-3), (
            f"{name}/{q}: the notebook's answer differs from the grader's {answer}: {match.group(0)}"
        )
        assert match.group(0).endswith("it passes"), f"{name}/{q}: {match.group(0)}"
        assert f"test_{q}" not in result["lost"] and QUESTIONS[q].notebook == name, f"{name}/{q}: {result['lost']}"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Object of type .* not in session")  # nbgrader's own gradebook code
@pytest.mark.parametrize("name", READY)
def test_claims_hold_in_the_run(name, autograded_solution):
    """What the markdown says this run shows (tests/claims.py) is what the solution's run printed, in fast mode
    (nbgrader's autograde of the solution, the execution test_solution_runs_clean reads too)."""
    from claims import CLAIMS, check

    nb = autograded_solution(name)["notebook"]
    wrong = [f"{claim.cell}: {why}" for claim in CLAIMS[name] if (why := check(claim, nb)) is not None]
    assert not wrong, f"solutions/{name}: claims the run contradicts:\n  " + _report(wrong)


@pytest.mark.slow
def test_nbgrader_finds_the_config_from_any_folder(tmp_path):
    """`nbgrader validate` from another folder, with the repository on JUPYTER_CONFIG_PATH (as
    `make lab` sets it), loads nbgrader_config.py: its PYTHONPATH makes autograder importable."""
    nb = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )
    cell = nbformat.v4.new_code_cell("import autograder.run\nprint('config loaded')")
    cell.metadata["nbgrader"] = {
        "grade": True,
        "grade_id": "check_config",
        "locked": True,
        "points": 1,
        "schema_version": 3,
        "solution": False,
        "task": False,
    }
    nb.cells.append(cell)
    nbformat.write(nb, str(tmp_path / "probe.ipynb"))
    env = {k: v for k, v in kernel_env().items() if k != "PYTHONPATH"}
    env["JUPYTER_CONFIG_PATH"] = str(ROOT)
    bin_dir = Path(sys.executable).parent
    result = subprocess.run(
        [str(bin_dir / "nbgrader"), "validate", "probe.ipynb", "--Application.log_level=DEBUG"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert f"Loaded config file: {ROOT / 'nbgrader_config.py'}" in log, log[-3000:]
    assert "Success! Your notebook passes all the tests." in log, log[-3000:]


def test_readme_course_table_lists_every_notebook():
    """The README's course table (the way in) has a row per notebook, with a time estimate."""
    rows = {
        line.split("`")[1]: line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| `") and line.split("`")[1][:2].isdigit()
    }
    names = sorted(p.name for p in SOLUTIONS.iterdir() if (p / f"{p.name}.ipynb").exists())
    assert sorted(rows) == names, f"README course table rows {sorted(rows)} vs notebooks {names}"
    for name, line in rows.items():
        assert re.search(r"\|\s*\d+(\.\d+)? h\s*\|", line), f"README: {name}'s row has no time estimate: {line}"


def test_notebook_00_gives_the_readme_plan():
    """Notebook 00's plan (time per notebook) is the README's course table: one plan, two places a
    learner meets it, kept equal here."""
    readme = {
        line.split("`")[1]: line.split("|")[2].strip()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| `") and line.split("`")[1][:2].isdigit()
    }
    intro = read(solution_path("00_meet_the_model")).cells[0].source
    plan = {
        line.split("`")[1]: line.split("|")[2].strip()
        for line in intro.splitlines()
        if line.startswith("| `") and line.split("`")[1][:2].isdigit()
    }
    assert plan == readme, f"notebook 00's plan {plan} differs from the README's course table {readme}"
    for tool in ("Validate", "Show hint", "Predict first", "decodelab progress"):
        assert tool in intro, f"notebook 00's introduction does not explain {tool!r}"

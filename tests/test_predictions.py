"""Predictions that teach (decodelab/course/predictions.py): one table of the questions, each answer cell
stating its unit and tolerance, the grader and the notebook's feedback applying the same rule to the
same answer, and each comparison printed once. The notebook runs themselves are checked in
tests/test_notebooks.py (test_solution_feedback_agrees_with_its_grade)."""

from __future__ import annotations

import ast
import importlib
import re

import pytest
from notebooks import COURSE, SOLUTIONS, grade_id, graded_cells, hidden_calls, read

from decodelab.course import predictions
from decodelab.course.predictions import QUESTIONS


def _q_cells(folder) -> dict[str, dict[str, object]]:
    """{"NN_topic": {"q_<name>": its answer cell}} of every notebook in folder."""
    found: dict[str, dict[str, object]] = {}
    for path in sorted(folder.glob("*/*.ipynb")):
        for cell in read(path).cells:
            if (grade_id(cell) or "").startswith("q_"):
                found.setdefault(path.parent.name, {})[grade_id(cell)] = cell
    return found


SOLUTION_Q = _q_cells(SOLUTIONS)


def _answer_and_check(name: str):
    """(the grader's answer_q_<name>(), its check_q_<name>) for one question, found through the
    notebook's hidden call."""
    nb = read(SOLUTIONS / QUESTIONS[name].notebook / f"{QUESTIONS[name].notebook}.ipynb")
    ((check, _),) = hidden_calls(graded_cells(nb)[f"test_{name}"].source)
    topic, _, function = check.rpartition(".")
    module = importlib.import_module(f"autograder.checks.{topic}")
    return getattr(module, f"answer_{name}")(), getattr(module, function)


def _solution_value(name: str):
    namespace: dict = {}
    exec(compile(SOLUTION_Q[QUESTIONS[name].notebook][name].source, f"<{name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def _grade(check, value) -> bool:
    try:
        check(value)
    except AssertionError:
        return False
    return True


def test_every_q_cell_is_in_the_table():
    asked = {(notebook, name) for notebook, cells in SOLUTION_Q.items() for name in cells}
    table = {(q.notebook, name) for name, q in QUESTIONS.items()}
    assert asked == table, (
        f"q_ cells without a row: {sorted(asked - table)}; rows without a q_ cell: {sorted(table - asked)}"
    )


@pytest.mark.parametrize("folder", [SOLUTIONS, COURSE])
def test_each_q_cell_states_its_unit_and_tolerance(folder):
    for notebook, cells in _q_cells(folder).items():
        for name, cell in cells.items():
            assert f"# {QUESTIONS[name].statement}" in cell.source, (
                f"{folder.name}/{notebook}/{name} does not state {QUESTIONS[name].statement!r}"
            )


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_solution_feedback_and_grade_agree_around_the_answer(name, capsys):
    """The solution's number passes the grader and the feedback says so; around the tolerance's
    edges, the feedback's verdict is the grade, value for value."""
    q = QUESTIONS[name]
    answer, check = _answer_and_check(name)
    solution = _solution_value(name)
    assert _grade(check, solution), f"{name}: the grader rejects the solution's {solution!r} (answer {answer})"
    tolerance = q.tolerance(answer)
    assert tolerance > 0
    values = [solution, answer] + [answer + k * tolerance for k in (-3, -1.02, -0.98, 0.5, 0.98, 1.02, 3)]
    for value in values + [None, "a lot", float("nan"), True]:
        predictions.show_answer(name, value, answer)
        (line,) = capsys.readouterr().out.splitlines()  # one line per comparison
        says_pass = line.endswith("it passes")
        assert says_pass == _grade(check, value), (
            f"{name}: for {value!r} the feedback says {line!r}, the grade "
            f"{'passes' if _grade(check, value) else 'fails'}"
        )
        assert ("you predicted" not in line) or f"graded {q.tolerance_text}" in line, line
    assert not _grade(check, answer + 1.02 * tolerance) and _grade(check, answer + 0.98 * tolerance)


def test_feedback_prints_once_and_returns_nothing(capsys):
    """A returned string, the cell's last value, would be shown a second time under the printed one."""
    assert predictions.show_answer("q_alpha", 0.7, 0.7) is None
    assert predictions.show_measured("alpha measured", 0.6) is None
    assert predictions.show_beside("rows", 100, 200) is None
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_a_hypothetical_is_checked_against_its_answer_not_the_measurement(capsys):
    """08's question: a step costs 20 ms + 1 ms a sequence. 12.9 passes whatever this machine measures,
    and the measurement is a separate line that compares nothing."""
    answer, check = _answer_and_check("q_throughput_gain_b32")
    predictions.show_answer("q_throughput_gain_b32", 12.92, answer)
    predictions.show_measured("throughput of batch 32 over batch 1, tiny on your machine", 6.297, "x")
    answer_line, measured_line = capsys.readouterr().out.splitlines()
    assert answer_line.endswith("it passes") and _grade(check, 12.92) and "cost model" in answer_line
    assert measured_line.startswith("measured here, not graded:") and "predicted" not in measured_line
    assert not _grade(check, 6.3)


def test_notebooks_compare_each_prediction_once_with_its_answer():
    """Every graded prediction goes through one show_answer with its own name, never show_beside
    (whose ratio to a measurement is for ungraded guesses)."""
    for path in sorted(SOLUTIONS.glob("*/*.ipynb")):
        calls: dict[str, int] = {}
        for cell in read(path).cells:
            if cell.cell_type != "code" or grade_id(cell):
                continue
            for node in ast.walk(ast.parse(cell.source)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    args = [a.id if isinstance(a, ast.Name) else getattr(a, "value", None) for a in node.args[:2]]
                    if node.func.attr == "show_beside":
                        assert not str(args[1]).startswith("q_"), f"{path.parent.name}: show_beside on {args[1]}"
                    elif node.func.attr == "show_answer":
                        assert args[0] == args[1], f"{path.parent.name}: show_answer({args[0]!r}, {args[1]})"
                        calls[args[0]] = calls.get(args[0], 0) + 1
        asked = SOLUTION_Q.get(path.parent.name, {})
        assert calls == {name: 1 for name in asked}, f"{path.parent.name}: show_answer calls {calls}"


def test_expect_prediction_reads_the_unit_and_tolerance_from_the_table(capsys):
    predictions.expect_prediction(512, "q_mha_kv_mib")
    out = capsys.readouterr().out
    assert "q_mha_kv_mib = 512 MiB" in out and "within 5% of the answer" in out
    with pytest.raises(KeyError, match="QUESTIONS"):
        predictions.expect_prediction(1, "q_not_asked")
    assert re.search(r"within 0\.5 of the answer \(the exact whole number\)", QUESTIONS["q_chunked_steps"].statement)

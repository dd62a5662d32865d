"""The hint ladders (decodelab/course/hints.py, decodelab/data/hints.json): every exercise has at
least two rungs and none gives its solution away; `python -m decodelab hints`; the button,
driven without a browser; the counter file; progress's `hints_used`; the grader's note."""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
import subprocess
import sys

import pytest
from notebooks import COURSE, ROOT, SOLUTIONS, grade_id, read

from decodelab.course import hints, progress

MIN_LEAK = 15  # a solution line (or its right-hand side) this long, normalised, must not appear in a hint
NEAR_COPY = 0.9  # a hint's code this similar (difflib's ratio) to such a line is a near-copy of it
MIN_EXPRESSION = 25  # an assignment's right-hand side this long in a hint's code gives the line away too
NO_BUTTONS_YET: set[str] = set()  # a notebook being rewritten may wait for its buttons here


def solution_exercises() -> dict[str, dict[str, list[str]]]:
    """{"NN_topic": {"ex_<name>": [the stripped lines of its ### BEGIN/END SOLUTION blocks]}}."""
    found: dict[str, dict[str, list[str]]] = {}
    for path in sorted(SOLUTIONS.glob("*/*.ipynb")):
        for cell in read(path).cells:
            gid = grade_id(cell) or ""
            if cell.cell_type == "code" and gid.startswith("ex_"):
                lines, inside = [], False
                for line in cell.source.splitlines():
                    if "### BEGIN SOLUTION" in line:
                        inside = True
                    elif "### END SOLUTION" in line:
                        inside = False
                    elif inside:
                        lines.append(line.strip())
                found.setdefault(path.parent.name, {})[gid] = lines
    return found


EXERCISES = solution_exercises()
HINTS = hints.load_hints()


def test_every_exercise_has_a_ladder_and_every_ladder_an_exercise():
    assert sum(len(ex) for ex in EXERCISES.values()) >= 40
    for notebook, exercises in EXERCISES.items():
        for exercise in exercises:
            rungs = HINTS.get(notebook, {}).get(exercise, [])
            assert len(rungs) >= 2, f"{notebook}/{exercise}: {len(rungs)} hints; every exercise needs at least 2"
            assert all(isinstance(r, str) and r.strip() for r in rungs), f"{notebook}/{exercise}: an empty hint"
    for notebook, exercises in HINTS.items():
        for exercise in exercises:
            assert exercise in EXERCISES.get(notebook, {}), f"hints.json names {notebook}/{exercise}: no such exercise"


def normalised(text: str) -> str:
    """Code compared without its whitespace: `x @ w.T` and `x@w.T` are the same line."""
    return re.sub(r"\s+", "", text)


def solution_pieces(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the normalised code of each solution line of MIN_LEAK characters or more, comments dropped;
    the right-hand sides of its assignments of MIN_EXPRESSION characters or more)."""
    whole, right = [], []
    for line in lines:
        code = "" if line.lstrip().startswith("#") else re.split(r"\s#\s|\s\s#", line)[0]
        if len(normalised(code)) >= MIN_LEAK:
            whole.append(normalised(code))
        assigned = re.match(r"^[\w\[\]., ]+?\s*[-+*/]?=(?!=)(.+)$", code)
        if assigned and len(normalised(assigned.group(1))) >= MIN_EXPRESSION:
            right.append(normalised(assigned.group(1)))
    return whole, right


def code_in(rung: str) -> list[str]:
    """The code a hint holds: its fenced blocks and `backticked` spans, one statement at a time."""
    blocks = re.findall(r"```(?:\w*\n)?(.*?)```", rung, re.S)
    blocks += re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", rung, flags=re.S))
    return [normalised(s) for block in blocks for s in re.split(r"[;\n]", block) if len(normalised(s)) >= MIN_LEAK]


def leaks(rung: str, pieces: tuple[list[str], list[str]]) -> list[str]:
    """What of the solution a rung holds: a whole line anywhere in it (whitespace aside); in its code,
    a near-copy of a line or an assignment's whole right-hand side."""
    whole, right = pieces
    text = normalised(rung)
    found = [line for line in whole if line in text]
    for code in code_in(rung):
        found += [
            line
            for line in whole
            if line not in found and difflib.SequenceMatcher(None, code, line).ratio() >= NEAR_COPY
        ]
        found += [expression for expression in right if expression not in found and expression in code]
    return found


@pytest.mark.parametrize("notebook", sorted(EXERCISES))
def test_no_hint_gives_the_solution_away(notebook):
    """No rung holds a line of its exercise's solution, or that line's right-hand side, MIN_LEAK
    characters or longer once whitespace is removed, nor code (backticks or a fenced block) that is a
    near-copy of one."""
    for exercise, lines in EXERCISES[notebook].items():
        pieces = solution_pieces(lines)
        for number, rung in enumerate(HINTS.get(notebook, {}).get(exercise, []), 1):
            leaked = leaks(rung, pieces)
            assert not leaked, f"{notebook}/{exercise}: hint {number} holds solution lines {leaked}"


def test_the_leak_rule_catches_a_copied_line(monkeypatch):
    line = next(line for line in EXERCISES["02_sampling"]["ex_top_p_filter"] if len(line) >= 25)
    leaky = {nb: {ex: list(r) for ex, r in exs.items()} for nb, exs in HINTS.items()}
    leaky["02_sampling"]["ex_top_p_filter"].append(f"just write `{line}`")
    monkeypatch.setattr(sys.modules[__name__], "HINTS", leaky)
    with pytest.raises(AssertionError, match="solution lines"):
        test_no_hint_gives_the_solution_away("02_sampling")


@pytest.mark.parametrize(
    "hint",
    [
        "`gate = x @ gate_weight.T`",  # a short line, whitespace aside
        "then `gate * torch.sigmoid(gate) * up` is hidden",  # a right-hand side
        "`gate=x @ gate_weights.T`",  # a near-copy in code
        "`(x32 * torch.rsqrt(mean_square + eps))`",  # an assignment's right-hand side, in code
        "```\nup = x @ up_weight.T\n```",  # a fenced block
    ],
)
def test_the_leak_rule_catches_short_lines_and_near_copies(hint):
    pieces = [solution_pieces(EXERCISES["01_forward_pass"][ex]) for ex in ("ex_mlp", "ex_rms_norm")]
    assert any(leaks(hint, p) for p in pieces)


def test_the_leak_rule_lets_a_named_function_through():
    pieces = solution_pieces(EXERCISES["01_forward_pass"]["ex_rms_norm"])
    assert not leaks("`torch.rsqrt(a)` is 1/sqrt(a); keep the dimension with `keepdim=True`", pieces)


def test_no_notebook_hides_hints_in_markdown():
    """Hints are the counted ladder's rungs, not <details> in the text (09's answers to its
    questions may stay: their summary is not a hint)."""
    for folder in (SOLUTIONS, COURSE):
        for path in sorted(folder.glob("*/*.ipynb")):
            for cell in read(path).cells:
                inline = re.findall(r"<details>\s*<summary>([^<]*hint[^<]*)</summary>", cell.source, re.I)
                assert not inline, f"{folder.name}/{path.parent.name}: inline hints {inline}; put them in hints.json"


def test_package_data_ships_the_hints():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"data/*"' in text and hints.HINTS_FILE.parent.name == "data" and hints.HINTS_FILE.is_file()


@pytest.mark.parametrize("folder", [SOLUTIONS, COURSE])
def test_every_notebook_has_a_button_after_each_exercise(folder):
    for path in sorted(folder.glob("*/*.ipynb")):
        notebook = path.parent.name
        cells = read(path).cells
        buttons = [c.source for c in cells if c.cell_type == "code" and "hint_button(" in c.source]
        for cell in cells:  # a button cell is a plain one-line cell, never graded, naming a real exercise
            if cell.cell_type == "code" and "hint_button(" in cell.source:
                assert grade_id(cell) is None and "\n" not in cell.source.strip()
        if notebook in NO_BUTTONS_YET and not buttons:
            continue
        for index, cell in enumerate(cells):
            gid = grade_id(cell) or ""
            if cell.cell_type == "code" and gid.startswith("ex_"):
                after = cells[index + 1]
                expected = f'course.hint_button("{notebook}", "{gid}")'
                assert after.cell_type == "code" and after.source.strip() == expected, (
                    f"{folder.name}/{notebook}: no `{expected}` cell right after {gid}"
                )
        assert len(buttons) == len(EXERCISES[notebook]), f"{notebook}: {len(buttons)} buttons"


# --------------------------------------------------------------------------- the CLI


def run_cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "decodelab", "hints", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


def test_cli_json_is_the_data_file():
    run = run_cli("--json")
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found == HINTS
    assert set(found) == set(EXERCISES)
    assert all(ex.startswith("ex_") and isinstance(r, list) for exs in found.values() for ex, r in exs.items())


def test_cli_one_notebook_as_text_and_json():
    run = run_cli("--notebook", "02")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("02_sampling\n") and "  ex_top_k_filter\n    1. " in run.stdout
    assert "03_kv_cache" not in run.stdout
    found = json.loads(run_cli("--notebook", "02_sampling", "--json").stdout)
    assert list(found) == ["02_sampling"] and list(found["02_sampling"]) == list(EXERCISES["02_sampling"])


def test_cli_unknown_notebook_exits_2():
    run = run_cli("--notebook", "99_nothing")
    assert run.returncode == 2 and "no hints for notebook" in run.stderr


# --------------------------------------------------------------------------- the button and the counter


def test_button_reveals_one_rung_per_click_and_counts(tmp_path):
    rungs = hints.hints_for("02_sampling", "ex_top_k_filter")
    button = hints.hint_button("02_sampling", "ex_top_k_filter", folder=tmp_path)
    assert button.html.value == "" and button.button.description == f"Show hint 1 of {len(rungs)}"
    assert not (tmp_path / hints.COUNTER_FILE).exists()
    button.button.click()  # what a click in the browser does: the on_click handlers run
    assert hints.render(rungs, 1) == button.html.value and "<li>" in button.html.value
    assert button.html.value.count("<li>") == 1 and hints.LAST_RUNG_NOTE not in button.html.value
    assert json.loads((tmp_path / hints.COUNTER_FILE).read_text()) == {"02_sampling": {"ex_top_k_filter": 1}}
    for _ in range(len(rungs) + 2):  # past the last rung: nothing more, no error
        button.button.click()
    assert button.html.value.count("<li>") == len(rungs) and hints.LAST_RUNG_NOTE in button.html.value
    assert button.button.disabled and button.button.description == "No more hints"
    assert hints.read_counts(tmp_path) == {"02_sampling": {"ex_top_k_filter": len(rungs)}}
    other = hints.hint_button("02_sampling", "ex_top_p_filter", folder=tmp_path)
    other.click()
    assert hints.read_counts(tmp_path)["02_sampling"] == {"ex_top_k_filter": len(rungs), "ex_top_p_filter": 1}
    again = hints.hint_button("02_sampling", "ex_top_k_filter", folder=tmp_path)  # a re-run cell
    again.click()
    assert hints.read_counts(tmp_path)["02_sampling"]["ex_top_k_filter"] == len(rungs)  # the count never drops
    assert "widget-view" in str(button._repr_mimebundle_())


def test_button_in_a_read_only_folder_does_not_raise(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        button = hints.hint_button("03_kv_cache", "ex_KVCache", folder=folder)
        button.click()
        assert "<li>" in button.html.value
        assert hints.record("03_kv_cache", "ex_KVCache", 1, folder) is False
        assert hints.read_counts(folder) == {}
    finally:
        folder.chmod(stat.S_IRWXU)


@pytest.mark.parametrize("broken", ["mkstemp", "replace"])
def test_a_failed_write_does_not_raise(tmp_path, monkeypatch, broken):
    """The same as a read-only folder, also as root (who may write anywhere)."""

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(hints.tempfile if broken == "mkstemp" else hints.os, broken, refuse)
    button = hints.hint_button("03_kv_cache", "ex_KVCache", folder=tmp_path)
    button.click()
    assert "<li>" in button.html.value and button.shown == 1
    assert hints.read_counts(tmp_path) == {} and list(tmp_path.iterdir()) == []  # no temporary file left


def test_a_missing_folder_does_not_raise(tmp_path):
    button = hints.hint_button("03_kv_cache", "ex_KVCache", folder=tmp_path / "gone")
    button.click()
    assert "<li>" in button.html.value


def test_button_defaults_to_the_working_directory_and_tolerates_unknown_exercises(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hints.hint_button("05_gqa", "ex_pool_kv_heads").click()
    assert hints.read_counts() == {"05_gqa": {"ex_pool_kv_heads": 1}}
    none = hints.hint_button("05_gqa", "ex_nothing")
    none.click()
    assert none.button.disabled and "No hints" in none.html.value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[1, 2]",
        '{"02_sampling": 3}',
        '{"02_sampling": {"ex_a": "x"}}',
        '{"02_sampling": {"ex_a": true, "ex_b": -1}}',
    ],
)
def test_a_broken_counter_file_reads_as_empty_and_is_rewritten(tmp_path, text):
    (tmp_path / hints.COUNTER_FILE).write_text(text)
    assert hints.read_counts(tmp_path) == {}
    assert hints.record("02_sampling", "ex_sample", 2, tmp_path)
    assert hints.read_counts(tmp_path) == {"02_sampling": {"ex_sample": 2}}
    assert [p.name for p in tmp_path.iterdir()] == [hints.COUNTER_FILE]  # no temporary file left behind


def test_render_escapes_and_marks_code():
    html = hints.render(["use `a < b` & <b>bold</b>", "two"], 1)
    assert "<code>a &lt; b</code>" in html and "&lt;b&gt;bold&lt;/b&gt;" in html and "two" not in html


# --------------------------------------------------------------------------- progress and the grader


def test_progress_shows_hints_used(tmp_path):
    import shutil

    shutil.copytree(COURSE / "02_sampling", tmp_path / "02_sampling")
    hints.record("02_sampling", "ex_top_k_filter", 2, tmp_path / "02_sampling")
    rows = progress.check_notebook(tmp_path / "02_sampling" / "02_sampling.ipynb")
    used = {r.exercise: r.hints_used for r in rows}
    assert set(used) == {ex.removeprefix("ex_") for ex in EXERCISES["02_sampling"]}
    assert used == {name: (2 if name == "top_k_filter" else 0) for name in used}
    assert {r.status for r in rows} == {"not started"}  # the release: nothing run, nothing changed
    table = progress.format_table(rows)
    assert table.splitlines()[0].split()[:5] == ["notebook", "exercise", "engine", "part", "hints"]
    assert any(
        line.startswith("02_sampling") and " 2 " in line and "top_k_filter" in line for line in table.splitlines()
    )
    exercises = json.loads(progress.to_json(rows))["exercises"]
    assert next(e for e in exercises if e["exercise"] == "top_k_filter")["hints_used"] == 2


def test_grader_note(tmp_path):
    from autograder.notes import hints_note

    assert hints_note(tmp_path, "02_sampling") is None  # no file submitted
    hints.record("02_sampling", "ex_top_p_filter", 1, tmp_path)
    hints.record("02_sampling", "ex_top_k_filter", 2, tmp_path)
    hints.record("03_kv_cache", "ex_KVCache", 3, tmp_path)
    assert hints_note(tmp_path, "02_sampling") == "hints: ex_top_k_filter 2, ex_top_p_filter 1"
    assert hints_note(tmp_path, "04_prefill_decode") is None
    (tmp_path / hints.COUNTER_FILE).write_text('{"02_sampling": {"ex_a; rm": 1}}')
    assert "; " not in hints_note(tmp_path, "02_sampling")  # the notes column's separator stays out

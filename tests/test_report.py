"""python -m autograder report (issue 32, item 2): the class page's numbers equal those recomputed
from the gradebook and the CSV, student text is escaped, bad input gets one clear line.

The report of a class graded for real (the grader's own class of hostile submissions) is tested in
tests/test_grading.py::test_report_numbers_equal_the_gradebook, on that file's graded class."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from autograder import report

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("student", "assignment", "score", "max_score", "status", "notes", "submitted_at", "late_penalty")
HOSTILE = "</script><script>alert('x')</script>"


# --------------------------------------------------------------------------- pure helpers (fast)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("q_x = 12", 12),
        ("q_x = 2 * 576 * 576 + 2 * 576", 2 * 576 * 576 + 2 * 576),
        ("q_x = -(-2000 // 508)", 4),
        ("q_x = 0.508 / 127 / 2", 0.508 / 127 / 2),
        ("q_x = 100000 ** (62 / 64)", 100000 ** (62 / 64)),
        ("q_x = None", None),
        ("q_x = 'a lot'", None),
        ("q_x = __import__('os').system('id')", None),
        ("q_x = 9 ** 9 ** 9", None),
        ("q_x = 1 / 0", None),
        ("q_x = True", None),
        ("q_x = (", None),
        ("q_y = 3", None),
        ("q_x = 1\nq_x = 2", 2),
        ("q_x = float('inf')", None),
    ],
)
def test_answers_are_read_as_constants_never_run(source, expected):
    assert report.answer_in(source, "q_x") == expected


def test_failure_patterns_mask_what_varies():
    a = report.failure_pattern("AssertionError: top_k_filter(k=3) kept 5 tokens, expected 3 ('the')")
    b = report.failure_pattern("AssertionError: top_k_filter(k=12) kept 1,024 tokens, expected 12 ('a b')")
    assert a == b == "AssertionError: top_k_filter(k=#) kept # tokens, expected # ('…')"
    assert report.failure_pattern("NotImplementedError: ") != a


def test_hint_notes_parse_as_the_grader_writes_them():
    from decodelab.course import hints

    note = hints.note({"02_sampling": {"ex_top_k_filter": 2, "ex_top_p_filter": 1}}, "02_sampling")
    assert report.hint_counts(note) == {"ex_top_k_filter": 2, "ex_top_p_filter": 1}
    assert report.hint_counts("late: submitted ...") == {}


# --------------------------------------------------------------------------- a small class (a gradebook)


def _notebook(path: Path, answer_cell: str) -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(answer_cell)
    cell.metadata["nbgrader"] = {
        "grade_id": "q_speedup",
        "solution": True,
        "grade": False,
        "locked": False,
        "schema_version": 3,
    }
    nb.cells = [cell]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


@pytest.fixture
def small_class(tmp_path):
    from gradebooks import make_gradebook

    cells = {"test_top_k": 2.0, "test_top_p": 2.0, "test_q_speedup": 1.0}
    scores = {
        "ana": {"test_top_k": 2, "test_top_p": 2, "test_q_speedup": 1},
        "bo": {"test_top_k": 0, "test_top_p": 2, "test_q_speedup": 0},
        "cy": {"test_top_k": 0, "test_top_p": 0, "test_q_speedup": 1},
        HOSTILE: {},
    }
    make_gradebook(tmp_path / "gradebook.db", "a1", cells, scores, duedate="2026-03-01 12:00:00")
    notes = {
        "ana": "hints: ex_top_k 2",
        "bo": "test_top_k failed: AssertionError: kept 5 tokens, expected 3; test_q_speedup failed: AssertionError: "
        "q_speedup: you predicted 2; the answer is 8 (graded within 5%); hints: ex_top_k 1, ex_top_p 3; "
        "similarity: ex_top_k identical to cy",
        "cy": "test_top_k failed: AssertionError: kept 9 tokens, expected 4; test_top_p failed: NotImplementedError: ; "
        "similarity: ex_top_k identical to bo; integrity: ex_top_p uses the reference x",
        HOSTILE: f"test_top_k failed: {HOSTILE}",
    }
    rows = [
        {
            "student": s,
            "assignment": "a1",
            "score": str(sum(scores[s].values()) - (1 if s == "cy" else 0)),
            "max_score": "5",
            "status": "ok" if s != HOSTILE else "crashed",
            "notes": notes[s],
            "submitted_at": {"ana": "2026-03-01T10:00:00+00:00", "cy": "2026-03-02T12:00:00+00:00"}.get(s, ""),
            "late_penalty": "1" if s == "cy" else "",
        }
        for s in scores
    ]
    rows.append({**rows[0], "assignment": "other", "score": "0"})  # another assignment's row: not counted
    with open(tmp_path / "grades.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    source = tmp_path / "solutions"
    _notebook(source / "a1" / "a1.ipynb", "q_speedup = 2 ** 3  # eight")
    subs = tmp_path / "submitted"
    for student, answer in {
        "ana": "q_speedup = 8.2",
        "bo": "q_speedup = 2",
        "cy": "q_speedup = open('/etc/passwd')",
    }.items():
        _notebook(subs / student / "a1" / "a1.ipynb", answer)
    return tmp_path


def test_numbers_of_a_small_class(small_class):
    r = report.build(
        "a1",
        small_class / "grades.csv",
        small_class / "gradebook.db",
        small_class / "submitted",
        small_class / "solutions",
    )
    assert r["students"] == 4 and r["statuses"] == {"crashed": 1, "ok": 3}
    cells = {c["grade_id"]: c for c in r["cells"]}
    assert (cells["test_top_k"]["graded"], cells["test_top_k"]["full_marks"]) == (4, 1)
    assert cells["test_top_p"]["pass_rate"] == 2 / 4 and cells["test_top_p"]["mean_points"] == 1.0
    assert r["failed_most"][:2] == ["test_top_k", "test_top_p"]
    top = cells["test_top_k"]["messages"][0]
    assert top["count"] == 2 and top["pattern"] == "AssertionError: kept # tokens, expected #"
    assert r["hints"] == {"ex_top_k": {"students": 2, "rungs": 3}, "ex_top_p": {"students": 1, "rungs": 3}}
    (q,) = r["predictions"]
    assert q["truth"] == 8.0 and q["answers"] == {"ana": 8.2, "bo": 2, "cy": None, HOSTILE: None}
    assert q["pass_rate"] == 2 / 4 and q["median_ratio"] == pytest.approx((8.2 / 8 + 2 / 8) / 2)
    assert r["late"] == {"cy": 1.0} and sorted(r["similarity"]) == ["bo", "cy"] and list(r["integrity"]) == ["cy"]
    assert r["hours_after_due"] == {"ana": -2.0, "cy": 24.0}


def test_page_escapes_student_text_and_inlines_plotly(small_class):
    from autograder.report_page import render

    page = render(
        report.build("a1", small_class / "grades.csv", small_class / "gradebook.db", source=small_class / "solutions")
    )
    assert HOSTILE not in page and "&lt;/script&gt;&lt;script&gt;alert(" in page
    assert page.count("<script") >= 2 and "<script src" not in page  # plotly inlined: no network
    assert "Failed most" in page and "2× AssertionError: kept 5 tokens, expected 3" in page


def _cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autograder", "report", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{ROOT / 'lib'}"},
        timeout=120,
    )


def test_cli_writes_json_and_html_and_refuses_bad_input(small_class):
    done = _cli(
        "--assignment",
        "a1",
        "--grades",
        "grades.csv",
        "--json",
        "--out",
        "r.json",
        "--source",
        "solutions",
        cwd=small_class,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((small_class / "r.json").read_text())["statuses"] == {"crashed": 1, "ok": 3}
    done = _cli("--assignment", "a1", "--grades", "grades.csv", cwd=small_class)
    assert done.returncode == 0 and (small_class / "report-a1.html").stat().st_size > 100_000, done.stderr
    for args, said in [
        (["--assignment", "nope"], "no rows for assignment 'nope'"),
        (["--assignment", "a1", "--grades", "missing.csv"], "missing.csv"),
        (["--assignment", "a1", "--gradebook", "grades.csv"], "not an nbgrader gradebook"),
        (["--assignment", "a1", "--submissions", "nowhere"], "not a folder"),
        (["--assignment", "a1", "--out", "solutions"], "a folder"),
    ]:
        done = (
            _cli("--grades", "grades.csv", *args, cwd=small_class)
            if "--grades" not in args
            else _cli(*args, cwd=small_class)
        )
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)


def test_a_failure_message_with_a_semicolon_stays_one_note():
    from autograder.notes import one_note

    note = f"test_q_x failed: {one_note('AssertionError: q_x: you predicted 2; the answer is 8 (graded within 5%)')}"
    assert report.notes_of({"notes": f"{note}; hints: ex_a 1"}) == [note, "hints: ex_a 1"]
    assert report.failure_pattern(report.FAILED.match(note)["why"]).endswith("the answer is # (graded within #%)")

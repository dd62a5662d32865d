"""`python -m autograder export` (autograder/export.py) on small hand-written files: Canvas's
gradebook export filled and kept importable, students matched by SIS Login ID, SIS User ID, then
ID, everyone missing on either side reported; the long format from nbgrader's gradebook; and a
clear error for every bad input."""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gradebooks import make_gradebook

from autograder import export

ROOT = Path(__file__).resolve().parents[1]

GRADES = """student,assignment,score,max_score,status,notes,submitted_at,late_penalty
ali,02_sampling,8,10,ok,,,
bo,02_sampling,6.5,10,ok,,2026-03-03T04:00:00+00:00,2
cy,02_sampling,10,10,ok,,,
zed,02_sampling,0,10,missing,no 02_sampling/02_sampling.ipynb; found: nothing,,
ali,00_meet_the_model,4,4,ok,,,
"""
# Canvas's export: header, the Points Possible row, students; the read-only totals at the end.
ROSTER = """Student,ID,SIS User ID,SIS Login ID,Section,02_sampling (1201),Quiz 1 (1190),Current Score,Final Score
    Points Possible,,,,,10,5,(read only),(read only)
"Lovelace, Ada",101,S-001,ALI,Section A,,4,80,80
"Babbage, Charles",102,bo,cbabbage,Section A,3,5,60,60
"Hopper, Grace",cy,S-003,ghopper,Section B,,3,70,70
"Turing, Alan",104,S-004,aturing,Section B,7,2,40,40
"Student, Test",105,,,Section A,,,,
"""


def _write(tmp_path, name: str, text: str, **kw):
    path = tmp_path / name
    path.write_text(text, **kw)
    return path


def _export(tmp_path, capsys, *args, grades: str = GRADES, roster: str | None = ROSTER):
    argv = ["--grades", str(_write(tmp_path, "grades.csv", grades)), "--out", str(tmp_path / "out.csv"), *args]
    if roster is not None:
        argv += ["--roster", str(_write(tmp_path, "roster.csv", roster, newline=""))]
    code = export.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rows(path):
    with open(path, newline="", encoding="utf-8-sig") as f:
        return list(csv.reader(f))


def test_canvas_fills_the_column_and_keeps_the_rest(tmp_path, capsys):
    code, out, err = _export(tmp_path, capsys, "--format", "canvas", "--assignment", "02_sampling")
    assert code == 0 and "filled 3 grade(s)" in out
    before, after = list(csv.reader(io.StringIO(ROSTER))), _rows(tmp_path / "out.csv")
    assert after[0] == before[0] and after[1] == before[1]  # the header and the Points Possible row
    col = before[0].index("02_sampling (1201)")
    assert [r[col] for r in after[2:]] == ["8", "6.5", "10", "7", ""]  # ali by login, bo by SIS id, cy by ID
    for b, a in zip(before, after):  # nothing else changed
        assert b[:col] + b[col + 1 :] == a[:col] + a[col + 1 :]
    assert "1 graded student(s) not in the roster (by SIS Login ID, SIS User ID or ID): zed" in err
    assert "1 roster student(s) not in the grades (left as they were): Turing, Alan (aturing)" in err
    assert "Test" not in err  # Canvas's Student View user is not a student


def test_canvas_explicit_column_and_semicolons_and_bom(tmp_path, capsys):
    roster = ROSTER.replace(",", ";").replace('"Lovelace; Ada"', '"Lovelace, Ada"')
    roster = roster.replace("Babbage; Charles", "Babbage, Charles").replace("Hopper; Grace", "Hopper, Grace")
    roster = roster.replace("Turing; Alan", "Turing, Alan").replace("Student; Test", "Student, Test")
    code, _, err = _export(
        tmp_path,
        capsys,
        "--format",
        "canvas",
        "--assignment",
        "00_meet_the_model",
        "--column",
        "Quiz 1 (1190)",
        roster="\ufeff" + roster,
    )
    assert code == 0, err
    raw = (tmp_path / "out.csv").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf") and b";" in raw.splitlines()[0]
    after = [line.split(";") for line in raw.decode("utf-8-sig").splitlines()]
    assert after[2][6] == "4" and after[3][6] == "5"  # ali's quiz replaced, bo's kept
    assert "worth 5 points, the grades' max_score is 4" in err


def test_canvas_reports_and_fails_when_nobody_matches(tmp_path, capsys):
    grades = GRADES.replace("ali,", "nobody1,").replace("bo,", "nobody2,").replace("cy,", "nobody3,")
    code, _, err = _export(tmp_path, capsys, "--format", "canvas", "--assignment", "02_sampling", grades=grades)
    assert code == 1 and "no graded student is in the roster" in err
    assert not (tmp_path / "out.csv").exists()


def test_canvas_duplicate_login_matches_nobody(tmp_path, capsys):
    roster = ROSTER.replace("cbabbage", "ALI")
    code, _, err = _export(tmp_path, capsys, "--format", "canvas", "--assignment", "02_sampling", roster=roster)
    assert code == 0 and "ali: 2 roster rows have SIS Login ID 'ali'; none filled" in err


@pytest.mark.parametrize(
    "args, roster, grades, message",
    [
        (["--assignment", "03_kv_cache"], ROSTER, GRADES, "no rows for assignment '03_kv_cache'"),
        ([], ROSTER, GRADES, "no column for assignment '00_meet_the_model'"),
        (["--assignment", "02_sampling", "--column", "Quiz 9 (1)"], ROSTER, GRADES, "no such assignment column"),
        (["--column", "Quiz 1 (1190)"], ROSTER, GRADES, "--column fills one assignment"),
        (["--assignment", "02_sampling"], "Name,Score\nali,3\n", GRADES, "not a Canvas gradebook export"),
        (["--assignment", "02_sampling"], ROSTER + "short,row\n", GRADES, "line 8 has 2 cells"),
        (["--assignment", "02_sampling"], ROSTER, "who,what\nali,3\n", "not a grades CSV"),
        (
            ["--assignment", "02_sampling"],
            ROSTER.replace("Quiz 1 (1190)", "02_sampling (1300)"),
            GRADES,
            "several columns for assignment '02_sampling'",
        ),
    ],
)
def test_canvas_clear_errors(tmp_path, capsys, args, roster, grades, message):
    code, _, err = _export(tmp_path, capsys, "--format", "canvas", *args, roster=roster, grades=grades)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out.csv").exists()


def test_missing_and_unreadable_files(tmp_path, capsys):
    code = export.main(
        [
            "--format",
            "canvas",
            "--grades",
            str(tmp_path / "nope.csv"),
            "--roster",
            str(tmp_path / "nope2.csv"),
            "--out",
            str(tmp_path / "o.csv"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--grades" in err and "no such file" in err
    (tmp_path / "latin1.csv").write_bytes(b"Student,ID\n\xe9,1\n")
    code = export.main(
        [
            "--format",
            "canvas",
            "--grades",
            str(_write(tmp_path, "grades.csv", GRADES)),
            "--roster",
            str(tmp_path / "latin1.csv"),
            "--out",
            str(tmp_path / "o.csv"),
        ]
    )
    assert code == 2 and "not UTF-8" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: canvas needs --roster
        export.main(["--format", "canvas", "--grades", "g.csv", "--out", "o.csv"])


# --------------------------------------------------------------------------- long

FORMULA_NAMES = ["=cmd|' /C calc'!A0", "+1", "@SUM(A1)", "-x", "\tab"]  # students a spreadsheet would run


@pytest.fixture(scope="module")
def gradebook(tmp_path_factory):
    """One gradebook for the long tests (making one takes seconds): ali, bo, and FORMULA_NAMES."""
    path = tmp_path_factory.mktemp("long") / "gradebook.db"
    make_gradebook(
        path,
        "02_sampling",
        {"test_top_k": 6, "test_top_p": 4},
        {
            "ali": {"test_top_k": 6, "test_top_p": 2},
            "bo": {"test_top_k": 0, "test_top_p": 4},
            **{name: {"test_top_k": 6, "test_top_p": 4} for name in FORMULA_NAMES},
        },
    )
    return path


def test_long_one_row_per_student_and_test_cell(tmp_path, capsys, gradebook):
    code, out, err = _export(
        tmp_path, capsys, "--format", "long", "--assignment", "02_sampling", "--gradebook", str(gradebook), roster=None
    )
    assert code == 0 and "wrote 4 cell grade(s) of 2 submission(s)" in out
    rows = list(csv.DictReader(open(tmp_path / "out.csv", newline="")))
    assert [tuple(r.values()) for r in rows] == [
        ("ali", "02_sampling", "test_top_k", "6", "6"),
        ("ali", "02_sampling", "test_top_p", "2", "4"),
        ("bo", "02_sampling", "test_top_k", "0", "6"),
        ("bo", "02_sampling", "test_top_p", "4", "4"),
    ]
    assert "cy: no 02_sampling submission in the gradebook" in err and "zed:" in err


def test_long_clear_errors(tmp_path, capsys):
    code, _, err = _export(tmp_path, capsys, "--format", "long", roster=None)
    assert code == 2 and "gradebook.db: no such file" in err
    (tmp_path / "gradebook.db").write_text("student,score\n")
    code, _, err = _export(tmp_path, capsys, "--format", "long", roster=None)
    assert code == 2 and "not an nbgrader gradebook" in err
    import sqlite3

    (tmp_path / "gradebook.db").unlink()
    with sqlite3.connect(tmp_path / "gradebook.db") as db:
        db.execute("CREATE TABLE notes (x)")
    code, _, err = _export(tmp_path, capsys, "--format", "long", roster=None)
    assert code == 2 and "not an nbgrader gradebook" in err
    with sqlite3.connect(tmp_path / "gradebook.db") as db:  # nbgrader did not add its tables to it
        assert [r[0] for r in db.execute("SELECT name FROM sqlite_master")] == ["notes"]
    with pytest.raises(SystemExit):
        export.main(["--format", "long", "--grades", "g.csv", "--out", "o.csv", "--roster", "r.csv"])


# --------------------------------------------------------------------------- hostile input


def _grades_csv(*rows: tuple) -> str:
    """A grades.csv of these (student, score, status, notes) rows of 02_sampling, max 10."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["student", "assignment", "score", "max_score", "status", "notes", "submitted_at", "late_penalty"])
    writer.writerows(
        [student, "02_sampling", score, 10, status, notes, "", ""] for student, score, status, notes in rows
    )
    return text.getvalue()


def _snapshot(folder) -> dict:
    """Every file and folder under folder: its bytes, or "folder"."""
    return {str(p.relative_to(folder)): "folder" if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def _canvas_column(path, login: str) -> str:
    rows = _rows(path)
    return next(r for r in rows if r[3] == login)[rows[0].index("02_sampling (1201)")]


GRADED = GRADES.encode()
HOSTILE = {  # id: (grades.csv's bytes, None: no file; the roster; --out; words of the error)
    "score not a number": (
        GRADED.replace(b"ali,02_sampling,8,", b"ali,02_sampling,abc,"),
        ROSTER,
        "out.csv",
        "line 2 (ali, 02_sampling): the score 'abc' is not a number >= 0",
    ),
    "score a formula": (
        GRADED.replace(b"ali,02_sampling,8,", b'ali,02_sampling,"=HYPERLINK(""http://x"",""y"")",'),
        ROSTER,
        "out.csv",
        "line 2 (ali, 02_sampling): the score '=HYPERLINK(",
    ),
    "score negative": (
        GRADED.replace(b"cy,02_sampling,10,", b"cy,02_sampling,-3,"),
        ROSTER,
        "out.csv",
        "line 4 (cy, 02_sampling): the score '-3' is not a number >= 0",
    ),
    "score empty": (
        GRADED.replace(b"bo,02_sampling,6.5,", b"bo,02_sampling,,"),
        ROSTER,
        "out.csv",
        "line 3 (bo, 02_sampling): the score '' is not a number",
    ),
    "quote never closed": (
        GRADED.replace(b"bo,02_sampling,6.5,", b'bo,02_sampling,"6.5,'),
        ROSTER,
        "out.csv",
        "grades.csv: line 3: not valid CSV (a quote opened here is never closed)",
    ),
    "text after a quote": (
        GRADED.replace(b"bo,02_sampling,6.5,", b'bo,02_sampling,"6.5"x,'),
        ROSTER,
        "out.csv",
        "line 3: not valid CSV",
    ),
    "row too short": (
        GRADED.replace(b"cy,02_sampling,10,10,ok,,,", b"cy,02_sampling,10"),
        ROSTER,
        "out.csv",
        "line 4 has 3 cells, the header 8",
    ),
    "not UTF-8": (GRADED.replace(b"ali,", "é,".encode("latin-1")), ROSTER, "out.csv", "not UTF-8 text"),
    "no grades file": (None, ROSTER, "out.csv", "grades.csv: no such file"),
    "roster quote never closed": (
        GRADED,
        ROSTER + '"Lamarr, Hedy,106,S-6,hlamarr,B,,,,\n',
        "out.csv",
        "roster.csv: line 8: not valid CSV (a quote opened here is never closed)",
    ),
    "out a folder": (GRADED, ROSTER, "folder", "folder: a folder; give the name of the file to write"),
    "out in no folder": (GRADED, ROSTER, "nowhere/out.csv", "/nowhere does not exist"),
    "out the grades": (GRADED, ROSTER, "grades.csv", "the --grades file itself"),
    "out the roster": (GRADED, ROSTER, "roster.csv", "the --roster file itself"),
}


@pytest.mark.parametrize("grades, roster, out, message", HOSTILE.values(), ids=HOSTILE.keys())
def test_canvas_hostile_input_one_line_error_and_nothing_written(tmp_path, capsys, grades, roster, out, message):
    if grades is not None:
        (tmp_path / "grades.csv").write_bytes(grades)
    _write(tmp_path, "roster.csv", roster, newline="")
    _write(tmp_path, "out.csv", "an earlier export\n")
    (tmp_path / "folder").mkdir()
    before = _snapshot(tmp_path)
    code = export.main(
        [
            "--format",
            "canvas",
            "--assignment",
            "02_sampling",
            "--grades",
            str(tmp_path / "grades.csv"),
            "--roster",
            str(tmp_path / "roster.csv"),
            "--out",
            str(tmp_path / out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("autograder export: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert _snapshot(tmp_path) == before  # inputs byte-identical, the earlier export kept, no temporary file


@pytest.mark.parametrize(
    "status, notes, cell",
    [
        ("grader_error", "grader: the worker was lost on each of 3 tries: KilledWorker", ""),
        ("missing", "no 02_sampling/02_sampling.ipynb; found: nothing", ""),
        ("unreadable", "not read: 02_sampling.ipynb cannot be opened (EACCES)", ""),
        ("unreadable", "not read: [Errno 5] Input/output error: '02_sampling.ipynb'", ""),
        ("unreadable", "", ""),
        ("unreadable", "not read: 02_sampling.ipynb is a link (not followed)", "0"),
        ("unreadable", "not read: 02_sampling is not a folder (a link or a file; not followed)", "0"),
        ("unreadable", "not read: 02_sampling.ipynb is not a regular file", "0"),
        ("unreadable", "not read: 02_sampling.ipynb is larger than 67,108,864 bytes", "0"),
        ("unreadable", "02_sampling.ipynb is not a valid notebook: Expecting value: line 1 column 1 (char 0)", "0"),
        ("crashed", "the kernel died", "0"),
    ],
)
def test_canvas_leaves_blank_and_lists_a_row_with_no_grade_of_the_students_making(
    tmp_path, capsys, status, notes, cell
):
    grades = _grades_csv(("aturing", "0", status, notes), ("ali", "8", "ok", ""))
    code, _, err = _export(tmp_path, capsys, "--format", "canvas", grades=grades)
    assert code == 0, err
    assert _canvas_column(tmp_path / "out.csv", "aturing") == cell  # Turing's earlier 7 replaced either way
    assert _canvas_column(tmp_path / "out.csv", "ALI") == "8"
    listed = f"autograder export: 02_sampling: left blank: aturing ({status}: {notes or 'no notes'})\n"
    assert (listed in err) == (cell == ""), err


def test_canvas_writes_nothing_when_every_matched_student_is_left_blank(tmp_path, capsys):
    grades = _grades_csv(("ali", "0", "missing", "found: nothing"), ("nobody", "3", "ok", ""))
    code, _, err = _export(tmp_path, capsys, "--format", "canvas", grades=grades)
    assert code == 1 and "left blank: ali (missing: found: nothing)" in err
    assert "no graded student is in the roster with a score to fill in" in err
    assert not (tmp_path / "out.csv").exists()


def test_canvas_scores_written_as_plain_numbers(tmp_path, capsys):
    grades = _grades_csv(("ali", " 8 ", "ok", ""), ("bo", "1e-05", "ok", ""), ("cy", "2.50", "ok", ""))
    code, _, err = _export(tmp_path, capsys, "--format", "canvas", grades=grades)
    assert code == 0, err
    assert [_canvas_column(tmp_path / "out.csv", login) for login in ("ALI", "cbabbage", "ghopper")] == [
        "8",
        "0.00001",
        "2.50",
    ]


@pytest.mark.parametrize("delimiter", [",", ";", "\t"])
def test_canvas_delimiter_inside_a_quoted_column_name(tmp_path, capsys, delimiter):
    """A column name holding more of another delimiter than the header has cells: sniffed, not counted."""
    name = "Sampling; top-k; top-p; min-p; temperature; repetition (1201)"
    if delimiter == ";":
        name = name.replace(";", ",")
    rows = [["Student", "ID", "SIS Login ID", "Section", name], ["Lovelace, Ada", "101", "ali", "A", ""]]
    text = io.StringIO()
    csv.writer(text, delimiter=delimiter).writerows(rows)
    roster, grades = _write(tmp_path, "roster.csv", text.getvalue(), newline=""), _write(tmp_path, "grades.csv", GRADES)
    before = _snapshot(tmp_path)
    code = export.main(
        [
            "--format",
            "canvas",
            "--assignment",
            "02_sampling",
            "--column",
            name,
            "--roster",
            str(roster),
            "--grades",
            str(grades),
            "--out",
            str(tmp_path / "out.csv"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    with open(tmp_path / "out.csv", newline="") as f:
        assert list(csv.reader(f, delimiter=delimiter)) == [rows[0], rows[1][:4] + ["8"]]
    assert _snapshot(tmp_path) == before | {"out.csv": (tmp_path / "out.csv").read_bytes()}  # nothing else written


@pytest.mark.parametrize(
    "header, delimiter",
    [
        ('Student,ID,"Lab; a; b; c (1)"', ","),
        ('Student;ID;"Lab, a, b, c (1)"', ";"),
        ('Student\tID\t"a, b; c (1)"', "\t"),
        ("Student,ID,Section", ","),
    ],
)
def test_sniff_delimiter_and_its_fallback(monkeypatch, header, delimiter):
    assert export.sniff_delimiter(f"{header}\n{delimiter.join(['Ada', '1', 'A'])}\n") == delimiter

    def cannot_tell(*args, **kwargs):
        raise csv.Error("Could not determine delimiter")

    monkeypatch.setattr(csv.Sniffer, "sniff", cannot_tell)  # the fallback: counted in the header, outside quotes
    assert export.sniff_delimiter(f"{header}\nAda,1,A\n") == delimiter


def test_long_neutralises_formulas_in_names(tmp_path, capsys, gradebook):
    grades = _grades_csv(*((name, "10", "ok", "") for name in [*FORMULA_NAMES, "ali"]))
    code, _, err = _export(
        tmp_path, capsys, "--format", "long", "--gradebook", str(gradebook), grades=grades, roster=None
    )
    assert code == 0, err
    with open(tmp_path / "out.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted({r["student"] for r in rows}) == sorted(["'" + name for name in FORMULA_NAMES] + ["ali"])
    assert {r["grade_id"] for r in rows} == {"test_top_k", "test_top_p"}


def test_the_command_line_lists_its_commands():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "lib")]))
    run = [sys.executable, "-m", "autograder"]
    helped = subprocess.run(
        [*run, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert helped.returncode == 0 and helped.stderr == ""
    for command in ("grade", "export", "report", "scheduler", "worker"):
        assert re.search(rf"^  {command} +\w.+$", helped.stdout, re.MULTILINE), helped.stdout
    bogus = subprocess.run([*run, "bogus"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert bogus.returncode == 2 and bogus.stdout == ""
    last = bogus.stderr.splitlines()[-1]
    assert last == "autograder: error: unknown command 'bogus' (the commands: grade, export, report, scheduler, worker)"
    assert re.search(r"^  export +\w.+$", bogus.stderr, re.MULTILINE), bogus.stderr
    assert subprocess.run(run, cwd=ROOT, env=env, capture_output=True, timeout=60, check=False).returncode == 2

"""The class grading command on a fake class of notebook 00 with every hostile or broken case
of issue 7: each student's score and status, the integrity flags, the feedback (no hidden test
code), nothing written outside the kernels' scratch folders, and a regrade that replaces rows.

Most students submit a trimmed release (the imports cell, the two exercises and their tests;
the learner may delete ungraded cells) so that the class grades in CI's budget; `correct` is
the full solution notebook and `stub` the full release.

The class is due at DUE with a penalty of a point a day (0 past 7 days); a few students carry
nbgrader's timestamp.txt (TIMESTAMPS): on time, 1.5 days late, past the cut-off, malformed.
Their answers also feed the similarity notes, and the graded class feeds the exports.

The sandbox needs root (its own uid per worker, namespaces, cgroups). Not as root, these tests
check the refusal and grade the cases that do not need isolation with --no-sandbox instead.
"""

from __future__ import annotations

import collections
import copy
import csv
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import nbformat
import pytest
from notebooks import ROOT, by_hand_points, read, release_path, solution_path

from autograder.grades_csv import COLUMNS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:Object of type .* not in session")

NAME = "00_meet_the_model"
AS_ROOT = sys.platform.startswith("linux") and os.geteuid() == 0
CELL_TIMEOUT = float(os.environ.get("DECODELAB_GRADE_CELL_TIMEOUT", "60"))
MEMORY_GIB = 2.0
SECRET = f"NEIGHBOUR-SECRET-{uuid.uuid4().hex}"
MARK = f"ESCAPE-MARK-{uuid.uuid4().hex}"
LINKED_SECRET = f"LINKED-SECRET-{uuid.uuid4().hex}"


def _gid(cell):
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def _solution_source(gid: str) -> str:
    return next(c.source for c in read(solution_path(NAME)).cells if _gid(c) == gid)


def _points(grade_id: str | None = None) -> float:
    """Points of one graded cell of the notebook, or of all of them (grade_id None)."""
    return sum(
        float(c.metadata.nbgrader.get("points", 0))
        for c in read(solution_path(NAME)).cells
        if c.get("metadata", {}).get("nbgrader", {}).get("grade") and grade_id in (None, _gid(c))
    )


# The class below varies two exercises (count_parameters, decode_tokens_per_second_bound: 2 points each);
# every other answer cell of the notebook (its predictions, any other exercise, all of them before the bound
# exercise) holds the solution in every _trimmed submission, so they add OTHER points wherever it runs.
MAX = _points()
BY_HAND = by_hand_points(read(solution_path(NAME)))  # written answers a person grades in formgrader: 0 until then
AUTOGRADED = MAX - sum(BY_HAND.values())  # what a full solution scores before a TA grades the written answers
OTHER = MAX - _points("test_count_parameters") - _points("test_decode_tokens_per_second_bound") - sum(BY_HAND.values())

SOL_COUNT = _solution_source("ex_count_parameters")
SOL_BOUND = _solution_source("ex_decode_tokens_per_second_bound")
WRONG_COUNT = (
    "def count_parameters(config):\n"
    "    V, E = config.vocab_size, config.hidden_size\n"
    "    return V * E  # forgets the layers\n"
)
REFERENCE_BOUND = "from decodelab.lessons.measure import decode_tokens_per_second_bound  # the library's own\n"


def _trimmed(count: str = SOL_COUNT, bound: str = SOL_BOUND):
    """The release without its ungraded demo cells, with these answers."""
    nb = read(release_path(NAME))
    keep = []
    for i, cell in enumerate(nb.cells):
        gid = _gid(cell)
        if cell.cell_type == "markdown" or i == 1 or gid:
            keep.append(cell)
    nb.cells = keep
    solution = read(solution_path(NAME))
    for cell in solution.cells:  # every other answer cell: the solution's
        gid = _gid(cell)
        if cell.metadata.get("nbgrader", {}).get("solution") and gid not in (
            "ex_count_parameters",
            "ex_decode_tokens_per_second_bound",
        ):
            _answer(nb, gid, cell.source)
    _answer(nb, "ex_count_parameters", count)
    _answer(nb, "ex_decode_tokens_per_second_bound", bound)
    return nb


def _answer(nb, gid: str, source: str) -> None:
    next(c for c in nb.cells if _gid(c) == gid).source = source


def _cell(nb, gid: str):
    return next(c for c in nb.cells if _gid(c) == gid)


def _escape_source(paths: dict[str, str]) -> str:
    """An answer cell that tries every way out, prints what happened, then answers correctly."""
    return (
        f"""
import os, pathlib
def attempt(name, fn):
    try:
        fn()
        print("ATTEMPT", name, "SUCCEEDED")
    except Exception as e:
        print("ATTEMPT", name, "blocked", type(e).__name__)
def _append(path):
    with open(path, "ab") as f:
        f.write(b"{MARK}")
def _read_neighbour():
    print(pathlib.Path({paths["neighbour"]!r}).read_text()[-3000:])
attempt("gradebook", lambda: _append({paths["gradebook"]!r}))
attempt("neighbour", _read_neighbour)
attempt("submissions", lambda: _append({paths["own_submission"]!r}))
attempt("grades-folder", lambda: _append({paths["out_dir"] + "/pwned.txt"!r}))
attempt("course-files", lambda: _append({paths["repo_file"]!r}))
attempt("tmp", lambda: _append({paths["tmp_marker"]!r}))
attempt("shm", lambda: _append({paths["shm_marker"]!r}))
attempt("chmod-scratch", lambda: os.chmod("..", 0o777))
def _read_all(pattern):
    found = sorted(pathlib.Path("/").glob(pattern.lstrip("/")))
    assert found, "nothing there"
    print(found[0].read_text()[:200])
attempt("read-solutions", lambda: _read_all({paths["solutions"] + "/*/*.ipynb"!r}))
attempt("read-grader", lambda: _read_all({paths["grader"]!r}))
attempt("read-git", lambda: _read_all({paths["git"] + "/*"!r}))
"""
        + SOL_COUNT
    )


SOCKET_SOURCE = (
    """
import socket
for address in [("127.0.0.1", {port}), ("8.8.8.8", 53), ("localhost", {port})]:
    try:
        socket.create_connection(address, timeout=2).sendall(b"hello from the sandbox")
        print("CONNECTED", address)
    except OSError as e:
        print("no network", address, type(e).__name__)
"""
    + SOL_COUNT
)

SILENCED_SOURCE = (
    """
ip = get_ipython()
ip.showtraceback = lambda *a, **k: None      # no traceback on screen
ip._showtraceback = lambda *a, **k: None
import decodelab.course.checking, autograder.run
decodelab.course.checking.expect_int = lambda *a, **k: None   # patch the visible-test helper
autograder.run.hidden = lambda *a, **k: None           # and the hidden-test entry point
"""
    + WRONG_COUNT
)

BIG_OUTPUT_COUNT = SOL_COUNT.replace(
    "def count_parameters(config: ModelConfig) -> int:",
    "import sys\nprint('x' * 3_000_000)\nprint('e' * 3_000_000, file=sys.stderr)\n"
    "def count_parameters(config: ModelConfig) -> int:\n    print('counting (a note on stderr)', file=sys.stderr)",
)

SWALLOW_BOUND = (
    """
import time
while True:   # swallows the grader's interrupt
    try:
        time.sleep(0.05)
    except KeyboardInterrupt:
        pass
"""
    + SOL_BOUND
)

FORK_BOMB_BOUND = (
    SOL_BOUND
    + """
import os
children = 0
try:
    while True:
        if os.fork() == 0:
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        children += 1
except OSError as e:
    print("fork refused after", children, "children:", type(e).__name__)
"""
)

# student -> (status, score on the two varied exercises, 4 points); the sandbox-only ones are graded only as
# root. _expected_score adds the OTHER points of the answers every _trimmed submission has right.
EXPECTED = {
    "correct": ("ok", 4),
    "stub": ("ok", 0),
    "wrong": ("ok", 2),
    "infinite_loop": ("timeout", 2),
    "swallows_interrupt": ("timeout", 2),
    "os_exit": ("crashed", 2),
    "memory_bomb": ("crashed", 2),
    "fork_bomb": ("ok", 4),
    "edited_test": ("tampered", 2),
    "deleted_test": ("tampered", 2),
    "stripped_metadata": ("tampered", 4),
    "malformed_json": ("unreadable", 0),
    "empty_file": ("unreadable", 0),
    "wrong_file_name": ("missing", 0),
    "big_output": ("ok", 4),
    "socket": ("ok", 4),
    "escape": ("ok", 4),
    "silenced_tracebacks": ("ok", 2),
    "linked_notebook": ("unreadable", 0),
    "linked_folder": ("missing", 0),
}
NEEDS_SANDBOX = {"memory_bomb", "fork_bomb", "socket", "escape"}
NOTHING_RIGHT = {
    "stub",
    "malformed_json",
    "empty_file",
    "wrong_file_name",
    "linked_notebook",
    "linked_folder",
}  # no answer of theirs is graded


def _expected_score(student: str) -> float:
    return EXPECTED[student][1] + (0 if student in NOTHING_RIGHT else OTHER)


DUE = "2026-03-01 17:00 Europe/Berlin"  # 16:00 UTC
LATE_SETTINGS = (
    "--AssignLatePenalties.plugin_class=autograder.late.PointsPerDay",
    "--PointsPerDay.points=1",
    "--PointsPerDay.cutoff_days=7",
)
TIMESTAMPS = {  # nbgrader's timestamp.txt of a few students
    "correct": "2026-03-01 16:59:00.000000 CET",  # a minute early
    "big_output": "2026-03-03 05:00:00.000000 CET",  # 1.5 days late: 2 points off
    "stripped_metadata": "2026-03-12 12:00:00 UTC",  # past the cut-off: the whole score
    "edited_test": "yesterday at noon",  # malformed: a note, no penalty
}
LATE_PENALTY = {
    "big_output": 2,
    "stripped_metadata": _expected_score("stripped_metadata"),
}  # past the cut-off: all it earned


def build_class(root: Path, port: int, out_dir: Path) -> Path:
    subs = root / "submissions"

    def put(student: str, nb=None, text: str | None = None, name: str = f"{NAME}.ipynb") -> Path:
        folder = subs / student / NAME
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        if nb is not None:
            nbformat.write(nb, str(path))
        else:
            path.write_text(text or "")
        return path

    correct = read(solution_path(NAME))
    correct.cells.insert(0, nbformat.v4.new_markdown_cell(SECRET))
    neighbour = put("correct", correct)
    put("stub", read(release_path(NAME)))
    put("wrong", _trimmed(count=WRONG_COUNT, bound=REFERENCE_BOUND))

    nb = _trimmed(bound="while True:\n    pass\n" + SOL_BOUND)
    _cell(nb, "test_count_parameters").source += "\n# a harmless edit: restored, still tampering"
    put("infinite_loop", nb)
    put("swallows_interrupt", _trimmed(bound=SWALLOW_BOUND))
    put("os_exit", _trimmed(bound="import os\nos._exit(3)\n" + SOL_BOUND))
    put("memory_bomb", _trimmed(bound="hoard = []\nwhile True:\n    hoard.append(bytearray(64 * 2**20))\n" + SOL_BOUND))
    put("fork_bomb", _trimmed(bound=FORK_BOMB_BOUND))

    nb = _trimmed(count=WRONG_COUNT)
    _cell(nb, "test_count_parameters").source = "pass"
    put("edited_test", nb)
    nb = _trimmed()
    nb.cells = [c for c in nb.cells if _gid(c) != "test_decode_tokens_per_second_bound"]
    put("deleted_test", nb)
    nb = _trimmed()
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    put("stripped_metadata", nb)

    put("malformed_json", text='{"cells": [ {"cell_type": "code", "source": "print(1)"')
    put("empty_file", text="")
    put("wrong_file_name", _trimmed(), name="notebook.ipynb")

    put("big_output", _trimmed(count=BIG_OUTPUT_COUNT))
    put("socket", _trimmed(count=SOCKET_SOURCE.format(port=port)))
    escape_nb = put("escape", _trimmed())
    paths = {
        "gradebook": str(out_dir / "gradebook.db"),
        "neighbour": str(neighbour),
        "own_submission": str(escape_nb),
        "out_dir": str(out_dir),
        "repo_file": str(ROOT / "autograder" / "run.py"),
        "tmp_marker": f"/tmp/{MARK}",
        "shm_marker": f"/dev/shm/{MARK}",
        "solutions": str(ROOT / "solutions"),
        "grader": str(ROOT / "autograder" / "grade.py"),
        "git": str(ROOT / ".git"),
    }
    nb = _trimmed(count=_escape_source(paths))
    nbformat.write(nb, str(escape_nb))
    for shadow in ("decodelab.py", "autograder.py"):  # sent beside the notebook: must not shadow imports
        (escape_nb.parent / shadow).write_text("raise SystemExit('a shadowing module was imported')\n")
    put("silenced_tracebacks", _trimmed(count=SILENCED_SOURCE))
    for student, stamp in TIMESTAMPS.items():
        (subs / student / NAME / "timestamp.txt").write_text(stamp + "\n")
    # Links the grader (root) must never follow: a notebook, a whole student folder, a timestamp,
    # a hint counter, each pointing at a secret outside the class.
    secret = root / "secret.txt"
    secret.write_text(f"root:{LINKED_SECRET}:19000:0:99999:7:::\n" + "{}")
    (subs / "linked_notebook" / NAME).mkdir(parents=True)
    (subs / "linked_notebook" / NAME / f"{NAME}.ipynb").symlink_to(secret)
    (subs / "linked_folder").symlink_to(subs / "correct")
    (subs / "wrong" / NAME / "timestamp.txt").symlink_to(secret)
    (subs / "wrong" / NAME / ".decodelab_hints.json").symlink_to(secret)
    return subs


def _snapshot(*folders: Path, files: tuple[Path, ...] = ()) -> dict[str, str]:
    digest = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                digest[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    for path in files:
        digest[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"
    return digest


def _grade(subs: Path, out: Path, *extra: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "lib")]), OMP_WAIT_POLICY="PASSIVE")
    cmd = [
        sys.executable,
        "-m",
        "autograder",
        "grade",
        "--assignment",
        NAME,
        "--submissions",
        str(subs),
        "--out",
        str(out),
        "--workers",
        "2",
        "--cell-timeout",
        str(CELL_TIMEOUT),
        "--notebook-timeout",
        "240",
        "--memory",
        str(MEMORY_GIB),
        "--max-processes",
        "96",
        "--output-limit",
        "200000",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(out: Path) -> dict[str, dict]:
    with open(out, newline="") as f:
        return {r["student"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    out_dir = root / "grades"
    out_dir.mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    accepted = []

    def watch():
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                continue

    stop = threading.Event()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    subs = build_class(root, listener.getsockname()[1], out_dir)
    if not AS_ROOT:
        for student in NEEDS_SANDBOX:
            subprocess.run(["rm", "-rf", str(subs / student)], check=True)
    watched_files = (
        ROOT / "autograder" / "run.py",
        Path(f"/tmp/{MARK}"),
        Path(f"/dev/shm/{MARK}"),
        out_dir / "pwned.txt",
    )
    before = _snapshot(subs, files=watched_files)
    out = out_dir / "grades.csv"
    feedback = root / "feedback"
    extra = ["--feedback", str(feedback), "--due", DUE, *LATE_SETTINGS] + ([] if AS_ROOT else ["--no-sandbox"])
    result = _grade(subs, out, *extra)
    stop.set()
    thread.join()
    listener.close()
    assert result.returncode == 0, f"grading failed:\n{result.stdout}\n{result.stderr[-5000:]}"
    return dict(
        rows=_rows(out),
        out=out,
        subs=subs,
        feedback=feedback,
        before=before,
        after=_snapshot(subs, files=watched_files),
        accepted=accepted,
        result=result,
        out_dir=out_dir,
    )


@pytest.mark.parametrize("student", sorted(EXPECTED))
def test_status_and_score(graded, student):
    if student in NEEDS_SANDBOX and not AS_ROOT:
        pytest.skip("needs the sandbox (root)")
    row = graded["rows"][student]
    status = EXPECTED[student][0]
    net = _expected_score(student) - LATE_PENALTY.get(student, 0)  # the score column is net of the late penalty
    assert (row["status"], float(row["score"]), float(row["max_score"])) == (status, net, MAX), row
    if not AS_ROOT:
        assert row["notes"].startswith("graded WITHOUT the sandbox"), row


def test_one_row_per_student_and_progress(graded):
    expected = {s for s in EXPECTED if AS_ROOT or s not in NEEDS_SANDBOX}
    with open(graded["out"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "student",
        "assignment",
        "score",
        "max_score",
        "status",
        "notes",
        "submitted_at",
        "late_penalty",
    ]
    assert sorted(r["student"] for r in rows) == sorted(expected)
    assert "grading 00_meet_the_model" in graded["result"].stderr  # the progress bar
    assert "graded 20 submissions" in graded["result"].stdout or not AS_ROOT


def test_notes_say_what_happened(graded):
    notes = {s: r["notes"] for s, r in graded["rows"].items()}
    assert "notebook.ipynb" in notes["wrong_file_name"]
    assert "not a valid notebook" in notes["malformed_json"] and "empty" in notes["empty_file"]
    assert "test_count_parameters edited" in notes["edited_test"]
    assert "test_decode_tokens_per_second_bound deleted" in notes["deleted_test"]
    assert "lost its nbgrader metadata" in notes["stripped_metadata"]
    assert "ran past" in notes["infinite_loop"] and "edited" in notes["infinite_loop"]  # timeout beats tampered
    assert "ignored the interrupt" in notes["swallows_interrupt"]
    assert "exited with code 3" in notes["os_exit"]
    assert "output cut" in notes["big_output"]
    if AS_ROOT:
        assert "killed for memory" in notes["memory_bomb"]


def test_links_are_never_followed(graded):
    """A notebook, a student folder, a timestamp.txt and a hint counter that are links to a file
    outside the class: refused by name, and not a byte of the target reaches the CSV, the
    feedback or the gradebook."""
    notes = {s: r["notes"] for s, r in graded["rows"].items()}
    assert "not read: 00_meet_the_model.ipynb is a link (not followed)" in notes["linked_notebook"]
    assert "the student's folder linked_folder is a link: not followed" in notes["linked_folder"]
    assert "late: timestamp.txt is a link (not followed): not checked, no penalty" in notes["wrong"].split("; ")
    assert not any(n.startswith("hints:") for n in notes["wrong"].split("; "))
    everything = graded["out"].read_bytes() + (graded["out_dir"] / "gradebook.db").read_bytes()
    everything += b"".join(p.read_bytes() for p in graded["feedback"].rglob("*") if p.is_file())
    assert LINKED_SECRET.encode() not in everything and b"root:" not in graded["out"].read_bytes()


def test_integrity_flags(graded):
    notes = {s: r["notes"] for s, r in graded["rows"].items()}
    assert (
        "integrity: ex_decode_tokens_per_second_bound uses the reference decodelab.lessons.measure."
        "decode_tokens_per_second_bound" in notes["wrong"]
    )
    assert "integrity: ex_count_parameters touches the grader's files (autograder/)" in notes["silenced_tracebacks"]
    flagged = {s for s, n in notes.items() if "integrity:" in n}
    assert flagged <= {"wrong", "silenced_tracebacks", "escape"}, flagged
    assert "correct" not in flagged and "stub" not in flagged


def test_version_notes(graded):
    """Releases record the decodelab version they were made for; the full solution records none:
    its row says so (its score stays 4, test_status_and_score), and so does the summary."""
    import decodelab

    notes = {s: r["notes"] for s, r in graded["rows"].items()}
    assert f"version: the notebook records no decodelab version (graded with {decodelab.__version__})" in notes[
        "correct"
    ].split("; ")
    assert not any("version:" in notes[s] for s in ("stub", "wrong", "edited_test")), notes
    assert f"1 submission(s) not released for decodelab {decodelab.__version__}" in graded["result"].stdout
    assert graded["result"].stdout.rstrip().endswith(": correct")


def test_feedback_shows_no_hidden_tests(graded):
    pages = {p.parts[-3]: p.read_text() for p in graded["feedback"].rglob("*.html")}
    assert set(pages) == set(graded["rows"])
    for student, page in pages.items():
        assert "BEGIN HIDDEN TESTS" not in page and 'hidden("meet_the_model.' not in page, student
    assert "expected 7056, got 1600" in pages["wrong"]  # the visible test's message
    assert len(pages["big_output"]) < 2_000_000
    assert "2 point(s) off" in pages["big_output"]  # the late note reaches the student
    assert not any("similarity:" in page or "integrity:" in page for page in pages.values())


def test_late_penalties(graded):
    """nbgrader's timestamp.txt against the due date: submitted_at, late_penalty, a net score,
    a "late:" note (and nothing guessed), nbgrader's gradebook, the summary."""
    from nbgrader.api import Gradebook

    rows = graded["rows"]
    got = {s: (rows[s]["submitted_at"], rows[s]["late_penalty"], float(rows[s]["score"])) for s in TIMESTAMPS}
    assert got == {
        "correct": ("2026-03-01T15:59:00+00:00", "0", _expected_score("correct")),
        "big_output": ("2026-03-03T04:00:00+00:00", "2", _expected_score("big_output") - 2),
        "stripped_metadata": ("2026-03-12T12:00:00+00:00", f"{_expected_score('stripped_metadata'):g}", 0.0),
        "edited_test": ("", "", _expected_score("edited_test")),
    }
    notes = {s: r["notes"].split("; ") for s, r in rows.items()}
    assert (
        "late: submitted 2026-03-03T04:00:00+00:00, 1.5 day(s) after the due date 2026-03-01T16:00:00+00:00: "
        "2 point(s) off (PointsPerDay: 1 point(s) per day, score 0 past 7 day(s))"
    ) in notes["big_output"]
    assert any(n.startswith("late: timestamp.txt is malformed") for n in notes["edited_test"])
    assert "late: no timestamp.txt in the submission folder: not checked, no penalty" in notes["stub"]
    assert not any(n.startswith("late:") for n in notes["correct"])
    assert (rows["stub"]["submitted_at"], rows["stub"]["late_penalty"]) == ("", "")
    with Gradebook(f"sqlite:///{graded['out_dir'] / 'gradebook.db'}") as gb:
        assert gb.find_submission_notebook(NAME, NAME, "big_output").late_submission_penalty == 2
        assert gb.find_submission(NAME, "big_output").total_seconds_late == 1.5 * 86400
    assert (
        "2 late submission(s) with points off (late_penalty; score is net): big_output, stripped_metadata"
        in graded["result"].stdout
    )


def test_similarity_notes(graded):
    """The same answers across the fake class are flagged with whom; short answers, the stub and
    unreadable submissions never are; scores are untouched (test_status_and_score)."""
    notes = {s: [n for n in r["notes"].split("; ") if n.startswith("similarity:")] for s, r in graded["rows"].items()}
    same = next(n for n in notes["correct"] if n.startswith("similarity: ex_count_parameters identical to "))
    assert "deleted_test's" in same and "infinite_loop's" in same, notes["correct"]
    assert not any("ex_count_parameters" in n for n in notes["wrong"])  # a 3-line answer: too short to tell
    for student in ("stub", "malformed_json", "empty_file", "wrong_file_name", "stripped_metadata"):
        assert notes[student] == [], (student, notes[student])
    assert "with answers like another's or the library's" in graded["result"].stdout


def test_exports_of_the_graded_class(graded, tmp_path):
    """`export --format long` reads the gradebook grade left; `--format canvas` fills a roster."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "lib")]))
    long_out = tmp_path / "cells.csv"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autograder",
            "export",
            "--format",
            "long",
            "--grades",
            str(graded["out"]),
            "--out",
            str(long_out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    with open(long_out, newline="") as f:
        cells = list(csv.DictReader(f))
    wrong = {r["grade_id"]: (r["points"], r["max_points"]) for r in cells if r["student"] == "wrong"}
    assert (wrong.pop("test_count_parameters"), wrong.pop("test_decode_tokens_per_second_bound")) == (
        ("0", "2"),
        ("2", "2"),
    )
    assert {g: wrong.pop(g) for g in BY_HAND} == {g: ("0", f"{p:g}") for g, p in BY_HAND.items()}  # for a TA
    assert all(points == max_points for points, max_points in wrong.values()), wrong  # the solution's answers
    for student, row in graded["rows"].items():  # per-cell points add up to the score before the penalty
        raw = float(row["score"]) + float(row["late_penalty"] or 0)
        assert sum(float(r["points"]) for r in cells if r["student"] == student) == raw, student
    roster = tmp_path / "roster.csv"
    roster.write_text(
        f"Student,ID,SIS User ID,SIS Login ID,Section,{NAME} (77),Current Score\n"
        f"    Points Possible,,,,,{MAX:g},(read only)\n"
        "One,1,,correct,A,,90\nTwo,2,wrong,w2,A,,80\nThree,3,,nobody,A,1,70\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autograder",
            "export",
            "--format",
            "canvas",
            "--grades",
            str(graded["out"]),
            "--roster",
            str(roster),
            "--out",
            str(tmp_path / "canvas.csv"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    filled = (tmp_path / "canvas.csv").read_text().splitlines()
    assert filled[2:] == [
        f"One,1,,correct,A,{_expected_score('correct'):g},90",
        f"Two,2,wrong,w2,A,{_expected_score('wrong'):g},80",
        "Three,3,,nobody,A,1,70",
    ]
    assert "not in the roster" in result.stderr and "Three (nobody)" in result.stderr


def test_report_numbers_equal_the_gradebook(graded, tmp_path):
    """`python -m autograder report --json` on the graded class: its per-cell counts equal those read
    from nbgrader's gradebook directly, its statuses and flags those of the CSV, and the correct
    student's predictions equal the solution's answers; the HTML page is written too."""
    from nbgrader.api import Gradebook

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "lib")]))
    out = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autograder",
            "report",
            "--assignment",
            NAME,
            "--grades",
            str(graded["out"]),
            "--submissions",
            str(graded["subs"]),
            "--json",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(out.read_text())
    rows = graded["rows"]
    assert got["students"] == len(rows)
    assert got["statuses"] == dict(collections.Counter(r["status"] for r in rows.values()))
    expected: dict[str, list] = {}
    with Gradebook(f"sqlite:///{graded['out_dir'] / 'gradebook.db'}") as gb:
        for student in rows:
            for notebook in gb.find_submission(NAME, student).notebooks:
                for grade in notebook.grades:
                    waiting = grade.auto_score is None and grade.manual_score is None
                    expected.setdefault(grade.name, []).append(None if waiting else grade.score == grade.max_score)
    cells = {c["grade_id"]: c for c in got["cells"]}
    assert {g: (c["graded"], c["full_marks"], c["waiting"]) for g, c in cells.items()} == {
        g: (sum(x is not None for x in v), sum(x is True for x in v), v.count(None)) for g, v in expected.items()
    }
    # none scored by hand yet: no full marks; a submission that lost the cell scores 0 (graded), not waiting
    assert all(cells[g]["waiting"] > 0 and cells[g]["full_marks"] == 0 for g in BY_HAND), {g: cells[g] for g in BY_HAND}
    failing = {g for g, v in expected.items() if False in v and not g.startswith("test_q_")}
    assert set(got["failed_most"]) == failing and "test_count_parameters" in failing
    assert any(m["count"] >= 1 for m in cells["test_count_parameters"]["messages"])
    assert set(got["integrity"]) == {s for s, r in rows.items() if "integrity:" in r["notes"]}
    assert set(got["late"]) == {s for s, r in rows.items() if r["late_penalty"] not in ("", "0")}
    for prediction in got["predictions"]:
        assert prediction["answers"]["correct"] == pytest.approx(prediction["truth"]), prediction
        assert prediction["answers"]["stub"] is None
    page = subprocess.run(
        [
            sys.executable,
            "-m",
            "autograder",
            "report",
            "--assignment",
            NAME,
            "--grades",
            str(graded["out"]),
            "--out",
            str(tmp_path / "report.html"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert page.returncode == 0 and "Failed most" in (tmp_path / "report.html").read_text(), page.stderr


@pytest.mark.skipif(not AS_ROOT, reason="the sandbox needs root")
def test_sandbox_held(graded):
    assert graded["before"] == graded["after"], "a submission changed files outside its scratch folder"
    assert not graded["accepted"], "a kernel reached the grader's network"
    assert MARK.encode() not in (graded["out_dir"] / "gradebook.db").read_bytes()
    page = next(graded["feedback"].glob("escape/*/*.html")).read_text()
    attempts = re.findall(r"ATTEMPT (\S+) (SUCCEEDED|blocked)", page)
    # its private /tmp and /dev/shm may be written (they vanish with it); nothing else
    assert len(attempts) == 11 and all(
        outcome == "blocked" for name, outcome in attempts if name not in ("tmp", "shm")
    ), attempts
    assert SECRET not in page, "the escape student read its neighbour's notebook"
    socket_page = next(graded["feedback"].glob("socket/*/*.html")).read_text()
    # what the cell printed (its source shows the same words without the parenthesis)
    assert not re.search(r"CONNECTED \(", socket_page) and len(re.findall(r"no network \(", socket_page)) == 3
    assert "fork refused after" in next(graded["feedback"].glob("fork_bomb/*/*.html")).read_text()


@pytest.mark.skipif(AS_ROOT, reason="as root the sandbox runs; the refusal is for other users")
def test_refuses_without_root(tmp_path):
    subs = tmp_path / "subs"
    (subs / "someone" / NAME).mkdir(parents=True)
    result = _grade(subs, tmp_path / "grades.csv")
    assert result.returncode == 3 and "--no-sandbox" in result.stderr, result.stderr
    assert not (tmp_path / "grades.csv").exists()


def test_regrade_replaces_rows(graded, tmp_path):
    """A second run over (part of) the class replaces those rows and keeps the others."""
    subs = tmp_path / "subs"
    for student in ("empty_file", "wrong_file_name"):
        (subs / student / NAME).mkdir(parents=True)
    (subs / "empty_file" / NAME / f"{NAME}.ipynb").write_text("not json")
    (subs / "wrong_file_name" / NAME / f"{NAME}.ipynb").write_text("")
    out = tmp_path / "grades.csv"
    out.write_bytes(graded["out"].read_bytes())
    before = _rows(out)
    result = _grade(subs, out, *([] if AS_ROOT else ["--no-sandbox"]))
    assert result.returncode == 0, result.stderr[-3000:]
    after = _rows(out)
    assert sorted(after) == sorted(before)  # nothing dropped, nothing duplicated
    with open(out, newline="") as f:
        assert len(list(csv.DictReader(f))) == len(before)
    assert after["wrong_file_name"]["status"] == "unreadable" and after["empty_file"]["status"] == "unreadable"
    assert after["correct"] == before["correct"]


def test_regrade_keeps_manual_scores_late_policy_and_columns(graded, tmp_path):
    """A regrade run with no late flags over a copy of the graded class's CSV and gradebook: a score
    a TA set by hand (formgrader writes manual_score) stays and counts, the late penalty of the
    first grading is charged again (the policy is kept in the gradebook), and a column the
    instructor added stays, for the regraded row and the others."""
    import shutil

    from nbgrader.api import Gradebook

    student = "big_output"  # 1.5 days late: 2 points off under the first grading's policy
    subs = tmp_path / "subs"
    shutil.copytree(graded["subs"] / student, subs / student)
    out = tmp_path / "grades.csv"
    with open(graded["out"], newline="") as f:
        rows = list(csv.DictReader(f))
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], "ta_comment"])
        writer.writeheader()
        writer.writerows({**r, "ta_comment": f"seen by TA ({r['student']})"} for r in rows)
    shutil.copy(graded["out_dir"] / "gradebook.db", tmp_path / "gradebook.db")
    (written,) = BY_HAND  # the written answer, graded in formgrader: what its page writes, through nbgrader's API
    comment = "Right about the bytes per token; quote your own bandwidth next time."
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:
        gb.find_grade("test_count_parameters", NAME, NAME, student).manual_score = 1  # of 2
        gb.find_grade(written, NAME, NAME, student).manual_score = 1.5
        gb.find_comment(written, NAME, NAME, student).manual_comment = comment
        gb.db.commit()
    assert f"by hand: {written} ({BY_HAND[written]:g} points) to grade in formgrader (not in the score yet)" in graded[
        "rows"
    ][student]["notes"].split("; ")
    feedback = tmp_path / "feedback"
    result = _grade(subs, out, "--feedback", str(feedback), *([] if AS_ROOT else ["--no-sandbox"]))
    assert result.returncode == 0, result.stderr[-3000:]
    after = _rows(out)
    assert float(after[student]["score"]) == _expected_score(student) - 1 - 2 + 1.5, after[student]
    assert after[student]["late_penalty"] == "2"
    notes = after[student]["notes"].split("; ")
    assert f"manual: test_count_parameters 1, {written} 1.5 (scored by hand, kept)" in notes, notes
    assert not any(n.startswith("by hand:") for n in notes), notes
    assert all(r["ta_comment"] == f"seen by TA ({s})" for s, r in after.items()), after
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:
        assert gb.find_grade("test_count_parameters", NAME, NAME, student).manual_score == 1
        assert gb.find_grade(written, NAME, NAME, student).manual_score == 1.5
        assert gb.find_comment(written, NAME, NAME, student).manual_comment == comment
    page = next(feedback.glob(f"{student}/{NAME}/*.html")).read_text()
    assert "quote your own bandwidth next time" in page
    assert re.search(r"1\.5\s*/\s*2", page), "the manual score of the written answer is not in the feedback"
    graded_nb = nbformat.read(tmp_path / "autograded" / student / NAME / f"{NAME}.ipynb", as_version=4)
    assert not any("BEGIN HIDDEN TESTS" in c.source or "hidden(" in c.source for c in graded_nb.cells)
    assert any(c.get("outputs") for c in graded_nb.cells if c.cell_type == "code")  # as graded, outputs kept


def test_graded_notebooks_wait_for_formgrader(graded):
    """grade writes nbgrader's autograded/<student>/<assignment>/ beside the CSV (formgrader's layout), without
    hidden tests; a submission that never ran has none."""
    folder = graded["out_dir"] / "autograded"
    for student, row in graded["rows"].items():
        path = folder / student / NAME / f"{NAME}.ipynb"
        ran = row["status"] not in ("missing", "unreadable")
        assert path.is_file() == ran, (student, row["status"])
        if ran:
            text = path.read_text()
            # (a hostile submission may name autograder.run in its own code; the hidden cells' calls never show)
            assert "BEGIN HIDDEN TESTS" not in text and 'hidden("meet_the_model.' not in text, student


@pytest.mark.parametrize(
    "flags, says",
    [
        (
            ["--PointsPerDay.points=3"],
            "the late penalty plugin is nbgrader.plugins.latesubmission.LateSubmissionPlugin",
        ),
        (
            ["--AssignLatePenalties.plugin_class=autograder.late.PointsPerDay", "--PointsPerDay.point=1"],
            "PointsPerDay has no setting 'point'",
        ),
        (["--NoSuchClass.points=1"], "only the late policy's settings can be given here"),
    ],
)
def test_late_flags_that_would_be_ignored_are_refused(tmp_path, flags, says):
    subs = tmp_path / "subs"
    (subs / "someone" / NAME).mkdir(parents=True)
    result = _grade(subs, tmp_path / "grades.csv", "--no-sandbox", *flags, timeout=300)
    assert result.returncode != 0 and says in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "grades.csv").exists() and not (tmp_path / "gradebook.db").exists()


def test_a_regrade_under_another_late_policy_is_refused(graded, tmp_path):
    import shutil

    out = tmp_path / "grades.csv"
    shutil.copy(graded["out"], out)
    shutil.copy(graded["out_dir"] / "gradebook.db", tmp_path / "gradebook.db")
    before = out.read_bytes()
    other = ("--AssignLatePenalties.plugin_class=autograder.late.PointsPerDay", "--PointsPerDay.points=3")
    result = _grade(graded["subs"], out, "--no-sandbox", *other, timeout=300)
    assert result.returncode != 0, result.stdout[-2000:]
    assert (
        'was first graded with the late policy "PointsPerDay: 1 point(s) per day, score 0 past 7 day(s)'
        in result.stderr
        and "--replace-late-policy" in result.stderr
    ), result.stderr[-2000:]
    assert out.read_bytes() == before


def test_an_empty_class_still_writes_its_csv_and_bad_outs_are_refused(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    result = _grade(subs, tmp_path / "grades.csv", "--no-sandbox", timeout=300)
    assert result.returncode == 0 and "no student folders in" in result.stderr, result.stderr[-2000:]
    assert (tmp_path / "grades.csv").read_text().splitlines() == [",".join(COLUMNS)]
    (tmp_path / "folder.csv").mkdir()
    result = _grade(subs, tmp_path / "folder.csv", "--no-sandbox", timeout=300)
    assert result.returncode != 0 and "a folder; give the CSV file to write" in result.stderr
    garbage = tmp_path / "garbage.csv"
    garbage.write_bytes(b"\xff\xfe not a grades file")
    result = _grade(subs, garbage, "--no-sandbox", timeout=300)
    assert result.returncode != 0 and "cannot be read back" in result.stderr
    assert garbage.read_bytes() == b"\xff\xfe not a grades file"


def test_status_precedence_and_tamper_check():
    from autograder.submission import check_tampering, worst

    assert worst(["ok", "tampered", "timeout", "crashed"]) == "crashed"
    assert worst(["tampered", "timeout"]) == "timeout" and worst([]) == "ok"
    release = read(release_path(NAME))
    assert check_tampering(read(solution_path(NAME)), release) == ([], False)  # hidden tests are not edits
    assert check_tampering(copy.deepcopy(release), release) == ([], False)
    edited = copy.deepcopy(release)
    _cell(edited, "test_count_parameters").metadata.nbgrader["points"] = 200
    notes, tampered = check_tampering(edited, release)
    assert tampered and notes == ["test_count_parameters edited: restored from the release"]


def test_no_sandbox_says_so_in_every_row(tmp_path):
    subs = tmp_path / "subs"
    (subs / "a" / NAME).mkdir(parents=True)
    (subs / "a" / NAME / f"{NAME}.ipynb").write_text("{")
    (subs / "b" / NAME).mkdir(parents=True)
    result = _grade(subs, tmp_path / "grades.csv", "--no-sandbox")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "grades.csv")
    assert [rows[s]["status"] for s in ("a", "b")] == ["unreadable", "missing"]
    assert all(r["notes"].startswith("graded WITHOUT the sandbox") for r in rows.values()), rows
    # no due date: the late columns stay empty and nothing is said about time
    assert all(r["submitted_at"] == r["late_penalty"] == "" and "late:" not in r["notes"] for r in rows.values())

"""nbgrader's exchange flow end to end, as a class runs it (issue 21, part 3).

nbgrader takes a student's name from the uid of the process, so each student here is an OS user
of their own (`useradd`, uids from 60100: the grading sandbox uses 61000 and up), with a home
folder of their own in a temporary folder. The exchange root is world-writable with the sticky
bit (like /srv/nbgrader/exchange); it and the course id are set in a site-wide
nbgrader_config.py on JUPYTER_CONFIG_PATH, as a JupyterHub would set them for everyone.

1. the instructor builds a course folder the way `make release` does (autograder.release into
   its course/) and runs `nbgrader release_assignment` (the repository's nbgrader_config.py);
2. each student runs `nbgrader fetch_assignment` and `nbgrader submit` as their own user
   (tests/as_user.py): `solver` answers every answer cell and used three hint rungs (the
   `.decodelab_hints.json` the hint buttons write), `idle` submits the release untouched, `late`
   submits the release before the due date and the answers after it;
3. the instructor runs `nbgrader collect`, then our grader on `<course>/submitted` as collected,
   with feedback into `<course>/feedback` and a point a day off for late work;
4. `nbgrader release_feedback`, then each student `nbgrader fetch_feedback` as their own user.

The notebook is 00_meet_the_model, the quickest to grade (bench/results/grading.json). Needs
root (useradd, the sandbox); skipped otherwise.
"""

from __future__ import annotations

import csv
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import nbformat
import pytest
from notebooks import ROOT, by_hand_points, grade_id, read, solution_path

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NAME = "00_meet_the_model"
ROLES = ("solver", "idle", "late")
FIRST_UID = 60100  # students' uids: below the sandbox's 61000 + slot (autograder/slots.py)
LAST_UID = 60999
HINTS = {"ex_count_parameters": 2, "ex_decode_tokens_per_second_bound": 1}
COMMAND_TIMEOUT = 240


def _max_points() -> float:
    return sum(
        float(c.metadata.nbgrader.get("points", 0))
        for c in read(solution_path(NAME)).cells
        if c.get("metadata", {}).get("nbgrader", {}).get("grade")
    )


MAX = _max_points()
# A full solution earns every point but the written answers, which wait for a TA in formgrader.
AUTOGRADED = MAX - sum(by_hand_points(read(solution_path(NAME))).values())


def in_ci() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("DECODELAB_CI"))


def _requirements() -> str | None:
    """Why this machine cannot run the exchange test, or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "the exchange test creates OS users (useradd) and grades in the sandbox: it needs root on Linux"
    missing = [tool for tool in ("useradd", "userdel") if shutil.which(tool) is None]
    if missing:
        return f"the exchange test needs {' and '.join(missing)} (Debian: the passwd package)"
    return None


# --------------------------------------------------------------------------- commands


def _run(argv: list[str], cwd: Path, env: dict, what: str) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert result.returncode == 0, (
        f"{what} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    return result


def _user_command(argv: list[str]) -> subprocess.CompletedProcess:
    """useradd/userdel, waiting out a lock on /etc/passwd held by a neighbour (under `pytest -n`,
    another test file adding or removing its own users at the same moment)."""
    for _ in range(60):
        done = subprocess.run(argv, capture_output=True, text=True)
        if "lock" not in done.stderr:  # "cannot lock /etc/passwd; try again later."
            return done
        time.sleep(1)
    return done


def _run_all(commands: dict[str, tuple[list[str], Path, dict]], what: str) -> dict[str, subprocess.CompletedProcess]:
    """Run the students' commands at once (the class does not queue); each must succeed."""
    started = {
        key: (subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), argv)
        for key, (argv, cwd, env) in commands.items()
    }
    done = {}
    for key, (process, argv) in started.items():
        out, err = process.communicate(timeout=COMMAND_TIMEOUT)
        done[key] = subprocess.CompletedProcess(argv, process.returncode, out, err)
    for key, result in done.items():
        assert result.returncode == 0, (
            f"{what} as {key} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return done


class Course:
    """The temporary class: the exchange, the site config, the instructor's course folder, the students."""

    def __init__(self, top: Path):
        self.top = top
        self.run_id = uuid.uuid4().hex[:6]
        self.course_id = f"decodelab-{self.run_id}"
        self.exchange = top / "exchange"
        self.site = top / "etc" / "jupyter"
        self.course = top / "course"
        self.homes = top / "home"
        self.students: dict[str, str] = {}  # role -> user name
        self.instructor_env = dict(
            os.environ,
            PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            JUPYTER_CONFIG_PATH=os.pathsep.join([str(ROOT), str(self.site)]),
        )
        self.instructor_env.pop("PYTHONPATH", None)

    # ---- set-up
    def build(self) -> None:
        os.chmod(self.top, 0o755)  # students traverse it to the exchange, the site config and their homes
        self.exchange.mkdir()
        os.chmod(self.exchange, 0o1777)
        self.site.mkdir(parents=True)
        (self.site / "nbgrader_config.py").write_text(
            "c = get_config()  # noqa: F821\n"
            f"c.Exchange.root = {str(self.exchange)!r}\n"
            f"c.CourseDirectory.course_id = {self.course_id!r}\n"
        )
        for folder in (self.top / "etc", self.site):
            os.chmod(folder, 0o755)
        self.homes.mkdir(mode=0o755)
        os.chmod(self.homes, 0o755)
        self.course.mkdir(mode=0o700)

    def add_student(self, role: str) -> str:
        name = f"dl{self.run_id}{role}"
        home = self.homes / name
        for uid in range(FIRST_UID, LAST_UID + 1):
            try:
                pwd.getpwuid(uid)
                continue
            except KeyError:
                pass
            made = _user_command(
                [
                    "useradd",
                    "--uid",
                    str(uid),
                    "--user-group",
                    "--no-create-home",
                    "--home-dir",
                    str(home),
                    "--shell",
                    "/usr/sbin/nologin",
                    name,
                ]
            )
            if made.returncode == 0:
                break
            if made.returncode != 4:  # 4: the uid was taken meanwhile (another run): try the next
                raise RuntimeError(f"useradd {name} failed: {made.stderr.strip()}")
        else:
            raise RuntimeError(f"no free uid in {FIRST_UID}..{LAST_UID} for {name}")
        self.students[role] = name
        user = pwd.getpwnam(name)
        home.mkdir(mode=0o700)
        os.chown(home, user.pw_uid, user.pw_gid)
        return name

    def remove_students(self) -> list[str]:
        problems = []
        for name in self.students.values():
            done = _user_command(["userdel", "--remove", name])
            if done.returncode not in (0, 12):  # 12: the home was not removed (it goes with the temp folder)
                problems.append(f"userdel {name}: {done.returncode} {done.stderr.strip()}")
        return problems

    # ---- who runs what
    def home(self, role: str) -> Path:
        return self.homes / self.students[role]

    def student_env(self, role: str) -> dict:
        return {
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": str(self.home(role)),
            "LANG": "C.UTF-8",
            "JUPYTER_CONFIG_PATH": str(self.site),
        }

    def as_student(self, role: str, *args: str) -> tuple[list[str], Path, dict]:
        argv = [
            sys.executable,
            str(ROOT / "tests" / "as_user.py"),
            self.students[role],
            "--",
            sys.executable,
            "-m",
            "nbgrader",
            *args,
        ]
        return argv, self.home(role), self.student_env(role)

    def students_run(self, roles, *args: str) -> dict[str, subprocess.CompletedProcess]:
        return _run_all({role: self.as_student(role, *args) for role in roles}, f"nbgrader {args[0]}")

    def instructor(self, *args: str) -> subprocess.CompletedProcess:
        return _run([sys.executable, "-m", "nbgrader", *args], self.course, self.instructor_env, f"nbgrader {args[0]}")

    # ---- what the students do in their folders
    def fetched(self, role: str) -> Path:
        return self.home(role) / NAME / f"{NAME}.ipynb"

    def answer(self, role: str) -> None:
        """The student answers every answer cell (the solution's code, without nbgrader's markers)."""
        path = self.fetched(role)
        nb = nbformat.read(str(path), as_version=4)
        solved = {
            grade_id(c): c.source
            for c in read(solution_path(NAME)).cells
            if c.get("metadata", {}).get("nbgrader", {}).get("solution")
        }
        for cell in nb.cells:
            if grade_id(cell) in solved:
                cell.source = "\n".join(
                    line
                    for line in solved[grade_id(cell)].splitlines()
                    if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line
                )
        nbformat.write(nb, str(path))

    def open_hints(self, role: str, counts: dict[str, int]) -> None:
        """What the hint buttons leave beside the notebook after these clicks."""
        from decodelab.course import hints

        folder = self.fetched(role).parent
        for exercise, shown in counts.items():
            assert hints.record(NAME, exercise, shown, folder=folder)
        user = pwd.getpwnam(self.students[role])
        os.chown(folder / hints.COUNTER_FILE, user.pw_uid, user.pw_gid)

    def submissions_in_cache(self, role: str) -> list[Path]:
        """The student's own record of each submission (nbgrader's cache), oldest first."""
        cache = self.home(role) / ".local" / "share" / "jupyter" / "nbgrader_cache" / self.course_id
        return sorted(cache.glob(f"{self.students[role]}+{NAME}+*"), key=lambda p: (p / "timestamp.txt").read_text())


def _next_whole_second(moment: datetime) -> datetime:
    return moment.replace(microsecond=0) + timedelta(seconds=1)


@pytest.fixture(scope="module")
def exchange_class():
    reason = _requirements()
    if reason:
        if in_ci() and os.geteuid() == 0:
            pytest.fail(reason + " and must run in CI")
        pytest.skip(reason)
    top = Path(tempfile.mkdtemp(prefix="decodelab-exchange-"))
    course = Course(top)
    try:
        course.build()
        for role in ROLES:
            course.add_student(role)
        yield course
    finally:
        problems = course.remove_students()
        shutil.rmtree(top, ignore_errors=True)
        assert not problems, problems


@pytest.fixture(scope="module")
def flow(exchange_class):
    """The whole term, once: every step's output for the tests below."""
    from autograder.release import generate

    c = exchange_class
    took = {}
    started = time.perf_counter()
    generate([NAME], out=c.course / "course")  # what `make release` writes, in this course's folder
    c.instructor("release_assignment", NAME)
    took["release"] = time.perf_counter() - started

    c.students_run(ROLES, "fetch_assignment", NAME)
    c.answer("solver")
    c.open_hints("solver", HINTS)
    c.students_run(ROLES, "submit", NAME)
    # The due date falls between the first submissions and the late student's second one.
    due = _next_whole_second(datetime.now(timezone.utc))
    time.sleep(max(0.0, (due - datetime.now(timezone.utc)).total_seconds()) + 0.05)
    c.answer("late")
    c.students_run(["late"], "submit", NAME)
    took["students"] = time.perf_counter() - started - took["release"]

    c.instructor("collect", NAME)
    mark = time.perf_counter()
    out = c.course / "grades.csv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "lib")]), OMP_WAIT_POLICY="PASSIVE")
    graded = _run(
        [
            sys.executable,
            "-m",
            "autograder",
            "grade",
            "--assignment",
            NAME,
            "--submissions",
            str(c.course / "submitted"),
            "--out",
            str(out),
            "--feedback",
            str(c.course / "feedback"),
            "--workers",
            "2",
            "--cell-timeout",
            "120",
            "--memory",
            "2",
            "--quiet",
            "--due",
            due.strftime("%Y-%m-%d %H:%M:%S UTC"),
            "--AssignLatePenalties.plugin_class=autograder.late.PointsPerDay",
            "--PointsPerDay.points=1",
        ],
        c.course,
        env,
        "python -m autograder grade",
    )
    took["grade"] = time.perf_counter() - mark
    mark = time.perf_counter()
    c.instructor("release_feedback", NAME)
    fetched = c.students_run(ROLES, "fetch_feedback", NAME)
    took["feedback"] = time.perf_counter() - mark
    with open(out, newline="") as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    print(f"exchange flow: {', '.join(f'{k} {v:.0f} s' for k, v in took.items())}")
    return dict(course=c, rows=rows, due=due, graded=graded, fetched=fetched)


def _row(flow, role: str) -> dict:
    return flow["rows"][flow["course"].students[role]]


# --------------------------------------------------------------------------- the tests


@pytest.mark.slow
def test_students_are_who_nbgrader_says(flow):
    """Each collected folder is named by the uid that submitted it, below the sandbox's uids."""
    c = flow["course"]
    submitted = c.course / "submitted"
    assert sorted(p.name for p in submitted.iterdir()) == sorted(c.students.values())
    inbound = c.exchange / c.course_id / "inbound"
    for entry in inbound.iterdir():
        owner = pwd.getpwuid(entry.stat().st_uid)
        assert entry.name.startswith(owner.pw_name + "+"), (entry.name, owner.pw_name)
        assert FIRST_UID <= owner.pw_uid < 61000
    assert stat.S_IMODE(c.exchange.stat().st_mode) == 0o1777  # world-writable, sticky


@pytest.mark.slow
def test_collect_keeps_the_exchange_files_and_the_hint_counter(flow):
    """What `nbgrader collect` leaves beside each notebook: the exchange's timestamp and secret,
    and the student's own dot-file (the hint counter) when there is one."""
    from decodelab.course import hints

    c = flow["course"]
    for role in ROLES:
        folder = c.course / "submitted" / c.students[role] / NAME
        assert {"timestamp.txt", "submission_secret.txt", f"{NAME}.ipynb"} <= {p.name for p in folder.iterdir()}
    solver = c.course / "submitted" / c.students["solver"] / NAME
    assert hints.read_counts(solver) == {NAME: HINTS}
    assert not (c.course / "submitted" / c.students["idle"] / NAME / hints.COUNTER_FILE).exists()


@pytest.mark.slow
def test_scores_in_the_csv(flow):
    solver, idle, late = (_row(flow, role) for role in ROLES)
    assert (solver["status"], solver["score"], solver["max_score"]) == ("ok", f"{AUTOGRADED:g}", f"{MAX:g}"), solver
    assert (idle["status"], idle["score"], idle["max_score"]) == ("ok", "0", f"{MAX:g}"), idle
    assert "test_count_parameters failed: NotImplementedError" in idle["notes"], idle
    assert "test_decode_tokens_per_second_bound failed: NotImplementedError" in idle["notes"], idle
    assert "hints: ex_count_parameters 2, ex_decode_tokens_per_second_bound 1" in solver["notes"], solver
    assert "hints:" not in idle["notes"] and "hints:" not in late["notes"]


@pytest.mark.slow
def test_the_late_student_is_graded_on_the_latest_submission(flow):
    """collect takes the newest submission; the grader reads its timestamp.txt: 1 point off."""
    c = flow["course"]
    first, second = c.submissions_in_cache("late")
    submitted = c.course / "submitted" / c.students["late"] / NAME
    assert (submitted / "timestamp.txt").read_text() == (second / "timestamp.txt").read_text()
    row = _row(flow, "late")
    assert (row["status"], row["score"], row["late_penalty"]) == ("ok", f"{AUTOGRADED - 1:g}", "1"), row
    on_time = _row(flow, "solver")
    assert on_time["late_penalty"] == "0" and on_time["submitted_at"] < flow["due"].isoformat() < row["submitted_at"]


@pytest.mark.slow
def test_feedback_in_nbgrader_layout(flow):
    """The grader's --feedback folder is what `nbgrader release_feedback` reads."""
    c = flow["course"]
    for role in ROLES:
        folder = c.course / "feedback" / c.students[role] / NAME
        submitted = c.course / "submitted" / c.students[role] / NAME
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [f"{NAME}.html", "submission_secret.txt", "timestamp.txt"]
        )
        for name in ("timestamp.txt", "submission_secret.txt"):
            assert (folder / name).read_bytes() == (submitted / name).read_bytes()
    released = list((c.exchange / c.course_id / "feedback").glob("*.html"))
    assert len(released) == len(ROLES)


@pytest.mark.slow
def test_each_student_fetches_their_own_feedback(flow):
    c = flow["course"]
    for role, score in (("solver", AUTOGRADED), ("idle", 0.0), ("late", AUTOGRADED - 1)):  # net of the late penalty
        feedback = c.home(role) / NAME / "feedback"
        stamps = [p.name for p in feedback.iterdir()]
        newest = c.submissions_in_cache(role)[-1]
        assert stamps == [newest.name.split("+")[2]], stamps  # the graded submission's, and only it
        page = feedback / stamps[0] / f"{NAME}.html"
        assert page.stat().st_uid == pwd.getpwnam(c.students[role]).pw_uid
        text = page.read_text()
        assert f"{NAME} (Score: {round(score, 2)} / {round(MAX, 2)})" in text, (role, text[:2000])
        assert "### BEGIN HIDDEN TESTS" not in text and "autograder.run" not in text
    late_page = next((c.home("late") / NAME / "feedback").rglob("*.html")).read_text()
    assert "Late submission penalty (Score: -1.0)" in late_page and "late: submitted" in late_page


def test_feedback_folder_gets_the_exchange_files(tmp_path):
    """Without nbgrader or root: the two files are copied, a link is not followed, and a copy a
    regrade no longer has a source for is removed."""
    from autograder.feedback import copy_exchange_files

    submitted, feedback, outside = tmp_path / "submitted", tmp_path / "feedback", tmp_path / "root-only.txt"
    for folder in (submitted, feedback):
        folder.mkdir()
    (submitted / "timestamp.txt").write_text("2026-03-01 16:59:00.123456 UTC")
    outside.write_text("not the student's")
    (submitted / "submission_secret.txt").symlink_to(outside)
    (feedback / "submission_secret.txt").write_text("an earlier submission's secret")
    assert copy_exchange_files(submitted, feedback) == ["timestamp.txt"]
    assert (feedback / "timestamp.txt").read_text() == "2026-03-01 16:59:00.123456 UTC"
    assert not (feedback / "submission_secret.txt").exists()
    assert copy_exchange_files(None, feedback) == [] and not any(feedback.iterdir())

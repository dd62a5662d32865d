"""`python -m decodelab progress`: how far the learner's engine has come, exercise by exercise.

    python -m decodelab progress --course ~/course [--json] [--notebooks 02_sampling,03] [--timeout 60]

It reads every notebook ``NN_topic/NN_topic.ipynb`` below the folder (a self-study learner's
``course/``, or a student's home after nbgrader's fetch) and, for every exercise cell in it
(nbgrader ``grade_id`` ``ex_<name>``), runs the *visible* part of its test cell ``test_<name>``
(everything before ``### BEGIN HIDDEN TESTS``). Each exercise gets one status:

* ``passing``: the visible tests ran to the end;
* ``failing: <first line of the message>`` (an AssertionError's message as is, any other
  exception as ``Type: message``; ``it uses X, which is not written yet`` when the
  NotImplementedError came from an earlier exercise's stub; ``timed out after 60 s``;
  ``the kernel died (...)``; ``the notebook cannot be read: ...``);
* ``not started``: the exercise cell is unchanged since the release (the checksum nbgrader
  wrote into its metadata still matches; nothing is run for it), or running it reached a
  ``raise NotImplementedError`` in the exercise's own cell. A cell edited since the release
  that still does (a class with one method left) reads ``failing: KVCache.truncate is not
  written yet`` instead.

What runs for exercise X, in a fresh module namespace (the cell-selection rule):

1. the notebook's set-up: its code cells that come before the first exercise cell *and* before
   the first markdown heading ``## N`` with N >= 1 (the imports and section 0, which loads the
   model the exercises may use). Cells with an nbgrader grade id never count as set-up, but for
   a prediction's answer cell (``q_<name>``, a number or None), which a set-up cell may show;
2. every exercise cell before X, in notebook order (what X may build on);
3. X's own cell;
4. the visible part of X's test cell.

Nothing else runs: not the explorers, plots and experiments between the exercises, and not
the hidden tests. The set-up runs again for every exercise, so one exercise's test cannot
change what the next one sees.

Each notebook runs in its own subprocess (`progress_worker`: ``DECODELAB_FAST=1``,
``NBGRADER_EXECUTION`` unset, stdout and stderr captured, in the notebook's folder), under one
time limit for the whole notebook: an endless loop or a crash of the learner's code costs that
notebook's rows, never the command. After a crash the remaining exercises run in a fresh
subprocess. What the learner's code starts dies with its subprocess (`run_until`): the subprocess
leads a process group of its own, killed at the end; on Linux, progress adopts the orphans of
that tree meanwhile (a child subreaper), so a grandchild that left the group with setsid is
killed too; and the subprocess dies if progress itself is killed.

It runs the learner's own code, as the notebook does: it is meant for the learner's own folder.
Run as root, it runs only code that root alone can change (`check_owner`): every folder on the
way to the course and its notebooks, and everything in each notebook's folder (the notebook, and
what its cells can import from there), must belong to root and be writable by no one else; else
it refuses, naming the file and its owner, and says how to run it as that user instead.

Each row also says how many rungs of the exercise's hint ladder the learner has seen
(``hints_used``: the counter file ``.decodelab_hints.json`` beside the notebook, written by the
hint buttons of course/hints.py; 0 when there is none). It is information, never a status.

`PARTS` (from the table of exercises, `course.exercises`) names the part of the engine each
exercise builds.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from decodelab.course import hints
from decodelab.course.exercises import PARTS

DEFAULT_TIMEOUT_S = 60.0
NOTEBOOK_DIR = re.compile(r"^\d\d_\w+$")
HIDDEN_BEGIN = "### BEGIN HIDDEN TESTS"
NUMBERED_SECTION = re.compile(r"^##\s+([0-9]+)\b", re.MULTILINE)  # "## 1. Temperature"
PASSING, NOT_STARTED = "passing", "not started"


class ProgressError(ValueError):
    """A bad command line: no such folder, no notebooks in it, not the caller's folder (exit 2)."""


@dataclass
class Row:
    notebook: str
    exercise: str
    part: str
    status: str
    hints_used: int = 0  # rungs of the exercise's hint ladder shown (course/hints.py's counter file)


@dataclass
class Plan:
    """What one notebook's check needs: its set-up, its exercise cells, their visible tests."""
    notebook: str
    path: Path
    setup: list[tuple[int, str]] = field(default_factory=list)  # (cell index, source)
    cells: list[tuple[str, int, str]] = field(default_factory=list)  # (exercise, cell index, source), in order
    tests: dict[str, str] = field(default_factory=dict)  # exercise -> visible part of its test cell
    unchanged: set[str] = field(default_factory=set)  # exercise cells still as released
    changed: set[str] = field(default_factory=set)  # exercise cells edited since the release
    problems: dict[str, str] = field(default_factory=dict)  # exercise -> why it cannot run
    error: str | None = None  # the notebook cannot be read at all


# --------------------------------------------------------------------------- finding and reading


def find_notebooks(course_dir, names=None) -> list[Path]:
    """NN_topic/NN_topic.ipynb below course_dir, by name; `names` keeps those whose folder is
    named, or whose NN is given ("02_sampling" or "02")."""
    folder = _folder(course_dir)
    found = sorted(p / f"{p.name}.ipynb" for p in folder.iterdir()
                   if p.is_dir() and NOTEBOOK_DIR.match(p.name) and (p / f"{p.name}.ipynb").is_file())
    if not found:
        raise ProgressError(f"no course notebooks in {folder}: expected folders like 02_sampling/02_sampling.ipynb")
    if names:
        wanted = {n.strip().rstrip("/") for n in names if n.strip()}
        kept = [p for p in found if p.parent.name in wanted or p.parent.name[:2] in wanted]
        unknown = sorted(n for n in wanted if not any(p.parent.name == n or p.parent.name[:2] == n for p in found))
        if unknown:
            raise ProgressError(f"no notebook {', '.join(unknown)} in {folder}; it has "
                                f"{', '.join(p.parent.name for p in found)}")
        found = kept
    return found


def _folder(course_dir) -> Path:
    folder = Path(course_dir).expanduser()
    if not folder.is_dir():
        raise ProgressError(f"{folder} is not a folder: give the folder that holds your notebooks "
                            f"(NN_topic/NN_topic.ipynb), e.g. --course ~/course")
    return folder


def _nbgrader(cell) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def release_checksum(cell) -> str:
    """nbgrader's checksum of a solution cell (nbgrader.utils.compute_checksum for a cell that is
    a solution and not graded): generate_assignment stores it in the released cell's metadata."""
    meta = _nbgrader(cell)
    grade, solution = bool(meta.get("grade")), bool(meta.get("solution"))
    locked = False if solution else (True if grade else bool(meta.get("locked")))
    m = hashlib.md5()
    for piece in (cell.get("source", ""), cell.get("cell_type", ""), str(grade), str(solution), str(locked),
                  meta.get("grade_id", "")):
        m.update(str(piece).encode("utf-8"))
    if grade:
        m.update(str(float(meta.get("points", 0))).encode("utf-8"))
    return m.hexdigest()


def _source(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def plan_notebook(path: Path) -> Plan:
    """Read one notebook and pick its cells (the rule in the module's docstring)."""
    import nbformat

    plan = Plan(notebook=path.parent.name, path=path)
    try:
        _pick_cells(plan, list(nbformat.read(str(path), as_version=4).cells))
    except Exception as exc:  # noqa: BLE001 - any unreadable notebook becomes its rows' status
        plan.error = f"the notebook cannot be read: {first_line(f'{type(exc).__name__}: {exc}')}"
    return plan


def _pick_cells(plan: Plan, cells: list) -> None:
    setup_open = True  # until the first exercise cell or the first "## N" heading with N >= 1
    test_cells = {}
    for index, cell in enumerate(cells):
        grade_id = str(_nbgrader(cell).get("grade_id") or "")
        kind = cell.get("cell_type")
        if kind == "markdown" and any(int(n) >= 1 for n in NUMBERED_SECTION.findall(_source(cell))):
            setup_open = False
        if kind != "code":
            continue
        if grade_id.startswith("ex_"):
            setup_open = False
            name = grade_id[3:]
            plan.cells.append((name, index, _source(cell)))
            checksum = _nbgrader(cell).get("checksum")
            if checksum:
                (plan.unchanged if checksum == release_checksum(cell) else plan.changed).add(name)
        elif grade_id.startswith("test_"):
            test_cells.setdefault(grade_id[5:], []).append(_source(cell))
        elif setup_open and (not grade_id or grade_id.startswith("q_")):  # a prediction: the set-up may show it
            plan.setup.append((index, _source(cell)))
    seen = [name for name, _, _ in plan.cells]
    for name in seen:
        if seen.count(name) > 1:
            plan.problems[name] = f"its exercise cell ex_{name} is in the notebook twice: delete one copy"
        elif len(test_cells.get(name, [])) > 1:
            plan.problems[name] = f"its test cell test_{name} is in the notebook twice: delete one copy"
        elif name in test_cells:
            plan.tests[name] = test_cells[name][0].split(HIDDEN_BEGIN, 1)[0]
        else:
            plan.problems[name] = f"its test cell test_{name} is missing from the notebook"
    exercises = {name for name, _, _ in plan.cells}
    for (notebook, name) in PARTS:
        if notebook == plan.notebook and name not in exercises:
            plan.problems[name] = f"its exercise cell ex_{name} is missing from the notebook"


def _exercise_names(plan: Plan) -> list[str]:
    names = list(dict.fromkeys(name for name, _, _ in plan.cells))
    return names + [name for name in plan.problems if name not in names]


def first_line(text: str, limit: int = 240) -> str:
    line = next((l.strip() for l in str(text).splitlines() if l.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


# --------------------------------------------------------------------------- running as root


def check_owner(course_dir, notebooks=None) -> None:
    """As root, refuse (ProgressError) to run code that anyone but root can change: a folder on
    the way to the course or to one of `notebooks` (default: all of the course's), or anything in a
    notebook's folder, that is not root's or that another user may write. Anyone else runs their
    own code: nothing to check."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return
    notebooks = find_notebooks(course_dir) if notebooks is None else notebooks
    code = set().union(*(_everything_in(Path(nb).parent.resolve()) for nb in notebooks))
    course = _folder(course_dir).resolve()
    on_the_way = {course, *course.parents, *(folder for path in code for folder in path.parents)} - code
    for path in sorted(on_the_way | code, key=lambda p: (len(p.parts), str(p))):  # the outermost first
        problem = _why_root_must_not_run(path, shared_ok=path in on_the_way, course_dir=course_dir)
        if problem:
            raise ProgressError(problem)


def _everything_in(folder: Path) -> set[Path]:
    """folder and every file and folder below it, as real paths (a symlinked folder is followed)."""
    found, todo = set(), [folder]
    while todo:
        path = todo.pop()
        if path not in found:
            found.add(path)
            if path.is_dir():
                todo.extend(child.resolve() for child in path.iterdir())
    return found


def _why_root_must_not_run(path: Path, shared_ok: bool, course_dir) -> str | None:
    """Why someone other than root could change the code root would run from path, and what to do
    instead; None when only root can. shared_ok: a sticky folder that everyone may write (like
    /tmp) is fine on the way, where nobody can rename what root put there."""
    try:
        info = os.stat(path)
    except FileNotFoundError:  # a dangling link: nothing to run
        return None
    if info.st_uid != 0:
        user = _user_name(info.st_uid)
        return (f"{path} belongs to {user} (uid {info.st_uid}), and progress would run the code in it as root. "
                f"Run it as that user instead: sudo -u {user} python -m decodelab progress --course {course_dir}")
    if shared_ok and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return None
    if info.st_mode & stat.S_IWOTH:
        who = "every user"
    elif info.st_mode & stat.S_IWGRP and info.st_gid != 0:
        who = f"the group {_group_name(info.st_gid)} (gid {info.st_gid})"
    else:
        return None
    return (f"{path} can be written by {who} (mode {stat.S_IMODE(info.st_mode):o}), and progress would run the "
            f"code in it as root: make it root's alone (chmod go-w), or run progress as the learner whose "
            f"notebooks these are")


def _user_name(uid: int) -> str:
    """The user's name, or sudo's '#uid' for a uid without one."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"'#{uid}'"


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"#{gid}"


# --------------------------------------------------------------------------- running one notebook


def worker_env() -> dict[str, str]:
    """The notebook subprocess's environment: fast mode, not under nbgrader, this decodelab."""
    env = dict(os.environ)
    env.pop("NBGRADER_EXECUTION", None)
    env["DECODELAB_FAST"] = "1"
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("MPLBACKEND", "Agg")
    here = str(Path(__file__).resolve().parents[2])  # the folder that holds decodelab/
    paths = [here, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class _Tail:
    """Drains a pipe on a thread and keeps only its last bytes (the learner may print forever)."""

    def __init__(self, pipe, keep: int = 4096):
        self.data, self.keep = b"", keep
        self.thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self.thread.start()

    def _drain(self, pipe):
        for chunk in iter(lambda: pipe.read(65536), b""):
            self.data = (self.data + chunk)[-self.keep:]

    def text(self) -> str:
        self.thread.join(timeout=1)
        return self.data.decode("utf-8", "replace")


# --------------------------------------------------------------------------- a subprocess that dies with progress

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 1, 36, 37  # linux/prctl.h


def linux_prctl(option: int, *args) -> bool:
    """Linux's prctl(option, *args) (ints, or ctypes pointers); False where there is none (macOS,
    Windows) or it fails."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError, TypeError):
        return False
    args = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
    return prctl(ctypes.c_int(option), *args, *[ctypes.c_ulong(0)] * (4 - len(args))) == 0


@contextlib.contextmanager
def _adopting_orphans():
    """Within: this process adopts the orphans of its descendants (Linux's child subreaper), so a
    grandchild that left our child's process group with setsid is still ours to kill."""
    was = ctypes.c_int(0)
    known = linux_prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was))
    linux_prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        yield
    finally:
        if known:
            linux_prctl(PR_SET_CHILD_SUBREAPER, was.value)


def _children() -> set[int]:
    """The pids whose parent is this process (read from Linux's /proc; empty elsewhere)."""
    me, found = os.getpid(), set()
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                after_name = Path(entry.path, "stat").read_text().rpartition(")")[2]  # " S PPID ..."
            except OSError:
                continue
            if int(after_name.split()[1]) == me:
                found.add(int(entry.name))
    return found


def _kill_strays(known: set[int]) -> None:
    """SIGKILL and reap every child of ours not in `known`, until none is left: the orphans of a
    killed tree come to a subreaper one generation at a time. Race-free: a child's pid cannot be
    reused before we reap it."""
    while strays := _children() - known:
        for pid in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in strays:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def run_until(command: list[str], cwd: Path, deadline: float) -> tuple[int, bool, str]:
    """Run command in the notebook's environment (worker_env) until it ends or time.monotonic()
    passes deadline, then kill everything it started: its process group and, on Linux, the
    processes that left the group (adopted meanwhile). (return code, timed out, the end of its
    output). A child that this process starts meanwhile from another thread would be killed too."""
    with _adopting_orphans():
        known = _children()
        proc = subprocess.Popen(command, cwd=str(cwd), env=worker_env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        tail = _Tail(proc.stdout)
        timed_out = False
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            _kill_strays(known)
    output = tail.text()
    if not tail.thread.is_alive():  # else a ResourceWarning in the caller (the capstone's kernel shows it)
        proc.stdout.close()
    return proc.returncode, timed_out, output


def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = ": out of memory?" if -returncode == signal.SIGKILL else ""
        return f"the kernel died (killed by {name}{hint})"
    return f"the kernel died (exit code {returncode})"


def run_notebook(plan: Plan, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, str]:
    """exercise -> status for the exercises of `plan` that must run; subprocesses under one
    deadline; a crash marks the exercise it was running and the rest run in a fresh one."""
    statuses: dict[str, str] = {}
    pending = [name for name, _, _ in plan.cells if name not in plan.unchanged and name not in plan.problems]
    if not pending:
        return statuses
    deadline = time.monotonic() + timeout
    shown = f"{timeout:g} s"
    with tempfile.TemporaryDirectory(prefix="decodelab-progress-") as tmp:
        attempt = 0
        while pending:
            attempt += 1
            spec_path, results_path = Path(tmp) / f"spec{attempt}.json", Path(tmp) / f"results{attempt}.jsonl"
            spec = {"parent": os.getpid(), "notebook": plan.notebook, "setup": plan.setup, "cells": plan.cells, "tests": plan.tests,
                    "changed": sorted(plan.changed), "run": pending}
            spec_path.write_text(json.dumps(spec))
            results_path.write_text("")
            returncode, timed_out, output = run_until(
                [sys.executable, "-m", "decodelab.course.progress_worker", str(spec_path), str(results_path)],
                plan.path.parent, deadline)
            running, phase = None, None
            for line in results_path.read_text().splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "start":
                    running, phase = event.get("exercise"), "set-up"
                elif event.get("event") == "phase":
                    phase = event.get("phase")
                elif event.get("event") == "done" and event.get("exercise") in pending:
                    statuses[event["exercise"]] = str(event.get("status"))
                    running = phase = None
                elif event.get("event") == "setup_failed":
                    for name in pending:
                        statuses.setdefault(name, f"failing: {event.get('status')}")
            pending = [name for name in pending if name not in statuses]
            if not pending:
                break
            in_setup = " in the set-up cells" if phase == "set-up" else ""
            if timed_out:
                for name in pending:
                    if name == running:
                        statuses[name] = f"failing: timed out after {shown}{in_setup}"
                    else:
                        where = f" in {running}" if running else ""
                        statuses[name] = f"failing: not checked: the notebook timed out after {shown}{where}"
                break
            death = _death(returncode)
            if running is None or phase == "set-up":
                # the set-up itself kills the kernel: every later attempt would die the same way
                last = first_line(output.strip().splitlines()[-1]) if output.strip() else ""
                why = f" ({last})" if running is None and last else ""
                for name in pending:
                    statuses[name] = f"failing: {death}{in_setup or ' before the first exercise'}{why}"
                break
            statuses[running] = f"failing: {death}"
            pending = [name for name in pending if name not in statuses]
            if pending and time.monotonic() >= deadline:
                for name in pending:
                    statuses[name] = f"failing: not checked: the notebook timed out after {shown}"
                break
    return statuses


def check_notebook(path: Path, timeout: float = DEFAULT_TIMEOUT_S) -> list[Row]:
    plan = plan_notebook(path)
    used = hints.read_counts(path.parent).get(plan.notebook, {})
    if plan.error:
        names = [name for (notebook, name) in PARTS if notebook == plan.notebook] or ["-"]
        return [Row(plan.notebook, name, PARTS.get((plan.notebook, name), ""), f"failing: {plan.error}",
                    used.get(f"ex_{name}", 0)) for name in names]
    statuses = run_notebook(plan, timeout)
    rows = []
    for name in _exercise_names(plan):
        if name in plan.problems:
            status = f"failing: {plan.problems[name]}"
        elif name in plan.unchanged:
            status = NOT_STARTED
        else:
            status = statuses.get(name, "failing: not checked")
        rows.append(Row(plan.notebook, name, PARTS.get((plan.notebook, name), ""), status, used.get(f"ex_{name}", 0)))
    return rows


def check_course(course_dir, names=None, timeout: float = DEFAULT_TIMEOUT_S, progress=None) -> list[Row]:
    """Every exercise's row, notebook by notebook. `progress(notebook)` is told before each one."""
    notebooks = find_notebooks(course_dir, names)
    check_owner(course_dir, notebooks)
    rows = []
    for path in notebooks:
        if progress:
            progress(path.parent.name)
        rows.extend(check_notebook(path, timeout))
    return rows


# --------------------------------------------------------------------------- output


def format_table(rows: list[Row]) -> str:
    header = ("notebook", "exercise", "engine part", "hints", "status")
    table = [header, *[(r.notebook, r.exercise, r.part or "-", str(r.hints_used), r.status) for r in rows]]
    widths = [max(len(line[i]) for line in table) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line[:4], widths)) + "  " + line[4] for line in table]
    passing = sum(r.status == PASSING for r in rows)
    not_started = sum(r.status == NOT_STARTED for r in rows)
    lines.append(f"\n{passing} of {len(rows)} exercises passing their visible tests, "
                 f"{len(rows) - passing - not_started} failing, {not_started} not started.")
    return "\n".join(lines)


def to_json(rows: list[Row]) -> str:
    return json.dumps({"exercises": [asdict(r) for r in rows]})

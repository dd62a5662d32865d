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

What runs for each exercise (the cell-selection rule) is `progress_plan`'s: the notebook's set-up,
the exercise cells before it, its own cell and the visible part of its test cell, nothing else.

The modules: `progress_plan` (reading the notebooks), `progress_owner` (as root),
`progress_process` (the subprocess's lifetime) and `progress_worker` (the subprocess itself).

Each notebook runs in its own subprocess (`progress_worker`: ``DECODELAB_FAST=1``,
``NBGRADER_EXECUTION`` unset, stdout and stderr captured, in the notebook's folder), under one
time limit for the whole notebook: an endless loop or a crash of the learner's code costs that
notebook's rows, never the command. After a crash the remaining exercises run in a fresh
subprocess. What the learner's code starts dies with its subprocess (`progress_process`): the
subprocess leads a process group of its own, killed at the end; on Linux, progress adopts the
orphans of that tree meanwhile (a child subreaper), so a grandchild that left the group with
setsid is killed too; and the subprocess dies if progress itself is killed.

It runs the learner's own code, as the notebook does: it is meant for the learner's own folder.
Run as root, it runs only code that root alone can change (`progress_owner.check_owner`): every
folder on the way to the course and its notebooks, and everything in each notebook's folder (the
notebook, and what its cells can import from there), must belong to root and be writable by no
one else; else it refuses, naming the file and its owner, and says how to run it as that user
instead.

Each row also says how many rungs of the exercise's hint ladder the learner has seen
(``hints_used``: the counter file ``.decodelab_hints.json`` beside the notebook, written by the
hint buttons of course/hints.py; 0 when there is none). It is information, never a status.

`PARTS` (from the table of exercises, `course.exercises`) names the part of the engine each
exercise builds.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from decodelab.course import hints
from decodelab.course.exercises import PARTS
from decodelab.course.progress_owner import check_owner
from decodelab.course.progress_plan import (
    HIDDEN_BEGIN,
    NOT_STARTED,
    PASSING,
    Plan,
    ProgressError,
    exercise_names,
    find_notebooks,
    first_line,
    plan_notebook,
    release_checksum,
)
from decodelab.course.progress_process import describe_death, run_until, worker_env

DEFAULT_TIMEOUT_S = 60.0


@dataclass
class Row:
    notebook: str
    exercise: str
    part: str
    status: str
    hints_used: int = 0  # rungs of the exercise's hint ladder shown (course/hints.py's counter file)


# --------------------------------------------------------------------------- running one notebook


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
            spec = {
                "parent": os.getpid(),
                "notebook": plan.notebook,
                "setup": plan.setup,
                "cells": plan.cells,
                "tests": plan.tests,
                "changed": sorted(plan.changed),
                "run": pending,
            }
            spec_path.write_text(json.dumps(spec))
            results_path.write_text("")
            returncode, timed_out, output = run_until(
                [sys.executable, "-m", "decodelab.course.progress_worker", str(spec_path), str(results_path)],
                plan.path.parent,
                deadline,
            )
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
            death = describe_death(returncode)
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
        return [
            Row(
                plan.notebook,
                name,
                PARTS.get((plan.notebook, name), ""),
                f"failing: {plan.error}",
                used.get(f"ex_{name}", 0),
            )
            for name in names
        ]
    statuses = run_notebook(plan, timeout)
    rows = []
    for name in exercise_names(plan):
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
    lines.append(
        f"\n{passing} of {len(rows)} exercises passing their visible tests, "
        f"{len(rows) - passing - not_started} failing, {not_started} not started."
    )
    return "\n".join(lines)


def to_json(rows: list[Row]) -> str:
    return json.dumps({"exercises": [asdict(r) for r in rows]})


# The names progress has always offered its callers, from the modules that now hold them.
__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HIDDEN_BEGIN",
    "NOT_STARTED",
    "PARTS",
    "PASSING",
    "Plan",
    "ProgressError",
    "Row",
    "check_course",
    "check_notebook",
    "check_owner",
    "find_notebooks",
    "first_line",
    "format_table",
    "plan_notebook",
    "release_checksum",
    "run_notebook",
    "run_until",
    "to_json",
    "worker_env",
]

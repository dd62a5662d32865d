"""One submission, graded in a worker: read, check for tampering, sanitize (nbgrader), execute in
the sandbox, settle the test cells. `grade_one` never raises: what went wrong is the Result's
status and notes.

status (the first that applies wins; autograder/grade.py explains each to the instructor):
grader_error, unreadable, missing, crashed, timeout, tampered, ok.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from autograder import student_files
from autograder.cells import is_test_cell, meta, without_hidden_tests
from autograder.notes import hints_note, one_note, short, version_note

STATUSES = ("grader_error", "unreadable", "missing", "crashed", "timeout", "tampered", "ok")


@dataclass
class Settings:
    assignment: str
    notebook: str  # file name, <assignment>.ipynb
    db_url: str
    release: str  # the released notebook nbgrader generated (trusted)
    work: str  # the grader's private work folder
    cell_timeout: float = 300.0
    notebook_timeout: float = 1800.0
    output_limit: int = 1_000_000  # bytes kept per cell; the rest is cut (and never costs marks)
    sandbox: bool = True
    limits: dict = field(default_factory=dict)
    hide: list = field(default_factory=list)
    version: str = ""  # the decodelab grading (decodelab.__version__); "" = not checked


@dataclass
class Result:
    student: str
    status: str = "ok"
    notes: list = field(default_factory=list)
    notebook: str | None = None  # the graded notebook (nbformat JSON text), None if it never ran
    tries: int = 1  # on a Dask cluster: the try that graded it (a lost worker: > 1)


def worst(statuses) -> str:
    return min(statuses, key=STATUSES.index, default="ok")


# --------------------------------------------------------------------------- tampering


def check_tampering(nb, release) -> tuple[list[str], bool]:
    """Repair what can be repaired before nbgrader restores the test cells; returns (notes,
    tampered). Trust comes from the release nbgrader generated here, never from the checksums a
    submission carries."""
    from nbgrader.utils import compute_checksum

    notes, tampered = [], False
    released = {meta(c)["grade_id"]: c for c in release.cells if meta(c).get("grade_id")}
    released_tests = {gid: c for gid, c in released.items() if is_test_cell(c)}
    seen: set[str] = set()
    for cell in nb.cells:
        role = meta(cell)
        gid = role.get("grade_id")
        if not gid:
            continue
        if gid not in released:  # a graded cell the release never had: it earns nothing
            if role.get("grade") or role.get("solution"):
                notes.append(f"{gid}: a graded cell not in the release, ignored")
                tampered = True
            cell.metadata.pop("nbgrader", None)
            continue
        if gid in released_tests and gid not in seen:
            want = released_tests[gid]
            # A solution notebook's test cell still holds its hidden tests: compare without them.
            visible = copy.deepcopy(cell)
            visible.source = without_hidden_tests(cell.source)
            if compute_checksum(visible) != want.metadata.nbgrader.checksum:
                notes.append(f"{gid} edited: restored from the release")
                tampered = True
        seen.add(gid)
    for gid, want in released_tests.items():
        if gid in seen:
            continue
        stripped = [
            c
            for c in nb.cells
            if c.cell_type == "code" and not meta(c).get("grade_id") and c.source.strip() == want.source.strip()
        ]
        tampered = True
        if stripped:
            stripped[0].metadata["nbgrader"] = copy.deepcopy(want.metadata.nbgrader)
            notes.append(f"{gid} lost its nbgrader metadata: restored from the release")
        else:
            notes.append(f"{gid} deleted: scored 0")
    return notes, tampered


# --------------------------------------------------------------------------- execution


def settle_test_cells(nb, ex) -> list[str]:
    """Make each test cell's outputs say what its execute reply said (nbgrader scores outputs):
    ok -> no error, no stderr; error, timeout or never run -> an error output. Returns notes."""
    from nbformat import NotebookNode

    failures = []
    for index, cell in enumerate(nb.cells):
        if not is_test_cell(cell):
            continue
        gid = meta(cell).get("grade_id")
        status = ex.replies.get(index) if ex is not None else None
        if status == "ok" and index not in ex.timed_out:
            cell.outputs = [
                o
                for o in cell.outputs
                if o.output_type != "error" and not (o.output_type == "stream" and o.name == "stderr")
            ]
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if index in getattr(ex, "timed_out", ()):
            why = "timed out"
        elif status is None:
            why = (
                "not run (the kernel had " + ("died" if ex is not None and ex.stopped == "crashed" else "stopped") + ")"
            )
        elif errors:
            why = f"{errors[0].get('ename', 'error')}: {one_note(errors[0].get('evalue', ''), 100)}"
        else:
            why = "error"
        if not errors:
            cell.outputs.append(NotebookNode(output_type="error", ename="NotScored", evalue=why, traceback=[]))
        failures.append(f"{gid} failed: {why}")
    return failures


# --------------------------------------------------------------------------- one submission (a worker)

_SLOT = 0  # the host-wide sandbox slot this pool process holds (autograder/slots.py)
_SLOT_HELD = None


def quiet() -> None:
    # nbgrader's own gradebook code warns about its SQLAlchemy sessions on every submission.
    warnings.filterwarnings("ignore", message=".*not in session.*")
    warnings.filterwarnings("ignore", module="sqlalchemy")


def init_worker() -> None:
    global _SLOT, _SLOT_HELD
    from autograder import slots

    quiet()
    if sys.platform.startswith("linux"):  # the grader killed: its workers (and so their kernels) go too
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    _SLOT_HELD = slots.acquire()  # held until this process exits (the kernel frees the lock then)
    _SLOT = _SLOT_HELD.number
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def grade_one(
    student: str, path: str, settings: Settings, slot: int | None = None, within: str | None = None
) -> Result:
    """Read, check, sanitize (nbgrader), execute (sandboxed in `slot`, default this pool process's):
    never raises. `within`: the submissions folder the path is read from without following a
    link on the way (default: the notebook's own folder)."""
    result = Result(student)
    try:
        _grade_one(result, Path(path), settings, _SLOT if slot is None else slot, Path(within or Path(path).parent))
    except Exception as exc:  # noqa: BLE001 - one submission never stops the class
        result.status = worst([result.status, "crashed"])
        result.notes.append(f"grader error: {type(exc).__name__}: {short(exc, 200)}")
        result.notes.append(short(traceback.format_exc(limit=3), 300))
    return result


def _read(path: Path, within: Path):
    import nbformat

    raw = student_files.read_bytes(path, student_files.NOTEBOOK_MAX_BYTES, within)
    if not raw.strip():
        raise ValueError("the file is empty")
    nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
    if not isinstance(nb.get("cells"), list):
        raise ValueError("no cells")
    for cell in nb.cells:
        if cell.get("cell_type") not in ("code", "markdown", "raw") or not isinstance(cell.get("source"), str):
            raise ValueError("a cell is not a notebook cell")
        cell.setdefault("metadata", nbformat.NotebookNode())
        if cell.cell_type == "code":
            cell.setdefault("outputs", [])
            cell.setdefault("execution_count", None)
    return nb, raw


def _grade_one(result: Result, path: Path, settings: Settings, slot: int = 0, within: Path | None = None) -> None:
    import nbformat
    from nbgrader.preprocessors import (
        CheckCellMetadata,
        ClearOutput,
        DeduplicateIds,
        LimitOutput,
        OverwriteCells,
        OverwriteKernelspec,
    )

    from autograder import integrity, sandbox
    from autograder.executor import SandboxedExecute

    try:
        nb, raw = _read(path, within or path.parent)
    except student_files.NotAStudentFile as exc:  # a link, a device, too large: never read
        result.status = "unreadable"
        result.notes.append(f"not read: {short(exc, 150)}")
        return
    except Exception as exc:  # noqa: BLE001 - anything that is not a notebook
        result.status = "unreadable"
        result.notes.append(f"{path.name} is not a valid notebook: {short(exc, 150)}")
        return
    note = version_note(nb, settings.version) if settings.version else None
    if note:
        result.notes.append(note)
    note = hints_note(path.parent, settings.assignment)
    if note:
        result.notes.append(note)
    release = nbformat.read(settings.release, as_version=4)
    notes, tampered = check_tampering(nb, release)
    result.notes.extend(notes)
    statuses = ["tampered"] if tampered else []
    result.notes.extend(f"integrity: {flag}" for flag in integrity.scan(nb, release))

    resources = {
        "nbgrader": {
            "notebook": Path(settings.notebook).stem,
            "assignment": settings.assignment,
            "student": result.student,
            "db_url": settings.db_url,
        }
    }
    for pp in (ClearOutput(), DeduplicateIds(), OverwriteKernelspec(), OverwriteCells(), CheckCellMetadata()):
        nb, resources = pp.preprocess(nb, resources)

    limits = sandbox.Limits(**settings.limits)
    box = sandbox.Sandbox(
        Path(settings.work),
        result.student.replace(os.sep, "_"),
        slot,
        limits,
        [Path(p) for p in settings.hide],
        enabled=settings.sandbox,
    )
    box.prepare(settings.notebook, raw)
    ex = SandboxedExecute(
        extra_arguments=["--HistoryManager.hist_file=:memory:"],
        allow_errors=True,
        interrupt_on_timeout=True,
        raise_on_iopub_timeout=True,
    )
    ex.setup(box, settings)
    resources["metadata"] = {"path": str(box.scratch)}
    try:
        nb, resources = ex.preprocess(nb, resources)
    except Exception as exc:  # noqa: BLE001 - e.g. the kernel never started
        if not ex.stopped:
            ex.stopped = "crashed"
            ex.events.append(f"the kernel failed: {type(exc).__name__}: {short(exc, 200)}")
    finally:
        box.cleanup()
    if ex.stopped:
        statuses.append(ex.stopped)
    elif ex.timed_out:
        statuses.append("timeout")
    result.notes[:0] = ex.events
    result.notes.extend(settle_test_cells(nb, ex))
    if ex.truncated:
        result.notes.append(f"output cut in {len(ex.truncated)} cell(s) (not scored)")
    nb, resources = LimitOutput().preprocess(nb, resources)
    result.status = worst(statuses)
    result.notebook = nbformat.writes(nb)

"""Grade a whole class: one command, parallel, sandboxed, one CSV row per student.

    python -m autograder grade --assignment 02_sampling --submissions DIR --out grades.csv \\
        [--feedback FEEDBACK_DIR] [--workers N] [--no-sandbox] [--due "2026-03-01 17:00 Europe/Berlin"] \\
        [--scheduler ADDRESS | --scheduler-file FILE | --scheduler local] [--tls-ca-file F --tls-cert F --tls-key F] \\
        [--AssignLatePenalties.plugin_class=autograder.late.PointsPerDay --PointsPerDay.points=1 ...]

DIR is in nbgrader's layout, DIR/<student>/<assignment>/<assignment>.ipynb; the roster is the
student folders in DIR. Built on nbgrader: `generate_assignment` of the source notebook makes
the gradebook (checksums, locked test cells with their hidden tests); each submission then goes
through nbgrader's sanitizing preprocessors (ClearOutput, DeduplicateIds, OverwriteKernelspec,
OverwriteCells, CheckCellMetadata), nbgrader's Execute (here `SandboxedExecute` of
autograder/executor.py, with a kernel sandboxed by autograder/sandbox.py), LimitOutput, and SaveAutoGrades into the gradebook.

Scoring trusts the kernel's execute replies, not what it displayed: a test cell whose reply says
error (or that timed out, or never ran) earns 0 whatever its outputs show, and a test cell whose
reply says ok is not zeroed by stray stderr. Before each test cell the grader drops the kernel's
imported test helpers (autograder.*, decodelab.course.checking) so that an answer cell cannot patch them.

status (the first that applies wins) | score
  grader_error  the grader, not the student: a Dask worker refused the   0 (nothing graded)
              task (another version, no model cache, no sandbox) or was
              lost on every try
  unreadable  not a valid notebook (bad JSON, empty file)             0
  missing     no <assignment>.ipynb in the student's folder            0
  crashed     the kernel died (os._exit, killed for memory/processes)  marks earned before the crash
  timeout     a cell or the notebook ran past its limit               marks earned; timed-out tests 0
  tampered    a test cell edited, deleted or stripped of metadata      restored cells graded; deleted 0
  ok          none of the above                                        as graded

The notes column says what happened, and flags what never changes a score: "integrity:" (an
answer that calls the library's reference or touches autograder/), "similarity:" (an answer
cell that is the same code as another submission's or the library's reference once names,
literals and formatting are set aside: autograder/similarity.py, run in this process once
every row is graded) and "version:" (a notebook released for another decodelab version than
the one grading it, or recording none: the release writes `decodelab.__version__` into its
metadata). The summary printed at the end lists them. "hints:" says how many rungs of each
exercise's hint ladder the student saw ("hints: ex_top_k_filter 2, ex_top_p_filter 1"), from the
`.decodelab_hints.json` the hint buttons write beside the notebook, when it was submitted; it
never changes a score. "grader:" notes are about the grading itself (a Dask worker lost and
the submission graded again, or why a worker refused it).

Feedback (--feedback DIR) is nbgrader's layout, DIR/<student>/<assignment>/<notebook>.html with the
submission's timestamp.txt and submission_secret.txt beside it: `nbgrader release_feedback` releases it
as it is (README, "Through nbgrader's exchange").

Where kernels run: a local process pool of --workers processes, each holding one host-wide
sandbox slot (autograder/slots.py: a kernel uid no other grader on the host uses), or, with
--scheduler/--scheduler-file, one Dask task per submission on the cluster's workers
(autograder/cluster.py: same grading, same rows; the parent alone writes the gradebook, the CSV
and the feedback).

Late submissions (autograder/late.py): when the assignment has a due date in the gradebook
(nbgrader's `duedate`, from `nbgrader db assignment add` or `--due`), each submission's
nbgrader `timestamp.txt` is read, the penalty plugin nbgrader's `AssignLatePenalties.plugin_class`
names (nbgrader_config.py, or `--Class.trait=value` here) gives the points off, and the row
gets `submitted_at` (UTC, ISO 8601) and `late_penalty`; `score` is net of it, never below 0. A
missing or malformed timestamp is a "late:" note and costs nothing. No due date: the two
columns stay empty.
"""
from __future__ import annotations

import copy
import csv
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATUSES = ("grader_error", "unreadable", "missing", "crashed", "timeout", "tampered", "ok")
COLUMNS = ("student", "assignment", "score", "max_score", "status", "notes", "submitted_at", "late_penalty")
HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
NO_SANDBOX_NOTE = "graded WITHOUT the sandbox (--no-sandbox): the kernel ran as the grader"
# What nbgrader's exchange writes into each submission (submit) and `release_feedback` reads beside
# each feedback HTML: the submission time and the secret that names the released file.
EXCHANGE_FILES = ("timestamp.txt", "submission_secret.txt")


@dataclass
class Settings:
    assignment: str
    notebook: str                 # file name, <assignment>.ipynb
    db_url: str
    release: str                  # the released notebook nbgrader generated (trusted)
    work: str                     # the grader's private work folder
    cell_timeout: float = 300.0
    notebook_timeout: float = 1800.0
    output_limit: int = 1_000_000  # bytes kept per cell; the rest is cut (and never costs marks)
    sandbox: bool = True
    limits: dict = field(default_factory=dict)
    hide: list = field(default_factory=list)
    version: str = ""             # the decodelab grading (decodelab.__version__); "" = not checked


@dataclass
class Result:
    student: str
    status: str = "ok"
    notes: list = field(default_factory=list)
    notebook: str | None = None    # the graded notebook (nbformat JSON text), None if it never ran
    tries: int = 1                 # on a Dask cluster: the try that graded it (a lost worker: > 1)


# --------------------------------------------------------------------------- helpers

def _meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def is_test_cell(cell) -> bool:
    meta = _meta(cell)
    return cell.get("cell_type") == "code" and bool(meta.get("grade")) and not meta.get("solution")


def worst(statuses) -> str:
    return min(statuses, key=STATUSES.index, default="ok")


def version_note(nb, version: str) -> str | None:
    """A note for the instructor when the submission was released for another decodelab than the
    one grading it (release.py records `decodelab.__version__` in the notebook's metadata), or
    records none; None when they agree. Never changes a score."""
    from autograder.release import recorded_version

    recorded = recorded_version(nb)
    if recorded == version:
        return None
    if recorded is None:  # no "; " in a note: the notes column joins them with it
        return f"version: the notebook records no decodelab version (graded with {version})"
    return f"version: the notebook was released for decodelab {recorded} (graded with {version})"


def hints_note(folder: Path, assignment: str) -> str | None:
    """"hints: ex_top_k_filter 2, ex_top_p_filter 1" from the hint counter the notebook's hint
    buttons write beside it (decodelab/course/hints.py, `.decodelab_hints.json`), when it was
    submitted; None when it was not or no hint was used. Information only: never scored."""
    from decodelab.course import hints

    return hints.note(hints.read_counts(folder), assignment)


def _short(text: str, n: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


# --------------------------------------------------------------------------- tampering

def _without_hidden_tests(source: str) -> str:
    if HIDDEN_BEGIN not in source:
        return source
    head, _, rest = source.partition(HIDDEN_BEGIN)
    _, _, tail = rest.partition(HIDDEN_END)
    lines = head.split("\n")
    if lines and not lines[-1].strip():
        lines = lines[:-1]
    return ("\n".join(lines) + tail.lstrip("\n")).rstrip("\n") if tail.strip() else "\n".join(lines).rstrip("\n")


def check_tampering(nb, release) -> tuple[list[str], bool]:
    """Repair what can be repaired before nbgrader restores the test cells; returns (notes,
    tampered). Trust comes from the release nbgrader generated here, never from the checksums a
    submission carries."""
    from nbgrader.utils import compute_checksum

    notes, tampered = [], False
    released = {_meta(c)["grade_id"]: c for c in release.cells if _meta(c).get("grade_id")}
    released_tests = {gid: c for gid, c in released.items() if is_test_cell(c)}
    seen: set[str] = set()
    for cell in nb.cells:
        meta = _meta(cell)
        gid = meta.get("grade_id")
        if not gid:
            continue
        if gid not in released:  # a graded cell the release never had: it earns nothing
            if meta.get("grade") or meta.get("solution"):
                notes.append(f"{gid}: a graded cell not in the release, ignored")
                tampered = True
            cell.metadata.pop("nbgrader", None)
            continue
        if gid in released_tests and gid not in seen:
            want = released_tests[gid]
            # A solution notebook's test cell still holds its hidden tests: compare without them.
            visible = copy.deepcopy(cell)
            visible.source = _without_hidden_tests(cell.source)
            if compute_checksum(visible) != want.metadata.nbgrader.checksum:
                notes.append(f"{gid} edited: restored from the release")
                tampered = True
        seen.add(gid)
    for gid, want in released_tests.items():
        if gid in seen:
            continue
        stripped = [c for c in nb.cells if c.cell_type == "code" and not _meta(c).get("grade_id")
                    and c.source.strip() == want.source.strip()]
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
        gid = _meta(cell).get("grade_id")
        status = ex.replies.get(index) if ex is not None else None
        if status == "ok" and index not in ex.timed_out:
            cell.outputs = [o for o in cell.outputs if o.output_type != "error"
                            and not (o.output_type == "stream" and o.name == "stderr")]
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if index in getattr(ex, "timed_out", ()):
            why = "timed out"
        elif status is None:
            why = "not run (the kernel had " + ("died" if ex is not None and ex.stopped == "crashed" else "stopped") + ")"
        elif errors:
            why = f"{errors[0].get('ename', 'error')}: {_short(errors[0].get('evalue', ''), 100)}"
        else:
            why = "error"
        if not errors:
            cell.outputs.append(NotebookNode(output_type="error", ename="NotScored", evalue=why, traceback=[]))
        failures.append(f"{gid} failed: {why}")
    return failures


# --------------------------------------------------------------------------- one submission (a worker)

_SLOT = 0   # the host-wide sandbox slot this pool process holds (autograder/slots.py)
_SLOT_HELD = None


def _quiet() -> None:
    # nbgrader's own gradebook code warns about its SQLAlchemy sessions on every submission.
    warnings.filterwarnings("ignore", message=".*not in session.*")
    warnings.filterwarnings("ignore", module="sqlalchemy")


def _init_worker() -> None:
    global _SLOT, _SLOT_HELD
    from autograder import slots

    _quiet()
    if sys.platform.startswith("linux"):  # the grader killed: its workers (and so their kernels) go too
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    _SLOT_HELD = slots.acquire()  # held until this process exits (the kernel frees the lock then)
    _SLOT = _SLOT_HELD.number
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def grade_one(student: str, path: str, settings: Settings, slot: int | None = None) -> Result:
    """Read, check, sanitize (nbgrader), execute (sandboxed in `slot`, default this pool process's):
    never raises."""
    result = Result(student)
    try:
        _grade_one(result, Path(path), settings, _SLOT if slot is None else slot)
    except Exception as exc:  # noqa: BLE001 - one submission never stops the class
        result.status = worst([result.status, "crashed"])
        result.notes.append(f"grader error: {type(exc).__name__}: {_short(exc, 200)}")
        result.notes.append(_short(traceback.format_exc(limit=3), 300))
    return result


def _read(path: Path):
    import nbformat

    raw = path.read_bytes()
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


def _grade_one(result: Result, path: Path, settings: Settings, slot: int = 0) -> None:
    import nbformat
    from nbgrader.preprocessors import (CheckCellMetadata, ClearOutput, DeduplicateIds, LimitOutput, OverwriteCells,
                                        OverwriteKernelspec)

    from autograder import integrity, sandbox
    from autograder.executor import SandboxedExecute

    try:
        nb, raw = _read(path)
    except Exception as exc:  # noqa: BLE001 - anything that is not a notebook
        result.status = "unreadable"
        result.notes.append(f"{path.name} is not a valid notebook: {_short(exc, 150)}")
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

    resources = {"nbgrader": {"notebook": Path(settings.notebook).stem, "assignment": settings.assignment,
                              "student": result.student, "db_url": settings.db_url}}
    for pp in (ClearOutput(), DeduplicateIds(), OverwriteKernelspec(), OverwriteCells(), CheckCellMetadata()):
        nb, resources = pp.preprocess(nb, resources)

    limits = sandbox.Limits(**settings.limits)
    box = sandbox.Sandbox(Path(settings.work), result.student.replace(os.sep, "_"), slot, limits,
                          [Path(p) for p in settings.hide], enabled=settings.sandbox)
    box.prepare(settings.notebook, raw)
    ex = SandboxedExecute(extra_arguments=["--HistoryManager.hist_file=:memory:"], allow_errors=True,
                          interrupt_on_timeout=True, raise_on_iopub_timeout=True)
    ex.setup(box, settings)
    resources["metadata"] = {"path": str(box.scratch)}
    try:
        nb, resources = ex.preprocess(nb, resources)
    except Exception as exc:  # noqa: BLE001 - e.g. the kernel never started
        if not ex.stopped:
            ex.stopped = "crashed"
            ex.events.append(f"the kernel failed: {type(exc).__name__}: {_short(exc, 200)}")
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


# --------------------------------------------------------------------------- the class

def roster(submissions: Path) -> list[str]:
    return sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))


def find_submission(submissions: Path, student: str, assignment: str) -> tuple[Path | None, list[str]]:
    """(the notebook, or None and what the student's folder holds instead)."""
    target = submissions / student / assignment / f"{assignment}.ipynb"
    if target.is_file():
        return target, []
    found = sorted(str(p.relative_to(submissions / student)) for p in (submissions / student).rglob("*")
                   if p.is_file() and ".ipynb_checkpoints" not in p.parts)
    return None, found


def prepare_course(assignment: str, source: Path, work: Path, db_path: Path) -> tuple[str, Path]:
    """nbgrader generate_assignment of the source notebook into a private course folder, with the
    gradebook at db_path; returns (db_url, the released notebook)."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    from autograder.release import ensure_tools_on_path, load_config

    ensure_tools_on_path()
    course = work / "course"
    if not (source / assignment / f"{assignment}.ipynb").is_file():
        raise SystemExit(f"no source notebook {source / assignment / (assignment + '.ipynb')}: "
                         f"--assignment names a folder of {source}")
    shutil.copytree(source / assignment, course / "solutions" / assignment,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    config = load_config()
    config.CourseDirectory.root = str(course)
    db_url = f"sqlite:///{db_path}"
    config.CourseDirectory.db_url = db_url
    api = NbGraderAPI(CourseDirectory(config=config), config=config)
    outcome = api.generate_assignment(assignment, force=True, create=True)
    if not outcome["success"]:
        raise SystemExit(f"nbgrader generate_assignment {assignment} failed:\n{outcome.get('error')}\n{outcome.get('log')}")
    os.chmod(db_path, 0o600)
    return db_url, course / "course" / assignment / f"{assignment}.ipynb"


def save_grades(result: Result, settings: Settings) -> tuple[float, float]:
    """The graded notebook into the gradebook (nbgrader SaveAutoGrades); (score, max_score)."""
    import nbformat
    from nbgrader.api import Gradebook
    from nbgrader.preprocessors import SaveAutoGrades

    notebook_id = Path(settings.notebook).stem
    with Gradebook(settings.db_url) as gb:
        gb.update_or_create_student(result.student)
        gb.update_or_create_submission(settings.assignment, result.student)
        sub = gb.find_submission_notebook(notebook_id, settings.assignment, result.student)
        for grade in sub.grades:  # a regrade starts from nothing
            grade.auto_score = 0
            grade.manual_score = None
            grade.needs_manual_grade = False
        sub.late_submission_penalty = None
        gb.db.commit()
    if result.notebook is not None:
        nb = nbformat.reads(result.notebook, as_version=4)
        resources = {"nbgrader": {"notebook": notebook_id, "assignment": settings.assignment,
                                  "student": result.student, "db_url": settings.db_url}}
        SaveAutoGrades().preprocess(nb, resources)
    with Gradebook(settings.db_url) as gb:
        sub = gb.find_submission_notebook(notebook_id, settings.assignment, result.student)
        return float(sub.score), float(sub.max_score)


def copy_exchange_files(submitted: Path | None, feedback: Path) -> list[str]:
    """Copy the submission's EXCHANGE_FILES (written by `nbgrader submit`, kept by `collect`) into
    its feedback folder, where `nbgrader release_feedback` reads them; a copy left by an earlier
    grading that the submission no longer has is removed. Only small regular files are copied
    (the submission folder is the student's: a link there is not followed). Returns the names."""
    copied = []
    for name in EXCHANGE_FILES:
        source, target = (submitted / name if submitted else None), feedback / name
        target.unlink(missing_ok=True)
        if source is None or source.is_symlink() or not source.is_file() or source.stat().st_size > 4096:
            continue
        target.write_bytes(source.read_bytes())
        copied.append(name)
    return copied


def write_feedback(result: Result, settings: Settings, folder: Path, score: float, max_score: float,
                   submitted: Path | None = None) -> Path:
    """HTML for the student, nbgrader's feedback template, no hidden test code anywhere, in
    nbgrader's feedback layout folder/<student>/<assignment>/<notebook>.html; beside it the
    exchange's files from the submission folder `submitted` (copy_exchange_files), so that
    `nbgrader release_feedback` releases the folder as it is."""
    import html

    import nbformat
    from nbconvert.exporters import HTMLExporter
    from nbgrader.preprocessors import ClearHiddenTests, GetGrades, LimitOutput
    from traitlets.config import Config

    target = folder / result.student / settings.assignment / f"{Path(settings.notebook).stem}.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    copy_exchange_files(submitted, target.parent)
    notes = [n for n in result.notes if not n.startswith("integrity:")]
    if result.notebook is None:
        body = (f"<html><body><h1>{html.escape(settings.assignment)}: {html.escape(result.status)}</h1>"
                f"<p>Score: {score:g} / {max_score:g}</p><ul>"
                + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul></body></html>")
        target.write_text(body)
        return target
    nb = nbformat.reads(result.notebook, as_version=4)
    resources = {"nbgrader": {"notebook": Path(settings.notebook).stem, "assignment": settings.assignment,
                              "student": result.student, "db_url": settings.db_url}}
    nb, resources = GetGrades().preprocess(nb, resources)
    nb, resources = ClearHiddenTests().preprocess(nb, resources)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "error":  # the traceback would quote the hidden-test lines
                output.traceback = [f"{output.get('ename', '')}: {output.get('evalue', '')}"]
        if HIDDEN_BEGIN in cell.source:  # belt and braces
            cell.source = cell.source.split(HIDDEN_BEGIN)[0]
    LimitOutput(max_lines=200).preprocess(nb, resources)
    summary = nbformat.v4.new_markdown_cell(f"**Grader: {result.status}.** "
                                            + html.escape("; ".join(notes) or "no problems"))
    nb.cells.insert(0, summary)
    c = Config()
    c.HTMLExporter.template_name = "feedback"
    import nbgrader

    base = Path(nbgrader.__file__).parent / "server_extensions" / "formgrader"
    c.HTMLExporter.extra_template_basedirs = [str(base / "templates")]
    c.HTMLExporter.extra_template_paths = [str(base / "static" / "node_modules" / "bootstrap" / "dist" / "css")]
    body, _ = HTMLExporter(config=c).from_notebook_node(nb, resources)
    target.write_text(body)
    return target


def write_csv(path: Path, rows: dict[tuple[str, str], dict]) -> None:
    """Atomically: every row kept, one per (student, assignment)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for key in sorted(rows, key=lambda k: (k[1], k[0])):
            writer.writerow(rows[key])
    os.replace(tmp, path)


def read_csv(path: Path) -> dict[tuple[str, str], dict]:
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        return {(r["student"], r["assignment"]): {k: r.get(k, "") for k in COLUMNS} for r in csv.DictReader(f)}


def _fmt(x: float) -> str:
    return f"{x:g}"


# --------------------------------------------------------------------------- late submissions

def late_policy(overrides=None):
    """The late policy of nbgrader_config.py (with command-line `--Class.trait=value` settings
    on top): SystemExit with the reason if its plugin or time zone is wrong."""
    from autograder import late
    from autograder.release import load_config

    config = load_config()
    if overrides is not None:
        config.merge(overrides)
    try:
        return late.policy_from_config(config)
    except ValueError as exc:
        raise SystemExit(f"autograder grade: {exc}") from None


def set_due_date(db_url: str, assignment: str, due: str | None, policy):
    """Write `--due` (None: keep the gradebook's, "none": remove it) into nbgrader's gradebook;
    returns the assignment's due date (naive UTC) or None."""
    from nbgrader.api import Gradebook

    with Gradebook(db_url) as gb:
        if due is not None:
            gb.update_or_create_assignment(assignment, duedate=parse_due(due, policy))
        return gb.find_assignment(assignment).duedate


def parse_due(due: str, policy):
    """`--due` as nbgrader's gradebook stores it (naive UTC; None for "none"); SystemExit if malformed."""
    from autograder import late

    try:
        return late.due_date_of(due, policy.timezone)
    except ValueError as exc:
        raise SystemExit(f"autograder grade: --due {due!r}: {exc}") from None


def late_columns(result: Result, settings: Settings, policy, submissions: Path, score: float) -> tuple[float, dict]:
    """(the score net of any late penalty, the row's submitted_at and late_penalty); a "late:"
    note joins result.notes when the submission is late or its time cannot be read."""
    from autograder import late

    empty = {"submitted_at": "", "late_penalty": ""}
    if policy is None:
        return score, empty
    try:
        found = policy.record(settings.db_url, settings.assignment, Path(settings.notebook).stem, result.student,
                              submissions / result.student / settings.assignment, score)
    except Exception as exc:  # noqa: BLE001 - the grade stands; the note says why nothing was taken off
        result.notes.append(f"late: not checked ({type(exc).__name__}: {_short(exc, 150)}), no penalty")
        return score, empty
    if found is None:
        return score, empty
    if found.note:
        result.notes.append(found.note)
    penalty = found.penalty
    return max(0.0, score - (penalty or 0.0)), {"submitted_at": late.show(found.submitted_at),
                                                "late_penalty": "" if penalty is None else _fmt(penalty)}


# --------------------------------------------------------------------------- answer similarity

def add_similarity_notes(settings: Settings, jobs: dict[str, Path], rows: dict, out: Path) -> None:
    """The class-wide comparison of answer cells (autograder/similarity.py), once every row is
    graded: its "similarity:" notes join those rows and the CSV is written again. Unreadable and
    missing submissions are skipped; a failure is a note, never a lost grade."""
    import nbformat

    from autograder import similarity

    graded = {s: p for s, p in jobs.items()
              if rows.get((s, settings.assignment), {}).get("status") not in ("unreadable", "missing", None)}
    if not graded:
        return
    try:
        found = similarity.class_notes(nbformat.read(settings.release, as_version=4), graded)
    except Exception as exc:  # noqa: BLE001 - the grades are written; only the comparison is lost
        found = {s: [f"similarity: not checked ({type(exc).__name__}: {_short(exc, 100)})"] for s in graded}
    for student, notes in found.items():
        row = rows[(student, settings.assignment)]
        row["notes"] = "; ".join([n for n in row["notes"].split("; ") if n] + notes)
    write_csv(out, rows)


def grade_class(assignment: str, submissions: Path, out: Path, *, feedback: Path | None = None, workers: int = 2,
                sandbox_on: bool = True, source: Path = ROOT / "solutions", gradebook: Path | None = None,
                cell_timeout: float = 300, notebook_timeout: float = 1800, memory_bytes: int = 4 * 2**30,
                max_processes: int = 128, output_limit: int = 1_000_000, progress: bool = True,
                due: str | None = None, late_settings=None, cluster=None) -> list[dict]:
    """Grade every student folder in submissions; returns the rows written for this run.

    `due`: a due date to write into the gradebook first ("none" removes it; None keeps what it
    has); `late_settings`: a traitlets Config over nbgrader_config.py for the late policy;
    `cluster`: an autograder.cluster.Cluster to grade on Dask workers instead of a local pool."""
    from autograder import sandbox
    from autograder.release import library_version

    policy = late_policy(late_settings)
    if due is not None:
        parse_due(due, policy)  # refused before any work
    submissions, out = submissions.resolve(), out.resolve()
    gradebook = (gradebook or out.with_name("gradebook.db")).resolve()
    if not submissions.is_dir():
        raise SystemExit(f"--submissions {submissions}: no such folder")
    limits = sandbox.Limits(memory_bytes=memory_bytes, max_processes=max_processes,
                            cpu_seconds=int(notebook_timeout * 2) + 60)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="decodelab-grade-"))
    os.chmod(work, 0o711)  # kernels traverse to their own folder; nothing else here is theirs
    hide = [submissions, work / "course", gradebook, out] + ([feedback.resolve()] if feedback else [])
    try:
        if sandbox_on and cluster is None:  # on a cluster, each worker checks its own machine
            sandbox.preflight(work, limits, hide)
        db_url, release = prepare_course(assignment, source, work / "c", gradebook)
        if set_due_date(db_url, assignment, due, policy) is None:
            policy = None  # no due date: nothing is late
        settings = Settings(assignment=assignment, notebook=f"{assignment}.ipynb", db_url=db_url, release=str(release),
                            work=str(work), cell_timeout=cell_timeout, notebook_timeout=notebook_timeout,
                            output_limit=output_limit, sandbox=sandbox_on, limits=asdict(limits),
                            hide=[str(p) for p in hide + [work / "c"]], version=library_version())
        return _run(settings, submissions, out, feedback, workers, progress, policy, cluster, gradebook)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(settings: Settings, submissions: Path, out: Path, feedback: Path | None, workers: int,
         progress: bool, policy=None, cluster=None, gradebook: Path | None = None) -> list[dict]:
    import multiprocessing

    from tqdm import tqdm

    _quiet()
    rows = read_csv(out)
    written = []
    students = roster(submissions)
    results: list[Result] = []
    jobs = {}
    for student in students:
        path, found = find_submission(submissions, student, settings.assignment)
        if path is None:
            what = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "") if found else "nothing"
            results.append(Result(student, "missing", [f"no {settings.assignment}/{settings.notebook}; found: {what}"]))
        else:
            jobs[student] = path
    bar = tqdm(total=len(students), desc=f"grading {settings.assignment}", unit="student", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)

    def finish(result: Result) -> None:
        if not settings.sandbox:
            result.notes.insert(0, NO_SANDBOX_NOTE)
        score, max_score = save_grades(result, settings)
        score, late = late_columns(result, settings, policy, submissions, score)
        if feedback is not None:
            write_feedback(result, settings, feedback.resolve(), score, max_score,
                           submitted=submissions / result.student / settings.assignment)
        row = {"student": result.student, "assignment": settings.assignment, "score": _fmt(score),
               "max_score": _fmt(max_score), "status": result.status, "notes": "; ".join(result.notes), **late}
        rows[(result.student, settings.assignment)] = row
        written.append(row)
        write_csv(out, rows)  # after every student: a crash of the grader loses nothing done
        bar.set_postfix_str(f"{result.student}: {result.status}", refresh=False)
        bar.update(1)

    for result in results:
        finish(result)
    if jobs and cluster is not None:
        from autograder.cluster import grade_on_cluster

        for result in grade_on_cluster(cluster, settings, jobs, gradebook or Path(settings.db_url[len("sqlite:///"):])):
            finish(result)
    elif jobs:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, initializer=_init_worker) as pool:
            futures = {pool.submit(grade_one, s, str(p), settings): s for s, p in jobs.items()}
            for future in as_completed(futures):
                try:
                    result = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker process died
                    result = Result(futures[future], "crashed", [f"grader worker died: {type(exc).__name__}: {exc}"])
                finish(result)
    bar.close()
    add_similarity_notes(settings, jobs, rows, out)
    return sorted(written, key=lambda r: r["student"])


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m autograder grade", description=__doc__.splitlines()[0])
    parser.add_argument("--assignment", required=True, help="the assignment (a folder of the source directory)")
    parser.add_argument("--submissions", required=True, type=Path, help="DIR/<student>/<assignment>/<assignment>.ipynb")
    parser.add_argument("--out", required=True, type=Path, help="the CSV to write (rows of this assignment replaced)")
    parser.add_argument("--feedback", type=Path, help="write HTML feedback to FEEDBACK/<student>/<assignment>/, "
                        "with the submission's timestamp.txt and submission_secret.txt (nbgrader's feedback "
                        "layout: `nbgrader release_feedback` releases it)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="kernels at once")
    parser.add_argument("--no-sandbox", action="store_true", help="grade without isolation (said in every row)")
    parser.add_argument("--source", type=Path, default=ROOT / "solutions", help="nbgrader source notebooks")
    parser.add_argument("--gradebook", type=Path, help="nbgrader gradebook (default: gradebook.db beside --out)")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell (default 300)")
    parser.add_argument("--notebook-timeout", type=float, default=1800, help="seconds per notebook (default 1800)")
    parser.add_argument("--memory", type=float, default=4.0, help="GiB per kernel (default 4)")
    parser.add_argument("--max-processes", type=int, default=128, help="processes/threads per kernel (default 128)")
    parser.add_argument("--output-limit", type=int, default=1_000_000, help="bytes of output kept per cell")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--scheduler", help="grade on a Dask cluster: the scheduler's address (tls:// off the "
                       "loopback), or 'local' for a LocalCluster of --workers processes on 127.0.0.1")
    where.add_argument("--scheduler-file", type=Path, help="grade on a Dask cluster: the scheduler's file "
                       "(dask scheduler --scheduler-file FILE)")
    parser.add_argument("--tls-ca-file", help="TLS: the CA that signed the scheduler's and workers' certificates")
    parser.add_argument("--tls-cert", help="TLS: this client's certificate")
    parser.add_argument("--tls-key", help="TLS: this client's private key")
    parser.add_argument("--due", help='the due date, written into the gradebook as nbgrader\'s duedate and kept '
                        'for later runs: "YYYY-MM-DD HH:MM[:SS] [ZONE]" (no zone: Exchange.timezone, default UTC); '
                        '"none" removes it. Default: the gradebook\'s')
    parser.epilog = ("Late penalty settings as in nbgrader_config.py, for this run: "
                     "--AssignLatePenalties.plugin_class=autograder.late.PointsPerDay --PointsPerDay.points=1 "
                     "--PointsPerDay.cutoff_days=7 --Exchange.timezone=Europe/Berlin")
    args, extra = parser.parse_known_args(argv)
    try:
        late_settings = nbgrader_settings(extra)
    except ValueError as exc:
        parser.error(str(exc))
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.memory <= 0 or args.cell_timeout <= 0 or args.notebook_timeout <= 0:
        parser.error("--memory, --cell-timeout and --notebook-timeout must be > 0")
    from autograder import sandbox
    from autograder.cluster import ClusterError

    cluster = None
    if args.scheduler or args.scheduler_file:
        from autograder.cluster import Cluster, check

        cluster = Cluster(scheduler=args.scheduler, scheduler_file=str(args.scheduler_file or "") or None,
                          tls_ca_file=args.tls_ca_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          local_workers=args.workers)
        try:
            check(cluster)
        except ClusterError as exc:
            print(f"autograder grade: {exc}", file=sys.stderr)
            return 2
    elif args.tls_ca_file or args.tls_cert or args.tls_key:
        parser.error("--tls-* options go with --scheduler or --scheduler-file")
    if not args.no_sandbox and (cluster is None or cluster.scheduler == "local"):
        reason = sandbox.unavailable_reason()
        if reason:
            print(f"autograder grade: refusing to run learners' code: {reason}", file=sys.stderr)
            return 3
    started = time.perf_counter()
    try:
        rows = grade_class(args.assignment, args.submissions, args.out, feedback=args.feedback, workers=args.workers,
                           sandbox_on=not args.no_sandbox, source=args.source, gradebook=args.gradebook,
                           cell_timeout=args.cell_timeout, notebook_timeout=args.notebook_timeout,
                           memory_bytes=int(args.memory * 2**30), max_processes=args.max_processes,
                           output_limit=args.output_limit, progress=not args.quiet, due=args.due,
                           late_settings=late_settings, cluster=cluster)
    except sandbox.SandboxUnavailable as exc:
        print(f"autograder grade: refusing to run learners' code: {exc}", file=sys.stderr)
        return 3
    except ClusterError as exc:
        print(f"autograder grade: {exc}", file=sys.stderr)
        return 2
    from autograder.release import library_version

    print("\n".join(summary(rows, args.assignment, time.perf_counter() - started, args.out, library_version())))
    return 0


LATE_SETTINGS = ("Exchange", "AssignLatePenalties", "LateSubmissionPlugin", "DailyPenalty", "PointsPerDay",
                 "PercentPerDay", "ZeroAfterCutoff")


def nbgrader_settings(extra: list[str]):
    """`--Class.trait=value` arguments (nbgrader's command-line syntax) -> a traitlets Config.
    ValueError for anything else, or a class the late policy does not read."""
    import re

    from traitlets.config.loader import KVArgParseConfigLoader

    bad = [a for a in extra if not re.fullmatch(r"--[A-Za-z_]\w*\.[A-Za-z_]\w*=.*", a, re.S)]
    if bad:
        raise ValueError(f"unrecognized arguments: {' '.join(bad)} (nbgrader settings are --Class.trait=value)")
    config = KVArgParseConfigLoader(argv=extra).load_config()
    plugin = str(config.AssignLatePenalties.get("plugin_class", "")).rpartition(".")[2] if extra else ""
    unknown = sorted(set(config) - set(LATE_SETTINGS) - {plugin})
    if unknown:
        raise ValueError(f"--{unknown[0]}.…: only the late policy's settings can be given here "
                         f"({', '.join(LATE_SETTINGS)}, or the plugin class named by AssignLatePenalties.plugin_class)")
    return config


def summary(rows: list[dict], assignment: str, seconds: float, out: Path, version: str) -> list[str]:
    """What `grade` prints at the end: the count of each status, every integrity flag, the late
    submissions, the similarity flags, and which submissions were released for another
    decodelab version than the one grading them."""
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines = [f"graded {len(rows)} submissions of {assignment} in {seconds:.0f} s: "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" -> {out}"]
    for row in rows:
        lines += [f"  {row['student']}: {flag}" for flag in row["notes"].split("; ") if flag.startswith("integrity:")]
    late = [r["student"] for r in rows if r.get("late_penalty") not in ("", "0", None)]
    if late:
        lines.append(f"  {len(late)} late submission(s) with points off (late_penalty; score is net): "
                     f"{', '.join(late)}")
    unknown = [r["student"] for r in rows if any(n.startswith("late:") and "not checked" in n
                                                 for n in r["notes"].split("; "))]
    if unknown:
        lines.append(f"  {len(unknown)} submission time(s) not read (a late: note; no penalty): {', '.join(unknown)}")
    similar = [r["student"] for r in rows if any(n.startswith("similarity:") for n in r["notes"].split("; "))]
    if similar:
        lines.append(f"  {len(similar)} submission(s) with answers like another's or the library's "
                     f"(a similarity: note; scores unchanged): {', '.join(similar)}")
    again = [r["student"] for r in rows if any(n.startswith("grader:") for n in r["notes"].split("; "))]
    if again:
        lines.append(f"  {len(again)} submission(s) with a grader: note (a lost Dask worker, or a worker that "
                     f"refused): {', '.join(again)}")
    other = [row["student"] for row in rows if any(n.startswith("version:") for n in row["notes"].split("; "))]
    if other:
        lines.append(f"  {len(other)} submission(s) not released for decodelab {version}, the version grading them "
                     f"(a note in their row; scores unchanged): {', '.join(other)}")
    return lines

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
as it is (README, "Through nbgrader's exchange"). The graded notebooks themselves (hidden tests removed)
go to nbgrader's autograded layout, AUTOGRADED/<student>/<assignment>/ (--autograded, default autograded/
beside --out), where formgrader finds them for grading by hand; a manual score or comment set there
survives every regrade, and a "by hand:" note names the answers still waiting for one.

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
columns stay empty. The policy the assignment was first graded with is kept in the gradebook
(late.policy_of_run): a rerun without flags charges it again; a rerun under another is refused
unless --replace-late-policy says so. A score set by hand (formgrader's manual_score) survives
every regrade, and columns an instructor added to the CSV stay.

Everything read from a submission goes through autograder/student_files.py: regular files of the
student's own, never through a link, size-capped.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from autograder.autograded import write_autograded
from autograder.feedback import write_feedback
from autograder.gradebook import prepare_course, save_grades, set_due_date
from autograder.grades_csv import GradesFileError, read_csv, write_csv
from autograder.late import late_columns, nbgrader_settings, parse_due, policy_of_run, store_policy
from autograder.notes import number, short
from autograder.student_files import is_real_folder, listing
from autograder.submission import STATUSES, Result, Settings, grade_one, init_worker, quiet

ROOT = Path(__file__).resolve().parent.parent
NO_SANDBOX_NOTE = "graded WITHOUT the sandbox (--no-sandbox): the kernel ran as the grader"


# --------------------------------------------------------------------------- the class


def roster(submissions: Path) -> list[str]:
    """The students: every folder in submissions, and every link there (graded as "missing", not followed)."""
    return sorted(
        p.name for p in submissions.iterdir() if not p.name.startswith(".") and (p.is_symlink() or is_real_folder(p))
    )


def submission_folder(submissions: Path, student: str, assignment: str) -> Path | None:
    """submissions/student/assignment when both are folders of their own (not links), else None."""
    folder = submissions / student / assignment
    return folder if is_real_folder(submissions / student) and is_real_folder(folder) else None


def find_submission(submissions: Path, student: str, assignment: str) -> tuple[Path | None, str]:
    """(the notebook's path, "") or (None, why there is none): a link on the way is never followed,
    and what the student's folder holds instead is listed by name."""
    folder = submissions / student
    if not is_real_folder(folder):
        return None, f"the student's folder {student} is a link: not followed"
    if (folder / assignment).is_symlink():
        return None, f"{assignment}/ is a link: not followed"
    target = folder / assignment / f"{assignment}.ipynb"
    if os.path.lexists(target):  # a link or a non-file is refused, with its reason, when read
        return target, ""
    found = listing(folder)
    what = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "") if found else "nothing"
    return None, f"no {assignment}/{assignment}.ipynb; found: {what}"


# --------------------------------------------------------------------------- answer similarity


def add_similarity_notes(settings: Settings, jobs: dict[str, Path], rows: dict, out: Path) -> None:
    """The class-wide comparison of answer cells (autograder/similarity.py), once every row is
    graded: its "similarity:" notes join those rows and the CSV is written again. Unreadable and
    missing submissions are skipped; a failure is a note, never a lost grade."""
    import nbformat

    from autograder import similarity

    graded = {
        s: p
        for s, p in jobs.items()
        if rows.get((s, settings.assignment), {}).get("status") not in ("unreadable", "missing", None)
    }
    if not graded:
        return
    try:
        found = similarity.class_notes(nbformat.read(settings.release, as_version=4), graded)
    except Exception as exc:  # noqa: BLE001 - the grades are written; only the comparison is lost
        found = {s: [f"similarity: not checked ({type(exc).__name__}: {short(exc, 100)})"] for s in graded}
    for student, notes in found.items():
        row = rows[(student, settings.assignment)]
        row["notes"] = "; ".join([n for n in row["notes"].split("; ") if n] + notes)
    write_csv(out, rows)


def grade_class(
    assignment: str,
    submissions: Path,
    out: Path,
    *,
    feedback: Path | None = None,
    workers: int = 2,
    sandbox_on: bool = True,
    source: Path = ROOT / "solutions",
    gradebook: Path | None = None,
    cell_timeout: float = 300,
    notebook_timeout: float = 1800,
    memory_bytes: int = 4 * 2**30,
    max_processes: int = 128,
    output_limit: int = 1_000_000,
    progress: bool = True,
    due: str | None = None,
    late_flags: list[str] | None = None,
    replace_late_policy: bool = False,
    cluster=None,
    autograded: Path | None = None,
) -> list[dict]:
    """Grade every student folder in submissions; returns the rows written for this run.

    `due`: a due date to write into the gradebook first ("none" removes it; None keeps what it
    has); `late_flags`: `--Class.trait=value` settings over nbgrader_config.py for the late policy
    (none: those the assignment was first graded with, kept in the gradebook; late.policy_of_run);
    `cluster`: an autograder.cluster.Cluster to grade on Dask workers instead of a local pool;
    `autograded`: where the graded notebooks go for formgrader (default autograded/ beside out)."""
    from autograder import sandbox
    from autograder.release import library_version

    submissions, out = submissions.resolve(), out.resolve()
    gradebook = (gradebook or out.with_name("gradebook.db")).resolve()
    autograded = (autograded or out.with_name("autograded")).resolve()
    policy, late_flags = policy_of_run(gradebook, assignment, late_flags or [], replace_late_policy)
    if due is not None:
        parse_due(due, policy)  # refused before any work
    if not submissions.is_dir():
        raise SystemExit(f"--submissions {submissions}: no such folder")
    if out.is_dir():
        raise SystemExit(f"--out {out}: a folder; give the CSV file to write")
    try:
        read_csv(out)  # an earlier CSV that cannot be read back is refused before any work
    except GradesFileError as exc:
        raise SystemExit(f"autograder grade: --out {exc}") from None
    limits = sandbox.Limits(
        memory_bytes=memory_bytes, max_processes=max_processes, cpu_seconds=int(notebook_timeout * 2) + 60
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="decodelab-grade-"))
    os.chmod(work, 0o711)  # kernels traverse to their own folder; nothing else here is theirs
    # What no kernel may read: every path the grader owns (the repository itself: sandbox.repository_hidden).
    hide = [submissions, work / "course", gradebook, out, source.resolve(), autograded] + (
        [feedback.resolve()] if feedback else []
    )
    try:
        if sandbox_on and cluster is None:  # on a cluster, each worker checks its own machine
            sandbox.preflight(work, limits, hide)
        db_url, release = prepare_course(assignment, source, work / "c", gradebook)
        store_policy(gradebook, assignment, late_flags, policy)
        if set_due_date(db_url, assignment, due, policy) is None:
            policy = None  # no due date: nothing is late
        settings = Settings(
            assignment=assignment,
            notebook=f"{assignment}.ipynb",
            db_url=db_url,
            release=str(release),
            work=str(work),
            cell_timeout=cell_timeout,
            notebook_timeout=notebook_timeout,
            output_limit=output_limit,
            sandbox=sandbox_on,
            limits=asdict(limits),
            hide=[str(p) for p in hide + [work / "c"]],
            version=library_version(),
        )
        return _run(settings, submissions, out, feedback, workers, progress, policy, cluster, gradebook, autograded)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(
    settings: Settings,
    submissions: Path,
    out: Path,
    feedback: Path | None,
    workers: int,
    progress: bool,
    policy=None,
    cluster=None,
    gradebook: Path | None = None,
    autograded: Path | None = None,
) -> list[dict]:
    import multiprocessing

    from tqdm import tqdm

    quiet()
    rows = read_csv(out)
    written = []
    students = roster(submissions)
    write_csv(out, rows)  # the CSV exists from the start, an empty class's included
    if not students:
        print(
            f"autograder grade: no student folders in {submissions} (nbgrader's layout: "
            f"<student>/{settings.assignment}/{settings.notebook})",
            file=sys.stderr,
        )
    results: list[Result] = []
    jobs = {}
    for student in students:
        path, why = find_submission(submissions, student, settings.assignment)
        if path is None:
            results.append(Result(student, "missing", [why]))
        else:
            jobs[student] = path
    bar = tqdm(
        total=len(students),
        desc=f"grading {settings.assignment}",
        unit="student",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )

    def finish(result: Result) -> None:
        if not settings.sandbox:
            result.notes.insert(0, NO_SANDBOX_NOTE)
        score, max_score = save_grades(result, settings)
        folder = submission_folder(submissions, result.student, settings.assignment)
        score, late = late_columns(result, settings, policy, folder, score)
        if feedback is not None:
            write_feedback(result, settings, feedback.resolve(), score, max_score, submitted=folder)
        if autograded is not None:
            write_autograded(result, settings, autograded)
        row = {
            "student": result.student,
            "assignment": settings.assignment,
            "score": number(score),
            "max_score": number(max_score),
            "status": result.status,
            "notes": "; ".join(result.notes),
            **late,
        }
        key = (result.student, settings.assignment)
        rows[key] = row = {**rows.get(key, {}), **row}  # an instructor's own columns stay
        written.append(row)
        write_csv(out, rows)  # after every student: a crash of the grader loses nothing done
        bar.set_postfix_str(f"{result.student}: {result.status}", refresh=False)
        bar.update(1)

    for result in results:
        finish(result)
    if jobs and cluster is not None:
        from autograder.cluster import grade_on_cluster

        for result in grade_on_cluster(
            cluster, settings, jobs, gradebook or Path(settings.db_url[len("sqlite:///") :])
        ):
            finish(result)
    elif jobs:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, initializer=init_worker) as pool:
            futures = {pool.submit(grade_one, s, str(p), settings, None, str(submissions)): s for s, p in jobs.items()}
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
    parser.add_argument(
        "--feedback",
        type=Path,
        help="write HTML feedback to FEEDBACK/<student>/<assignment>/, "
        "with the submission's timestamp.txt and submission_secret.txt (nbgrader's feedback "
        "layout: `nbgrader release_feedback` releases it)",
    )
    parser.add_argument(
        "--autograded",
        type=Path,
        help="where the graded notebooks go, in nbgrader's layout "
        "AUTOGRADED/<student>/<assignment>/ (hidden tests removed), for grading by hand in "
        "formgrader (default: autograded/ beside --out)",
    )
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
    where.add_argument(
        "--scheduler",
        help="grade on a Dask cluster: the scheduler's address (tls:// off the "
        "loopback), or 'local' for a LocalCluster of --workers processes on 127.0.0.1",
    )
    where.add_argument(
        "--scheduler-file",
        type=Path,
        help="grade on a Dask cluster: the scheduler's file (dask scheduler --scheduler-file FILE)",
    )
    parser.add_argument("--tls-ca-file", help="TLS: the CA that signed the scheduler's and workers' certificates")
    parser.add_argument("--tls-cert", help="TLS: this client's certificate")
    parser.add_argument("--tls-key", help="TLS: this client's private key")
    parser.add_argument(
        "--due",
        help="the due date, written into the gradebook as nbgrader's duedate and kept "
        'for later runs: "YYYY-MM-DD HH:MM[:SS] [ZONE]" (no zone: Exchange.timezone, default UTC); '
        '"none" removes it. Default: the gradebook\'s',
    )
    parser.epilog = (
        "Late penalty settings as in nbgrader_config.py, for this run: "
        "--AssignLatePenalties.plugin_class=autograder.late.PointsPerDay --PointsPerDay.points=1 "
        "--PointsPerDay.cutoff_days=7 --Exchange.timezone=Europe/Berlin"
    )
    parser.add_argument(
        "--replace-late-policy",
        action="store_true",
        help="grade with the late-policy settings given now although the assignment was first "
        "graded with others (kept in the gradebook; without this flag such a run is refused)",
    )
    args, extra = parser.parse_known_args(argv)
    try:
        nbgrader_settings(extra)
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

        cluster = Cluster(
            scheduler=args.scheduler,
            scheduler_file=str(args.scheduler_file or "") or None,
            tls_ca_file=args.tls_ca_file,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            local_workers=args.workers,
        )
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
        rows = grade_class(
            args.assignment,
            args.submissions,
            args.out,
            feedback=args.feedback,
            workers=args.workers,
            sandbox_on=not args.no_sandbox,
            source=args.source,
            gradebook=args.gradebook,
            cell_timeout=args.cell_timeout,
            notebook_timeout=args.notebook_timeout,
            memory_bytes=int(args.memory * 2**30),
            max_processes=args.max_processes,
            output_limit=args.output_limit,
            progress=not args.quiet,
            due=args.due,
            late_flags=extra,
            replace_late_policy=args.replace_late_policy,
            cluster=cluster,
            autograded=args.autograded,
        )
    except sandbox.SandboxUnavailable as exc:
        print(f"autograder grade: refusing to run learners' code: {exc}", file=sys.stderr)
        return 3
    except ClusterError as exc:
        print(f"autograder grade: {exc}", file=sys.stderr)
        return 2
    from autograder.release import library_version

    print("\n".join(summary(rows, args.assignment, time.perf_counter() - started, args.out, library_version())))
    return 0


def summary(rows: list[dict], assignment: str, seconds: float, out: Path, version: str) -> list[str]:
    """What `grade` prints at the end: the count of each status, every integrity flag, the late
    submissions, the similarity flags, and which submissions were released for another
    decodelab version than the one grading them."""
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines = [
        f"graded {len(rows)} submissions of {assignment} in {seconds:.0f} s: "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + f" -> {out}"
    ]
    for row in rows:
        lines += [f"  {row['student']}: {flag}" for flag in row["notes"].split("; ") if flag.startswith("integrity:")]
    late = [r["student"] for r in rows if r.get("late_penalty") not in ("", "0", None)]
    if late:
        lines.append(
            f"  {len(late)} late submission(s) with points off (late_penalty; score is net): {', '.join(late)}"
        )
    unknown = [
        r["student"] for r in rows if any(n.startswith("late:") and "not checked" in n for n in r["notes"].split("; "))
    ]
    if unknown:
        lines.append(f"  {len(unknown)} submission time(s) not read (a late: note; no penalty): {', '.join(unknown)}")
    similar = [r["student"] for r in rows if any(n.startswith("similarity:") for n in r["notes"].split("; "))]
    if similar:
        lines.append(
            f"  {len(similar)} submission(s) with answers like another's or the library's "
            f"(a similarity: note; scores unchanged): {', '.join(similar)}"
        )
    again = [r["student"] for r in rows if any(n.startswith("grader:") for n in r["notes"].split("; "))]
    if again:
        lines.append(
            f"  {len(again)} submission(s) with a grader: note (a lost Dask worker, or a worker that "
            f"refused): {', '.join(again)}"
        )
    other = [row["student"] for row in rows if any(n.startswith("version:") for n in row["notes"].split("; "))]
    if other:
        lines.append(
            f"  {len(other)} submission(s) not released for decodelab {version}, the version grading them "
            f"(a note in their row; scores unchanged): {', '.join(other)}"
        )
    return lines

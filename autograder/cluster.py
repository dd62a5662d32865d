"""Grading a class on a Dask cluster: `grade --scheduler ADDRESS` (or `--scheduler-file FILE`, or
`--scheduler local` for a LocalCluster of --workers processes on 127.0.0.1).

Each submission is one Dask task (`Client.submit(grade_task, ..., resources={"grader": 1})`)
that runs, on the worker's machine, the same per-submission grading the process pool runs
(`grade.grade_one`: a sandboxed kernel; student code never runs in the Dask worker process).
The parent builds the release and the gradebook once; each task gets through Dask what it needs
(the submission's bytes, the released notebook's bytes, a copy of the gradebook for nbgrader's
OverwriteCells, the settings), grades in a private folder of its own on the worker, and sends
back a picklable `grade.Result` (status, notes, the graded notebook). The parent alone writes the
gradebook, the CSV and the feedback, as with the process pool.

Per machine: `python -m autograder worker ADDRESS --nworkers N` (autograder/dask_cli.py: Dask's
worker with the repository on its sys.path; the scheduler, which unpickles each task, is
`python -m autograder scheduler`) runs N worker processes of one `grader` and one thread each, so N
kernels at once; each kernel takes a host-wide sandbox slot (autograder/slots.py), so two
workers on one host never share a kernel uid.

A worker lost mid-task: the scheduler runs the task again elsewhere (its `allowed-failures`), or,
when the scheduler gives up (KilledWorker), the parent submits it again; each task counts its
tries in the scheduler's metadata, and a row graded on a later try gets LOST_NOTE. After
MAX_TRIES tries that all lost their worker the row is `grader_error` (nothing graded, score 0),
never `crashed` (the student's). A worker whose decodelab or autograder differs from the
parent's, that has no SmolLM2 model cache, or that cannot sandbox, refuses: `grader_error` with
the reason.

Security: whoever reaches a Dask scheduler can run any code on its workers, and grading workers
run as root (the sandbox needs it). So an address off the loopback must be tls:// with client
certificates (`--tls-ca-file/--tls-cert/--tls-key`, or Dask's `distributed.comm.tls.*` config);
anything else is refused (`check_address`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

from autograder import student_files
from autograder.notes import short
from decodelab.course.hints import COUNTER_FILE, MAX_COUNTER_BYTES

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = ("127.0.0.1", "localhost", "::1")
RESOURCE = "grader"
MAX_TRIES = 3
LOST_NOTE = "grader: the worker was lost, graded again"
SMOLLM2_DIR = "smollm2-135m-instruct"  # decodelab.model.registry.SMOLLM2_DIR_NAME (a test checks)
RISK = (
    "whoever can reach a Dask scheduler can run any code, as root, on its workers (grading workers "
    "run as root for the sandbox)"
)


class ClusterError(RuntimeError):
    """The cluster cannot be used (an unsafe address, no worker, no grader resource)."""


@dataclass
class Cluster:
    """Where to grade: one of scheduler (an address, or "local") and scheduler_file, and TLS files."""

    scheduler: str | None = None
    scheduler_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    local_workers: int = 2


# --------------------------------------------------------------------------- the address and TLS


def _host(address: str) -> tuple[str, str]:
    """(scheme, host) of a Dask address: tcp://h:p, tls://h:p, h:p, [::1]:p."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "tcp", address
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):
        host = rest[1:].partition("]")[0]
    elif rest.count(":") > 1:  # a bare IPv6 address without a port
        host = rest
    else:
        host = rest.partition(":")[0]
    return scheme.lower(), host.lower()


def address_of(cluster: Cluster) -> str:
    if cluster.scheduler_file:
        try:
            return json.loads(Path(cluster.scheduler_file).read_text())["address"]
        except (OSError, ValueError, KeyError) as exc:
            raise ClusterError(
                f"--scheduler-file {cluster.scheduler_file}: no scheduler address in it ({type(exc).__name__}: {exc})"
            ) from None
    return cluster.scheduler or ""


def security_of(cluster: Cluster, address: str):
    """The client's distributed.Security, or None on the loopback without TLS; ClusterError for
    an address that would hand root on the workers to whoever reaches the scheduler."""
    scheme, host = _host(address)
    files = (cluster.tls_ca_file, cluster.tls_cert, cluster.tls_key)
    if scheme != "tls":
        if any(files):
            raise ClusterError(f"--tls-* options given but the scheduler address {address} is not tls://")
        if host not in LOOPBACK:
            raise ClusterError(
                f"refusing the scheduler {address}: it is neither TLS nor on this machine's loopback, and "
                f"{RISK}. Use a tls:// address with client certificates (--tls-ca-file, --tls-cert, "
                f"--tls-key; README: Grading on a cluster), or a scheduler on 127.0.0.1"
            )
        return None
    from distributed.security import Security

    if any(files):
        if not all(files):
            raise ClusterError("TLS needs all three of --tls-ca-file, --tls-cert and --tls-key")
        return Security(
            tls_ca_file=cluster.tls_ca_file,
            tls_client_cert=cluster.tls_cert,
            tls_client_key=cluster.tls_key,
            require_encryption=True,
        )
    security = Security()  # Dask's config: distributed.comm.tls.{ca-file, client.cert, client.key}
    if not (security.tls_ca_file and security.tls_client_cert):
        raise ClusterError(
            f"the tls:// scheduler {address} needs a CA and a client certificate: pass --tls-ca-file, "
            "--tls-cert and --tls-key, or set distributed.comm.tls.ca-file and "
            "distributed.comm.tls.client.{cert,key} in Dask's config"
        )
    return security


def check(cluster: Cluster):
    """Refuse an unsafe or unreadable cluster setting before any work; returns the Security."""
    if cluster.scheduler == "local":
        return None
    return security_of(cluster, address_of(cluster))


# --------------------------------------------------------------------------- what a worker must match


def versions() -> dict[str, str]:
    """decodelab.__version__ and a digest of autograder's sources: a worker must have the same."""
    import decodelab

    digest = hashlib.sha256()
    base = Path(__file__).resolve().parent
    for path in sorted(base.rglob("*.py")):
        if "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"decodelab": decodelab.__version__, "autograder": digest.hexdigest()[:16]}


def worker_problem(expected: dict[str, str]) -> str | None:
    """Why this worker must not grade (a version differs, the model cache is missing), or None."""
    from decodelab.paths import cache_dir

    mine = versions()
    for what in ("decodelab", "autograder"):
        if mine.get(what) != expected.get(what):
            kind = "version" if what == "decodelab" else "source digest"
            return (
                f"its {what} {kind} {mine.get(what)} differs from the grader's {expected.get(what)}: "
                "install the same Decode Lab on every worker"
            )
    model = cache_dir() / SMOLLM2_DIR / "model.safetensors"
    if not model.is_file():
        return (
            f"its SmolLM2 model cache is missing ({model}): run `python -m decodelab` once on that machine "
            "(or set DECODELAB_CACHE) before grading"
        )
    return None


# --------------------------------------------------------------------------- the task (runs on a worker)

_preflight_lock = threading.Lock()
_preflight: dict[str, str] = {}  # "reason" -> "" once the sandbox worked in this worker process


def _count_try(tag: str) -> int:
    """This task's try number, kept in the scheduler's metadata (1 when there is no scheduler)."""
    try:
        from distributed import get_client

        client = get_client()
        tries = int(client.get_metadata(["decodelab-grader", tag], 0)) + 1
        client.set_metadata(["decodelab-grader", tag], tries)
        return tries
    except Exception:  # noqa: BLE001 - not on a worker (a direct call): the first try
        return 1


def hint_counts_beside(notebook: Path) -> bytes | None:
    """The bytes of the hint counter submitted beside a notebook (a small regular file, never
    through a link), or None."""
    try:
        return student_files.read_bytes(notebook.parent / COUNTER_FILE, MAX_COUNTER_BYTES)
    except (OSError, ValueError):
        return None


def grade_task(
    tag: str,
    student: str,
    notebook: bytes,
    release: bytes,
    gradebook: bytes,
    settings,
    expected: dict[str, str],
    hint_counts: bytes | None = None,
):
    """One submission on a worker: its own folder and slot, then `grade.grade_one`; a Result.
    `hint_counts`: the submitted `.decodelab_hints.json` beside the notebook, if any (its note)."""
    from autograder import sandbox, slots, submission

    submission.quiet()
    where = socket.gethostname()
    tries = _count_try(tag)
    if tries > MAX_TRIES:
        return submission.Result(
            student,
            "grader_error",
            [f"grader: the worker was lost on each of {MAX_TRIES} tries: not graded"],
            tries=tries,
        )
    problem = worker_problem(expected)
    if problem is None and settings.sandbox:
        problem = sandbox.unavailable_reason()
    if problem:
        return submission.Result(
            student, "grader_error", [f"grader: the worker on {where} refused the task: {problem}"], tries=tries
        )
    slot = slots.acquire()
    work = Path(tempfile.mkdtemp(prefix="decodelab-grade-task-"))
    try:
        os.chmod(work, 0o711)  # kernels traverse to their own folder; nothing else here is theirs
        course = work / "c"
        course.mkdir(mode=0o700)
        (course / "release.ipynb").write_bytes(release)
        (course / "gradebook.db").write_bytes(gradebook)
        os.chmod(course / "gradebook.db", 0o600)
        path = course / "submission" / settings.notebook
        path.parent.mkdir(mode=0o700)
        path.write_bytes(notebook)
        if hint_counts is not None:
            (path.parent / COUNTER_FILE).write_bytes(hint_counts)
        local = replace(
            settings,
            release=str(course / "release.ipynb"),
            work=str(work),
            db_url=f"sqlite:///{course / 'gradebook.db'}",
            hide=list(settings.hide) + [str(course)],
        )
        if local.sandbox:
            with _preflight_lock:
                if "reason" not in _preflight:
                    try:
                        sandbox.preflight(
                            work, sandbox.Limits(**local.limits), [Path(p) for p in local.hide], slot.number
                        )
                        _preflight["reason"] = ""
                    except sandbox.SandboxUnavailable as exc:
                        _preflight["reason"] = str(exc)
            if _preflight["reason"]:
                why = short(_preflight["reason"], 300)
                return submission.Result(
                    student, "grader_error", [f"grader: the worker on {where} refused the task: {why}"], tries=tries
                )
        result = submission.grade_one(student, str(path), local, slot=slot.number)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        slot.release()
    result.tries = tries
    return result


# --------------------------------------------------------------------------- the parent


def _client(cluster: Cluster, stack):
    from distributed import Client, LocalCluster

    if cluster.scheduler == "local":
        local = stack.enter_context(
            LocalCluster(
                n_workers=cluster.local_workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                resources={RESOURCE: 1},
                silence_logs=50,
            )
        )
        return stack.enter_context(Client(local))
    address = address_of(cluster)
    return stack.enter_context(Client(address, security=security_of(cluster, address), timeout="60s"))


def _wait_for_graders(client, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while True:
        workers = (
            client.scheduler_info(n_workers=-1).get("workers", {})
            if _takes_n(client)
            else client.scheduler_info().get("workers", {})
        )
        if any((w.get("resources") or {}).get(RESOURCE) for w in workers.values()):
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"no worker of the scheduler offers the '{RESOURCE}' resource "
                f"({len(workers)} worker(s)): start them with "
                "`python -m autograder worker ADDRESS --nworkers N` from the repository root"
            )
        time.sleep(0.5)


def _takes_n(client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


def grade_on_cluster(cluster: Cluster, settings, jobs: dict[str, Path], gradebook: Path) -> Iterator:
    """Submit every job, yield each student's grade.Result as it comes back."""
    from contextlib import ExitStack

    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    from autograder.submission import Result

    release = Path(settings.release).read_bytes()
    expected = versions()
    run = uuid.uuid4().hex[:12]
    notebooks = {}
    for student, path in jobs.items():  # read here, never through a link: workers get the bytes
        try:
            notebooks[student] = student_files.read_bytes(path, student_files.NOTEBOOK_MAX_BYTES)
        except (OSError, ValueError) as exc:
            yield Result(student, "unreadable", [f"not read: {short(exc, 150)}"])
    with ExitStack() as stack:
        client = _client(cluster, stack)
        _wait_for_graders(client)
        book = gradebook.read_bytes()  # after the due date is written

        def submit(student: str):
            return client.submit(
                grade_task,
                f"{run}-{student}",
                student,
                notebooks[student],
                release,
                book,
                settings,
                expected,
                hint_counts_beside(jobs[student]),
                key=f"grade-{student}-{run}-{uuid.uuid4().hex[:6]}",
                resources={RESOURCE: 1},
                pure=False,
            )

        owner, futures = {}, []
        for student in notebooks:
            future = submit(student)
            owner[future.key] = student
            futures.append(future)
        done = as_completed(futures)
        del futures
        for future in done:
            student = owner.pop(future.key)
            try:
                result = future.result()
            except KilledWorker:
                tries = int(client.get_metadata(["decodelab-grader", f"{run}-{student}"], 0))
                if tries < MAX_TRIES:
                    again = submit(student)
                    owner[again.key] = student
                    done.add(again)
                    continue
                result = Result(
                    student,
                    "grader_error",
                    [f"grader: the worker was lost on each of {tries} tries: not graded"],
                    tries=tries,
                )
            except Exception as exc:  # noqa: BLE001 - the task never ran its grading: not the student's fault
                result = Result(
                    student,
                    "grader_error",
                    [f"grader: the task failed on the cluster: {type(exc).__name__}: {short(exc, 200)}"],
                )
            finally:
                future.release()
            if result.tries > 1 and result.status != "grader_error":
                result.notes.insert(0, LOST_NOTE)
            yield result

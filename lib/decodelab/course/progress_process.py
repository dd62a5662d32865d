"""The notebook's subprocess and everything it starts, which die with `python -m decodelab progress`:
`run_until` on progress's side, `die_with_parent` on the subprocess's.

Each notebook runs in its own subprocess (`progress_worker`: ``DECODELAB_FAST=1``,
``NBGRADER_EXECUTION`` unset, stdout and stderr captured, in the notebook's folder), under one
time limit for the whole notebook: an endless loop or a crash of the learner's code costs that
notebook's rows, never the command. After a crash the remaining exercises run in a fresh
subprocess. What the learner's code starts dies with its subprocess (`run_until`): the subprocess
leads a process group of its own, killed at the end; on Linux, progress adopts the orphans of
that tree meanwhile (a child subreaper), so a grandchild that left the group with setsid is
killed too; and the subprocess dies if progress itself is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from pathlib import Path


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
            self.data = (self.data + chunk)[-self.keep :]

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
        proc = subprocess.Popen(
            command,
            cwd=str(cwd),
            env=worker_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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


def die_with_parent(parent: int | None) -> None:
    """In the subprocess, on Linux: be killed when progress is (even by SIGKILL, which leaves it no
    time to kill us)."""
    if linux_prctl(PR_SET_PDEATHSIG, signal.SIGKILL) and parent is not None and os.getppid() != parent:
        os._exit(1)  # progress died before we asked


def describe_death(returncode: int) -> str:
    """How the subprocess ended, for a status: a signal (SIGKILL: out of memory?) or an exit code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = ": out of memory?" if -returncode == signal.SIGKILL else ""
        return f"the kernel died (killed by {name}{hint})"
    return f"the kernel died (exit code {returncode})"

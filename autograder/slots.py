"""Sandbox slots, allocated host-wide: slot N is the kernel uid `sandbox.UID_BASE + N`, and a slot's
clean-up kills every process of that uid, so two graders on one host (two process pools, two
Dask workers, a pool and a worker) must never hold the same slot.

A slot is an exclusive `fcntl.flock` on LOCK_DIR/slot-N (LOCK_DIR: $DECODELAB_GRADER_LOCKS, else
/run/lock/decodelab-grader when /run/lock exists, else decodelab-grader-slots in the system's
temp folder: a folder every grader on the host sees). The kernel frees the lock when its holder
exits or is killed, so a dead grader never leaks a slot; whoever takes a slot next kills what the
uid may still run (`sandbox.kill_uid`) before using it.

    slot = slots.acquire()      # Slot(number, fd); slots.release(slot) or slot exit frees it
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MAX_SLOTS = 512  # uids 61000..61511


@dataclass
class Slot:
    number: int
    fd: int
    path: str

    def release(self) -> None:
        release(self)


def lock_dir() -> Path:
    if os.environ.get("DECODELAB_GRADER_LOCKS"):
        return Path(os.environ["DECODELAB_GRADER_LOCKS"])
    if Path("/run/lock").is_dir() and os.access("/run/lock", os.W_OK):
        return Path("/run/lock/decodelab-grader")
    return Path(tempfile.gettempdir()) / "decodelab-grader-slots"


def acquire(wait: float = 60.0, folder: Path | None = None) -> Slot:
    """The lowest free slot on this host (waits up to `wait` seconds for one); RuntimeError if none."""
    folder = Path(folder) if folder is not None else lock_dir()
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    deadline = time.monotonic() + wait
    while True:
        for number in range(MAX_SLOTS):
            path = folder / f"slot-{number}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return Slot(number, fd, str(path))
        if time.monotonic() > deadline:
            raise RuntimeError(f"no free grading slot in {folder} ({MAX_SLOTS} held on this host)")
        time.sleep(0.2)


def release(slot: Slot) -> None:
    if slot.fd < 0:
        return
    try:
        fcntl.flock(slot.fd, fcntl.LOCK_UN)
    finally:
        os.close(slot.fd)
        slot.fd = -1


def held(folder: Path | None = None) -> list[int]:
    """The slots some process on this host holds now (for tests and diagnostics)."""
    folder = Path(folder) if folder is not None else lock_dir()
    taken = []
    for path in sorted(folder.glob("slot-*")) if folder.is_dir() else []:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            taken.append(int(path.name.partition("-")[2]))
        finally:
            os.close(fd)
    return sorted(taken)

"""What a student submitted, and nothing else: regular files under the submissions folder,
reached without following a link, size-capped.

The grader runs as root, and a student's folder may hold a link to anywhere (/etc/shadow,
/proc/self/environ, another student's work). Every file the grader reads from a submission goes
through `read_bytes`, which opens each folder on the way and the file itself with O_NOFOLLOW
(a link swapped in between a check and the open is refused too), and accepts only a regular
file no larger than the cap. A refusal says why in words that hold nothing read from the file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

NOTEBOOK_MAX_BYTES = 64 * 2**20  # a submitted notebook (outputs included) larger than this is refused
SMALL_FILE_MAX_BYTES = 64 * 2**10  # timestamp.txt, submission_secret.txt, the hint counter


class NotAStudentFile(ValueError):
    """The path is not a regular file of the student's own: a link, a folder, a device, too large."""


def _why(exc: OSError, name: str) -> NotAStudentFile | FileNotFoundError:
    if exc.errno == errno.ENOENT:
        return FileNotFoundError(errno.ENOENT, "no such file", name)
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return NotAStudentFile(f"{name} is a link (not followed)")
    if exc.errno == errno.ENOTDIR:
        return NotAStudentFile(f"{name} is not a folder (a link or a file; not followed)")
    return NotAStudentFile(f"{name} cannot be opened ({errno.errorcode.get(exc.errno, exc.errno)})")


def _open_folder_chain(within: Path, parts: tuple[str, ...]) -> int:
    """An fd of within/parts[0]/.../parts[-1], each step opened without following a link."""
    fd = os.open(within, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise NotAStudentFile(f"{part!r} is not a plain folder name")
            try:
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise _why(exc, part) from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: Path, limit: int, within: Path | None = None) -> bytes:
    """The bytes of `path`, a regular file at most `limit` bytes, reached from the folder
    `within` (default: its own folder) without following any link on the way.
    FileNotFoundError when it is absent; NotAStudentFile when it is anything else."""
    path = Path(path)
    within = Path(within) if within is not None else path.parent
    try:
        parts = path.relative_to(within).parts
    except ValueError:
        raise NotAStudentFile(f"{path} is not inside {within}") from None
    if not parts:
        raise NotAStudentFile(f"{path} is a folder")
    folder = _open_folder_chain(within, parts[:-1])
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        except OSError as exc:
            raise _why(exc, parts[-1]) from None
    finally:
        os.close(folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotAStudentFile(f"{parts[-1]} is not a regular file")
        if info.st_size > limit:
            raise NotAStudentFile(f"{parts[-1]} is larger than {limit:,} bytes")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:  # it grew while being read
            raise NotAStudentFile(f"{parts[-1]} is larger than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_real_folder(path: Path) -> bool:
    """A folder itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def listing(folder: Path, limit: int = 1000) -> list[str]:
    """The names of the regular files under a real folder, relative to it, links not followed
    (a link is listed by its own name, marked "(link)"); at most `limit` names."""
    if not is_real_folder(folder):
        return []
    found = []
    for top, dirs, files in os.walk(folder, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != ".ipynb_checkpoints")
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            full = Path(top) / name
            label = str(full.relative_to(folder))
            found.append(label + " (link)" if full.is_symlink() else label)
            if len(found) >= limit:
                return found
    return found

"""Run a command as another OS user who can still run this Python: the students of the exchange test.

    python tests/as_user.py USER -- nbgrader fetch_assignment 00_meet_the_model     # as root
    python tests/as_user.py USER --reach /root/repo/hub -- jupyterhub-singleuser    # and that folder

nbgrader takes a student's name from the uid of the process, so each student's commands must
run as that student's own user. The Python running the tests may live where other users cannot
reach it (a pyenv or a checkout under /root, mode 0700). Like the grading sandbox does for its
kernels (autograder/sandbox.py), this launcher enters a mount namespace of its own, covers each
folder others cannot traverse on the way to this Python with an empty tmpfs, binds this
Python's folders (and each --reach FOLDER) back read-only, then drops to USER (uid, gid, no
other groups) and execs the command with the environment and working directory it was given.
Nothing changes outside the namespace; where every folder is already open it only drops to USER.
"""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The sandbox's own mount primitives: one implementation of "bind a closed folder back".
from autograder.sandbox import (  # noqa: E402
    CLONE_NEWNS,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    _bind,
    _check,
    _first_closed_ancestor,
    _libc,
    _mount,
    _traversable_by_others,
)


def reach_python(paths: list[str]) -> None:
    """In a new mount namespace: make each of paths readable by any user (read-only)."""
    closed: dict[Path, list[Path]] = {}
    for path in map(Path, dict.fromkeys(paths)):
        if path.exists() and not _traversable_by_others(path):
            top = _first_closed_ancestor(path)
            if top is not None and top != path:
                closed.setdefault(top, []).append(path)
    if not closed:
        return
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(mount)")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
    fds = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for paths_ in closed.values() for path in paths_}
    for top in sorted(closed, key=lambda p: len(p.parts)):
        _mount(libc, "tmpfs", str(top), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for path in sorted(closed[top], key=lambda p: len(p.parts)):
            _bind(libc, fds[path], path, readonly=True)


def main(argv: list[str]) -> None:
    usage = "usage: python tests/as_user.py USER [--reach FOLDER]... -- COMMAND [ARG...]"
    reach = []
    while len(argv) > 2 and argv[1] == "--reach":  # more folders the command must read (the hub's role configs)
        reach.append(argv[2])
        argv = [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit(usage)
    user = pwd.getpwnam(argv[0])
    reach_python([sys.base_prefix, sys.prefix, *reach])
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)
    command = argv[2:]
    os.execvpe(command[0], command, dict(os.environ))


if __name__ == "__main__":
    main(sys.argv[1:])

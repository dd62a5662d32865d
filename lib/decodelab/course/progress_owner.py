"""Progress run as root: it runs the learner's code, so as root it runs only code that root alone
can change.

It runs the learner's own code, as the notebook does: it is meant for the learner's own folder.
Run as root, it runs only code that root alone can change (`check_owner`): every folder on the
way to the course and its notebooks, and everything in each notebook's folder (the notebook, and
what its cells can import from there), must belong to root and be writable by no one else; else
it refuses, naming the file and its owner, and says how to run it as that user instead.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from decodelab.course.progress_plan import ProgressError, course_folder, find_notebooks


def check_owner(course_dir, notebooks=None) -> None:
    """As root, refuse (ProgressError) to run code that anyone but root can change: a folder on
    the way to the course or to one of `notebooks` (default: all of the course's), or anything in a
    notebook's folder, that is not root's or that another user may write. Anyone else runs their
    own code: nothing to check."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return
    notebooks = find_notebooks(course_dir) if notebooks is None else notebooks
    code = set().union(*(_everything_in(Path(nb).parent.resolve()) for nb in notebooks))
    course = course_folder(course_dir).resolve()
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
        return (
            f"{path} belongs to {user} (uid {info.st_uid}), and progress would run the code in it as root. "
            f"Run it as that user instead: sudo -u {user} python -m decodelab progress --course {course_dir}"
        )
    if shared_ok and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
        return None
    if info.st_mode & stat.S_IWOTH:
        who = "every user"
    elif info.st_mode & stat.S_IWGRP and info.st_gid != 0:
        who = f"the group {_group_name(info.st_gid)} (gid {info.st_gid})"
    else:
        return None
    return (
        f"{path} can be written by {who} (mode {stat.S_IMODE(info.st_mode):o}), and progress would run the "
        f"code in it as root: make it root's alone (chmod go-w), or run progress as the learner whose "
        f"notebooks these are"
    )


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

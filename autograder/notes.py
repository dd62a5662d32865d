"""The words of the grader's `notes` column: short, one line, no "; " (the column joins notes with it)."""

from __future__ import annotations

from pathlib import Path


def short(text, n: int = 120) -> str:
    """text on one line, cut to n characters with an ellipsis."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def number(x: float) -> str:
    """A score as the CSV writes it: 3, 2.5, 0.333333."""
    return f"{x:g}"


def version_note(nb, version: str) -> str | None:
    """A note for the instructor when the submission was released for another decodelab than the
    one grading it (release.py records `decodelab.__version__` in the notebook's metadata), or
    records none; None when they agree. Never changes a score."""
    from autograder.release import recorded_version

    recorded = recorded_version(nb)
    if recorded == version:
        return None
    if recorded is None:
        return f"version: the notebook records no decodelab version (graded with {version})"
    return f"version: the notebook was released for decodelab {recorded} (graded with {version})"


def hints_note(folder: Path, assignment: str) -> str | None:
    """ "hints: ex_top_k_filter 2, ex_top_p_filter 1" from the hint counter the notebook's hint
    buttons write beside it (decodelab/course/hints.py, `.decodelab_hints.json`), when it was
    submitted as a regular file (a link is not followed); None when it was not or no hint was used. Information only: never scored."""
    from autograder import student_files
    from decodelab.course import hints

    try:
        raw = student_files.read_bytes(Path(folder) / hints.COUNTER_FILE, hints.MAX_COUNTER_BYTES)
        counts = hints.counts_from_text(raw.decode("utf-8"))
    except (OSError, ValueError):  # absent, a link, too large, not text: no note
        return None
    return hints.note(counts, assignment)


def one_note(text, n: int = 120) -> str:
    """short(text, n) that reads as one note of the column: "; " (its separator) becomes ", ", so that a
    failure message such as "you predicted 2; the answer is 8" is not split in two."""
    return short(str(text).replace("; ", ", "), n)

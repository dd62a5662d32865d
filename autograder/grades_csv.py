"""grades.csv: one row per (student, assignment), written atomically after every student.

Columns an instructor added (a "comment" column, a curve) are kept, in their place after ours,
for every row, across regrades: grading only ever writes COLUMNS.
"""

from __future__ import annotations

import csv
import os
import secrets
from pathlib import Path

COLUMNS = ("student", "assignment", "score", "max_score", "status", "notes", "submitted_at", "late_penalty")


class GradesFileError(ValueError):
    """An existing grades CSV that cannot be read back (so it is never overwritten)."""


def write_csv(path: Path, rows: dict[tuple[str, str], dict]) -> None:
    """Atomically: every row kept, one per (student, assignment), COLUMNS then any other column
    the rows hold, in the order first seen."""
    extra = list(dict.fromkeys(k for row in rows.values() for k in row if k not in COLUMNS))

    def write(f) -> None:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *extra], restval="")
        writer.writeheader()
        for key in sorted(rows, key=lambda k: (k[1], k[0])):
            writer.writerow(rows[key])

    write_atomically(path, write)


def write_atomically(out: Path, write, encoding: str = "utf-8") -> None:
    """write(file) into a new file beside out, then renamed over it: out is the whole file or
    stays as it was (OSError if it cannot be written)."""
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(8)}.tmp")  # a fresh name, no one else's file
    try:
        with open(tmp, "x", newline="", encoding=encoding) as f:
            write(f)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def read_csv(path: Path) -> dict[tuple[str, str], dict]:
    """(student, assignment) -> the row, every column kept; {} when there is no file yet.
    GradesFileError when the file is there but is not a grades CSV we can read back."""
    if not path.exists():
        return {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, strict=True)
            header = reader.fieldnames or []
            missing = [c for c in ("student", "assignment") if c not in header]
            if missing:
                raise GradesFileError(
                    f"{path}: not a grades CSV (no {', '.join(missing)} column); give another --out or move it away"
                )
            rows = {}
            for row in reader:
                row.pop(None, None)  # cells beyond the header
                rows[(row["student"], row["assignment"])] = {
                    **{k: "" for k in COLUMNS},
                    **{k: v or "" for k, v in row.items()},
                }
            return rows
    except (UnicodeDecodeError, csv.Error, OSError) as exc:
        raise GradesFileError(
            f"{path}: cannot be read back ({type(exc).__name__}: {exc}); give another --out or mend it"
        ) from None

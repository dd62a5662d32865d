"""grades.csv: one row per (student, assignment), written atomically after every student."""
from __future__ import annotations

import csv
import os
from pathlib import Path

COLUMNS = ("student", "assignment", "score", "max_score", "status", "notes", "submitted_at", "late_penalty")


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

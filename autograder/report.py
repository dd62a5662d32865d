"""python -m autograder report: one page on how a class did on one assignment.

    python -m autograder report --assignment 02_sampling --grades grades.csv [--gradebook gradebook.db]
        [--submissions DIR] [--out report.html] [--json]

It reads what `grade` wrote — grades.csv (scores, statuses, the notes column) and nbgrader's
gradebook beside it (points per test cell) — and, with --submissions, each student's prediction
answers (the `q_` cells, read as numbers, never run). It computes, for the class:

* the score distribution and the count of each status;
* per test cell: how many earned full marks, the mean points, and the failure messages of those
  who did not, clustered (numbers and quoted text masked) with the most common first;
* hints opened per exercise (the grader's "hints:" notes);
* per prediction (`q_` cell): its pass rate and, with --submissions, each answer's ratio to the
  solution's answer;
* late submissions, similarity and integrity flags, and when work was submitted against the due date.

The page is one HTML file (plotly inlined, no server, no network); student text (notes, names) is
escaped and never put inside a plot. --json writes the same numbers for scripts instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
import sys
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from autograder.export import ExportError, check_gradebook, read_grades
from autograder.notes import short

ROOT = Path(__file__).resolve().parents[1]
SHOWN_MESSAGES = 3  # clusters of failure messages kept per test cell
MAX_ANSWER_BYTES = 20_000_000  # a submitted notebook larger than this is not read for its answers
FAILED = re.compile(r"^(?P<gid>[A-Za-z0-9_]+) failed: (?P<why>.*)$")
HINTS = re.compile(r"^hints: (?P<counts>.*)$")


@dataclass
class CellStats:
    """One graded cell across the class (from the gradebook; `messages` from the notes)."""

    grade_id: str
    max_points: float
    graded: int = 0  # submissions with a score for this cell
    waiting: int = 0  # submissions whose answer waits for a person (formgrader): not graded yet
    full_marks: int = 0
    total_points: float = 0.0
    messages: list = field(default_factory=list)  # [{"message": example, "pattern": masked, "count": n}]

    @property
    def pass_rate(self) -> float | None:
        return self.full_marks / self.graded if self.graded else None

    @property
    def mean_points(self) -> float | None:
        return self.total_points / self.graded if self.graded else None


@dataclass
class Prediction:
    grade_id: str  # test_q_<name>
    truth: float | None  # the solution's answer; None when it is not a number
    answers: dict = field(default_factory=dict)  # student -> the number answered (None: unanswered or not a number)

    def ratios(self) -> list[float]:
        """answer / truth for each numeric answer (truth non-zero)."""
        if not self.truth:
            return []
        return [a / self.truth for a in self.answers.values() if isinstance(a, (int, float))]


# --------------------------------------------------------------------------- reading what grade wrote


def failure_pattern(why: str) -> str:
    """A failure message with what varies between students masked: quoted text -> '…', numbers -> #."""
    masked = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", why)
    masked = re.sub(r"[-+]?\d[\d,_]*(\.\d+)?([eE][-+]?\d+)?", "#", masked)
    return " ".join(masked.split())


def notes_of(row: dict) -> list[str]:
    return [n for n in (row.get("notes") or "").split("; ") if n]


def hint_counts(note: str) -> dict[str, int]:
    """ "hints: ex_a 2, ex_b 1" -> {"ex_a": 2, "ex_b": 1} (what autograder.notes.hints_note writes)."""
    match = HINTS.match(note)
    counts = {}
    for part in match["counts"].split(", ") if match else []:
        name, _, n = part.rpartition(" ")
        if name and n.isdigit():
            counts[name] = int(n)
    return counts


def read_cells(gradebook: Path, assignment: str, students: list[str]) -> tuple[dict[str, CellStats], object]:
    """grade_id -> CellStats over these students' submissions, and the assignment's due date (naive
    UTC, or None). A student with no submission in the gradebook is not counted in any cell."""
    from nbgrader.api import Gradebook, MissingEntry

    check_gradebook(gradebook)
    cells: dict[str, CellStats] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Gradebook(f"sqlite:///{Path(gradebook).resolve()}") as gb:
            try:
                found = gb.find_assignment(assignment)
            except MissingEntry:
                raise ExportError(f"--gradebook {gradebook}: no assignment {assignment!r} in it") from None
            due = found.duedate
            for notebook in found.notebooks:
                for cell in notebook.grade_cells:
                    cells[cell.name] = CellStats(cell.name, float(cell.max_score))
            for student in students:
                try:
                    submission = gb.find_submission(assignment, student)
                except MissingEntry:
                    continue
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        stats = cells.setdefault(grade.name, CellStats(grade.name, float(grade.max_score)))
                        if grade.auto_score is None and grade.manual_score is None:
                            stats.waiting += 1
                            continue
                        stats.graded += 1
                        stats.total_points += float(grade.score)
                        stats.full_marks += float(grade.score) >= float(grade.max_score)
    return cells, due


def cluster_failures(rows: list[dict], cells: dict[str, CellStats]) -> None:
    """Fill each cell's `messages`: its failure notes, clustered by failure_pattern, most common first."""
    by_cell: dict[str, Counter] = {}
    example: dict[tuple[str, str], str] = {}
    for row in rows:
        for note in notes_of(row):
            match = FAILED.match(note)
            if match and match["gid"] in cells:
                pattern = failure_pattern(match["why"])
                by_cell.setdefault(match["gid"], Counter())[pattern] += 1
                example.setdefault((match["gid"], pattern), match["why"])
    for gid, counter in by_cell.items():
        cells[gid].messages = [
            {"pattern": p, "message": example[(gid, p)], "count": n}
            for p, n in sorted(counter.items(), key=lambda pn: (-pn[1], pn[0]))[:SHOWN_MESSAGES]
        ]


# --------------------------------------------------------------------------- predictions


def _number(node, depth: int = 0):
    """The value of a constant arithmetic expression (numbers, + - * / // % **, unary -), else None.
    Student text is never run: anything else (a name, a call) is not a number here."""
    if depth > 50:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _number(node.operand, depth + 1)
        return None if value is None else (value if isinstance(node.op, ast.UAdd) else -value)
    if isinstance(node, ast.BinOp):
        left, right = _number(node.left, depth + 1), _number(node.right, depth + 1)
        if left is None or right is None:
            return None
        try:
            if isinstance(node.op, ast.Pow):
                if abs(right) > 64 or abs(left) > 1e12:  # no 9 ** 9 ** 9
                    return None
                return float(left) ** right
            ops = {
                ast.Add: lambda: left + right,
                ast.Sub: lambda: left - right,
                ast.Mult: lambda: left * right,
                ast.Div: lambda: left / right,
                ast.FloorDiv: lambda: left // right,
                ast.Mod: lambda: left % right,
            }
            op = ops.get(type(node.op))
            value = op() if op else None
        except (ArithmeticError, ValueError):
            return None
        if isinstance(value, int) and abs(value) > 10**30:
            return None
        return value
    return None


def answer_in(source: str, name: str):
    """The number `name = <constant arithmetic>` assigns in a cell's source, read without running it;
    None when the cell does not assign it a number."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    value = None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            value = _number(stmt.value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _cells_by_id(nb) -> dict[str, str]:
    return {
        cell.get("metadata", {}).get("nbgrader", {}).get("grade_id"): cell.get("source", "")
        for cell in nb.get("cells", [])
        if isinstance(cell, dict)
    }


def read_predictions(
    assignment: str, cells: dict[str, CellStats], source: Path, submissions: Path | None, students: list[str]
) -> list[Prediction]:
    """One Prediction per `test_q_` cell: the solution notebook's answer (the instructor's code, run)
    and, with submissions, each student's (read as a constant, never run)."""
    import nbformat

    from autograder import student_files

    solution = source / assignment / f"{assignment}.ipynb"
    truth_source = _cells_by_id(nbformat.read(solution, as_version=4)) if solution.is_file() else {}
    predictions = []
    for gid in sorted(g for g in cells if g.startswith("test_q_")):
        name = gid.removeprefix("test_")
        truth = None
        if name in truth_source:
            namespace: dict = {}
            exec(compile(truth_source[name], f"<{solution.name}:{name}>", "exec"), namespace)  # noqa: S102 - ours
            value = namespace.get(name)
            truth = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        predictions.append(Prediction(gid, truth))
    if submissions is None or not predictions:
        return predictions
    for student in students:
        path = submissions / student / assignment / f"{assignment}.ipynb"
        try:
            nb = json.loads(student_files.read_bytes(path, MAX_ANSWER_BYTES))
            sources = _cells_by_id(nb) if isinstance(nb, dict) else {}
        except (OSError, ValueError):
            sources = {}
        for prediction in predictions:
            name = prediction.grade_id.removeprefix("test_")
            text = sources.get(name)
            prediction.answers[student] = answer_in("".join(text) if isinstance(text, list) else str(text or ""), name)
    return predictions


# --------------------------------------------------------------------------- the report


def _parse_time(text: str):
    try:
        moment = datetime.fromisoformat(text.strip())
    except (ValueError, AttributeError):
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def build(
    assignment: str, grades: Path, gradebook: Path, submissions: Path | None = None, source: Path = ROOT / "solutions"
) -> dict:
    """The report's numbers (what --json writes; the HTML page draws them)."""
    rows = read_grades(grades, assignment)
    students = sorted(r["student"] for r in rows)
    cells, due = read_cells(gradebook, assignment, students)
    cluster_failures(rows, cells)
    predictions = read_predictions(assignment, cells, source, submissions, students)

    hints: dict[str, dict] = {}
    for row in rows:
        for note in notes_of(row):
            for exercise, n in hint_counts(note).items():
                entry = hints.setdefault(exercise, {"students": 0, "rungs": 0})
                entry["students"] += 1
                entry["rungs"] += n
    due_utc = due.replace(tzinfo=timezone.utc) if due is not None else None
    hours_after_due = {}
    for row in rows:
        moment = _parse_time(row.get("submitted_at") or "")
        if moment is not None and due_utc is not None:
            hours_after_due[row["student"]] = round((moment - due_utc).total_seconds() / 3600, 3)

    def flagged(prefix: str) -> dict[str, list[str]]:
        found = {r["student"]: [n for n in notes_of(r) if n.startswith(prefix)] for r in rows}
        return {s: found[s] for s in sorted(found) if found[s]}

    scores = [float(r["score"]) for r in rows]
    maxima = [float(r["max_score"]) for r in rows if (r.get("max_score") or "").strip()]
    test_cells = [c for c in cells.values() if not c.grade_id.startswith("test_q_")]
    return {
        "assignment": assignment,
        "students": len(rows),
        "max_score": max(maxima) if maxima else None,
        "scores": {r["student"]: float(r["score"]) for r in rows},
        "score_mean": statistics.fmean(scores) if scores else None,
        "score_median": statistics.median(scores) if scores else None,
        "statuses": dict(sorted(Counter(r.get("status") or "" for r in rows).items())),
        "cells": [{**asdict(c), "pass_rate": c.pass_rate, "mean_points": c.mean_points} for c in cells.values()],
        "failed_most": [
            c.grade_id
            for c in sorted(test_cells, key=lambda c: (-(c.graded - c.full_marks), c.grade_id))
            if c.graded > c.full_marks
        ],
        "hints": dict(sorted(hints.items())),
        "predictions": [
            {
                "grade_id": p.grade_id,
                "truth": p.truth,
                "answers": p.answers,
                "pass_rate": cells[p.grade_id].pass_rate,
                "median_ratio": statistics.median(p.ratios()) if p.ratios() else None,
            }
            for p in predictions
        ],
        "late": {
            r["student"]: float(r["late_penalty"])
            for r in rows
            if _is_number(r.get("late_penalty")) and float(r["late_penalty"]) > 0
        },
        "due": due_utc.isoformat() if due_utc else None,
        "hours_after_due": hours_after_due,
        "similarity": flagged("similarity:"),
        "integrity": flagged("integrity:"),
    }


def _is_number(text) -> bool:
    try:
        return math.isfinite(float(text))
    except (TypeError, ValueError):
        return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autograder report",
        description="One HTML page (or --json) on how a class did on an assignment: scores, statuses, pass rate "
        "and clustered failure messages per test cell, hints opened, predictions, late and "
        "similarity flags, submission times. Reads what `grade` wrote.",
    )
    parser.add_argument("--assignment", required=True, help="the assignment (e.g. 02_sampling)")
    parser.add_argument("--grades", type=Path, default=Path("grades.csv"), help="grade's --out (default grades.csv)")
    parser.add_argument("--gradebook", type=Path, help="nbgrader gradebook (default: gradebook.db beside --grades)")
    parser.add_argument(
        "--submissions",
        type=Path,
        help="the graded submissions (<student>/<assignment>/<assignment>.ipynb): adds each "
        "prediction's answers (read as numbers, never run)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=ROOT / "solutions",
        help="the solution notebooks, for the predictions' answers (default: solutions/)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="the page to write (default report-<assignment>.html; with "
        "--json, report-<assignment>.json; '-' prints the JSON)",
    )
    parser.add_argument("--json", action="store_true", help="write the numbers as JSON instead of a page")
    args = parser.parse_args(argv)
    gradebook = args.gradebook or args.grades.with_name("gradebook.db")
    try:
        if args.submissions is not None and not args.submissions.is_dir():
            raise ExportError(f"--submissions {args.submissions}: not a folder")
        report = build(args.assignment, args.grades, gradebook, args.submissions, args.source)
    except ExportError as exc:
        print(f"autograder report: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(f"report-{args.assignment}.{'json' if args.json else 'html'}")
    if args.json:
        text = json.dumps(report, indent=1, sort_keys=True)
        if str(out) == "-":
            print(text)
            return 0
    else:
        from autograder.report_page import render

        text = render(report)
    if out.is_dir():
        print(f"autograder report: --out {out}: a folder; give the file to write", file=sys.stderr)
        return 2
    from autograder.grades_csv import write_atomically

    try:
        write_atomically(out, lambda f: f.write(text))
    except OSError as exc:
        print(f"autograder report: --out {out}: {short(exc, 200)}", file=sys.stderr)
        return 2
    print(f"{args.assignment}: {report['students']} students -> {out}")
    return 0

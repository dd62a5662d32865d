"""Export the grades for an LMS.

    python -m autograder export --format canvas --grades grades.csv --roster canvas_export.csv \\
        --out canvas.csv [--assignment NAME] [--column "Assignment Name (12345)"]
    python -m autograder export --format long --grades grades.csv --out cells.csv \\
        [--gradebook gradebook.db] [--assignment NAME]

canvas: the roster is Canvas's own gradebook export (Grades > Export): the columns Student, ID,
SIS User ID, SIS Login ID (Integration ID, Root Account if present), Section, then one column per
assignment named "Assignment Name (id)" and Canvas's read-only totals; a "Points Possible" row
(and, in some exports, a posting-policy row) follows the header. Each student of grades.csv is
found by SIS Login ID, else SIS User ID, else Canvas ID (compared without case or surrounding
spaces); the score (net of any late penalty) goes into the column of the matching assignment:
the one whose name before " (id)" is the assignment's name, or --column. Every other cell,
row, the delimiter and a byte-order mark are kept, so the file imports back (Grades > Import).
Students missing from either side are listed on stderr; the exit status is 1 only if no
student matched with a score to fill in (then nothing is written).

Rows with no grade of the student's making get a blank cell, for the instructor to decide, and
a line on stderr, "left blank: NAME (status: notes)": grader_error (the grader failed: nothing
graded), missing (nothing submitted: nothing graded), and unreadable unless its note names the
student's doing. The student's doing, whose 0 stands: a file that "is not a valid notebook", or
one "not read" because it is a link, not a folder, not a regular file, or larger than the cap
(autograder/student_files.py); any other unreadable row (the grader could not open or read a
regular file: permissions, an I/O error) is left blank.

long: one row per student x graded test cell: student, assignment, grade_id, points,
max_points, read from the nbgrader gradebook `grade` leaves (default: gradebook.db beside
grades.csv). Points are the test cells' own, before any late penalty (which is per notebook).

Bad input is an error naming the file and line, with exit status 2 and one line on stderr,
"autograder export: error: ...": a score that is not a number >= 0 (grade writes nothing else,
so the file was edited by hand), a quote never closed, a row of another width than the header,
a file that is not UTF-8. The roster's delimiter (comma, semicolon or tab) is csv.Sniffer's,
which reads quoted cells as cells, else the one most frequent outside quotes in its header.
The export is written to a new file beside --out, then renamed over it: when anything fails
nothing is written and an existing --out is left as it was. --out is a file in a folder that
exists, and none of the inputs. Against CSV injection, a cell this export writes (the score; in
long, the student, assignment and grade_id) that starts with =, +, -, @, a tab or a carriage
return gets a leading ' (OWASP's advice). Canvas's own cells are written back as they came: they
must import back unchanged (a ' before another assignment's -2 would change that grade).
"""

from __future__ import annotations

import csv
import io
import re
import sys
import warnings
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from autograder import grades_csv
from autograder.notes import short

ASSIGNMENT_COLUMN = re.compile(r"^(?P<name>.*)\s\((?P<id>\d+)\)$")
KEYS = ("SIS Login ID", "SIS User ID", "ID")  # how a student is found, first match wins
NOT_STUDENT = re.compile(r"^\s*(Muted|Manual Posting.*|\(read only\))?\s*$", re.I)
TEST_STUDENTS = {"student, test", "test student"}  # Canvas's Student View user
LONG_COLUMNS = ("student", "assignment", "grade_id", "points", "max_points")
DELIMITERS = ",;\t"  # what Canvas writes (the locale decides)
SNIFFED_LINES = 20
SCORE = re.compile(r"[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")  # as `notes.number` writes it, or by hand
NOTHING_GRADED = ("grader_error", "missing")
# unreadable, and the student's doing: the score 0 stands (the notes of submission.py and cluster.py)
STUDENTS_OWN_UNREADABLE = re.compile(
    r"is not a valid notebook: |not read: [^;]*? (is a link|is not a folder|is not a regular file|is larger than)\b"
)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet may run as a formula


class ExportError(Exception):
    """A file or option the export cannot use; the message says which and why."""


# --------------------------------------------------------------------------- grades.csv


def read_grades(path: Path, assignment: str | None = None) -> list[dict]:
    """The rows of a grades CSV (`python -m autograder grade --out`), of one assignment if given."""
    records = parse_csv(_read_text(path, "--grades"), path, "--grades")
    header = records[0][1] if records else []
    missing = [c for c in ("student", "assignment", "score", "max_score") if c not in header]
    if missing:
        raise ExportError(
            f"--grades {path}: not a grades CSV of `python -m autograder grade` (no column "
            f"{', '.join(repr(c) for c in missing)})"
        )
    check_widths(records, path, "--grades")
    rows = []
    for line, cells in records[1:]:
        row = dict(zip(header, cells))
        if row["student"] and (assignment is None or row["assignment"] == assignment):
            where = f"--grades {path}: line {line} ({short(row['student'], 60)}, {short(row['assignment'], 60)})"
            row["score"] = checked_score(row["score"], where)
            rows.append(row)
    if not rows:
        raise ExportError(f"--grades {path}: no rows" + (f" for assignment {assignment!r}" if assignment else ""))
    return rows


def checked_score(text: str, where: str) -> str:
    """The score as a plain decimal (3, 2.5, 0.00001); ExportError naming the row for anything
    else: grade writes only numbers >= 0, so another value was typed into the file by hand."""
    text = text.strip()
    if not SCORE.fullmatch(text):
        raise ExportError(
            f"{where}: the score {text!r} is not a number >= 0 (grade writes only numbers: "
            "was the file edited by hand?)"
        )
    return format(Decimal(text), "f") if "e" in text.lower() else text


def why_left_blank(row: dict) -> str | None:
    """ "status: notes" when the row's score is not one the student earned, so the LMS gets a blank
    cell for the instructor to decide; None when the score stands (see the module docstring)."""
    status, notes = row.get("status", "").strip(), row.get("notes", "")
    if status in NOTHING_GRADED or (status == "unreadable" and not STUDENTS_OWN_UNREADABLE.search(notes)):
        return f"{status}: {short(notes, 150) or 'no notes'}"
    return None


# --------------------------------------------------------------------------- CSV files in and out


def _read_bytes(path: Path, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ExportError(f"{option} {path}: no such file") from None
    except IsADirectoryError:
        raise ExportError(f"{option} {path}: a folder, not a CSV file") from None
    except OSError as exc:
        raise ExportError(f"{option} {path}: cannot be read ({exc.strerror})") from None


def _decode(raw: bytes, path: Path, option: str) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ExportError(f"{option} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _read_text(path: Path, option: str) -> str:
    return _decode(_read_bytes(path, option), path, option)


def parse_csv(text: str, path: Path, option: str, delimiter: str = ",") -> list[tuple[int, list[str]]]:
    """(line number, cells) of every record of a CSV text, blank lines left out; ExportError naming
    the line of a malformed record (a quote never closed, text after a closing quote)."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    records = []
    while True:
        line = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            return records
        except csv.Error as exc:
            why = "a quote opened here is never closed" if "unexpected end of data" in str(exc) else str(exc)
            raise ExportError(f"{option} {path}: line {line}: not valid CSV ({why})") from None
        if cells:
            records.append((line, cells))


def check_widths(records: list[tuple[int, list[str]]], path: Path, option: str) -> None:
    """ExportError naming the first record whose number of cells is not the header's."""
    width = len(records[0][1])
    for line, cells in records[1:]:
        if len(cells) != width:
            raise ExportError(f"{option} {path}: line {line} has {len(cells)} cells, the header {width}")


def sniff_delimiter(text: str) -> str:
    """The delimiter of a CSV text, one of DELIMITERS: csv.Sniffer's guess from its first lines
    (it reads quoted cells as cells), else the one found most often outside quotes in its header."""
    sample = "".join(text.splitlines(keepends=True)[:SNIFFED_LINES])
    try:
        return csv.Sniffer().sniff(sample, delimiters=DELIMITERS).delimiter
    except csv.Error:  # no quoted cell, and no delimiter as frequent on every line
        counts = dict.fromkeys(DELIMITERS, 0)
        quoted = False
        for char in text:
            if char == '"':
                quoted = not quoted
            elif char == "\n" and not quoted:
                break
            elif char in counts and not quoted:
                counts[char] += 1
        return max(DELIMITERS, key=counts.get)  # a tie: the first, a comma


def inert(cell: str) -> str:
    """The cell as a spreadsheet shows it, never runs it: one that starts like a formula gets a
    leading ' (OWASP's advice against CSV injection)."""
    return "'" + cell if cell.startswith(FORMULA_STARTS) else cell


def check_out(out: Path, inputs: dict[str, Path | None]) -> None:
    """ExportError unless --out names a file that can be written: in a folder that exists, not
    a folder itself, none of the input files (option -> path)."""
    if out.is_dir():
        raise ExportError(f"--out {out}: a folder; give the name of the file to write")
    folder = out.parent
    if not folder.is_dir():
        raise ExportError(
            f"--out {out}: the folder {folder} " + ("is not a folder" if folder.exists() else "does not exist")
        )
    for option, path in inputs.items():
        if path is not None and out.resolve() == Path(path).resolve():
            raise ExportError(f"--out {out}: the {option} file itself; write the export to another file")


def write_atomically(out: Path, write, encoding: str = "utf-8") -> None:
    """grades_csv.write_atomically, with ExportError if it cannot be written."""
    try:
        grades_csv.write_atomically(out, write, encoding)
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot be written ({exc.strerror})") from None


# --------------------------------------------------------------------------- Canvas


@dataclass
class Roster:
    """A Canvas gradebook export, kept cell for cell."""

    header: list[str]
    rows: list[list[str]]
    delimiter: str = ","
    bom: bool = False
    newline: str = "\r\n"

    def is_student(self, row: list[str]) -> bool:
        if not row or "Points Possible" in row[0]:
            return False
        return not all(NOT_STUDENT.match(cell or "") for cell in row)

    def column(self, name: str) -> int | None:
        names = [h.strip() for h in self.header]
        return names.index(name) if name in names else None

    def assignment_columns(self) -> dict[str, int]:
        """ "Name (id)" -> its index, for every assignment column."""
        return {h.strip(): i for i, h in enumerate(self.header) if ASSIGNMENT_COLUMN.match(h.strip())}

    def points_possible(self, index: int) -> str:
        row = next((r for r in self.rows if r and "Points Possible" in r[0]), None)
        return row[index].strip() if row is not None and index < len(row) else ""


def read_roster(path: Path) -> Roster:
    """Canvas's gradebook CSV (comma, semicolon or tab separated, with or without a BOM)."""
    raw = _read_bytes(path, "--roster")
    text = _decode(raw, path, "--roster")
    delimiter = sniff_delimiter(text)
    records = parse_csv(text, path, "--roster", delimiter)
    header = records[0][1] if records else []
    if len(header) < 3 or "Student" not in header[0] or "ID" not in [h.strip() for h in header]:
        raise ExportError(
            f"--roster {path}: not a Canvas gradebook export (its first columns are Student, ID, "
            f"SIS User ID, SIS Login ID, Section; got {', '.join(header[:5]) or 'nothing'})"
        )
    check_widths(records, path, "--roster")
    return Roster(
        header,
        [cells for _, cells in records[1:]],
        delimiter,
        raw.startswith(b"\xef\xbb\xbf"),
        "\r\n" if "\r\n" in text else "\n",
    )


def find_column(roster: Roster, assignment: str, column: str | None) -> int:
    """The roster's column for an assignment: `column` exactly, else the one whose name before
    " (id)" is the assignment (case and spaces aside). ExportError naming the choices if none or several."""
    columns = roster.assignment_columns()
    choices = "; ".join(columns) or "none"
    if column is not None:
        if column.strip() not in columns:
            raise ExportError(
                f"--column {column!r}: the roster has no such assignment column (its assignment columns: {choices})"
            )
        return columns[column.strip()]
    key = " ".join(assignment.split()).casefold()
    found = [
        i for name, i in columns.items() if " ".join(ASSIGNMENT_COLUMN.match(name)["name"].split()).casefold() == key
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ExportError(
            f"no column for assignment {assignment!r} in the roster (its assignment columns: "
            f'{choices}): name the Canvas assignment {assignment!r}, or give --column "Name (id)"'
        )
    raise ExportError(
        f"several columns for assignment {assignment!r}: {'; '.join(roster.header[i] for i in found)}: give --column"
    )


def match_students(roster: Roster, students: list[str]) -> tuple[dict[str, int], list[str], list[str]]:
    """(student -> roster row index, students not found, problems): by SIS Login ID, then SIS User
    ID, then ID; a value shared by several roster rows matches none of them."""
    indexes = {}
    for key in KEYS:
        col = roster.column(key)
        if col is None:
            continue
        index: dict[str, list[int]] = {}
        for i, row in enumerate(roster.rows):
            if roster.is_student(row) and row[col].strip():
                index.setdefault(row[col].strip().casefold(), []).append(i)
        indexes[key] = index
    matched, missing, problems = {}, [], []
    for student in students:
        hit = None
        for key, index in indexes.items():
            rows = index.get(student.strip().casefold(), [])
            if len(rows) > 1:
                problems.append(f"{student}: {len(rows)} roster rows have {key} {student!r}; none filled")
                hit = -1
                break
            if rows:
                hit = rows[0]
                break
        if hit is None:
            missing.append(student)
        elif hit >= 0:
            matched[student] = hit
    return matched, missing, problems


def export_canvas(grades: list[dict], roster: Roster, column: str | None = None) -> tuple[Roster, list[str], int]:
    """Fill the roster's assignment column(s) from the grades; (roster, report lines, students filled)."""
    assignments = sorted({r["assignment"] for r in grades})
    if column is not None and len(assignments) > 1:
        raise ExportError(f"--column fills one assignment; the grades hold {', '.join(assignments)}: give --assignment")
    report, filled = [], 0
    for assignment in assignments:
        rows = {r["student"]: r for r in grades if r["assignment"] == assignment}
        col = find_column(roster, assignment, column)
        report += _points_warning(roster, col, assignment, rows.values())
        matched, missing, problems = match_students(roster, sorted(rows))
        blank = {student: why for student in matched if (why := why_left_blank(rows[student]))}
        for student, i in matched.items():
            roster.rows[i][col] = "" if student in blank else inert(rows[student]["score"])
        filled += len(matched) - len(blank)
        report += [f"{assignment}: left blank: {student} ({why})" for student, why in blank.items()]
        report += problems
        if missing:
            report.append(
                f"{assignment}: {len(missing)} graded student(s) not in the roster (by SIS Login ID, "
                f"SIS User ID or ID): {', '.join(missing)}"
            )
        ungraded = [
            _who(roster, row)
            for i, row in enumerate(roster.rows)
            if roster.is_student(row) and i not in matched.values() and not _is_test_student(row)
        ]
        if ungraded:
            report.append(
                f"{assignment}: {len(ungraded)} roster student(s) not in the grades (left as they were): "
                f"{', '.join(ungraded)}"
            )
    return roster, report, filled


def _points_warning(roster: Roster, col: int, assignment: str, rows) -> list[str]:
    possible = roster.points_possible(col)
    maxima = {r.get("max_score", "") for r in rows} - {""}
    try:
        differs = possible and len(maxima) == 1 and float(possible) != float(next(iter(maxima)))
    except ValueError:
        differs = False
    if differs:
        return [
            f"{assignment}: the Canvas column is worth {possible} points, the grades' max_score is "
            f"{next(iter(maxima))}: scores written as graded, not scaled"
        ]
    return []


def _who(roster: Roster, row: list[str]) -> str:
    login = roster.column("SIS Login ID")
    name = row[0].strip() or "?"
    return f"{name} ({row[login].strip()})" if login is not None and row[login].strip() else name


def _is_test_student(row: list[str]) -> bool:
    return row[0].strip().casefold() in TEST_STUDENTS


def write_roster(roster: Roster, out: Path) -> None:
    """Atomically, with the roster's delimiter, line ending and byte-order mark."""

    def write(f):
        writer = csv.writer(f, delimiter=roster.delimiter, lineterminator=roster.newline)
        writer.writerow(roster.header)
        writer.writerows(roster.rows)

    write_atomically(out, write, "utf-8-sig" if roster.bom else "utf-8")


# --------------------------------------------------------------------------- long


def export_long(grades: list[dict], gradebook: Path) -> tuple[list[dict], list[str]]:
    """(one row per student x graded cell, report lines) from nbgrader's gradebook."""
    from nbgrader.api import Gradebook, MissingEntry

    check_gradebook(gradebook)
    out, report = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with Gradebook(f"sqlite:///{Path(gradebook).resolve()}") as gb:
                for row in sorted(grades, key=lambda r: (r["assignment"], r["student"])):
                    try:
                        submission = gb.find_submission(row["assignment"], row["student"])
                    except MissingEntry:
                        report.append(f"{row['student']}: no {row['assignment']} submission in the gradebook")
                        continue
                    out += _cell_rows(submission, row)
        except ExportError:
            raise
        except Exception as exc:  # noqa: BLE001 - not a gradebook, or another nbgrader's
            raise ExportError(
                f"--gradebook {gradebook}: not an nbgrader gradebook ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''})"
            ) from None
    return out, report


def check_gradebook(path: Path) -> None:
    """ExportError unless path is an nbgrader gradebook (read only: nbgrader's Gradebook would
    add its tables to any other SQLite file it is given)."""
    import sqlite3

    if not Path(path).is_file():
        raise ExportError(f"--gradebook {path}: no such file (grade writes gradebook.db beside its --out)")
    try:
        with sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True) as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise ExportError(f"--gradebook {path}: not an nbgrader gradebook ({exc})") from None
    if not {"assignment", "submitted_assignment", "grade", "alembic_version"} <= tables:
        raise ExportError(f"--gradebook {path}: not an nbgrader gradebook (no assignment, submission or grade tables)")


def _cell_rows(submission, row: dict) -> list[dict]:
    cells = []
    for notebook in submission.notebooks:
        for grade in sorted(notebook.grades, key=lambda g: g.name):
            cells.append(
                {
                    "student": inert(row["student"]),
                    "assignment": inert(row["assignment"]),
                    "grade_id": inert(grade.name),
                    "points": f"{float(grade.score):g}",
                    "max_points": f"{float(grade.max_score):g}",
                }
            )
    return cells


def write_long(rows: list[dict], out: Path) -> None:
    def write(f):
        writer = csv.DictWriter(f, fieldnames=LONG_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    write_atomically(out, write)


# --------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m autograder export",
        description=__doc__.splitlines()[0],
        epilog="canvas matches students by SIS Login ID, then SIS User ID, then ID.",
    )
    parser.add_argument("--format", required=True, choices=("canvas", "long"), help="what to write")
    parser.add_argument("--grades", required=True, type=Path, help="the CSV `python -m autograder grade` wrote")
    parser.add_argument("--out", required=True, type=Path, help="the file to write")
    parser.add_argument("--roster", type=Path, help="canvas: Canvas's gradebook export (Grades > Export)")
    parser.add_argument("--column", help='canvas: the assignment column to fill, "Name (id)" as in the roster')
    parser.add_argument("--assignment", help="only this assignment's rows of --grades")
    parser.add_argument(
        "--gradebook", type=Path, help="long: nbgrader's gradebook (default: gradebook.db beside --grades)"
    )
    args = parser.parse_args(argv)
    if args.format == "canvas" and args.roster is None:
        parser.error("--format canvas needs --roster (Canvas's gradebook export)")
    if args.format == "long" and (args.roster is not None or args.column is not None):
        parser.error("--roster and --column are for --format canvas")
    if args.format == "long" and args.gradebook is None:
        args.gradebook = args.grades.parent / "gradebook.db"
    try:
        check_out(args.out, {"--grades": args.grades, "--roster": args.roster, "--gradebook": args.gradebook})
        return _canvas(args) if args.format == "canvas" else _long(args)
    except ExportError as exc:
        print(f"autograder export: error: {exc}", file=sys.stderr)
        return 2


def _canvas(args) -> int:
    grades = read_grades(args.grades, args.assignment)
    roster, report, filled = export_canvas(grades, read_roster(args.roster), args.column)
    for line in report:
        print(f"autograder export: {line}", file=sys.stderr)
    if not filled:
        print(
            f"autograder export: no graded student is in the roster with a score to fill in: {args.out} not written",
            file=sys.stderr,
        )
        return 1
    write_roster(roster, args.out)
    print(f"filled {filled} grade(s) into {args.out}")
    return 0


def _long(args) -> int:
    grades = read_grades(args.grades, args.assignment)
    rows, report = export_long(grades, args.gradebook)
    for line in report:
        print(f"autograder export: {line}", file=sys.stderr)
    if not rows:
        print(f"autograder export: no graded cells found: {args.out} not written", file=sys.stderr)
        return 1
    write_long(rows, args.out)
    print(
        f"wrote {len(rows)} cell grade(s) of {len({(r['student'], r['assignment']) for r in rows})} "
        f"submission(s) to {args.out}"
    )
    return 0

"""Late submissions: nbgrader's due date, nbgrader's `timestamp.txt`, nbgrader's penalty plugin.

The due date is nbgrader's: the assignment's `duedate` in the gradebook (naive UTC), set with
``nbgrader db assignment add NAME --duedate "2026-03-01 17:00:00 Europe/Berlin" --db sqlite:///…``
or with ``python -m autograder grade --due …`` (which writes it there); a student's extension
(nbgrader's `SubmittedAssignment.extension`) moves that student's due date. No due date: nothing
is assessed.

The submission time is the `timestamp.txt` nbgrader's exchange writes into each submission folder
(`DIR/<student>/<assignment>/timestamp.txt`, ``Exchange.timestamp_format``, by default
``2026-03-01 17:00:00.123456 CET``). A missing, empty or malformed file is reported, never
guessed, and costs nothing.

The penalty is nbgrader's `LateSubmissionPlugin` interface, chosen the nbgrader way in
nbgrader_config.py::

    c.AssignLatePenalties.plugin_class = "autograder.late.PointsPerDay"
    c.PointsPerDay.points = 1           # per day late
    c.PointsPerDay.cutoff_days = 7      # later than that: score 0 (default: no cut-off)

nbgrader's own plugin (``penalty_method = 'zero'``: any late submission scores 0) works too, and
ours work inside nbgrader's own ``nbgrader autograde``. The penalty is clipped to [0, score], as
nbgrader's `AssignLatePenalties` does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from nbgrader.plugins import LateSubmissionPlugin
from traitlets import Enum, Float

from autograder import notes, student_files

TIMESTAMP_FILE = "timestamp.txt"
DAY = 86400.0
_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
_ZONE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_+\-/]*")
_OFFSET = re.compile(r"[+-]\d{2}:?\d{2}")


# --------------------------------------------------------------------------- the plugins


class DailyPenalty(LateSubmissionPlugin):
    """A penalty for each day late (`per_day`), and the whole score past `cutoff_days`."""

    cutoff_days = Float(
        None, allow_none=True, help="Late by more than this many days: the score is 0. None: no cut-off."
    ).tag(config=True)
    partial_days = Enum(
        ("whole", "fraction"),
        default_value="whole",
        help="'whole': a started day counts as a day (1.5 days late is 2); 'fraction': days are prorated (1.5 is 1.5).",
    ).tag(config=True)

    def per_day(self, score: float) -> float:
        """Points taken for one day late, for a submission that earned `score`."""
        return 0.0

    def days_charged(self, seconds_late: float) -> float:
        days = seconds_late / DAY
        return float(math.ceil(days)) if self.partial_days == "whole" else days

    def late_submission_penalty(self, student_id: str, score: float, total_seconds_late: float) -> float | None:
        """nbgrader's plugin interface: the points to take off (None: none)."""
        if total_seconds_late <= 0:
            return None
        if self.cutoff_days is not None and total_seconds_late > self.cutoff_days * DAY:
            return score
        return min(score, self.days_charged(total_seconds_late) * self.per_day(score))

    def rate(self) -> str:
        """What one day late costs, in words ("" for nothing)."""
        return ""

    def describe(self) -> str:
        """The plugin and its settings, for the notes: "PointsPerDay: 1 point(s) per day, score 0 past 7 days"."""
        parts = [self.rate()]
        if self.cutoff_days is not None:
            parts.append("score 0 if late" if self.cutoff_days == 0 else f"score 0 past {self.cutoff_days:g} day(s)")
        return f"{type(self).__name__}: " + ", ".join(p for p in parts if p) if any(parts) else type(self).__name__


class PointsPerDay(DailyPenalty):
    """`points` off for each day late."""

    points = Float(1.0, min=0.0, help="Points taken off per day late.").tag(config=True)

    def per_day(self, score: float) -> float:
        return self.points

    def rate(self) -> str:
        return f"{self.points:g} point(s) per day"


class PercentPerDay(DailyPenalty):
    """`percent` of the score earned off for each day late (nbgrader's plugins see the score
    earned, not the maximum: ours do the same, so they work inside nbgrader too)."""

    percent = Float(10.0, min=0.0, max=100.0, help="Percent of the score earned taken off per day late.").tag(
        config=True
    )

    def per_day(self, score: float) -> float:
        return score * self.percent / 100.0

    def rate(self) -> str:
        return f"{self.percent:g}% of the score per day"


class ZeroAfterCutoff(DailyPenalty):
    """Nothing off up to `cutoff_days` late (default 0: any late submission), then the score is 0."""

    cutoff_days = Float(0.0, min=0.0, help="Late by more than this many days: the score is 0.").tag(config=True)


def describe(plugin) -> str:
    """A short name of the plugin and its settings, for the notes."""
    if hasattr(plugin, "describe"):
        return plugin.describe()
    method = getattr(plugin, "penalty_method", None)
    return f"{type(plugin).__name__}" + (f" ({method})" if method else "")


# --------------------------------------------------------------------------- times


def parse_time(text: str, default_zone: str = "UTC") -> datetime:
    """A date and time as nbgrader writes them -> an aware UTC datetime; ValueError if it is not one.

    Accepts ``YYYY-MM-DD HH:MM[:SS[.ffffff]]`` (or ``T``) followed by a numeric offset
    (``+01:00``, ``-0500``, ``Z``) or a zone name (``UTC``, ``Europe/Berlin``, or the abbreviation
    `default_zone` uses at that time, e.g. ``CEST`` for Europe/Berlin in summer); with neither,
    the time is in `default_zone` (nbgrader's ``Exchange.timezone``). nbgrader's own
    `nbgrader.utils.parse_utc` is not used: it reads ``-0500`` as -500 seconds and an unknown
    zone name (``BST``) as UTC, silently.
    """
    from dateutil.parser import isoparse

    text = " ".join(str(text).split())
    if not _DATE_TIME.match(text):
        raise ValueError(f"{_quote(text)} is not a date and time (YYYY-MM-DD HH:MM[:SS] [zone])")
    head, _, last = text.rpartition(" ")
    zone_name = last if head and _ZONE_NAME.fullmatch(last) else None
    stamp = head if zone_name else head + last if head and _OFFSET.fullmatch(last) else text
    try:
        moment = isoparse(stamp)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"{_quote(text)} is not a date and time: {exc}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=zone(zone_name, moment, default_zone) if zone_name else zone(default_zone))
    elif zone_name:
        raise ValueError(f"{_quote(text)} gives both an offset and a zone name")
    return moment.astimezone(timezone.utc)


def zone(name: str, moment: datetime | None = None, default_zone: str | None = None):
    """The tzinfo of a zone name; an abbreviation such as CEST is read as `default_zone` when
    that zone uses it at `moment`. ValueError for a name that is neither."""
    from dateutil.tz import UTC, gettz

    if name.upper() in ("UTC", "Z", "GMT"):
        return UTC
    if default_zone and moment is not None:
        home = gettz(default_zone)
        if home is not None and moment.replace(tzinfo=home).tzname() == name:
            return home
    found = gettz(name) if "/" in name or name.isalpha() else None
    if found is None:
        raise ValueError(f"unknown time zone {name!r}")
    return found


def check_zone(name: str) -> str:
    """`name` if it is a time zone (nbgrader's Exchange.timezone), else ValueError."""
    zone(name)
    return name


def naive_utc(moment: datetime) -> datetime:
    """The naive UTC datetime nbgrader's gradebook stores."""
    return moment.astimezone(timezone.utc).replace(tzinfo=None)


def show(moment: datetime | None) -> str:
    """ISO 8601 in UTC, to the second: the `submitted_at` column and the notes."""
    if moment is None:
        return ""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).isoformat(timespec="seconds")


def _quote(text: str, n: int = 60) -> str:
    text = str(text).replace(";", ",")  # a note never holds "; ": the notes column joins with it
    return repr(text if len(text) <= n else text[: n - 1] + "…")


# --------------------------------------------------------------------------- one submission


@dataclass
class Lateness:
    """What the late policy found for one submission."""

    submitted_at: datetime | None = None  # aware, UTC; None when unknown
    seconds_late: float = 0.0
    penalty: float | None = None  # points off; None when not assessed
    note: str | None = None  # "late: ..." for the notes column, or None


def read_timestamp(folder: Path | None, default_zone: str = "UTC") -> tuple[datetime | None, str | None]:
    """(the submission time, None) from folder/timestamp.txt, or (None, why it cannot be read).
    Only a small regular file is read (a link is not followed): nothing else reaches the note."""
    if folder is None:
        return None, "no submission folder of the student's own (a link is not followed)"
    path = Path(folder) / TIMESTAMP_FILE
    try:
        raw = student_files.read_bytes(path, student_files.SMALL_FILE_MAX_BYTES)
    except FileNotFoundError:
        return None, f"no {TIMESTAMP_FILE} in the submission folder"
    except student_files.NotAStudentFile as exc:
        return None, f"{exc}"
    except OSError as exc:
        return None, f"{TIMESTAMP_FILE} cannot be read ({type(exc).__name__})"
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{TIMESTAMP_FILE} is not text"
    if not text:
        return None, f"{TIMESTAMP_FILE} is empty"
    try:
        return parse_time(text, default_zone), None
    except ValueError as exc:
        return None, f"{TIMESTAMP_FILE} is malformed: {exc}"


def assess(
    submitted_at: datetime | None,
    problem: str | None,
    due: datetime,
    score: float,
    plugin,
    student: str = "",
    extension: timedelta | None = None,
) -> Lateness:
    """The penalty for a submission that earned `score`, due at `due` (aware or naive UTC; a
    student's extension already added, and named in the note)."""
    if submitted_at is None:
        return Lateness(note=f"late: {problem or 'no submission time'}: not checked, no penalty")
    due = due if due.tzinfo else due.replace(tzinfo=timezone.utc)
    seconds = max(0.0, (submitted_at - due).total_seconds())
    if seconds <= 0:
        return Lateness(submitted_at, 0.0, 0.0)
    raw = plugin.late_submission_penalty(student, score, seconds)
    penalty = min(max(float(raw or 0.0), 0.0), max(score, 0.0))
    note = (
        f"late: submitted {show(submitted_at)}, {days_text(seconds)} after the due date {show(due)}"
        f"{extension_text(extension)}: "
        f"{notes.number(penalty)} point(s) off ({describe(plugin)})"
    )
    return Lateness(submitted_at, seconds, penalty, note)


def days_text(seconds: float) -> str:
    days = seconds / DAY
    if days >= 1:
        return f"{days:.2f}".rstrip("0").rstrip(".") + " day(s)"
    hours = seconds / 3600
    return f"{hours:.1f} hour(s)" if hours >= 1 else f"{max(1, round(seconds / 60))} minute(s)"


# --------------------------------------------------------------------------- the policy of a run


@dataclass
class LatePolicy:
    """The penalty plugin and the time zone of a grading run (the due date is the gradebook's)."""

    plugin: object
    timezone: str = "UTC"

    def assess_folder(
        self, folder: Path, due: datetime, score: float, student: str = "", extension: timedelta | None = None
    ) -> Lateness:
        submitted_at, problem = read_timestamp(folder, self.timezone)
        return assess(submitted_at, problem, due, score, self.plugin, student, extension)

    def record(
        self, db_url: str, assignment: str, notebook_id: str, student: str, folder: Path, score: float
    ) -> Lateness | None:
        """Assess one graded submission against the gradebook's due date (with the student's
        extension) and write what nbgrader keeps there: the submission's timestamp and the
        notebook's late_submission_penalty. None when the assignment has no due date."""
        from nbgrader.api import Gradebook

        with Gradebook(db_url) as gb:
            submission = gb.find_submission(assignment, student)
            if submission.assignment.duedate is None:
                return None
            extension = submission.extension
            due = submission.assignment.duedate + (extension or timedelta(0))
            late = self.assess_folder(folder, due, score, student, extension)
            submission.timestamp = naive_utc(late.submitted_at) if late.submitted_at else None
            notebook = gb.find_submission_notebook(notebook_id, assignment, student)
            notebook.late_submission_penalty = late.penalty if late.penalty else None
            gb.db.commit()
        return late


def policy_from_config(config) -> LatePolicy:
    """The plugin nbgrader's `AssignLatePenalties.plugin_class` names, configured from `config`
    (nbgrader_config.py plus any command-line settings), and `Exchange.timezone`. ValueError
    for a class that cannot be loaded, a bad setting or an unknown time zone."""
    from nbgrader.preprocessors import AssignLatePenalties
    from traitlets import TraitError

    try:
        chooser = AssignLatePenalties(config=config)
        plugin = chooser.plugin_class(parent=chooser)
    except (TraitError, ImportError, AttributeError, TypeError, ValueError) as exc:
        why = re.sub(r"<[\w.]+ object at 0x[0-9a-f]+>", "AssignLatePenalties", str(exc))
        raise ValueError(f"the late penalty plugin (AssignLatePenalties.plugin_class): {why}") from None
    tz = config.Exchange.get("timezone", "UTC") if "Exchange" in config else "UTC"
    try:
        check_zone(str(tz))
    except ValueError as exc:
        raise ValueError(f"Exchange.timezone: {exc}") from None
    return LatePolicy(plugin, str(tz))


def due_date_of(text: str, default_zone: str) -> datetime | None:
    """`--due TEXT` -> naive UTC (nbgrader's gradebook), None for "none"; ValueError if malformed."""
    if text.strip().lower() == "none":
        return None
    return naive_utc(parse_time(text, default_zone))


def extension_text(delta: timedelta | None) -> str:
    return "" if not delta else f" (with an extension of {days_text(delta.total_seconds())})"


# --------------------------------------------------------------------------- the grader's side


def late_policy(overrides=None):
    """The late policy of nbgrader_config.py (with command-line `--Class.trait=value` settings
    on top): SystemExit with the reason if its plugin or time zone is wrong, or if a setting names
    a trait its class does not have or a plugin class that is not the one in use."""
    from autograder.release import load_config

    config = load_config()
    if overrides is not None:
        config.merge(overrides)
    try:
        policy = policy_from_config(config)
        check_settings(overrides, policy)
    except ValueError as exc:
        raise SystemExit(f"autograder grade: {exc}") from None
    return policy


def _setting_classes(plugin) -> dict:
    """Class name -> class, for every class whose settings the late policy reads."""
    from nbgrader.exchange.abc import Exchange
    from nbgrader.preprocessors import AssignLatePenalties

    known = {
        "Exchange": Exchange,
        "AssignLatePenalties": AssignLatePenalties,
        "LateSubmissionPlugin": LateSubmissionPlugin,
        "DailyPenalty": DailyPenalty,
        "PointsPerDay": PointsPerDay,
        "PercentPerDay": PercentPerDay,
        "ZeroAfterCutoff": ZeroAfterCutoff,
    }
    known[type(plugin).__name__] = type(plugin)
    return known


def check_settings(overrides, policy: LatePolicy) -> None:
    """ValueError for a command-line setting the run would silently ignore: a misspelt trait
    (--PointsPerDay.point=1), or a plugin's setting while another plugin is in use
    (--PointsPerDay.points=1 without --AssignLatePenalties.plugin_class=autograder.late.PointsPerDay)."""
    if not overrides:
        return
    classes = _setting_classes(policy.plugin)
    for section in sorted(overrides):
        cls = classes.get(section)
        if cls is None:
            raise ValueError(f"--{section}.…: not a setting of the late policy")
        traits = sorted(cls.class_trait_names(config=True))
        for trait in sorted(overrides[section]):
            if trait not in traits:
                raise ValueError(
                    f"--{section}.{trait}: {section} has no setting {trait!r} (its settings: {', '.join(traits)})"
                )
        plugin_like = issubclass(cls, LateSubmissionPlugin)
        if plugin_like and not isinstance(policy.plugin, cls):
            used = f"{type(policy.plugin).__module__}.{type(policy.plugin).__name__}"
            raise ValueError(
                f"--{section}.… is given but the late penalty plugin is {used}: add "
                f"--AssignLatePenalties.plugin_class=autograder.late.{section} (or set it in "
                "nbgrader_config.py)"
            )


# --------------------------------------------------------------------------- the policy kept with the assignment

POLICY_TABLE = "decodelab_late_policy"  # beside nbgrader's tables in its gradebook


def fingerprint(policy: LatePolicy) -> str:
    """What makes two late policies the same: the plugin's class, its settings, the time zone."""
    import json

    plugin = policy.plugin
    settings = {name: getattr(plugin, name) for name in sorted(plugin.trait_names(config=True))}
    return json.dumps(
        {
            "plugin": f"{type(plugin).__module__}.{type(plugin).__name__}",
            "settings": settings,
            "timezone": policy.timezone,
        },
        sort_keys=True,
        default=str,
    )


def stored_policy(gradebook: Path, assignment: str) -> dict | None:
    """{"flags": [...], "fingerprint": ..., "description": ...} stored with the assignment at its
    first grading, or None (no gradebook yet, or never stored)."""
    import json
    import sqlite3

    if not Path(gradebook).is_file():
        return None
    db = sqlite3.connect(f"file:{gradebook}?mode=ro", uri=True)  # a refused run changes nothing
    try:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (POLICY_TABLE,)).fetchone():
            return None
        row = db.execute(f"SELECT policy FROM {POLICY_TABLE} WHERE assignment = ?", (assignment,)).fetchone()
    finally:
        db.close()
    return json.loads(row[0]) if row else None


def store_policy(gradebook: Path, assignment: str, flags: list[str], policy: LatePolicy) -> None:
    import json
    import sqlite3

    record = {
        "flags": list(flags),
        "fingerprint": fingerprint(policy),
        "description": f"{describe(policy.plugin)}, times in {policy.timezone}",
    }
    with sqlite3.connect(gradebook) as db:
        db.execute(f"CREATE TABLE IF NOT EXISTS {POLICY_TABLE} (assignment TEXT PRIMARY KEY, policy TEXT NOT NULL)")
        db.execute(f"INSERT OR REPLACE INTO {POLICY_TABLE} VALUES (?, ?)", (assignment, json.dumps(record)))


def policy_of_run(gradebook: Path, assignment: str, flags: list[str], replace: bool = False):
    """(the late policy of this run, the flags it was made from): the flags given now, or, when
    none are, those stored with the assignment at its first grading, so that a regrade charges
    what the first grading charged. SystemExit, before anything is graded, when they disagree
    with the stored policy (unless `replace`) or name a setting that would be ignored."""
    stored = stored_policy(gradebook, assignment)
    use = list(flags) if (flags or stored is None or replace) else list(stored["flags"])
    try:
        policy = late_policy(nbgrader_settings(use) if use else None)
    except ValueError as exc:
        raise SystemExit(f"autograder grade: {exc}") from None
    if stored is not None and not replace and fingerprint(policy) != stored["fingerprint"]:
        given = " ".join(use) or "nbgrader_config.py alone"
        raise SystemExit(
            f"autograder grade: {assignment} was first graded with the late policy "
            f'"{stored["description"]}" ({" ".join(stored["flags"]) or "nbgrader_config.py alone"}), '
            f"kept in the gradebook; this run's is \"{describe(policy.plugin)}, times in "
            f'{policy.timezone}" ({given}). Pass --replace-late-policy to grade with the new one '
            "(later runs keep it)."
        )
    return policy, use


def parse_due(due: str, policy):
    """`--due` as nbgrader's gradebook stores it (naive UTC; None for "none"); SystemExit if malformed."""

    try:
        return due_date_of(due, policy.timezone)
    except ValueError as exc:
        raise SystemExit(f"autograder grade: --due {due!r}: {exc}") from None


def late_columns(result, settings, policy, folder: Path | None, score: float) -> tuple[float, dict]:
    """result: a submission.Result, settings: its Settings. (the score net of any late penalty, the row's submitted_at and late_penalty); a "late:"
    note joins result.notes when the submission is late or its time cannot be read."""

    empty = {"submitted_at": "", "late_penalty": ""}
    if policy is None:
        return score, empty
    try:
        found = policy.record(
            settings.db_url, settings.assignment, Path(settings.notebook).stem, result.student, folder, score
        )
    except Exception as exc:  # noqa: BLE001 - the grade stands; the note says why nothing was taken off
        result.notes.append(f"late: not checked ({type(exc).__name__}: {notes.short(exc, 150)}), no penalty")
        return score, empty
    if found is None:
        return score, empty
    if found.note:
        result.notes.append(found.note)
    penalty = found.penalty
    return max(0.0, score - (penalty or 0.0)), {
        "submitted_at": show(found.submitted_at),
        "late_penalty": "" if penalty is None else notes.number(penalty),
    }


LATE_SETTINGS = (
    "Exchange",
    "AssignLatePenalties",
    "LateSubmissionPlugin",
    "DailyPenalty",
    "PointsPerDay",
    "PercentPerDay",
    "ZeroAfterCutoff",
)


def nbgrader_settings(extra: list[str]):
    """`--Class.trait=value` arguments (nbgrader's command-line syntax) -> a traitlets Config.
    ValueError for anything else, or a class the late policy does not read."""
    import re

    from traitlets.config.loader import KVArgParseConfigLoader

    bad = [a for a in extra if not re.fullmatch(r"--[A-Za-z_]\w*\.[A-Za-z_]\w*=.*", a, re.S)]
    if bad:
        raise ValueError(f"unrecognized arguments: {' '.join(bad)} (nbgrader settings are --Class.trait=value)")
    config = KVArgParseConfigLoader(argv=extra).load_config()
    plugin = str(config.AssignLatePenalties.get("plugin_class", "")).rpartition(".")[2] if extra else ""
    unknown = sorted(set(config) - set(LATE_SETTINGS) - {plugin})
    if unknown:
        raise ValueError(
            f"--{unknown[0]}.…: only the late policy's settings can be given here "
            f"({', '.join(LATE_SETTINGS)}, or the plugin class named by AssignLatePenalties.plugin_class)"
        )
    return config

"""The late policy (autograder/late.py): nbgrader's timestamp.txt read without guessing, due
dates and time zones, our LateSubmissionPlugin classes chosen the nbgrader way, and what the
grader writes into nbgrader's gradebook (timestamp, late_submission_penalty, extensions)."""

from __future__ import annotations

import warnings
from datetime import datetime, timedelta, timezone

import pytest
from gradebooks import make_gradebook
from traitlets.config import Config

from autograder import late

DAY = 86400
DUE = datetime(2026, 3, 1, 16, 0, tzinfo=timezone.utc)  # 17:00 in Berlin (CET)


def _points(**settings):
    return late.PointsPerDay(**settings)


# --------------------------------------------------------------------------- the plugins


def test_on_time_costs_nothing():
    found = late.assess(DUE - timedelta(minutes=1), None, DUE, 4.0, _points(points=1))
    assert (found.penalty, found.seconds_late, found.note) == (0.0, 0.0, None)
    assert late.assess(DUE, None, DUE, 4.0, _points()).penalty == 0.0  # at the due date exactly


def test_one_and_a_half_days_late():
    submitted = DUE + timedelta(days=1.5)
    whole = late.assess(submitted, None, DUE, 4.0, _points(points=1))
    assert whole.penalty == 2.0  # a started day counts
    assert whole.note == (
        "late: submitted 2026-03-03T04:00:00+00:00, 1.5 day(s) after the due date "
        "2026-03-01T16:00:00+00:00: 2 point(s) off (PointsPerDay: 1 point(s) per day)"
    )
    assert late.assess(submitted, None, DUE, 4.0, _points(points=1, partial_days="fraction")).penalty == 1.5
    assert late.assess(submitted, None, DUE, 5.0, late.PercentPerDay(percent=10)).penalty == 1.0  # 2 x 10% of 5


def test_past_the_cutoff_scores_zero_and_never_below():
    policy = _points(points=1, cutoff_days=7)
    assert late.assess(DUE + timedelta(days=6.5), None, DUE, 4.0, policy).penalty == 4.0  # 7 days x 1, clipped
    assert late.assess(DUE + timedelta(days=6.5), None, DUE, 10.0, policy).penalty == 7.0
    past = late.assess(DUE + timedelta(days=7, seconds=1), None, DUE, 10.0, policy)
    assert past.penalty == 10.0 and "score 0 past 7 day(s)" in past.note
    assert late.assess(DUE + timedelta(days=3), None, DUE, 0.0, policy).penalty == 0.0
    zero = late.ZeroAfterCutoff()
    assert late.assess(DUE + timedelta(minutes=5), None, DUE, 3.0, zero).penalty == 3.0
    grace = late.ZeroAfterCutoff(cutoff_days=2)
    assert late.assess(DUE + timedelta(days=1.5), None, DUE, 3.0, grace).penalty == 0.0
    assert late.assess(DUE + timedelta(days=2.5), None, DUE, 3.0, grace).penalty == 3.0


def test_plugins_speak_nbgraders_interface():
    """nbgrader's AssignLatePenalties calls late_submission_penalty(student, score, seconds)."""
    assert _points(points=1).late_submission_penalty("ali", 4.0, 0) is None
    assert _points(points=1).late_submission_penalty("ali", 4.0, 1.5 * DAY) == 2.0
    with pytest.raises(Exception):
        _points(points=-1)
    with pytest.raises(Exception):
        late.PercentPerDay(percent=150)


def test_chosen_the_nbgrader_way():
    c = Config()
    c.AssignLatePenalties.plugin_class = "autograder.late.PointsPerDay"
    c.PointsPerDay.points = 0.5
    c.PointsPerDay.cutoff_days = 3
    c.Exchange.timezone = "Europe/Berlin"
    policy = late.policy_from_config(c)
    assert isinstance(policy.plugin, late.PointsPerDay) and policy.plugin.points == 0.5
    assert policy.plugin.cutoff_days == 3 and policy.timezone == "Europe/Berlin"
    nbgraders = Config()
    nbgraders.LateSubmissionPlugin.penalty_method = "zero"
    zero = late.policy_from_config(nbgraders)
    assert type(zero.plugin).__name__ == "LateSubmissionPlugin"
    assert late.assess(DUE + timedelta(hours=1), None, DUE, 3.0, zero.plugin).penalty == 3.0
    assert late.assess(DUE + timedelta(hours=1), None, DUE, 3.0, late.policy_from_config(Config()).plugin).penalty == 0


def test_a_wrong_policy_is_refused():
    c = Config()
    c.AssignLatePenalties.plugin_class = "autograder.late.NoSuchPlugin"
    with pytest.raises(ValueError, match="AssignLatePenalties.plugin_class"):
        late.policy_from_config(c)
    c = Config()
    c.Exchange.timezone = "Mars/Olympus_Mons"
    with pytest.raises(ValueError, match="Exchange.timezone"):
        late.policy_from_config(c)


# --------------------------------------------------------------------------- timestamps and time zones


@pytest.mark.parametrize(
    "text, utc",
    [
        ("2026-03-01 17:00:00.123456 UTC", "2026-03-01 17:00:00.123456"),  # nbgrader's own format
        ("2026-03-01 17:00:00.000000 CET", "2026-03-01 16:00:00"),
        ("2026-03-01 17:00:00 Europe/Berlin", "2026-03-01 16:00:00"),
        ("2026-07-01 17:00:00 Europe/Berlin", "2026-07-01 15:00:00"),  # summer time
        ("2026-03-01 17:00:00 -0500", "2026-03-01 22:00:00"),  # nbgrader's parse_utc: 17:08:20
        ("2026-03-01T17:00:00+01:00", "2026-03-01 16:00:00"),
        ("2026-03-01T17:00:00Z", "2026-03-01 17:00:00"),
    ],
)
def test_timestamps_in_any_zone(text, utc):
    assert late.parse_time(text).replace(tzinfo=None) == datetime.fromisoformat(utc)


def test_no_zone_means_exchange_timezone():
    assert late.parse_time("2026-03-01 17:00", "Europe/Berlin") == DUE
    assert late.parse_time("2026-03-01 17:00", "UTC") == DUE + timedelta(hours=1)
    # an abbreviation the Exchange's own zone writes (nbgrader's %Z), resolved through that zone
    assert late.parse_time("2026-07-01 17:00:00.5 CEST", "Europe/Berlin").hour == 15


def test_agrees_with_nbgrader_on_its_own_format():
    from nbgrader.utils import parse_utc

    for text in ("2026-03-01 17:00:00.123456 UTC", "2026-03-01 17:00:00.000000 CET", "2026-03-01 09:30:00 EST"):
        assert late.naive_utc(late.parse_time(text)) == parse_utc(text)


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "not a date"),
        ("yesterday at noon", "not a date"),
        ("17:00", "not a date"),
        ("2026-02-30 10:00:00 UTC", "day is out of range"),
        ("2026-03-01 17:00:00 BST", "unknown time zone 'BST'"),  # nbgrader's parse_utc: UTC, silently
        ("2026-03-01 17:00:00+01:00 CET", "both an offset and a zone"),
    ],
)
def test_malformed_timestamps_are_refused(text, why):
    with pytest.raises(ValueError, match=why):
        late.parse_time(text)


def test_a_bad_or_missing_timestamp_is_a_note_not_a_penalty(tmp_path):
    policy = late.LatePolicy(_points(points=1), "UTC")
    missing = policy.assess_folder(tmp_path, DUE, 4.0)
    assert (missing.penalty, missing.submitted_at) == (None, None)
    assert missing.note == "late: no timestamp.txt in the submission folder: not checked, no penalty"
    for content, why in [(b"", "is empty"), (b"yesterday; at noon", "is malformed"), (b"\xff\xfe", "is not text")]:
        (tmp_path / "timestamp.txt").write_bytes(content)
        found = policy.assess_folder(tmp_path, DUE, 4.0)
        assert found.penalty is None and why in found.note and "; " not in found.note, found.note
    (tmp_path / "timestamp.txt").write_text("2026-03-03 05:00:00.000000 CET\n")
    found = policy.assess_folder(tmp_path, DUE, 4.0)
    assert (found.penalty, late.show(found.submitted_at)) == (2.0, "2026-03-03T04:00:00+00:00")


def test_due_dates():
    assert late.due_date_of("2026-03-01 17:00 Europe/Berlin", "UTC") == datetime(2026, 3, 1, 16, 0)
    assert late.due_date_of("2026-03-01 17:00", "Europe/Berlin") == datetime(2026, 3, 1, 16, 0)
    assert late.due_date_of("none", "UTC") is None
    with pytest.raises(ValueError):
        late.due_date_of("next friday", "UTC")


# --------------------------------------------------------------------------- the gradebook


def test_recorded_in_nbgraders_gradebook_with_extensions(tmp_path):
    from nbgrader.api import Gradebook

    url = make_gradebook(
        tmp_path / "gradebook.db",
        "a1",
        {"test_a": 2, "test_b": 2},
        {"ali": {"test_a": 2, "test_b": 2}, "bo": {"test_a": 2, "test_b": 2}},
        duedate="2026-03-01 17:00:00 Europe/Berlin",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Gradebook(url) as gb:
            gb.grant_extension("a1", "bo", days=2)
        policy = late.LatePolicy(_points(points=1), "UTC")
        for student in ("ali", "bo"):
            (tmp_path / student).mkdir()
            (tmp_path / student / "timestamp.txt").write_text("2026-03-03 05:00:00.000000 CET")
        ali = policy.record(url, "a1", "a1", "ali", tmp_path / "ali", 4.0)
        bo = policy.record(url, "a1", "a1", "bo", tmp_path / "bo", 4.0)
        assert ali.penalty == 2.0 and bo.penalty == 0.0 and bo.note is None  # bo's extension covers it
        with Gradebook(url) as gb:
            assert gb.find_submission_notebook("a1", "a1", "ali").late_submission_penalty == 2.0
            assert gb.find_submission("a1", "ali").timestamp == datetime(2026, 3, 3, 4, 0)
            assert gb.find_submission("a1", "ali").total_seconds_late == 1.5 * DAY  # nbgrader agrees
            gb.update_or_create_assignment("a1", duedate=None)
        assert policy.record(url, "a1", "a1", "ali", tmp_path / "ali", 4.0) is None  # no due date: not assessed

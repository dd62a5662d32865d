"""The package's version has one source, `decodelab.__version__`: the installed metadata reads it,
each released notebook records it, and the class grader notes a submission released for
another version (never changing its score)."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import pytest
from notebooks import COURSE, ROOT, read, release_path

import decodelab
from autograder import release
from autograder.grade import summary
from autograder.notes import version_note

NAME = "00_meet_the_model"


def test_the_version_is_written_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "decodelab.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", decodelab.__version__)


def test_the_installed_metadata_reads_it():
    try:
        installed = importlib.metadata.version("decodelab")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("decodelab is not pip-installed here (PYTHONPATH only)")
    assert installed == decodelab.__version__, "reinstall: pip install -e ."


def test_the_changelog_describes_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{decodelab.__version__}]" in text
    assert re.findall(r"^## \[([\d.]+)\]", text, re.M)[0] == decodelab.__version__, "the newest entry comes first"


def test_every_released_notebook_records_the_version():
    released = sorted(COURSE.glob("*/*.ipynb"))
    assert released
    for path in released:
        assert release.recorded_version(read(path)) == decodelab.__version__, (
            f"{path.relative_to(ROOT)} was released for another version: run `make release`"
        )


def test_record_version_changes_only_the_metadata(tmp_path):
    path = tmp_path / "nb.ipynb"
    path.write_bytes(release_path(NAME).read_bytes())
    before = json.loads(path.read_text())
    release.record_version(path, "9.8.7")
    after = json.loads(path.read_text())
    assert after["metadata"].pop("decodelab") == {"version": "9.8.7"}
    before["metadata"].pop("decodelab", None)
    assert after == before
    release.record_version(path)
    assert release.recorded_version(json.loads(path.read_text())) == decodelab.__version__


def test_release_writes_the_version(tmp_path):
    (written,) = release.generate([NAME], out=tmp_path)
    assert json.loads(written.read_text())["metadata"]["decodelab"] == {"version": decodelab.__version__}


def test_version_note():
    nb = read(release_path(NAME))
    nb.metadata["decodelab"] = {"version": "0.2.0"}
    assert version_note(nb, "0.2.0") is None
    assert version_note(nb, "0.3.0") == "version: the notebook was released for decodelab 0.2.0 (graded with 0.3.0)"
    for recorded in (None, "0.2.0", {"version": ""}, {"other": 1}):
        unrecorded = copy.deepcopy(nb)
        if recorded is None:
            del unrecorded.metadata["decodelab"]
        else:
            unrecorded.metadata["decodelab"] = recorded
        assert (
            version_note(unrecorded, "0.2.0")
            == "version: the notebook records no decodelab version (graded with 0.2.0)"
        ), recorded
    assert all("; " not in version_note(nb, v) for v in ("0.3.0", "1.0.0"))  # the notes column's separator


def test_summary_names_the_submissions_of_another_version():
    rows = [
        {"student": "ada", "status": "ok", "notes": ""},
        {
            "student": "bob",
            "status": "ok",
            "notes": "version: the notebook was released for decodelab 0.1.0 (graded with 0.2.0)",
        },
        {
            "student": "cy",
            "status": "tampered",
            "notes": "test_x edited: restored from the release; version: the "
            "notebook records no decodelab version (graded with 0.2.0); "
            "integrity: ex_x touches the grader's files (autograder/)",
        },
    ]
    lines = summary(rows, NAME, 12.3, Path("grades.csv"), "0.2.0")
    assert lines[0] == f"graded 3 submissions of {NAME} in 12 s: 1 tampered, 2 ok -> grades.csv"
    assert "  cy: integrity: ex_x touches the grader's files (autograder/)" in lines
    assert lines[-1].startswith("  2 submission(s) not released for decodelab 0.2.0") and lines[-1].endswith("bob, cy")
    assert not any("submission(s) not released" in line for line in summary(rows[:1], NAME, 1, Path("g"), "0.2.0"))

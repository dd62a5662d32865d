"""`python -m decodelab progress`: every exercise of a learner's folder as passing, failing (with
the first line of its message) or not started; robust to the learner's hangs, crashes, prints
and broken notebooks; refuses to run as root over someone else's folder."""

from __future__ import annotations

import inspect
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from notebooks import COURSE, ROOT, SOLUTIONS, grade_id, read
from oracles import load_fixture

from decodelab.course import progress

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def run_progress(*args, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "decodelab", "progress", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


def statuses(run: subprocess.CompletedProcess) -> dict[tuple[str, str], str]:
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout)["exercises"]
    for row in rows:
        assert set(row) == {"notebook", "exercise", "part", "status", "hints_used"}
    return {(r["notebook"], r["exercise"]): r["status"] for r in rows}


def copy_notebook(source_root: Path, name: str, dest: Path, replace: dict[str, str] | None = None) -> Path:
    """dest/name/name.ipynb from source_root, with the sources of the cells in `replace` (by grade id)."""
    shutil.copytree(source_root / name, dest / name, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    path = dest / name / f"{name}.ipynb"
    if replace:
        nb = read(path)
        for cell in nb.cells:
            if grade_id(cell) in replace:
                cell.source = replace.pop(grade_id(cell))
        assert not replace, f"no such cells: {sorted(replace)}"
        nbformat.write(nb, str(path))
    return path


def exercises_in(root: Path) -> set[tuple[str, str]]:
    found = set()
    for path in sorted(root.glob("*/*.ipynb")):
        if path.parent.name == path.stem:
            found |= {(path.stem, g[3:]) for g in map(grade_id, read(path).cells) if g and g.startswith("ex_")}
    return found


# --------------------------------------------------------------------------- reading the notebooks


def test_release_checksum_is_nbgraders():
    from nbgrader.utils import compute_checksum

    for path in sorted(COURSE.glob("*/*.ipynb")):
        for cell in read(path).cells:
            if (grade_id(cell) or "").startswith("ex_"):
                assert progress.release_checksum(cell) == compute_checksum(cell) == cell.metadata.nbgrader.checksum


# --------------------------------------------------------------------------- the cell-selection rule


def test_set_up_is_the_code_before_the_first_numbered_section_or_exercise():
    plan = progress.plan_notebook(SOLUTIONS / "02_sampling" / "02_sampling.ipynb")
    cells = read(plan.path).cells
    # cell 1: imports and setup_notebook(); cell 2: the engine map; cell 4 (section 0): the model and
    # its logits. The cells under "## 1." are demonstrations, not set-up.
    assert [i for i, _ in plan.setup] == [1, 2, 4]
    assert "course.setup_notebook()" in plan.setup[0][1]
    assert [name for name, _, _ in plan.cells] == [
        "top_k_filter",
        "top_p_filter",
        "apply_repetition_penalty",
        "process_logits",
        "sample",
        "beam_search",
    ]
    assert all(cells[i].metadata.nbgrader.grade_id == f"ex_{name}" for name, i, _ in plan.cells)
    for name, visible in plan.tests.items():
        assert "hidden(" not in visible and progress.HIDDEN_BEGIN not in visible and f"{name}(" in visible
    assert not plan.unchanged and not plan.problems  # solutions carry no release checksum

    plan = progress.plan_notebook(SOLUTIONS / "04_prefill_decode" / "04_prefill_decode.ipynb")
    assert [i for i, _ in plan.setup] == [1, 2]  # the engine map; "## 1." comes before the model is loaded

    released = progress.plan_notebook(COURSE / "02_sampling" / "02_sampling.ipynb")
    assert released.unchanged == {name for name, _, _ in released.cells}


# --------------------------------------------------------------------------- the command line


def test_released_course_is_not_started():
    found = statuses(run_progress("--course", COURSE, "--json"))
    assert set(found) == exercises_in(COURSE)
    assert set(found.values()) == {"not started"}


def test_released_stubs_run_are_not_started(tmp_path):
    """Without the release checksum the stubs run, and their NotImplementedError says the same."""
    path = copy_notebook(COURSE, "02_sampling", tmp_path)
    nb = read(path)
    for cell in nb.cells:
        cell.metadata.get("nbgrader", {}).pop("checksum", None)
    nbformat.write(nb, str(path))
    found = statuses(run_progress("--course", tmp_path, "--json"))
    assert len(found) == 6 and set(found.values()) == {"not started"}, found


@pytest.mark.slow
def test_solutions_pass_and_a_kept_bug_fails(tmp_path):
    buggy_sampling = load_fixture("buggy_sampling")
    buggy = inspect.getsource(buggy_sampling.top_k_drops_ties).replace("def top_k_drops_ties(", "def top_k_filter(")
    copy_notebook(SOLUTIONS, "02_sampling", tmp_path, replace={"ex_top_k_filter": buggy})
    copy_notebook(SOLUTIONS, "03_kv_cache", tmp_path)
    copy_notebook(SOLUTIONS, "00_meet_the_model", tmp_path)  # filtered out below
    run = run_progress("--course", tmp_path, "--notebooks", "02_sampling,03", "--json")
    found = statuses(run)
    assert {nb for nb, _ in found} == {"02_sampling", "03_kv_cache"}
    assert found.pop(("02_sampling", "top_k_filter")).startswith(
        "failing: top_k_filter(logits [3, 1, 2, 2, 0.5], k=2): tokens 2 and 3 tie for 2nd place"
    )
    found.pop(("02_sampling", "sample"))  # the solution's sample calls the buggy top_k_filter
    assert len(found) == 9 and set(found.values()) == {"passing"}, found

    table = run_progress("--course", tmp_path, "--notebooks", "03_kv_cache")
    assert table.returncode == 0, table.stderr
    assert "KV cache" in table.stdout and "5 of 5 exercises passing" in table.stdout


@pytest.mark.slow
def test_an_endless_loop_times_out_and_other_notebooks_keep_their_rows(tmp_path):
    looping = "def count_parameters(config):\n    print('thinking...')\n    while True:\n        pass\n"
    copy_notebook(COURSE, "00_meet_the_model", tmp_path, replace={"ex_count_parameters": looping})
    copy_notebook(SOLUTIONS, "11_tiled_attention", tmp_path)  # runs, in its own subprocess
    found = statuses(run_progress("--course", tmp_path, "--timeout", "15", "--json"))
    assert found == {
        ("00_meet_the_model", "bpe_encode"): "not started",
        ("00_meet_the_model", "count_parameters"): "failing: timed out after 15 s",
        ("00_meet_the_model", "decode_tokens_per_second_bound"): "not started",
        **{
            ("11_tiled_attention", name): "passing"
            for name in [
                "attention_memory_bytes",
                "online_softmax_update",
                "tiled_attention",
                "tiled_causal_attention",
                "combine_partial_attention",
            ]
        },
    }


# Synthetic notebooks (no torch): the learner's crashes, prints and mistakes, quickly.


def synthetic_notebook(path: Path, cells: list[tuple[str, str, str | None]], released: dict | None = None) -> None:
    """cells: (kind, source, grade id or None); ex_ cells are solution cells, test_ cells graded.
    released: grade id -> the source the release had, for nbgrader's checksum in its metadata."""
    nb = nbformat.v4.new_notebook()
    for kind, source, gid in cells:
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
            continue
        cell = nbformat.v4.new_code_cell(textwrap.dedent(source))
        if gid:
            graded = gid.startswith("test_")
            cell.metadata["nbgrader"] = {
                "grade": graded,
                "grade_id": gid,
                "locked": graded,
                "solution": not graded,
                "schema_version": 3,
                "task": False,
                **({"points": 1} if graded else {}),
            }
        if gid in (released or {}):
            as_released = nbformat.v4.new_code_cell(textwrap.dedent(released[gid]), metadata=dict(cell.metadata))
            cell.metadata["nbgrader"]["checksum"] = progress.release_checksum(as_released)
        nb.cells.append(cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def exercise(name: str, body: str, test: str) -> list[tuple[str, str, str | None]]:
    return [
        ("code", body, f"ex_{name}"),
        (
            "code",
            f"{textwrap.dedent(test)}\n### BEGIN HIDDEN TESTS\nraise AssertionError('hidden tests ran')\n"
            "### END HIDDEN TESTS\n",
            f"test_{name}",
        ),
    ]


COUNTER = """\
class Counter:
    def __init__(self):
        raise NotImplementedError('write it')

    def bump(self):
        raise NotImplementedError('write it')
"""


def test_crashes_prints_and_mistakes_cost_only_their_rows(tmp_path):
    synthetic_notebook(
        tmp_path / "90_mistakes" / "90_mistakes.ipynb",
        [
            ("markdown", "# 90 · Mistakes\n## 0. Set-up", None),
            (
                "code",
                "import os, sys\nBASE = 10\nprint('set-up says hi' * 1000)\nprint('noise', file=sys.stderr)",
                None,
            ),
            ("markdown", "## 1. First", None),
            ("code", "raise RuntimeError('an explorer cell: never run by progress')", None),
            *exercise(
                "add",
                'def add(x):\n    print(\'{"not": "json"}\')\n    return x + BASE\n',
                "assert add(1) == 11, 'add(1) should be 11'",
            ),
            ("code", "raise RuntimeError('an experiment between exercises: never run')", None),
            *exercise(
                "stub", "def stub():\n    # YOUR CODE HERE\n    raise NotImplementedError('write it')\n", "stub()"
            ),
            *exercise("uses_stub", "def uses_stub():\n    return stub() + 1\n", "uses_stub()"),
            *exercise(
                "wrong",
                "def wrong(x):\n    return x\n",
                "assert wrong(2) == 3, 'wrong(2): expected 3, got ' + str(wrong(2))\nprint('not reached')",
            ),
            *exercise("exits", "import os\ndef exits():\n    os._exit(3)\n", "exits()"),
            *exercise("segfaults", "import ctypes\ndef segfaults():\n    ctypes.string_at(0)\n", "segfaults()"),
            *exercise("after_crash", "def after_crash():\n    return BASE\n", "assert after_crash() == 10"),
            *exercise("typo", "def typo(:\n    pass\n", "typo()"),
            *exercise("quits", "import sys\ndef quits():\n    sys.exit('bye')\n", "quits()"),
            ("code", "def orphan():\n    return 1\n", "ex_orphan"),
            *exercise(
                "Counter",
                COUNTER.replace("        raise NotImplementedError('write it')\n", "        self.n = 0\n", 1),
                "c = Counter()\nc.bump()",
            ),
            *exercise("untouched", "def untouched():\n    return 1\n", "raise AssertionError('an unchanged cell ran')"),
        ],
        released={"ex_Counter": COUNTER, "ex_untouched": "def untouched():\n    return 1\n"},
    )
    synthetic_notebook(
        tmp_path / "91_broken_setup" / "91_broken_setup.ipynb",
        [
            ("code", "import nothing_called_this", None),
            *exercise("fine", "def fine():\n    return 1\n", "assert fine() == 1"),
        ],
    )
    found = statuses(run_progress("--course", tmp_path, "--timeout", "60", "--json"))
    assert found == {
        ("90_mistakes", "add"): "passing",
        ("90_mistakes", "stub"): "not started",
        ("90_mistakes", "uses_stub"): "failing: it uses stub, which is not written yet",
        ("90_mistakes", "wrong"): "failing: wrong(2): expected 3, got 2",
        ("90_mistakes", "exits"): "failing: the kernel died (exit code 3)",
        ("90_mistakes", "segfaults"): "failing: the kernel died (killed by SIGSEGV)",
        ("90_mistakes", "after_crash"): "passing",
        ("90_mistakes", "typo"): "failing: SyntaxError: invalid syntax (line 1)",
        ("90_mistakes", "quits"): "failing: SystemExit: bye",
        ("90_mistakes", "orphan"): "failing: its test cell test_orphan is missing from the notebook",
        ("90_mistakes", "Counter"): "failing: Counter.bump is not written yet",  # edited, half written
        ("90_mistakes", "untouched"): "not started",  # as released: not even run
        ("91_broken_setup", "fine"): "failing: the set-up cell 0 raised ModuleNotFoundError: "
        "No module named 'nothing_called_this'",
    }


def test_a_malformed_notebook_says_so_and_the_rest_still_run(tmp_path):
    copy_notebook(COURSE, "00_meet_the_model", tmp_path)
    (tmp_path / "02_sampling").mkdir()
    (tmp_path / "02_sampling" / "02_sampling.ipynb").write_text('{"cells": [{"cell_type": "code"')
    found = statuses(run_progress("--course", tmp_path, "--json"))
    assert len(found) == 9  # 00's three exercises and 02's six
    assert {s for (nb, _), s in found.items() if nb == "00_meet_the_model"} == {"not started"}
    assert {
        s.split(":")[:2] == ["failing", " the notebook cannot be read"]
        for (nb, _), s in found.items()
        if nb == "02_sampling"
    } == {True}
    table = run_progress("--course", tmp_path)
    assert table.returncode == 0 and "sampling: top-k" in table.stdout and "cannot be read" in table.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--course", "/no/such/folder"], "is not a folder"),
        (["--course", "{empty}"], "no course notebooks"),
        (["--course", str(COURSE), "--notebooks", "99_nothing"], "no notebook 99_nothing"),
        (["--course", str(COURSE), "--timeout", "0"], "--timeout"),
    ],
)
def test_bad_input_exits_2(tmp_path, args, message):
    run = run_progress(*[a.replace("{empty}", str(tmp_path)) for a in args])
    assert run.returncode == 2 and message in run.stderr and run.stdout == "", (run.stdout, run.stderr)


# --------------------------------------------------------------------------- as root; what the code starts

as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (to chown, and to be refused)"
)
NOBODY = 65534  # a uid that is not root's: the student


def one_exercise_course(
    folder: Path, name: str = "90_one", body: str = "def one():\n    return 1\n", test: str = "assert one() == 1"
) -> Path:
    path = folder / name / f"{name}.ipynb"
    synthetic_notebook(path, exercise(name.split("_", 1)[1], body, test))
    return path


@as_root
def test_root_refuses_a_students_notebook_in_roots_folder(tmp_path):
    notebook = one_exercise_course(tmp_path / "course")
    os.chown(notebook, NOBODY, NOBODY)
    run = run_progress("--course", tmp_path / "course", "--json")
    assert run.returncode == 2 and run.stdout == "", (run.stdout, run.stderr)
    user = pwd.getpwuid(NOBODY).pw_name
    assert run.stderr.strip() == (
        f"decodelab: error: {notebook} belongs to {user} (uid {NOBODY}), and progress would run the code in it as "
        f"root. Run it as that user instead: sudo -u {user} python -m decodelab progress --course {tmp_path / 'course'}"
    )


def _students_module(course, notebook):
    (notebook.parent / "helpers.py").write_text("x = 1\n")
    os.chown(notebook.parent / "helpers.py", NOBODY, NOBODY)


def _link_to_students_file(course, notebook):
    (course.parent / "elsewhere.py").write_text("x = 1\n")
    os.chown(course.parent / "elsewhere.py", NOBODY, NOBODY)
    (notebook.parent / "helpers.py").symlink_to(course.parent / "elsewhere.py")


def _students_subfolder(course, notebook):
    (notebook.parent / "data" / "deeper").mkdir(parents=True)
    (notebook.parent / "data" / "deeper" / "mod.py").write_text("x = 1\n")
    os.chown(notebook.parent / "data" / "deeper" / "mod.py", NOBODY, NOBODY)


@as_root
@pytest.mark.parametrize(
    "change, refused",
    [
        (_students_module, "90_one/helpers.py belongs to"),
        (_link_to_students_file, "elsewhere.py belongs to"),
        (_students_subfolder, "90_one/data/deeper/mod.py belongs to"),
        (lambda course, notebook: os.chown(course.parent, NOBODY, NOBODY), "home belongs to"),  # could swap course/
        (lambda course, notebook: os.chmod(notebook.parent, 0o777), "90_one can be written by every user (mode 777)"),
        (lambda course, notebook: os.chmod(notebook.parent, 0o1777), "90_one can be written by every user (mode 1777)"),
        (
            lambda course, notebook: (os.chown(notebook, 0, NOBODY), os.chmod(notebook, 0o664)),
            "90_one.ipynb can be written by the group",
        ),
        (lambda course, notebook: os.chmod(course.parent, 0o1777), None),  # shared like /tmp, on the way only
        (lambda course, notebook: os.chmod(notebook, 0o664), None),  # root's own group
    ],
    ids=[
        "module",
        "symlink",
        "subfolder",
        "folder_on_the_way",
        "world_writable",
        "sticky_code_folder",
        "group_writable",
        "sticky_on_the_way",
        "roots_group",
    ],
)
def test_root_runs_only_code_that_root_alone_can_change(tmp_path, change, refused):
    course = tmp_path / "home" / "course"
    notebook = one_exercise_course(course)
    change(course, notebook)
    if refused is None:
        progress.check_owner(course)
        return
    with pytest.raises(progress.ProgressError, match=re.escape(refused)):
        progress.check_owner(course)


def alive(pid: int) -> bool:
    """Running (a zombie no longer runs: the init of a container may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


ESCAPE = (
    "import subprocess; print(subprocess.Popen(['sleep', '300'], start_new_session=True, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
)  # in a session of its own, its parent gone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc and the child subreaper")
def test_a_process_left_behind_dies_when_the_notebook_ends(tmp_path):
    returncode, timed_out, output = progress.run_until([sys.executable, "-c", ESCAPE], tmp_path, time.monotonic() + 60)
    assert (returncode, timed_out) == (0, False), output
    assert not alive(int(output))


HANGS = f"""
import subprocess, sys, time
def hangs():
    left = subprocess.Popen(["sleep", "300"], start_new_session=True)  # its own session
    orphan = int(subprocess.run([sys.executable, "-c", "{ESCAPE}"], capture_output=True, text=True).stdout)
    with open("pids", "w") as pids:
        print(left.pid, orphan, file=pids)
    time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: /proc and the child subreaper")
def test_what_a_notebook_that_times_out_started_dies_with_it(tmp_path):
    notebook = one_exercise_course(tmp_path, "92_hangs", HANGS, "hangs()")
    [row] = progress.check_notebook(notebook, timeout=3)
    assert row.status == "failing: timed out after 3 s"
    pids = [int(pid) for pid in (tmp_path / "92_hangs" / "pids").read_text().split()]
    assert len(pids) == 2 and not [pid for pid in pids if alive(pid)]

"""The class grader on a Dask cluster (autograder/cluster.py), with real processes on 127.0.0.1:
a LocalCluster grades a small class to the same rows as the process pool; README's one-machine
recipe, run word for word in a user's shell (no PYTHONPATH: `python -m autograder scheduler`,
`python -m autograder worker --nworkers 2`), grades it to the same rows through
`--scheduler-file`, and a worker killed while it grades a slow submission loses no row (graded
again, and the row says so); the host-wide slot allocator; the refusal of a scheduler that is
neither TLS nor on the loopback.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from notebooks import ROOT
from test_grading import AS_ROOT, AUTOGRADED, MAX, NAME, OTHER, SOL_BOUND, WRONG_COUNT, _grade, _rows, _trimmed

pytest.importorskip("distributed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:Object of type .* not in session")

SLOW_SECONDS = 15
SANDBOX = [] if AS_ROOT else ["--no-sandbox"]


def small_class(root: Path, slow: bool = False) -> Path:
    subs = root / "submissions"

    def put(student: str, nb=None, text: str | None = None) -> None:
        folder = subs / student / NAME
        folder.mkdir(parents=True, exist_ok=True)
        if nb is not None:
            nbformat.write(nb, str(folder / f"{NAME}.ipynb"))
        else:
            (folder / f"{NAME}.ipynb").write_text(text or "")

    put("correct", _trimmed())
    (subs / "correct" / NAME / ".decodelab_hints.json").write_text(json.dumps({NAME: {"ex_count_parameters": 2}}))
    put("wrong", _trimmed(count=WRONG_COUNT))
    put("malformed", text="{")
    if slow:
        put("slow", _trimmed(bound=f"import time\ntime.sleep({SLOW_SECONDS})\n" + SOL_BOUND))
    return subs


def _triples(rows: dict) -> dict:
    return {s: (r["status"], float(r["score"]), float(r["max_score"])) for s, r in rows.items()}


@pytest.fixture(scope="module")
def by_pool(tmp_path_factory) -> dict:
    """The small class graded by the process pool (`--workers 2`): the rows a cluster must give."""
    root = tmp_path_factory.mktemp("pool")
    result = _grade(small_class(root), root / "grades.csv", *SANDBOX, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return _rows(root / "grades.csv")


@pytest.mark.slow
def test_local_cluster_grades_like_the_pool(tmp_path, by_pool):
    subs = small_class(tmp_path)
    dask = tmp_path / "dask" / "grades.csv"
    result = _grade(subs, dask, "--scheduler", "local", *SANDBOX, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    by_dask = _rows(dask)
    assert _triples(by_dask) == _triples(by_pool)
    assert _triples(by_dask) == {
        "correct": ("ok", AUTOGRADED, MAX),
        "wrong": ("ok", 2 + OTHER, MAX),
        "malformed": ("unreadable", 0, MAX),
    }
    assert not any("grader:" in r["notes"] for r in by_dask.values()), by_dask
    assert list(by_dask) == list(by_pool)  # the same row order
    for rows in (by_pool, by_dask):  # the hint counter beside the notebook reaches the worker
        assert "hints: ex_count_parameters 2" in rows["correct"]["notes"], rows["correct"]


def _executing(dask_worker) -> list[str]:
    """The keys a worker is running now (not those only queued on it)."""
    return [str(ts.key) for ts in dask_worker.state.executing]


def users_shell() -> dict:
    """The environment of a user's shell after `make` or an activated venv: the venv's bin first on
    PATH, HOME, LANG (and where the model cache is, if they set it); no PYTHONPATH."""
    env = {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    env.update({name: os.environ[name] for name in ("DECODELAB_CACHE", "XDG_CACHE_HOME") if name in os.environ})
    return env


def readme_recipe(scheduler_file: Path) -> dict[str, list[str]]:
    """README's one-machine recipe word for word ("scheduler", "worker", "grade": each a command
    line), `sched.json` replaced by `scheduler_file`; the grade line keeps its `...`."""
    blocks = (ROOT / "README.md").read_text().split("```")[1::2]  # what is inside each fence
    block = next(b for b in blocks if "python -m autograder worker --scheduler-file" in b)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    recipe = {}
    for name in ("scheduler", "worker", "grade"):
        start = ["python", "-m", "autograder", name]
        words = next(words for words in commands if words[: len(start)] == start)
        recipe[name] = [str(scheduler_file) if word == "sched.json" else word for word in words]
    return recipe


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=users_shell(), stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


@pytest.mark.slow
def test_readme_recipe_and_a_lost_worker(tmp_path, by_pool):
    """README's scheduler, workers and grading command, as written there, in a user's shell: the
    pool's rows; the worker grading `slow` is killed mid-run: no row is lost, `slow` is graded
    again (by the other worker or the one its nanny starts again) and its row says so."""
    import cloudpickle
    from distributed import Client

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _executing runs on the workers
    subs = small_class(tmp_path, slow=True)
    file = tmp_path / "scheduler.json"
    recipe = readme_recipe(file)
    processes = [_start(recipe["scheduler"], tmp_path / "scheduler.log")]
    try:
        for _ in range(600):
            if file.exists() and file.stat().st_size:
                break
            time.sleep(0.1)
        processes.append(_start(recipe["worker"], tmp_path / "workers.log"))
        out = tmp_path / "grades.csv"
        at = recipe["grade"].index("...")
        arguments = [
            "--assignment",
            NAME,
            "--submissions",
            str(subs),
            "--out",
            str(out),
            "--cell-timeout",
            "120",
            "--notebook-timeout",
            "300",
            "--memory",
            "2",
            "--quiet",
            *SANDBOX,
        ]
        grader = subprocess.Popen(
            recipe["grade"][:at] + arguments + recipe["grade"][at + 1 :],
            cwd=ROOT,
            env=users_shell(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        processes.append(grader)
        killed = None
        with Client(json.loads(file.read_text())["address"], timeout="30s") as client:
            deadline = time.monotonic() + 240
            while killed is None and time.monotonic() < deadline and grader.poll() is None:
                for worker, keys in client.run(_executing).items():
                    if any(k.startswith("grade-slow-") for k in keys):
                        time.sleep(4)  # its kernel is starting or running the sleep by now
                        pid = client.run(os.getpid, workers=[worker])[worker]
                        os.kill(pid, signal.SIGKILL)
                        killed = worker
                        break
                time.sleep(0.5)
        stdout, stderr = grader.communicate(timeout=600)
        assert killed, f"the slow submission was never seen running\n{stderr[-3000:]}"
        assert grader.returncode == 0, stderr[-3000:]
        rows = _rows(out)
        notes = {s: r["notes"] for s, r in rows.items()}
        assert _triples({s: r for s, r in rows.items() if s != "slow"}) == _triples(by_pool), notes
        assert _triples(rows)["slow"] == ("ok", AUTOGRADED, MAX), notes
        assert "grader: the worker was lost, graded again" in rows["slow"]["notes"].split("; "), rows["slow"]
        assert not any("grader:" in r["notes"] for s, r in rows.items() if s != "slow")
        assert "with a grader: note" in stdout
    finally:
        for process in reversed(processes):
            _stop(process)


SLOT_HOLDER = (
    "import sys, time; sys.path[:0] = {paths!r}\n"
    "from autograder import slots\n"
    "s = slots.acquire(folder={folder!r}); print(s.number, flush=True); time.sleep(60)\n"
)


def test_slots_are_host_wide_and_freed(tmp_path):
    from autograder import slots

    code = SLOT_HOLDER.format(paths=[str(ROOT), str(ROOT / "lib")], folder=str(tmp_path))
    holders = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        numbers = sorted(int(h.stdout.readline()) for h in holders)
        assert numbers == [0, 1] and slots.held(tmp_path) == [0, 1]
        mine = slots.acquire(folder=tmp_path)  # this process too: a third, distinct slot
        assert mine.number == 2
        holders[0].kill()
        holders[0].wait()
        free = [n for n in numbers if n not in slots.held(tmp_path)]
        assert len(free) == 1  # the killed holder's slot came back
        again = slots.acquire(folder=tmp_path)
        assert again.number == free[0]
        mine.release()
        again.release()
        assert len(slots.held(tmp_path)) == 1
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_refuses_a_remote_scheduler_without_tls(tmp_path):
    from autograder.cluster import Cluster, ClusterError, check

    subs = tmp_path / "subs"
    (subs / "someone" / NAME).mkdir(parents=True)
    result = _grade(subs, tmp_path / "grades.csv", "--scheduler", "tcp://10.1.2.3:8786", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "neither TLS nor on this machine's loopback" in result.stderr and "as root" in result.stderr
    assert not (tmp_path / "grades.csv").exists()
    for ok in ("tcp://127.0.0.1:8786", "localhost:8786", "tcp://[::1]:8786", "local"):
        check(Cluster(scheduler=ok))
    for bad, why in [
        ("grader.example.org:8786", "loopback"),
        ("tls://grader.example.org:8786", "client certificate"),
        ("tcp://127.0.0.1:1", "not tls://"),
    ]:
        with pytest.raises(ClusterError, match=why):
            check(Cluster(scheduler=bad, tls_ca_file="ca.pem" if bad.endswith(":1") else None))
    file = tmp_path / "scheduler.json"
    file.write_text(json.dumps({"address": "tcp://192.0.2.7:8786"}))
    with pytest.raises(ClusterError, match="as root"):
        check(Cluster(scheduler_file=str(file)))


def test_a_worker_refuses_another_version_or_no_model(tmp_path, monkeypatch):
    """grader_error, first in the precedence, with the reason; nothing is run."""
    from autograder import cluster
    from autograder import submission as grade
    from decodelab.model.registry import SMOLLM2_DIR_NAME

    assert cluster.SMOLLM2_DIR == SMOLLM2_DIR_NAME
    assert grade.STATUSES[0] == "grader_error" and grade.worst(["crashed", "grader_error", "ok"]) == "grader_error"
    settings = grade.Settings(assignment=NAME, notebook=f"{NAME}.ipynb", db_url="", release="", work=str(tmp_path))
    other = dict(cluster.versions(), decodelab="0.0.1")
    result = cluster.grade_task("t1", "someone", b"{}", b"", b"", settings, other)
    assert result.status == "grader_error" and "decodelab version" in result.notes[0], result
    monkeypatch.setenv("DECODELAB_CACHE", str(tmp_path / "empty-cache"))
    result = cluster.grade_task("t2", "someone", b"{}", b"", b"", settings, cluster.versions())
    assert result.status == "grader_error" and "SmolLM2 model cache is missing" in result.notes[0], result


def test_a_grading_worker_grades_one_submission_at_a_time(capsys):
    """`python -m autograder worker` asks Dask for grader=1 and one thread per worker process, after
    the user's options (nothing overrides them), and refuses another --resources or --nthreads."""
    from autograder import dask_cli
    from autograder.cluster import RESOURCE

    args = dask_cli.dask_worker_args(3, ["--scheduler-file", "s.json", "--host", "127.0.0.1"])
    assert args[-6:] == ["--nworkers", "3", "--resources", f"{RESOURCE}=1", "--nthreads", "1"]
    assert args.index("--host") < len(args) - 6
    for refused in (["--resources", "grader=4"], ["--resources=grader=4"], ["--nthreads", "2"], ["--nworkers", "0"]):
        with pytest.raises(SystemExit) as exit:
            dask_cli.main(["worker", "--scheduler-file", "s.json", *refused])
        assert exit.value.code == 2, refused
    assert "--nworkers N" in capsys.readouterr().err

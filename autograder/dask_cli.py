"""`python -m autograder scheduler ...` and `python -m autograder worker ...`: Dask's own scheduler
and worker command lines, run from this repository's checkout so that they can import
`autograder` (README: Grading on a cluster).

`autograder` is not an installed package (the distribution students install is decodelab alone,
never the hidden checks), and `dask scheduler` and `dask worker` do not put the folder they run in
on sys.path: the scheduler could not unpickle a grading task (it reads each task's function and
settings), nor a worker run one, so every row came back `grader_error`. `python -m autograder`
puts the repository root on sys.path; `worker` puts it on PYTHONPATH as well, for the worker
processes its nannies spawn (and spawn again after a crash).

`worker` gives each worker process what cluster.py's tasks ask for, the `grader=1` resource and one
thread, so it grades one submission at a time (`--nworkers N`: N at once), and no dashboard of its
own, its HTTP endpoints (health, metrics) on the loopback only, unless `--dashboard` or
`--dashboard-address` say otherwise: a grading worker runs as root. Every other option is
Dask's (`dask worker --help`, `dask scheduler --help`): the scheduler address, --scheduler-file,
--tls-ca-file, --tls-cert, --tls-key, --host, ...
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from autograder.cluster import RESOURCE

ROOT = Path(__file__).resolve().parent.parent
PROG = "python -m autograder"


def _positive(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return number


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} worker",
        allow_abbrev=False,
        description=f"A Dask worker that grades: one submission at a time per worker process ({RESOURCE}=1, "
        "one thread), the repository root on every worker process's sys.path.",
        epilog="Any other option is `dask worker`'s (`dask worker --help`): the scheduler address, "
        "--scheduler-file, --tls-ca-file, --tls-cert, --tls-key, --host, --local-directory, --dashboard, ...",
    )
    p.add_argument(
        "--nworkers",
        type=_positive,
        default=1,
        help="worker processes: the submissions this machine grades at once (README: N)",
    )
    p.add_argument(
        "--nthreads",
        type=int,
        choices=[1],
        default=1,
        help="threads per worker process: 1, one submission at a time (the default)",
    )
    return p


def dask_worker_args(nworkers: int, dask_args: list[str]) -> list[str]:
    """`dask worker`'s command line: no dashboard and HTTP on the loopback unless the user's options,
    next, say otherwise, then the grading worker's processes, resource and thread (last: nothing
    overrides them)."""
    return [
        "--no-dashboard",
        "--dashboard-address",
        "127.0.0.1:0",
        *dask_args,
        "--nworkers",
        str(nworkers),
        "--resources",
        f"{RESOURCE}=1",
        "--nthreads",
        "1",
    ]


def put_root_on_path() -> None:
    """The repository root first on PYTHONPATH: each worker process a nanny spawns imports autograder."""
    inherited = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([inherited] if inherited else [])])


def run_click(command, args: list[str], prog: str) -> int:
    """One of Dask's click command lines, run in this process; its exit status."""
    try:
        command.main(args=args, prog_name=prog)
    except SystemExit as done:  # click's standalone mode always exits
        return done.code if isinstance(done.code, int) else 1
    return 0


def worker(argv: list[str]) -> int:
    p = worker_parser()
    options, dask_args = p.parse_known_args(argv)
    if any(arg.partition("=")[0] == "--resources" for arg in dask_args):
        p.error(
            f"--resources is set by this command ({RESOURCE}=1 per worker process): use --nworkers N to "
            "grade N submissions at once"
        )
    put_root_on_path()
    from distributed.cli.dask_worker import main as dask_worker

    return run_click(dask_worker, dask_worker_args(options.nworkers, dask_args), f"{PROG} worker")


def scheduler(argv: list[str]) -> int:
    """`dask scheduler` with its options as given; `python -m` has put the repository on sys.path."""
    from distributed.cli.dask_scheduler import main as dask_scheduler

    return run_click(dask_scheduler, argv, f"{PROG} scheduler")


def main(argv: list[str]) -> int:
    """argv: "scheduler" or "worker", then that command's options."""
    command = {"scheduler": scheduler, "worker": worker}[argv[0]]
    return command(argv[1:])

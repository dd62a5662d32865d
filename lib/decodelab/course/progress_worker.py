"""The notebook's subprocess of `python -m decodelab progress` (progress.py starts it, one per
notebook, in the notebook's folder): it runs each exercise's cells by the cell-selection rule of
progress_plan.py's docstring, in a fresh module namespace, and writes one JSON line per event to the
results file (start, phase, done, setup_failed), which progress reads back even after a crash.

    python -m decodelab.course.progress_worker SPEC.json RESULTS.jsonl
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import traceback
import types
from pathlib import Path

from decodelab.course.progress_plan import NOT_STARTED, PASSING, first_line
from decodelab.course.progress_process import die_with_parent


def _compile(source: str, filename: str):
    return compile(source, filename, "exec", dont_inherit=True)


def _fresh_namespace() -> dict:
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module.__dict__


def _raised_in(exc: BaseException) -> tuple[str, str]:
    """(file name, qualified name) of the innermost frame of exc's traceback: where it was raised."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "", ""
    code = tb.tb_frame.f_code
    return code.co_filename, getattr(code, "co_qualname", code.co_name)


def _message(exc: BaseException) -> str:
    text = first_line(str(exc))
    if isinstance(exc, AssertionError) and text:
        return text
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_one(spec: dict, name: str, emit) -> str:
    os.chdir(spec["cwd"])  # an earlier exercise may have moved away
    ns = _fresh_namespace()
    emit(event="phase", phase="set-up")
    for index, source in spec["setup"]:
        try:
            exec(_compile(source, f"<set-up cell {index}>"), ns)
        except BaseException as exc:  # noqa: BLE001 - the learner's code: anything may come out
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise _SetupFailed(f"the set-up cell {index} raised {_message(exc)}") from None
    emit(event="phase", phase="exercise")
    files = {}
    for other, index, source in spec["cells"]:
        filename = f"<exercise {other}, cell {index}>"
        files[filename] = other
        try:
            exec(_compile(source, filename), ns)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001
            if other == name:
                return f"failing: {_message(exc)}"
            # an earlier exercise's broken cell: its own row says so; this one goes on without it
        if other == name:
            break
    try:
        exec(_compile(spec["tests"][name], f"<test cell of {name}>"), ns)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, NotImplementedError):
            filename, function = _raised_in(exc)
            owner = files.get(filename)
            if owner == name:
                # a stub: not started, unless the cell was edited since the release (a class
                # with some methods written): then say which piece is still missing
                return f"failing: {function} is not written yet" if name in spec.get("changed", ()) else NOT_STARTED
            if owner is not None:
                return f"failing: it uses {owner}, which is not written yet"
        return f"failing: {_message(exc)}"
    return PASSING


class _SetupFailed(Exception):
    pass


def worker(spec_path: str, results_path: str) -> int:
    """In the notebook's subprocess: check each exercise in `run`, one JSON line per event."""
    spec = json.loads(Path(spec_path).read_text())
    die_with_parent(spec.get("parent"))
    spec["cells"] = [tuple(c) for c in spec["cells"]]
    spec["cwd"] = os.getcwd()
    sys.path.insert(0, spec["cwd"])  # as in a kernel: the notebook's folder is importable
    with open(results_path, "a", buffering=1) as results:

        def emit(**event):
            results.write(json.dumps(event) + "\n")
            results.flush()

        for name in spec["run"]:
            emit(event="start", exercise=name)
            try:
                status = _check_one(spec, name, emit)
            except _SetupFailed as exc:
                emit(event="setup_failed", status=str(exc))
                return 0
            except SystemExit as exc:
                status = f"failing: SystemExit: {exc.code}" if exc.code not in (None, 0) else "failing: SystemExit"
            except BaseException:  # noqa: BLE001 - whatever escapes is this exercise's failure
                status = f"failing: {first_line(traceback.format_exc().splitlines()[-1])}"
            emit(event="done", exercise=name, status=status)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(
            "usage: python -m decodelab.course.progress_worker SPEC.json RESULTS.jsonl "
            "(progress starts it; you want: python -m decodelab progress --course DIR)"
        )
    sys.exit(worker(sys.argv[1], sys.argv[2]))

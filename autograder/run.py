"""The one call a notebook's hidden-test block makes:

    ### BEGIN HIDDEN TESTS
    from autograder.run import hidden
    hidden("sampling.check_top_k_filter", top_k_filter)
    ### END HIDDEN TESTS

`hidden` runs ``autograder.checks.<topic>.check_<name>`` on the learner's function (only
``check_*`` functions are hidden tests: `autograder.checks.calling`, how the checks call the
function, is none). A failure becomes a fresh `HiddenTestFailed` carrying only the check's
message (input, expected, got; for an unfinished stub "<function> is not written yet: it
raises NotImplementedError"): no traceback into the check, so the hidden tests' source never
shows in the feedback. Whatever the function under test prints, or warns, is swallowed:
nbgrader would score a test cell 0 for a single line on stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import warnings


class HiddenTestFailed(AssertionError):
    """A hidden test failed; the message says on which input and how."""


def _run(check_name: str, fn) -> str | None:
    """The failure message of one check, or None if it passed."""
    module_name, _, function_name = check_name.rpartition(".")
    if not function_name.startswith("check_"):
        return f"the grader has no hidden test named {check_name!r}"
    try:
        check = getattr(importlib.import_module(f"autograder.checks.{module_name}"), function_name)
    except (ImportError, AttributeError, ValueError):
        return f"the grader has no hidden test named {check_name!r}"
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            check(fn)
    except AssertionError as failure:
        return str(failure) or "a hidden test failed"
    except Exception as crash:  # noqa: BLE001 - the check itself could not run on this function
        return f"the hidden tests could not run on this function: {type(crash).__name__}: {crash}"
    return None


def hidden(check_name: str, fn) -> None:
    """Run one hidden check on fn; print a line if it passes, raise HiddenTestFailed if not."""
    __tracebackhide__ = True  # IPython and pytest leave this frame out of tracebacks
    message = _run(check_name, fn)
    if message is None:
        print(f"hidden tests passed: {check_name.rpartition('.')[2].removeprefix('check_')}")
        return
    raise HiddenTestFailed(f"hidden test failed: {message}") from None

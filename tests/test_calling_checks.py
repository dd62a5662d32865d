"""How the hidden checks call the learner's function (autograder/checks/calling.py): one way,
one message shape in every notebook. An unfinished stub is "<function> is not written yet: it
raises NotImplementedError"; any other exception, an AssertionError inside the function
included, is "<what was called, on which input> raised <Type>: <message>"."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from notebooks import SOLUTIONS, hidden_calls, read, solution_path

from autograder.checks.calling import call, expect_raises
from autograder.run import _run

STUB_BODY = 'raise NotImplementedError("write this function, then run the test cell below it")'


def _hidden_checks() -> list[tuple[str, str, str]]:
    """(notebook, check, exercise) for every hidden call of an exercise in every source notebook (a
    prediction's check grades a number, not a function: tests/test_notebooks.py covers those)."""
    found = []
    for path in sorted(SOLUTIONS.glob("*/*.ipynb")):
        name = path.parent.name
        if path.stem != name:
            continue
        for cell in read(solution_path(name)).cells:
            found += [
                (name, check, function)
                for check, function in hidden_calls(cell.source)
                if not function.startswith("q_")
            ]
    return found


HIDDEN_CHECKS = _hidden_checks()


def _is_class(check: str, function: str) -> bool:
    module = importlib.import_module(f"autograder.checks.{check.partition('.')[0]}")
    reference_module, _, attr = module.REFERENCES[function].partition(":")
    return inspect.isclass(getattr(importlib.import_module(reference_module), attr))


def _kernel_parameters(check: str, function: str) -> str | None:
    """The parameter list of a Triton kernel exercise's reference (None for any other exercise)."""
    module = importlib.import_module(f"autograder.checks.{check.partition('.')[0]}")
    reference_module, _, attr = module.REFERENCES[function].partition(":")
    reference = getattr(importlib.import_module(reference_module), attr)
    if type(reference).__name__ not in ("JITFunction", "InterpretedFunction"):
        return None
    return ", ".join(inspect.signature(reference.fn).parameters)


def _learner_code(check: str, function: str, body: str):
    """The exercise as a notebook cell defines it (compiled outside any installed package), with
    this body: a function, a Triton kernel (@triton.jit, the reference's parameters), or for a class
    exercise a class whose __init__ has it. Returns (the object, the name a stub message must give)."""
    kernel_parameters = _kernel_parameters(check, function)
    if kernel_parameters is not None:
        source = f"import triton\nimport triton.language as tl\n@triton.jit\ndef {function}({kernel_parameters}):\n    {body}\n"
        where = function
    elif _is_class(check, function):
        source = f"class {function}:\n    def __init__(self, *args, **kwargs):\n        {body}\n"
        where = f"{function}.__init__"
    else:
        source = f"def {function}(*args, **kwargs):\n    {body}\n"
        where = function
    namespace: dict = {}
    exec(compile(source, "/tmp/ipykernel_1/cell.py", "exec"), namespace)
    return namespace[function], where


def test_every_notebook_has_hidden_checks():
    notebooks = {p.parent.name for p in SOLUTIONS.glob("*/*.ipynb") if p.stem == p.parent.name}
    assert {name for name, _, _ in HIDDEN_CHECKS} == notebooks


@pytest.mark.parametrize("notebook, check, function", HIDDEN_CHECKS, ids=[c for _, c, _ in HIDDEN_CHECKS])
def test_an_unfinished_stub_gets_the_same_message_in_every_notebook(notebook, check, function):
    stub, name = _learner_code(check, function, STUB_BODY)
    assert _run(check, stub) == f"{name} is not written yet: it raises NotImplementedError", notebook


@pytest.mark.parametrize("notebook, check, function", HIDDEN_CHECKS, ids=[c for _, c, _ in HIDDEN_CHECKS])
def test_a_crash_names_the_call_and_the_exception_in_every_notebook(notebook, check, function):
    """An assert of the learner's own is a crash of their function, reported like any other."""
    crash, _ = _learner_code(check, function, 'assert False, "an assert of the learner\'s"')
    message = _run(check, crash)
    assert message.endswith(" raised AssertionError: an assert of the learner's"), (notebook, message)
    assert not message.startswith(" raised") and "could not run" not in message, (notebook, message)


def test_call_returns_what_the_function_returns():
    assert call("max([1, 3])", max, [1, 3]) == 3
    assert call("int('7', base=8)", int, "7", base=8) == 7


def test_call_reports_a_crash_with_the_input():
    def top_k_filter(logits, k):
        raise IndexError(f"k is {k}")

    with pytest.raises(
        AssertionError, match=r"^top_k_filter\(logits \[1, 2\], k=0\) raised IndexError: k is 0$"
    ) as info:
        call("top_k_filter(logits [1, 2], k=0)", top_k_filter, [1, 2], 0)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no traceback into the check


def test_not_implemented_inside_an_installed_library_is_a_crash_not_a_stub():
    """torch raising NotImplementedError (here: a module without forward) is not the learner's stub."""
    with pytest.raises(AssertionError, match=r"^model\(x\) raised NotImplementedError: Module \[Module\] is missing"):
        call("model(x)", torch.nn.Module(), torch.zeros(1))


def test_a_stub_reached_through_other_code_is_named():
    """The check may reach the learner's code through the library (a cache inside the model, a
    step inside the engine): the message names the function whose body raised."""
    stub, name = _learner_code("kv_cache.check_kv_cache_class", "KVCache", STUB_BODY)
    with pytest.raises(AssertionError, match=r"^KVCache\.__init__ is not written yet: it raises NotImplementedError$"):
        call("make the cache", lambda: stub(None))


def test_expect_raises():
    def checked(k):
        if k < 1:
            raise ValueError("k must be >= 1")
        return k

    expect_raises("checked(0)", ValueError, "k must be >= 1", checked, 0)
    with pytest.raises(
        AssertionError, match=r"^checked\(3\) should raise ValueError \(k must be >= 1\); it returned 3$"
    ):
        expect_raises("checked(3)", ValueError, "k must be >= 1", checked, 3)
    with pytest.raises(AssertionError, match=r"^f\(\) should raise ValueError; it raised KeyError: 'x'$"):
        expect_raises("f()", ValueError, "", lambda: {}["x"])
    with pytest.raises(AssertionError, match=r"it returned a tensor of shape \[5, 5\]$"):
        expect_raises("eye", ValueError, "", torch.eye, 5)
    stub, _ = _learner_code("sampling.check_top_k_filter", "top_k_filter", STUB_BODY)
    with pytest.raises(AssertionError, match=r"^top_k_filter is not written yet: it raises NotImplementedError$"):
        expect_raises("top_k_filter(logits, k=0)", RuntimeError, "a stub is no RuntimeError", stub)

"""How every hidden check calls the function under test: one way, one message shape.

Not a check module (it has no ``check_*``; `autograder.run` only runs those). The checks use

    got = call(f"top_k_filter(logits {x}, k=3)", fn, x, 3)
    expect_raises(f"top_k_filter(logits, k=0)", ValueError, "k must be >= 1", fn, x, 0)

and whatever the function under test raises becomes an ``AssertionError`` (which `hidden`
reports as a failed hidden test) in one of two shapes, in every notebook:

* an unfinished stub, a NotImplementedError raised by the learner's own code:
  ``"<function> is not written yet: it raises NotImplementedError"``, naming the function
  whose body raised it (``top_k_filter``, ``KVCache.__init__``), however the check reached it;
* anything else, an ``AssertionError`` inside the function included (an assert of the learner's
  is a crash of their function, not a verdict of the check):
  ``"<what was called, on which input> raised <Type>: <message>"``.

A NotImplementedError raised inside an installed library (torch's "not implemented for this
dtype", a module without `forward`) is a crash, reported with its message.
"""

from __future__ import annotations

import math
import sysconfig

import torch

__all__ = ["call", "expect_raises", "failure", "format_values"]

_INSTALLED = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def _unwritten(exc: BaseException) -> str | None:
    """The function whose own body raised this NotImplementedError (the innermost frame), or
    None if it came from an installed library rather than the learner's code."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if code.co_filename.startswith(_INSTALLED):
        return None
    return getattr(code, "co_qualname", code.co_name).rpartition("<locals>.")[2]  # KVCache.append, or helper


def failure(what: str, exc: Exception) -> AssertionError:
    """The AssertionError that reports exc, raised by `what` (the call and its input)."""
    if isinstance(exc, NotImplementedError):
        name = _unwritten(exc)
        if name is not None:
            return AssertionError(f"{name} is not written yet: it raises NotImplementedError")
    return AssertionError(f"{what} raised {type(exc).__name__}: {exc}")


def call(what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs); whatever it raises fails the check, with `what` in the message."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any exception of the code under test fails the check
        raise failure(what, exc) from None


def _shown(value) -> str:
    """A returned value for a message: small tensors in full, large ones by shape."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "tolist"):
        size = 1
        for n in shape:
            size *= int(n)
        return f"{value.tolist()!r}" if size <= 16 else f"a tensor of shape {list(shape)}"
    text = repr(value)
    return text if len(text) <= 200 else text[:199] + "…"


def format_values(x, digits: int = 6, max_values: int = 24) -> str:
    """A number, a tensor or a nested list for a message: [a, b, ...] with floats to `digits`
    significant digits (nan, inf and -inf by name); a tensor of more than `max_values` values by
    its shape only."""
    if isinstance(x, torch.Tensor):
        if x.numel() > max_values:
            return f"<tensor of shape {list(x.shape)}>"
        x = x.detach().cpu().tolist()
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(format_values(v, digits, max_values) for v in x) + "]"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "-inf" if x < 0 else "inf"
        return f"{x:.{digits}g}"
    return str(x)


def expect_raises(what: str, error: type[Exception], why: str, fn, *args, **kwargs) -> None:
    """fn(*args, **kwargs) must raise `error` (because `why`); anything else fails the check:
    "<what> should raise ValueError (<why>); it raised <Type>: <message>" / "; it returned <value>"."""
    should = f"{what} should raise {error.__name__}" + (f" ({why})" if why else "")
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the wrong exception fails the check too
        if isinstance(exc, NotImplementedError) and _unwritten(exc) is not None:
            raise failure(what, exc) from None  # a stub, even where a RuntimeError is expected
        if isinstance(exc, error):
            return
        raise AssertionError(f"{should}; it raised {type(exc).__name__}: {exc}") from None
    raise AssertionError(f"{should}; it returned {_shown(result)}")

"""Small checks that the notebooks' visible tests use: each says what was checked, on which
input, what was expected and what came back.

    expect_close(top_p_filter(logits, 0.9), expected, "top_p_filter(logits, p=0.9) on logits [2, 1, 0.5, -1]")

Every ``expect_*`` raises ``AssertionError`` with a sentence a person can act on, and
returns None when the check passes. Nothing here is secret: the hidden tests that grade a
notebook live elsewhere and check more cases.
"""

from __future__ import annotations

import math
import numbers

import torch


def describe(value, max_items: int = 12) -> str:
    """A short, readable rendering: floats to 6 significant digits, long tensors by shape."""
    if isinstance(value, torch.Tensor):
        if value.numel() > max_items:
            return f"<tensor of shape {list(value.shape)}, dtype {value.dtype}>"
        value = value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v, max_items) for v in value) + "]"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "-inf" if value < 0 else "inf"
        return f"{value:.6g}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return repr(value) if isinstance(value, str) else str(value)


def expect_equal(got, expected, what: str) -> None:
    """got == expected exactly (numbers, lists, tensors of equal shape)."""
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        same = (
            isinstance(got, torch.Tensor)
            and isinstance(expected, torch.Tensor)
            and got.shape == expected.shape
            and torch.equal(got.cpu(), expected.cpu())
        )
    else:
        same = got == expected
    if not same:
        raise AssertionError(
            f"{what}: expected {describe(expected)}, got {describe(got)}{_first_difference(got, expected)}"
        )


def _first_difference(got, expected, max_items: int = 12) -> str:
    """For two tensors of one shape too long to print: where they first differ, and how often."""
    if (
        not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor))
        or got.shape != expected.shape
        or expected.numel() <= max_items
    ):
        return ""
    g, e = got.detach().cpu(), expected.detach().cpu()
    differ = g != e
    if g.is_floating_point() or e.is_floating_point():
        differ &= ~(torch.isnan(g.double()) & torch.isnan(e.double()))
    if not differ.any():
        return f" (the same values, but dtype {got.dtype} where {expected.dtype} was expected)"
    index = tuple(int(i) for i in differ.nonzero()[0])
    at = index[0] if len(index) == 1 else index
    return (
        f"; they first differ at index {at}: expected {describe(e[index].item())}, got {describe(g[index].item())} "
        f"({int(differ.sum()):,} of {differ.numel():,} entries differ)"
    )


def expect_close(got, expected, what: str, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """got within atol + rtol * |expected| of expected: a number or a tensor of the same shape.
    Entries that are -inf (or inf) must match exactly."""
    if isinstance(expected, torch.Tensor):
        expect_tensor(got, what, shape=tuple(expected.shape))
        g, e = got.detach().cpu().double(), expected.detach().cpu().double()
        bad = ~torch.isclose(g, e, rtol=rtol, atol=atol) | torch.isnan(g)
        if bad.any():
            i = tuple(int(j) for j in bad.nonzero()[0])
            where = f" at index {i[0] if len(i) == 1 else i}" if g.dim() else ""
            detail = f"\n  expected {describe(expected)}\n  got      {describe(got)}" if expected.numel() <= 12 else ""
            raise AssertionError(
                f"{what}: expected {describe(e[i].item())}{where}, got {describe(g[i].item())}"
                f" (tolerance {atol:g} + {rtol:g} x |expected|){detail}"
            )
        return
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, numbers.Real) or isinstance(got, bool):
        raise AssertionError(
            f"{what}: expected a number close to {describe(expected)}, got {type(got).__name__} {describe(got)}"
        )
    if not math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) or math.isnan(got):
        raise AssertionError(
            f"{what}: expected {describe(float(expected))}, got {describe(float(got))} "
            f"(tolerance {atol:g} + {rtol:g} x |expected|)"
        )


def expect_tensor(got, what: str, shape: tuple | None = None, floating: bool | None = None) -> None:
    """got is a torch.Tensor (of `shape`; floating-point or integer if `floating` says so)."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__} {describe(got)}")
    if shape is not None and tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{what}: expected shape {list(shape)}, got shape {list(got.shape)}")
    if floating is True and not got.is_floating_point():
        raise AssertionError(f"{what}: expected floating-point values, got dtype {got.dtype}")
    if floating is False and (got.is_floating_point() or got.dtype == torch.bool):
        raise AssertionError(f"{what}: expected integer values (e.g. torch.int64), got dtype {got.dtype}")


def expect_int(got, expected: int, what: str) -> None:
    """got is a Python/NumPy integer (not a float, not a tensor) equal to expected."""
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        hint = " (use // for integer division)" if isinstance(got, float) else ""
        raise AssertionError(
            f"{what}: expected the integer {describe(expected)}, got {type(got).__name__} {got!r}{hint}"
        )
    expect_equal(int(got), int(expected), what)


def expect_kept(got, logits: torch.Tensor, keep: list[int], what: str) -> None:
    """A filter's result: the entries at `keep` equal the input logits, every other one is -inf."""
    expect_tensor(got, what, shape=tuple(logits.shape), floating=True)
    g = got.detach().cpu()
    kept = [i for i in range(g.shape[-1]) if g[i] != float("-inf")]
    if kept != sorted(keep):
        raise AssertionError(
            f"{what}: kept tokens {kept} (of {g.shape[-1]}), expected to keep {sorted(keep)}"
            f"\n  logits: {describe(logits)}\n  got:    {describe(got)}"
        )
    expect_close(g[keep], logits[keep].cpu(), f"{what}, the kept logits (they must stay unchanged)")


def expect_unchanged(before: torch.Tensor, after: torch.Tensor, what: str) -> None:
    """The caller's tensor was not modified in place."""
    if not torch.equal(before, after):
        raise AssertionError(
            f"{what} changed its input in place: {describe(before)} became {describe(after)}; "
            "return a new tensor instead"
        )


def expect_raises(exception: type[BaseException], fn, *args, what: str, why: str = "") -> None:
    """fn(*args) raises `exception` (e.g. ValueError for an out-of-range argument)."""
    try:
        result = fn(*args)
    except exception:
        return
    except Exception as exc:  # noqa: BLE001 - any other exception is the wrong one
        raise AssertionError(
            f"{what} should raise {exception.__name__}{f' ({why})' if why else ''}; "
            f"it raised {type(exc).__name__}: {exc}"
        ) from None
    raise AssertionError(
        f"{what} should raise {exception.__name__}{f' ({why})' if why else ''}; it returned {describe(result)}"
    )


def passed(what: str) -> None:
    """Say so when every check in a test cell passed."""
    print(f"\N{CHECK MARK} {what}")


__all__ = [
    "describe",
    "expect_equal",
    "expect_close",
    "expect_tensor",
    "expect_int",
    "expect_kept",
    "expect_unchanged",
    "expect_raises",
    "passed",
]

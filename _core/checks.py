"""Argument checks of the package, written once: `positive_int`, `number`, `flag`, `choice`.

The manifold classes, the optimizers and their hyper-parameters all call these,
so every bad value raises the same way: ValueError (or TypeError for a value of
the wrong type) naming the argument, the value given and what is allowed.

Example:
    ```python
    from stiefel._core import checks as _checks

    assert _checks.positive_int("k", 3) == 3
    assert _checks.number("lr", 0.1, low_open=True) == 0.1
    assert _checks.flag("nesterov", False) is False
    assert _checks.choice("metric", "canonical", ("euclidean", "canonical")) == "canonical"
    ```
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from collections.abc import Iterable, Iterator
from typing import Any

import torch

REAL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)
#: every dtype the kernels run in (complex32 and the float8 types have no kernels)
DTYPES = REAL_DTYPES + COMPLEX_DTYPES
#: the dtypes computed in float32 and returned in their own (Note [Low precision in float32])
LOW_PRECISION = (torch.float16, torch.bfloat16)
#: whether `number` reads a one-element tensor on the host (see `tensors_unread`)
_READ_TENSORS: contextvars.ContextVar[bool] = contextvars.ContextVar("read", default=True)


@contextlib.contextmanager
def tensors_unread() -> Iterator[None]:
    """Within it, `number` takes a one-element real tensor as it is, unread.

    A value a step checks again (Note [Values set after construction] in
    `stiefel.optimizers.groups`) may be a tensor on a device: reading it would
    synchronise the step with the device, and capturing a step in a CUDA graph
    forbids it. Its range was checked where it was given.
    """
    token = _READ_TENSORS.set(False)
    try:
        yield
    finally:
        _READ_TENSORS.reset(token)


def choice(name: str, value: object, allowed: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise listing them.

    Raises:
        TypeError: ``value`` is not a string (the wrong type, e.g. ``metric=1``).
        ValueError: a string that is not one of ``allowed``.
    """
    allowed = tuple(allowed)
    if not isinstance(value, str):
        raise TypeError(
            f"{name}={value!r} ({type(value).__name__}) is not supported; allowed: "
            f"{', '.join(allowed)} (strings)"
        )
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(allowed)}")
    return value


def int_at_least(name: str, value: object, low: int, *, none_ok: bool = False) -> int | None:
    """Return ``value`` if it is an int >= ``low`` (not a bool), or None when ``none_ok``.

    Raises:
        ValueError: anything else, naming ``name``, the value and what is allowed.
    """
    if value is None and none_ok:
        return None
    if not integer(value) or value < low:
        allowed = ("None or " if none_ok else "") + f"an int >= {low}"
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {allowed}")
    return int(value)


def integer(value: object) -> bool:
    """An int, or an integer of another library (numpy's int64 from a config or an array
    shape, which torch takes too); never a bool (True is not a size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value: object, *, none_ok: bool = False) -> int | None:
    """Return ``value`` if it is an int >= 1 (not a bool), or None when ``none_ok``.

    Raises:
        ValueError: anything else, naming ``name``, the value and what is allowed.
    """
    return int_at_least(name, value, 1, none_ok=none_ok)


def number(
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    high: float = math.inf,
    low_open: bool = False,
    closed_high: bool = False,
) -> float:
    """A finite real number in [low, high) (``low_open``: (low, …; ``closed_high``: …, high]).

    Args:
        name: the argument's name, for the message.
        value: the value given (a 1-element real tensor is accepted).
        low: the lower bound.
        high: the upper bound.
        low_open: whether ``low`` itself is refused.
        closed_high: whether ``high`` itself is allowed.

    Returns:
        The value as a float (a one-element tensor as it is inside `tensors_unread`).

    Raises:
        TypeError: not a real number.
        ValueError: not finite or out of range (the message gives the range).
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        if not _READ_TENSORS.get():
            return value  # type: ignore[return-value]
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    above = low < value if low_open else low <= value
    below = value <= high if closed_high else value < high
    if not (math.isfinite(value) and above and below):
        left, right = "(" if low_open else "[", "]" if closed_high else ")"
        raise ValueError(f"{name}={value!r} is out of range; allowed: {left}{low}, {high}{right}")
    return float(value)


def flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise TypeError naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} is not allowed; allowed: True, False")
    return value


def pair(name: str, value: object) -> tuple:
    """Return ``value`` as a tuple if it is a pair (tuple or list of two), else raise."""
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name}={value!r} is not allowed; allowed: a pair (tuple of two)")
    if len(value) != 2:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: a pair (tuple of two)")
    return tuple(value)


def int_in_range(
    name: str, value: object, low: int, high: int, *, none_ok: bool = False, where: str = ""
) -> int:
    """Return ``value`` if it is an int (not a bool) in [low, high]; else raise TypeError
    (not an int) or ValueError (out of range).

    ``where`` is appended to "out of range" (e.g. " for Orthogonal(n=4)"), and
    ``none_ok`` only changes the message (the caller handles None itself).
    """
    allowed = ("None or " if none_ok else "") + f"an int with {low} <= {name} <= {high}"
    if not integer(value):
        raise TypeError(f"{name}={value!r} is not an int; allowed: {allowed}")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} is out of range{where}; allowed: {allowed}")
    return int(value)


def tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def finite(name: str, x: torch.Tensor) -> torch.Tensor:
    """Raise ValueError if ``x`` holds NaN or ±inf (this synchronizes with the device).

    The sum of the entries is finite whenever every entry is (save overflow of
    huge values), so one reduction is the fast path; only a non-finite sum
    pays for the element-wise test that counts the bad entries.
    """
    if x.is_meta:  # no values (deferred initialisation): nothing to check
        return x
    if x.numel() and not bool(torch.isfinite(x.sum())):
        bad = int((~torch.isfinite(x)).sum())
        if bad == 0:  # the sum overflowed, the entries are fine
            return x
        raise ValueError(f"{name} has {bad} non-finite entries (NaN or inf); finite values needed")
    return x


def matrix(name: str, x: object, n: int, m: int, is_complex: bool, manifold: str) -> torch.Tensor:
    """Check that ``x`` is a (..., n, m) tensor of the manifold's field; return it."""
    x = tensor(name, x)
    allowed = COMPLEX_DTYPES if is_complex else REAL_DTYPES
    if x.dtype not in allowed:
        if x.dtype in DTYPES:
            kind = "complex" if x.is_complex() else "real"
            raise TypeError(
                f"{name} is {kind} ({x.dtype}) but {manifold} is "
                f"{'complex' if is_complex else 'real'}; allowed dtypes: "
                f"{', '.join(str(d) for d in allowed)}"
            )
        raise TypeError(
            f"{name} has dtype {x.dtype}; allowed: {', '.join(str(d) for d in allowed)}"
        )
    if x.dim() < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., {n}, {m}) for {manifold}, "
            f"got shape {tuple(x.shape)}"
        )
    if tuple(x.shape[-2:]) != (n, m):
        raise ValueError(
            f"{name} must have trailing shape ({n}, {m}) for {manifold}, got {tuple(x.shape)}"
        )
    return x


def represented_dtype(x: torch.Tensor) -> torch.dtype:
    r"""The coarsest of float32/float64 (complex64/complex128) that holds ``x`` exactly.

    A float64 tensor whose every entry is a float32 number was produced in
    float32 (e.g. trained in float32, then ``.double()``): Note [Tolerance of
    right inverses] in stiefel.parametrizations._originals. The manifolds' default
    check tolerance uses it too, so such a point is judged at float32's.
    """
    if x.dtype in (torch.float64, torch.complex128) and x.device.type != "meta":
        low = torch.complex64 if x.is_complex() else torch.float32
        if torch.equal(x.to(low).to(x.dtype), x):
            return low
    return x.dtype

"""Argument checks shared by the manifold classes (and reused by the rest of the package)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

REAL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def choice(name: str, value: object, allowed: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise ValueError listing them."""
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(allowed)}")
    return value


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def int_in_range(
    name: str, value: object, low: int, high: int, *, none_ok: bool = False, where: str = ""
) -> int:
    """Return ``value`` if it is an int (not a bool) in [low, high], else raise ValueError.

    ``where`` is appended to "out of range" (e.g. " for Orthogonal(n=4)"), and
    ``none_ok`` only changes the message (the caller handles None itself).
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        allowed = ("None or " if none_ok else "") + f"an int with {low} <= {name} <= {high}"
        raise ValueError(f"{name}={value!r} is out of range{where}; allowed: {allowed}")
    return value


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
        if x.dtype in COMPLEX_DTYPES or x.dtype in REAL_DTYPES:
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


def same_shape(name: str, u: torch.Tensor, x: torch.Tensor) -> None:
    if u.shape[-2:] != x.shape[-2:]:
        raise ValueError(
            f"{name} must have the trailing shape of x {tuple(x.shape[-2:])}, got {tuple(u.shape)}"
        )


def represented_dtype(x: torch.Tensor) -> torch.dtype:
    r"""The coarsest of float32/float64 (complex64/complex128) that holds ``x`` exactly.

    A float64 tensor whose every entry is a float32 number was produced in
    float32 (e.g. trained in float32, then ``.double()``): Note [Tolerance of
    right inverses] in stiefel.parametrizations.base. The manifolds' default
    check tolerance uses it too, so such a point is judged at float32's.
    """
    if x.dtype in (torch.float64, torch.complex128) and x.device.type != "meta":
        low = torch.complex64 if x.is_complex() else torch.float32
        if torch.equal(x.to(low).to(x.dtype), x):
            return low
    return x.dtype

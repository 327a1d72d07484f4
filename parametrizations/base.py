r"""The base class of the maps onto St(N, M), O(n), U(n), and the registry of methods.

A map is an ``nn.Module`` in the ``torch.nn.utils.parametrize`` style: ``forward``
takes the free parameter tensor ("original") and returns the constrained weight;
``right_inverse`` takes a point of the manifold and returns an original that maps
back to it (possibly updating the map's own buffers and parameters, such as a
sign or phase diagonal or a base point).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

import torch
from torch import nn

from ..manifolds import Orthogonal, Stiefel, Unitary, _checks
from ..manifolds.kernels import haar, orthogonality_error, polar
from ._inverse import Unreachable

__all__ = ["OrthogonalMap", "register", "available", "get", "manifold_for", "INITS", "DTYPES"]

DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)
INITS = ("nearest", "haar", "identity", "random")

_REGISTRY: dict[str, type | str] = {}
M = TypeVar("M", bound=type)


def manifold_for(shape: Sequence[int], is_complex: bool) -> Stiefel:
    """The manifold of a weight of this shape: O(n), U(n), or St(N, M) (wide: its transpose)."""
    rows, cols = shape[-2:]
    n, m = max(rows, cols), min(rows, cols)
    if n == m:
        return Unitary(n) if is_complex else Orthogonal(n)
    return Stiefel(n, m, complex=is_complex)


def register(name: str) -> Callable[[M], M]:
    """Class decorator adding an :class:`OrthogonalMap` subclass under ``name``.

    Example::

        >>> import torch
        >>> from stiefel.parametrizations import OrthogonalMap, register, available
        >>> @register("polar_demo")
        ... class PolarDemo(OrthogonalMap):
        ...     def matrix(self, x):
        ...         return torch.linalg.svd(x, full_matrices=False)[0] @ \\
        ...             torch.linalg.svd(x, full_matrices=False)[2]
        ...     def inverse(self, q):
        ...         return q
        >>> "polar_demo" in available()
        True
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, OrthogonalMap)):
            raise TypeError(f"register({name!r}) decorates OrthogonalMap subclasses, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method {name!r} is already registered ({_REGISTRY[name]!r})")
        cls.method = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _register_special(name: str) -> None:
    _REGISTRY[name] = name


_BUILTIN_ORDER = ("householder", "cwy", "tcwy", "exp", "cayley", "scaled_cayley", "riemannian")


def available() -> list[str]:
    """Names of the registered methods: built-ins first, then user maps in registration order."""
    builtin = [n for n in _BUILTIN_ORDER if n in _REGISTRY]
    return builtin + [n for n in _REGISTRY if n not in _BUILTIN_ORDER]


def get(name: object) -> type | str:
    """The class registered under ``name`` (a str for the non-parametrization ``"riemannian"``)."""
    return _REGISTRY[_checks.choice("method", name, available())]


def methods_serving(shape: Sequence[int], dtype: torch.dtype) -> list[str]:
    """Names of the methods that can serve a weight of this shape and dtype."""
    out = []
    for name, cls in _REGISTRY.items():
        if isinstance(cls, str):
            if shape[-2] >= shape[-1]:
                out.append(name)
        elif cls.serves(shape, dtype):
            out.append(name)
    return out


class OrthogonalMap(nn.Module):
    r"""A smooth map from free parameters onto St(n, m), O(n) or U(n).

    Subclasses implement :meth:`matrix` (original → the tall point, shape
    (…, n, m) with n ≥ m) and :meth:`inverse` (a tall point → an original), and
    may override :meth:`operator` (the operator form of ``F.linear``),
    :meth:`random_original` and :meth:`default_init`. The base class handles
    wide weights (stored as their transpose), argument checks and the
    manifold. Constructor keyword arguments are the method's options.

    Args:
        shape: shape of the weight, (…, rows, cols).
        dtype: its dtype (float32, float64, complex64 or complex128).
        device: its device.
    """

    method: ClassVar[str] = "?"
    real_only: ClassVar[bool] = False

    def __init__(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str | None = None
    ):
        super().__init__()
        shape = tuple(int(s) for s in shape)
        self.weight_shape = shape
        self.transposed = shape[-2] < shape[-1]
        self.n, self.m = max(shape[-2:]), min(shape[-2:])
        self.batch = shape[:-2]
        self.is_complex = dtype.is_complex
        self.manifold = manifold_for(shape, self.is_complex)
        self._pending: torch.Tensor | None = None

    # ------------------------------------------------------------------ capability
    @classmethod
    def serves(cls, shape: Sequence[int], dtype: torch.dtype) -> bool:
        """Whether this map can represent weights of this shape and dtype."""
        return not (cls.real_only and dtype.is_complex)

    @classmethod
    def option_names(cls) -> list[str]:
        params = inspect.signature(cls.__init__).parameters
        return [p for p in params if p not in ("self", "shape", "dtype", "device")]

    # ------------------------------------------------------------------ to implement
    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        """The point of the manifold, tall: shape (…, n, m)."""
        raise NotImplementedError

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        """An original with ``matrix(original) == q`` (q tall, on the manifold, float64-safe)."""
        raise NotImplementedError

    def operator(self, original: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """``F.linear(x, W)`` without forming W, or None if the map has no operator form."""
        return None

    def prepare_operator(self, original: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function x ↦ ``F.linear(x, W)`` for many x with one W (a rollout).

        Note [Factors once per rollout]
        A recurrent rollout applies the same W at every step. Maps whose
        operator form needs per-weight work (CWY's U and S, O(nL²)) override
        this to do it once; the default calls :meth:`operator` each time and
        falls back to forming W once when the map has no operator form.
        """

        if type(self).operator is OrthogonalMap.operator:  # no operator form: W once
            w = self.forward(original)
            return lambda x: x @ w.mT

        def apply(x: torch.Tensor) -> torch.Tensor:
            y = self.operator(original, x)
            return x @ self.forward(original).mT if y is None else y

        return apply

    def default_init(self) -> str:
        """The ``init`` used when none is given: the nearest point of the current weight."""
        return "nearest"

    def random_original(self, generator: torch.Generator | None, like: torch.Tensor):
        """An original for ``init="random"``; by default that of a Haar-random point."""
        return self.inverse(self._haar(like, generator))

    # ------------------------------------------------------------------ parametrize interface
    def forward(self, original: torch.Tensor) -> torch.Tensor:
        q = self.matrix(original)
        return q.mT if self.transposed else q

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        r"""Parameters mapping back to ``value``, a manifold point (any shape the weight has).

        Raises ValueError if ``value`` is off the manifold (giving ‖QᴴQ − I‖_F
        and pointing to ``projx``) or not reachable with this map's options.
        """
        if self._pending is not None:  # the value computed by orthogonalize() at registration
            pending, self._pending = self._pending, None
            return pending
        q = self.check_point(value, "value")
        return self.inverse(q)

    def check_point(self, value: object, name: str) -> torch.Tensor:
        """Check ``value`` (shape, dtype, finite, on the manifold) and return it tall."""
        value = _checks.tensor(name, value)
        if tuple(value.shape) != self.weight_shape:
            raise ValueError(
                f"{name} must have the weight's shape {self.weight_shape}, got {tuple(value.shape)}"
            )
        if value.dtype.is_complex != self.is_complex:
            raise TypeError(
                f"{name} has dtype {value.dtype}; {self.manifold!r} needs a "
                f"{'complex' if self.is_complex else 'real'} dtype"
            )
        _checks.finite(name, value)
        q = value.mT if self.transposed else value
        err = float(orthogonality_error(q.detach()).max()) if q.numel() else 0.0
        tol = self.manifold.default_atol(value.dtype)
        if not err <= tol:
            raise ValueError(
                f"{name} is not on {self.manifold!r}: ‖QᴴQ − I‖_F = {err:.3e} > {tol:.3e}; "
                f"use manifold.projx(Q) (the nearest point) first"
            )
        return q

    def _haar(self, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        dt = torch.complex128 if self.is_complex else torch.float64
        q = haar(self.n, self.m, *self.batch, dtype=dt, generator=generator)
        return q.to(device=like.device)

    def initial(
        self, weight: torch.Tensor, init: str, generator: torch.Generator | None
    ) -> torch.Tensor:
        """The original for ``init`` ("nearest", "haar", "identity" or "random") and ``weight``."""
        if init == "random":
            return self.random_original(generator, weight)
        if init == "haar":
            q = self._haar(weight, generator).to(weight.dtype)
        elif init == "identity":
            q = torch.eye(self.n, self.m, dtype=weight.dtype, device=weight.device)
            q = q.expand(*self.batch, self.n, self.m)
        else:
            w = weight.detach().mT if self.transposed else weight.detach()
            hi = torch.complex128 if self.is_complex else torch.float64
            q = polar(w.to(hi)).to(weight.dtype)
        try:
            return self.inverse(q)
        except Unreachable as err:
            raise ValueError(
                f"init={init!r}: {err}; or init='random' (a random point this map reaches)"
            ) from None

    # ------------------------------------------------------------------ helpers for subclasses
    def tolerance(self, dtype: torch.dtype) -> float:
        """Reachability tolerance of right inverses: 1000·n·eps of the weight's dtype."""
        return 1000 * self.n * torch.finfo(dtype).eps

    def extra_repr(self) -> str:
        t = ", transposed" if self.transposed else ""
        return f"{self.method!r}, manifold={self.manifold!r}{t}"


def high(x: torch.Tensor) -> torch.Tensor:
    """x in float64 / complex128 (the working precision of right inverses)."""
    return x.to(torch.complex128 if x.is_complex() else torch.float64)

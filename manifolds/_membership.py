r"""Whether a tensor is a point or a tangent vector of St(N, M): the checks the manifold runs.

The shapes, dtypes and field (real or complex) an argument must have, the
tolerance of membership (‖XᴴX − I‖_F for a point, ‖sym(Xᴴu)‖_F for a tangent
vector: geoopt's ``_check_point_on_manifold`` and ``_check_vector_on_tangent``),
and geoopt's size and dtype conventions for new points. `Stiefel` inherits them;
each names the argument, the value given and what is allowed.
"""

from __future__ import annotations

import math

import geoopt
import torch

from .._core import checks as _checks
from . import kernels
from .geometry import METRICS

__all__ = ["Membership"]

_LOW = _checks.LOW_PRECISION


class Membership:
    """The argument and membership checks of `Stiefel` (a mixin: it reads ``n``, ``m``,
    ``complex``, ``metric`` and ``default_atol`` of the manifold it is mixed into)."""

    n: int
    m: int
    complex: bool
    metric: str

    def _point(self, x: object, name: str = "x") -> torch.Tensor:
        return _checks.matrix(name, x, self.n, self.m, self.complex, repr(self))

    def _vector(self, x: torch.Tensor, u: object, name: str = "u") -> torch.Tensor:
        u = _checks.matrix(name, u, self.n, self.m, self.complex, repr(self))
        if u.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {u.dtype} but x has {x.dtype}; they must match")
        return u

    def _broadcast(self, **named: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors (in the order given) expanded to their common batch shape.

        Note [Batch dimensions broadcast]
        Points and vectors broadcast over their leading dimensions by torch's
        rules, as in geoopt: a (3, n, m) batch of steps at one (n, m) point, or one
        step at every point of a batch. The kernels take equal batch shapes (the
        Woodbury and QR steps flatten the batch), so a tensor with other leading
        dimensions is expanded (and copied) here; batch shapes that do not
        broadcast raise ValueError naming every argument's shape, never torch's
        RuntimeError from inside a kernel (nor, for the Euclidean ``inner``, which
        does not read x, a silent result).
        """
        shapes = [tuple(t.shape[:-2]) for t in named.values()]
        try:
            batch = torch.broadcast_shapes(*shapes)
        except RuntimeError:
            given = ", ".join(f"{k} {tuple(t.shape)}" for k, t in named.items())
            raise ValueError(
                f"the leading (batch) dimensions of {given} do not broadcast for {self!r}; "
                f"allowed: shapes (..., {self.n}, {self.m}) whose batch dimensions broadcast"
            ) from None
        return tuple(
            t if tuple(t.shape[:-2]) == batch else t.expand(*batch, *t.shape[-2:]).contiguous()
            for t in named.values()
        )

    def _metric(self, metric: str | None) -> str:
        return self.metric if metric is None else _checks.choice("metric", metric, METRICS)

    def _check_shape(self, shape: tuple[int, ...], name: str) -> tuple[bool, str | None]:
        if len(shape) < 2:
            return False, f"{name} needs at least 2 dimensions, got shape {tuple(shape)}"
        if tuple(shape[-2:]) != (self.n, self.m):
            return False, f"{name} must end in ({self.n}, {self.m}), got {tuple(shape)}"
        return True, None

    def _check_point_on_manifold(
        self, x: torch.Tensor, *, atol: float | None = None, rtol: float | None = None
    ) -> tuple[bool, str | None]:
        if x.is_complex() != self.complex:
            return False, f"x is {'complex' if x.is_complex() else 'real'}, {self!r} is not"
        if x.dtype not in _checks.DTYPES:  # an integer x: no eps to scale a tolerance with
            return False, f"x has dtype {x.dtype}; allowed: {', '.join(map(str, _checks.DTYPES))}"
        if x.is_meta:  # no values to check (deferred initialisation)
            return True, None
        atol = self.default_atol(_checks.represented_dtype(x)) if atol is None else atol
        rtol = 0.0 if rtol is None else rtol
        xv = x.detach().float() if x.dtype in _LOW else x.detach()
        err = float(kernels.orthogonality_error(xv).max()) if x.numel() else 0.0
        bound = atol + rtol * math.sqrt(self.m)
        if not err <= bound:
            return False, f"‖XᴴX − I‖_F = {err:.3e} exceeds the tolerance {bound:.3e}"
        return True, None

    def check_vector_on_tangent(
        self, x, u, *, ok_point=False, explain=False, atol=None, rtol=None
    ) -> bool | tuple[bool, str | None]:
        """geoopt's check that ``u`` is tangent at ``x`` (and, unless ``ok_point``, that ``x``
        is a point), with the tolerances of `check_point_on_manifold` by default.

        Note [Tangent check tolerances]
        geoopt's default ``atol=rtol=1e-5`` is fixed: it judged a float64 vector off its
        tangent space by 1e-6 tangent, and a bfloat16 point, whose rounding alone is
        about 1e-3, off the manifold. ``None`` takes the dtype's `default_atol`: the
        test is ‖sym(Xᴴu)‖_F ≤ atol·(‖u‖_F + 1) + rtol·‖u‖_F per matrix.
        """
        return geoopt.Manifold.check_vector_on_tangent(
            self, x, u, ok_point=ok_point, explain=explain, atol=atol, rtol=rtol
        )

    def assert_check_vector_on_tangent(self, x, u, *, ok_point=False, atol=None, rtol=None):
        """Raise ValueError with the reason when `check_vector_on_tangent` fails."""
        geoopt.Manifold.assert_check_vector_on_tangent(
            self, x, u, ok_point=ok_point, atol=atol, rtol=rtol
        )

    def _check_vector_on_tangent(
        self, x: torch.Tensor, u: torch.Tensor, *, atol: float | None = None, rtol=None
    ) -> tuple[bool, str | None]:
        if u.is_complex() != x.is_complex() or u.dtype not in _checks.DTYPES:
            return False, f"u has dtype {u.dtype} but x has {x.dtype}; both must be of {self!r}"
        if x.is_meta or u.is_meta:
            return True, None
        coarse = max((x.dtype, u.dtype), key=lambda t: torch.finfo(t).eps)
        atol = self.default_atol(coarse) if atol is None else atol  # the rounding of either
        rtol = 0.0 if rtol is None else rtol
        work = torch.promote_types(x.dtype, u.dtype)
        work = torch.float32 if work in _LOW else work
        x, u = x.detach().to(work), u.detach().to(work)
        err = torch.linalg.matrix_norm(kernels.sym(x.mH @ u))
        size = torch.linalg.matrix_norm(u).expand_as(err)
        bound = atol * (size + 1.0) + rtol * size
        if err.numel() and not bool((err <= bound).all()):
            i = int(torch.argmax(err - bound))  # the worst matrix of the batch
            e, b = float(err.flatten()[i]), float(bound.flatten()[i])
            return False, f"‖sym(Xᴴu)‖_F = {e:.3e} exceeds {b:.3e}"
        return True, None

    def dist(self, x, y, *, keepdim=False):
        """Not implemented (nor is it for geoopt's Stiefel manifolds): says so, and what to use."""
        raise NotImplementedError(
            f"{self!r} has no geodesic distance or logarithm (nor have geoopt's Stiefel "
            "manifolds); use the chordal distance torch.linalg.matrix_norm(x - y)"
        )

    def logmap(self, x, y):
        """Not implemented: raises as `dist` does."""
        self.dist(x, y)

    def _size(self, size: tuple) -> tuple[int, ...]:
        """geoopt's size convention: the whole shape (..., n, m), tuple or ints, () → (n, m)."""
        shape = geoopt.utils.size2shape(*size) if size else (self.n, self.m)
        for b in shape:
            if not _checks.integer(b) or b < 0:
                raise ValueError(f"size must be non-negative ints, got {size!r}")
        if len(shape) < 2 or tuple(shape[-2:]) != (self.n, self.m):
            raise ValueError(
                f"size={tuple(shape)!r} does not fit {self!r}: the whole shape (..., "
                f"{self.n}, {self.m}) is expected (empty means ({self.n}, {self.m}))"
            )
        return tuple(map(int, shape))

    def _dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        if dtype is None:
            dtype = torch.get_default_dtype()
            if self.complex:
                dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
            return dtype
        allowed = _checks.COMPLEX_DTYPES if self.complex else _checks.REAL_DTYPES
        if dtype not in allowed:
            raise TypeError(
                f"dtype={dtype} does not fit {self!r}; allowed: {', '.join(map(str, allowed))}"
            )
        return dtype

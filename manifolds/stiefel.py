r"""The Stiefel manifold St(N, M) and its square cases O(n) and U(n), as geoopt manifolds."""

from __future__ import annotations

import functools
import math

import geoopt
import torch

from .._core import checks as _checks
from . import kernels
from ._membership import Membership
from .geometry import EGRAD2RGRAD, INNER, METRICS, StiefelGeometry

__all__ = ["Stiefel", "Orthogonal", "Unitary", "METRICS", "RETRACTIONS"]

RETRACTIONS = tuple(kernels.RETRACTIONS)
_LOW = _checks.LOW_PRECISION


def _in_float32(fn):
    """Run a method on float16/bfloat16 tensors in float32; return the dtype of ``x``.

    Note [Low precision in float32]
    A Gram matrix or a factorization in bfloat16 is off by ~1e-2 (8 bits of
    mantissa), more than the whole tolerance of a stored bfloat16 point; the
    work is done in float32 and only the result is rounded to the input dtype.

    Note [Mixed precision follows the point]
    A float32 master weight with a bfloat16 gradient (autocast) is the usual
    mixed call: the result belongs to the point, so it has ``x``'s dtype (the
    first tensor argument), as torch's type promotion gives it in geoopt for
    every x at least as wide as the vector. When an argument is low precision,
    every real argument is computed in the working dtype (x's, or float32 when
    x itself is low precision) and the result is returned in x's dtype; without
    a low-precision argument, dtypes must match as before.
    """

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # a complex (or integer) x is left to the checks, which name the dtypes given
        if not any(a.dtype in _LOW for a in tensors) or not tensors[0].is_floating_point():
            return fn(self, *args, **kwargs)
        out_dtype = tensors[0].dtype
        work = torch.float32 if out_dtype in _LOW else out_dtype

        def up(a):
            if not isinstance(a, torch.Tensor) or not a.dtype.is_floating_point:
                return a
            return a.to(work)

        out = fn(self, *[up(a) for a in args], **kwargs)
        if isinstance(out, tuple):
            return tuple(o.to(out_dtype) for o in out)
        return out.to(out_dtype)

    return wrapper


_EXPMAP = {"euclidean": kernels.expmap_euclidean, "canonical": kernels.expmap_canonical}


class Stiefel(Membership, geoopt.Manifold):
    r"""St(N, M) = {X ∈ 𝔽^{N×M} : XᴴX = I}, 𝔽 = ℝ or ℂ, with N ≥ M.

    Points are tensors of shape (..., n, m); leading dimensions are a batch.
    The metric (``"euclidean"``: Re tr(ξᴴη); ``"canonical"``:
    Re tr(ξᴴ(I − ½XXᴴ)η)) sets the default of `egrad2rgrad` and
    `inner`; every such method also takes ``metric=`` per call.

    Args:
        n: number of rows N.
        m: number of orthonormal columns M (1 ≤ M ≤ N).
        complex: complex Stiefel manifold (points have a complex dtype).
        metric: ``"euclidean"`` or ``"canonical"``.

    Example:
        ```python
        import torch
        from stiefel.manifolds import Stiefel

        st = Stiefel(50, 4)
        x = st.random(dtype=torch.float64)
        g = torch.randn(50, 4, dtype=torch.float64)
        y = st.retr(x, -0.1 * st.egrad2rgrad(x, g))
        assert float(st.orthogonality_error(y)) < 1e-12
        ```

    Note [One retraction table]
    ``retractions`` (class attribute, by default `kernels.RETRACTIONS`) maps a
    name to a descent kernel; `retr`, `retr_transp` and the optimizers' steps
    (through `geometry`) all read it, so a subclass that replaces an entry, or
    overrides `geometry`, changes the map everywhere with no optimizer edit.
    """

    ndim = 2
    # the default retraction (Cayley) with its own transport is reversible: retracting
    # back along the transported −u returns the start (geoopt's samplers need this)
    reversible = True
    retractions = kernels.RETRACTIONS

    def __init__(self, n: int, m: int, complex: bool = False, metric: str = "euclidean"):
        super().__init__()
        self.n = _checks.positive_int("n", n)
        self.m = _checks.positive_int("m", m)
        if m > n:
            raise ValueError(
                f"m={m} > n={n}: a Stiefel point needs at most n orthonormal columns "
                f"(store a wide matrix as its transpose)"
            )
        self.complex = _checks.flag("complex", complex)
        self.metric = _checks.choice("metric", metric, METRICS)
        self.name = self._name()

    # ------------------------------------------------------------------ identity
    def _name(self) -> str:
        return "Stiefel"

    def _key(self) -> tuple:
        return (self.n, self.m, self.complex, self.metric)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stiefel):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("stiefel",) + self._key())

    def extra_repr(self) -> str:
        field = ", complex=True" if self.complex else ""
        return f"n={self.n}, m={self.m}{field}, metric={self.metric!r}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    @property
    def dim(self) -> int:
        """Real dimension: NM − M(M+1)/2 (real) or 2NM − M² (complex)."""
        n, m = self.n, self.m
        return 2 * n * m - m * m if self.complex else n * m - m * (m + 1) // 2

    # ------------------------------------------------------------------ checks
    def default_atol(self, dtype: torch.dtype) -> float:
        """Default tolerance on ‖XᴴX − I‖_F: 100·n·eps of the dtype.

        One retraction lands within about 10·n·eps; the factor 100 leaves room for
        the rounding that accumulates over a long optimization. float16 and bfloat16
        points are computed in float32 and rounded once (Note [Low precision in
        float32]), so theirs is float32's plus twice the rounding's bound √m·eps:
        100·n·eps of their own dtype is above 1 (bfloat16, n ≥ 2), which any matrix
        of the right shape would pass.
        """
        if dtype in _LOW:
            return self.default_atol(torch.float32) + 2 * math.sqrt(self.m) * torch.finfo(dtype).eps
        return 100 * self.n * torch.finfo(dtype).eps

    def check_point_on_manifold(
        self,
        x: torch.Tensor,
        *,
        explain: bool = False,
        atol: float | None = None,
        rtol: float | None = None,
    ) -> bool | tuple[bool, str | None]:
        """Whether ‖XᴴX − I‖_F ≤ atol + rtol·√m for every batch element.

        The default ``atol`` is 100·n·eps of x's dtype (`default_atol`). With ``explain=True``
        returns ``(ok, reason)`` (geoopt's convention).
        """
        ok, reason = self._check_shape(tuple(_checks.tensor("x", x).shape), "x")
        if ok:
            ok, reason = self._check_point_on_manifold(x, atol=atol, rtol=rtol)
        return (ok, reason) if explain else ok

    def assert_check_point_on_manifold(
        self, x: torch.Tensor, *, atol: float | None = None, rtol: float | None = None
    ) -> None:
        """Raise ValueError with the reason when x is not on the manifold."""
        self._point(x)
        ok, reason = self._check_point_on_manifold(x, atol=atol, rtol=rtol)
        if not ok:
            raise ValueError(f"x is not on {self!r}: {reason}; use projx(x) for the nearest point")

    @_in_float32
    def orthogonality_error(self, x: torch.Tensor) -> torch.Tensor:
        """‖XᴴX − I‖_F per batch element: the drift metric of this package."""
        return kernels.orthogonality_error(self._point(x))

    # ------------------------------------------------------------------ points
    def random(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> geoopt.ManifoldTensor:
        """Haar-distributed points as a `geoopt.ManifoldTensor` on this manifold.

        Args:
            *size: the whole shape (..., n, m), as a tuple or ints (geoopt's
                convention); empty means (n, m).
            dtype: default torch's default dtype (its complex counterpart on a
                complex manifold).
            device: the device.
            generator: a `torch.Generator` for reproducible draws. The numbers are
                drawn on the generator's device and moved to ``device``: a CPU
                generator gives the same points on every device.

        Returns:
            A ManifoldTensor of shape ``size``.

        Raises:
            ValueError: a shape not ending in (n, m).
            TypeError: a dtype of the wrong field.
        """
        shape = self._size(size)
        dtype = self._dtype(dtype)
        work = torch.float32 if dtype in _LOW else dtype  # Note [Low precision in float32]
        draw = device if generator is None else generator.device
        x = kernels.haar(self.n, self.m, *shape[:-2], dtype=work, device=draw, generator=generator)
        # row-major like torch.randn: LAPACK's QR leaves Q column-major, and a parameter
        # cloned from such a point keeps that layout, so every write of a step into it
        # (and every pass over it) would walk it transposed
        x = x.to(device=device, dtype=dtype).contiguous()
        return geoopt.ManifoldTensor(x, manifold=self)

    @_in_float32
    def projx(self, x: torch.Tensor) -> torch.Tensor:
        """The nearest point of the manifold: the polar factor U Vᴴ of X = U Σ Vᴴ."""
        x = _checks.finite("x", self._point(x))
        return kernels.polar(x)

    def origin(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
    ) -> geoopt.ManifoldTensor:
        """The point [I; 0] broadcast to ``size`` (geoopt's convention), no random numbers.

        Args:
            *size: the whole shape (..., n, m), tuple or ints; empty means (n, m).
            dtype: as in `random`.
            device: the device.
            seed: accepted for geoopt's signature and ignored (nothing is random).

        Returns:
            A ManifoldTensor of shape ``size``.
        """
        shape = self._size(size)
        x = torch.eye(self.n, self.m, dtype=self._dtype(dtype), device=device)
        return geoopt.ManifoldTensor(x.expand(shape).clone(), manifold=self)

    def geometry(self, metric: str | None = None, retraction: str = "cayley") -> StiefelGeometry:
        """The operations an optimizer's update rule calls, bound to a metric and a retraction.

        Args:
            metric: ``"euclidean"``, ``"canonical"`` or None (this manifold's).
            retraction: a name of `retractions`.

        Returns:
            A `StiefelGeometry` using this manifold's retraction table.
        """
        return StiefelGeometry(self, metric, retraction, default_metric=self.metric)

    # ------------------------------------------------------------------ tangent vectors
    @_in_float32
    def proju(self, x: torch.Tensor, u: torch.Tensor, *, metric: str | None = None) -> torch.Tensor:
        """Projection onto the tangent space, U − X sym(XᴴU).

        ``metric`` is accepted for a uniform signature and validated; the
        result does not depend on it (see Note [Projection does not depend on
        the metric] in `stiefel.manifolds.kernels`).
        """
        x = self._point(x)
        self._metric(metric)
        return kernels.proj_tangent(*self._broadcast(x=x, u=self._vector(x, u)))

    @_in_float32
    def egrad2rgrad(
        self, x: torch.Tensor, u: torch.Tensor, *, metric: str | None = None
    ) -> torch.Tensor:
        """Riemannian gradient of the Euclidean gradient ``u``.

        Euclidean metric: G − X sym(XᴴG); canonical metric: G − XGᴴX.
        """
        x, u = self._broadcast(x=self._point(x), u=self._vector(x, u))
        return EGRAD2RGRAD[self._metric(metric)](x, u)

    @_in_float32
    def inner(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        keepdim: bool = False,
        metric: str | None = None,
    ) -> torch.Tensor:
        """Riemannian inner product (real); ``v=None`` gives the squared norm of u."""
        x = self._point(x)
        u = self._vector(x, u)
        v = u if v is None else self._vector(x, v, "v")
        x, u, v = self._broadcast(x=x, u=u, v=v)
        return INNER[self._metric(metric)](x, u, v, keepdim)

    # ------------------------------------------------------------------ moving
    @_in_float32
    def retr(self, x: torch.Tensor, u: torch.Tensor, method: str = "cayley") -> torch.Tensor:
        """Retraction of the tangent step ``u`` at ``x``: the optimizers' step with lr = −1.

        ``"cayley"``: (I − ½A)⁻¹(I + ½A)X with A = (Pu)Xᴴ − X(Pu)ᴴ, through a
        2M×2M Sherman–Morrison–Woodbury system when 2M < N (no N×N matrix),
        a dense solve otherwise; ``"qr"``: qf(X + U) with R's diagonal made
        positive; ``"polar"``: polar factor of X + U. Each is followed by the
        Newton–Schulz factor (3I − YᴴY)/2 (the identity on the manifold, Note
        [Newton–Schulz drift correction]), exactly as an optimizer step with
        ``retraction=method`` (Note [One retraction table]).
        """
        method = _checks.choice("method", method, self.retractions)
        x = _checks.finite("x", self._point(x))
        u = _checks.finite("u", self._vector(x, u))
        x, u = self._broadcast(x=x, u=u)  # Note [Batch dimensions broadcast]
        return self.geometry(retraction=method).retract(_near(x), u)

    @_in_float32
    def expmap(self, x: torch.Tensor, u: torch.Tensor, *, metric: str | None = None):
        """Exact geodesic of the chosen metric (Edelman, Arias & Smith 1998)."""
        x = _checks.finite("x", self._point(x))
        x, u = self._broadcast(x=x, u=_checks.finite("u", self._vector(x, u)))
        return _EXPMAP[self._metric(metric)](x, u)

    @_in_float32
    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport by projection: the tangent part of ``v`` at ``y``."""
        x, y = self._point(x), self._point(y, "y")
        x, y, v = self._broadcast(x=x, y=y, v=self._vector(y, v, "v"))
        return kernels.proj_tangent(y, v)

    @_in_float32
    def retr_transp(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, method: str = "cayley"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Retract ``u`` and transport ``v`` to the new point in one call.

        With ``"cayley"`` both are moved by the same orthogonal map Cayley(A)
        in one solve (an isometric transport, Wen & Yin 2013); with ``"qr"`` and
        ``"polar"`` ``v`` is projected onto the new tangent space.
        """
        method = _checks.choice("method", method, self.retractions)
        x = _checks.finite("x", self._point(x))
        u = _checks.finite("u", self._vector(x, u))
        x, u, v = self._broadcast(x=x, u=u, v=self._vector(x, v, "v"))
        return self.retractions[method](_near(x), u, -1.0, v)


def _near(x: torch.Tensor) -> torch.Tensor:
    r"""``x``, with the matrices too far from the manifold for a retraction projected.

    Note [Retraction from a point off the manifold]
    Every retraction ends with the Newton–Schulz factor (3I − YᴴY)/2 (Note
    [Newton–Schulz drift correction]); with YᴴY = I + E the new error is
    ¾E² + ¼E³, which contracts only while ‖E‖₂ < 1 and grows without bound once
    a singular value of Y exceeds √5 (e = 4 gives 28): repeated retractions
    from a point far off the manifold (geoopt's sampler tests start from
    ``torch.randn``) diverged. A matrix with ‖XᴴX − I‖_F ≥ 1 (‖E‖₂ ≤ ‖E‖_F) is
    therefore replaced by its polar factor, the nearest point, before the
    retraction, as an optimizer's step does (Note [Off-manifold points at a
    step]); nearer ones keep the correction, which contracts there.
    """
    far = kernels.orthogonality_error(x) >= 1.0
    if not bool(far.any()):
        return x
    return torch.where(far[..., None, None], kernels.polar(x), x)


class Orthogonal(Stiefel):
    """The orthogonal group O(n) = St(n, n), real.

    Example:
        ```python
        from stiefel.manifolds import Orthogonal

        assert Orthogonal(3).dim == 3
        ```
    """

    def __init__(self, n: int, metric: str = "euclidean"):
        super().__init__(n, n, complex=False, metric=metric)

    def _name(self) -> str:
        return "Orthogonal"

    def extra_repr(self) -> str:
        return f"n={self.n}, metric={self.metric!r}"


class Unitary(Stiefel):
    """The unitary group U(n) = complex St(n, n); ``dim`` is its real dimension n².

    Example:
        ```python
        from stiefel.manifolds import Unitary

        assert Unitary(3).dim == 9
        ```
    """

    def __init__(self, n: int, metric: str = "euclidean"):
        super().__init__(n, n, complex=True, metric=metric)

    def _name(self) -> str:
        return "Unitary"

    def extra_repr(self) -> str:
        return f"n={self.n}, metric={self.metric!r}"

r"""`FunctionMap`: a plain function of a skew matrix as a map (geotorch's ``triv``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import kernels
from ._inverse import Unreachable, complete
from ._precision import high
from .base import point_error
from .dense import _Based

__all__ = ["FunctionMap"]


class FunctionMap(_Based):
    r"""Q = (B·f(A))[:, :m] for a user function f of the skew-Hermitian A (geotorch's ``triv``).

    ``orthogonalize(module, method=f)`` with f taking a skew-symmetric
    (skew-Hermitian) n×n A, with leading batch dimensions, to an orthogonal
    (unitary) n×n matrix, e.g. ``torch.linalg.matrix_exp`` or a Cayley
    transform; A = X₊ − X₊ᴴ is read from the free n×n X as for ``exp``. B is a
    base buffer (Note [The base point makes every point reachable]):
    ``right_inverse(Q)`` stores B = Q and A = 0, which needs f(0) = I (checked,
    as geotorch assumes it). With ``inverse=g`` (g(f(A)) = A, e.g.
    ``torch.linalg.logm``-like), B stays I and A = g(Q) instead, which needs Q
    reachable by f (checked).

    Args:
        shape: the weight's shape (…, rows, cols).
        dtype: the weight's dtype.
        device: where the base buffer lives.
        function: f.
        inverse: g, optional.

    Example:
        ```python
        import torch
        from stiefel import orthogonalize

        def cayley(a):
            eye = torch.eye(a.shape[-1], dtype=a.dtype)
            return torch.linalg.solve(eye + a, eye - a)

        lin = orthogonalize(torch.nn.Linear(5, 5), method=cayley)
        w = lin.weight
        assert torch.allclose(w @ w.T, torch.eye(5), atol=1e-5)
        ```
    """

    method = "function"
    domain = "the image of f (times the base buffer)"
    tested_here = False  # f is the user's (Note [A map from elsewhere is checked ...])

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        function: Callable[[torch.Tensor], torch.Tensor],
        inverse: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__(shape, dtype, device)
        if not callable(function):
            raise TypeError(f"function must be callable, got {type(function).__name__}")
        if inverse is not None and not callable(inverse):
            raise TypeError(f"inverse must be callable or None, got {type(inverse).__name__}")
        self.function, self.inverse_function = function, inverse

    def _f(self, a: torch.Tensor) -> torch.Tensor:
        """f(A), refused (naming f) unless a tensor of A's shape."""
        fa = self.function(a)
        if not isinstance(fa, torch.Tensor) or fa.shape != a.shape:
            got = tuple(fa.shape) if isinstance(fa, torch.Tensor) else type(fa).__name__
            raise ValueError(
                f"function {self._name()} returned {got} for a skew A of shape "
                f"{tuple(a.shape)}; allowed: a tensor of A's shape (an orthogonal f(A))"
            )
        return fa

    def _name(self) -> str:
        return getattr(self.function, "__name__", type(self.function).__name__)

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        return self.base @ self._f(kernels.skew_from_raw(original))[..., : self.m]

    def check_first_point(self, original: torch.Tensor, q: object) -> None:
        """The base class's check, and f at a random skew A: f(0) = I holds at A = 0, the
        first point, for functions that are not orthogonal elsewhere (f(A) = A + I)."""
        super().check_first_point(original, q)
        raw = torch.randn(original.shape, generator=torch.Generator().manual_seed(0))
        a = kernels.skew_from_raw(raw.to(original) / self.n)
        fa = self._f(a)
        err = point_error(fa)
        if not err <= self.tolerance(fa.dtype):
            raise ValueError(
                f"function {self._name()} is not orthogonal at a skew A (‖A‖_F ≈ 1): "
                f"‖f(A)ᴴf(A) − I‖_F = {err:.3e}; allowed: f mapping every skew-symmetric "
                "(skew-Hermitian) A to an orthogonal (unitary) matrix, e.g. "
                "torch.linalg.matrix_exp or a Cayley transform"
            )

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        p = complete(high(q))
        zero = torch.zeros(*self.batch, self.n, self.n, dtype=q.dtype, device=q.device)
        if self.inverse_function is None:
            at_zero = high(self._f(zero))
            eye = torch.eye(self.n, dtype=at_zero.dtype, device=at_zero.device)
            err = float(torch.linalg.matrix_norm(at_zero - eye).max())
            if not err <= self.tolerance(q.dtype):
                raise Unreachable(
                    f"function(0) is not the identity (‖f(0) − I‖_F = {err:.3e}): the base "
                    "point cannot move Q to A = 0; pass inverse= (A from Q)"
                )
            return super().inverse(q)
        a = high(self.inverse_function(p.to(q.dtype)))
        a = 0.5 * (a - a.mH)
        raw = kernels.raw_from_skew(a)
        check = high(self._f(kernels.skew_from_raw(raw).to(q.dtype)))[..., : self.m]
        err = float(torch.linalg.matrix_norm(check - p[..., : self.m]).max())
        if not err <= self.tolerance(q.dtype):
            raise Unreachable(
                f"function(inverse(Q)) is {err:.3e} away from Q: Q is not reachable by f"
            )
        with torch.no_grad():
            eye = torch.eye(self.n, self.base.shape[-1], dtype=self.base.dtype)
            self.base.copy_(eye.to(self.base.device).expand_as(self.base))
        return raw.to(dtype=q.dtype, device=q.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", function={self._name()}"

r"""Square points stepped in their frame: tangent vectors as XΩ, Ω skew-Hermitian.

`StiefelGeometry.frame(x)` returns a `FrameGeometry` for a square point whose
retraction has a frame step; an update rule then keeps its moments as the n×n
coordinates Ω (their transport is Ω itself).
"""

from __future__ import annotations

import torch

from . import kernels
from .geometry import Geometry, StiefelGeometry, linear_in_g

__all__ = ["FrameGeometry"]


class FrameGeometry(Geometry):
    r"""Tangent vectors of a square point in its frame: ξ = XΩ, Ω n×n skew-Hermitian.

    Note [Moments in the frame of X]
    On O(n) and U(n) every tangent vector at X is ξ = XΩ with Ω = Xᴴξ
    skew-Hermitian, and the Cayley step Y = X·Cayley(S) carries ξ to
    Cayley(A)ξ = Y·Ω (Note [Square Cayley step in the frame of X]): in the
    frame of the point, a transported vector keeps its coordinates. A rule that
    keeps a moment as Ω instead of ξ (radam's first moment, rgd's Cayley
    momentum) never forms ξ, its coordinates Xᴴξ or its transport Y·(Xᴴξ).
    With H = XᴴG the gradient is
    Ω = skew(H) (Euclidean metric: G − X sym(H) = X skew(H) when XXᴴ = I) or
    2 skew(H) (canonical: G − XGᴴX = X(H − Hᴴ)); its squared length is
    ‖Ω‖²_F, or ½‖Ω‖²_F under the canonical metric (⟨ξ, ξ⟩ − ½‖Xᴴξ‖²_F); the
    step is the frame step on Ω. A step of radam then costs two n³ products
    (XᴴG and X·F) and the n×n Cayley factor, where the ambient form takes five
    (six under the canonical metric: its inner product's Xᴴξ): the gradient's
    XᴴG and X·sym(H), Xᴴm, X·F and the transport Y·(Xᴴm).
    Both forms agree to rounding: they differ by terms of X's drift
    E = XᴴX − I (XXᴴ = I was used above), which the correction every k-th step
    keeps at rounding (Note [The drift correction every k-th step]). The frame
    needs every row of X on this rank (`frame.in_frame`): a row-sharded point
    keeps the ambient form.

    Args:
        base: the geometry of the point (its metric, its off-manifold test's Gram).
        step: the retraction's frame kernel ``step(x, omega, lr, *, xx)`` computing
            retr(X, −lr·XΩ) (`kernels.cayley_frame_descent`).

    Example:
        ```python
        import torch
        from stiefel.manifolds import Orthogonal

        o = Orthogonal(5)
        base = o.geometry()
        x = o.random(dtype=torch.float64)
        fg = base.frame(x)
        g = torch.randn(5, 5, dtype=torch.float64)
        omega = fg.rgrad(x, g)
        assert torch.allclose(fg.lift(x, omega), base.rgrad(x, g), atol=1e-12)
        y, moved = fg.descend_transport(x, omega, 0.1)
        assert moved is omega  # Y·Ω is the transported vector
        ```
    """

    stiefel = True

    def __init__(self, base: StiefelGeometry, step):
        self.base = base
        self._step = step
        self._scale = 1.0 if base.metric == "euclidean" else 2.0

    def _omega(self, x, g):  # c·skew(XᴴG), scaled in the fresh tensor of `lower`
        omega = self.lower(x, g)
        return omega if self._scale == 1.0 else omega.mul_(self._scale)

    def rgrad(self, x, g):
        base = self.base
        return linear_in_g(self._omega, x, g, base._absmax(g), checks=base._step_checks)

    def taken_as_one(self, site, scale):
        return self.base.taken_as_one(site, scale)

    def component_inner(self, x, u):
        sq = kernels.inner_euclidean(x, u, u, keepdim=True)
        return sq if self._scale == 1.0 else sq * 0.5

    def descend(self, x, d, lr):
        return self._step(x, d, lr, xx=self.base._xx(x), **self.base._checks)

    def descend_transport(self, x, d, lr):
        return self.descend(x, d, lr), d

    @staticmethod
    def lift(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
        """The tangent vector XΩ of the coordinates Ω."""
        return x @ omega

    @staticmethod
    def lower(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The coordinates skew(Xᴴv) = ½(Xᴴv − vᴴX) of a tangent vector v (a fresh tensor)."""
        return kernels.frame.minus_adjoint(kernels.reduce.gram(x, v)).mul_(0.5)

    def project(self, x):
        return self.base.project(x)

    def error(self, x):
        return self.base.error(x)

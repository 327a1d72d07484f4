r"""`ManifoldPoint`: the map of ``method="riemannian"`` inside a parametrization."""

from __future__ import annotations

import geoopt
import torch

from .base import OrthogonalMap

__all__ = ["ManifoldPoint"]


class ManifoldPoint(OrthogonalMap):
    r"""The identity on St(n, m), O(n) or U(n): the original is the tall point itself.

    Built by `build` for ``method="riemannian"`` (Note [One map per constrained
    weight, riemannian included]). The owner stores the original as a
    ``geoopt.ManifoldParameter`` on ``manifold``, so a Riemannian optimizer
    keeps it on the manifold; ``right_inverse(Q)`` checks Q and returns it
    (tall), ``initial`` gives the point of each ``init``. Not registered: it
    is not a map of `maps` (it constrains nothing by itself).

    Example:
        ```python
        import torch
        from stiefel.parametrizations import build

        fmap = build("riemannian", (5, 3), torch.float64)
        q = fmap.initial(torch.randn(5, 3, dtype=torch.float64), "nearest", None)
        assert torch.equal(fmap(q), q)
        ```
    """

    method = "riemannian"
    formula = "0 (the point is the parameter)"
    domain = "the manifold (a Riemannian optimizer keeps it there)"
    stores_point = True

    @classmethod
    def flops(cls, n: int, m: int, reflections: int | None = None) -> float:
        """0: nothing is computed."""
        return 0.0

    @classmethod
    def bytes(cls, n: int, m: int, reflections: int | None = None, itemsize: int = 4) -> float:
        """0: nothing is read or written."""
        return 0.0

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        return original

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def claim(self, original: torch.Tensor) -> None:
        """Make the Parameter ``original`` a ``geoopt.ManifoldParameter`` on ``manifold``, in place.

        The object is kept (its class changes; ``geoopt.ManifoldParameter`` adds
        no storage, only the ``manifold`` attribute), so optimizers and ties
        holding it keep working. Called when the original is made and again at
        every reset: ``module.to_empty`` rebuilds a plain Parameter.
        """
        original.__class__ = geoopt.ManifoldParameter
        original.manifold = self.manifold

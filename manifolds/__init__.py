"""Manifolds of matrices with orthonormal columns: St(N, M), O(n) and U(n).

The classes subclass :class:`geoopt.Manifold`, so they work with geoopt's
``ManifoldParameter`` and optimizers; the pure tensor kernels they use live in
:mod:`stiefel.manifolds.kernels`.
"""

from . import kernels
from .stiefel import METRICS, RETRACTIONS, Orthogonal, Stiefel, Unitary

__all__ = ["Stiefel", "Orthogonal", "Unitary", "kernels", "METRICS", "RETRACTIONS"]

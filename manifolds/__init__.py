"""Manifolds of matrices with orthonormal columns: St(N, M), O(n) and U(n).

The classes subclass `geoopt.Manifold`, so they work with geoopt's
``ManifoldParameter`` and optimizers; the pure tensor kernels they use live in
`stiefel.manifolds.kernels`, and `Stiefel.geometry` hands the optimizers a
`Geometry` (`stiefel.manifolds.geometry`) built on them.
"""

from . import kernels
from .frame_geometry import FrameGeometry
from .geometry import EuclideanGeometry, Geometry, StiefelGeometry
from .stiefel import METRICS, RETRACTIONS, Orthogonal, Stiefel, Unitary

__all__ = [
    "Stiefel",
    "Orthogonal",
    "Unitary",
    "kernels",
    "METRICS",
    "RETRACTIONS",
    "Geometry",
    "EuclideanGeometry",
    "StiefelGeometry",
    "FrameGeometry",
]

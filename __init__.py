"""stiefel: learning matrices with orthonormal columns in PyTorch.

O(n), U(n) and the Stiefel manifold St(N, M), as parametrizations any torch
optimizer can train and as manifolds for Riemannian optimizers, with a
harness that compares the two.
"""

from ._core.lazy_scipy import import_geoopt

import_geoopt()  # Note [geoopt without scipy at import]

from . import dispatch, integrations, manifolds, nn, optimizers, parametrizations  # noqa: E402
from .manifolds import Orthogonal, Stiefel, Unitary  # noqa: E402
from .parametrizations import merge, orthogonalize, rotate, rotation  # noqa: E402

__version__ = "0.4.0.dev0"

__all__ = [
    "orthogonalize",
    "rotate",
    "merge",
    "rotation",
    "manifolds",
    "parametrizations",
    "optimizers",
    "nn",
    "integrations",
    "dispatch",
    "Stiefel",
    "Orthogonal",
    "Unitary",
    "__version__",
]

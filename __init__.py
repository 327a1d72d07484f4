"""stiefel: learning matrices with orthonormal columns in PyTorch.

O(n), U(n) and the Stiefel manifold St(N, M), as parametrizations any torch
optimizer can train and as manifolds for Riemannian optimizers, with a
harness that compares the two.
"""

from . import manifolds, optimizers, parametrizations
from .manifolds import Orthogonal, Stiefel, Unitary
from .parametrizations import orthogonalize
from .parametrizations.rotate import merge, rotate, rotation  # noqa: F401  (orthogonal fine-tuning)

__version__ = "0.1.0"

__all__ = [
    "orthogonalize",
    "manifolds",
    "parametrizations",
    "optimizers",
    "Stiefel",
    "Orthogonal",
    "Unitary",
    "__version__",
]

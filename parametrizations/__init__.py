r"""Maps from free parameters onto O(n), U(n) and St(N, M), and :func:`orthogonalize`.

Methods (see :func:`available`): ``householder``, ``cwy``, ``tcwy``, ``exp``,
``cayley``, ``scaled_cayley`` (``nn.Module`` parametrizations for
``torch.nn.utils.parametrize``) and ``riemannian`` (the weight becomes a
``geoopt.ManifoldParameter`` for the Riemannian optimizers). The pure tensor
kernels are in :mod:`stiefel.parametrizations.kernels`.

Example::

    >>> import torch
    >>> from stiefel.parametrizations import available, orthogonalize
    >>> available()[:7]
    ['householder', 'cwy', 'tcwy', 'exp', 'cayley', 'scaled_cayley', 'riemannian']
    >>> rnn = torch.nn.RNN(8, 8)
    >>> rnn = orthogonalize(rnn, "weight_hh_l0", method="householder")
"""

from . import kernels
from .base import OrthogonalMap, _register_special, available, get, manifold_for, register
from .dense import Cayley, Exp, ScaledCayley
from .orthogonalize import RIEMANNIAN, OrthogonalMatrix, orthogonalize
from .reflections import CWY, TCWY, Householder  # registers householder, cwy, tcwy (first)
from .rotate import Rotation, merge, rotate, rotation  # noqa: F401 (orthogonal fine-tuning)

_register_special(RIEMANNIAN)

__all__ = [
    "orthogonalize",
    "available",
    "register",
    "get",
    "manifold_for",
    "OrthogonalMap",
    "OrthogonalMatrix",
    "Householder",
    "CWY",
    "TCWY",
    "Exp",
    "Cayley",
    "ScaledCayley",
    "kernels",
]

r"""Maps from free parameters onto O(n), U(n) and St(N, M), and `orthogonalize`.

Methods (see `available`): ``householder``, ``cwy``, ``tcwy``, ``exp``,
``cayley``, ``scaled_cayley`` (``nn.Module`` parametrizations for
``torch.nn.utils.parametrize``, registered in this order) and ``riemannian``
(the weight itself becomes a ``geoopt.ManifoldParameter`` for the Riemannian
optimizers; ``orthogonalize`` handles it, it is not a registered map). `maps`
gives the registered map classes, with their capabilities declared on the
class. `build` makes the map of every constrained weight (``orthogonalize``,
``conv_kernel=True``, `rotate`, the PEFT method), from a name, a class,
``"riemannian"`` or a plain function. The pure tensor kernels are in
``stiefel.parametrizations.kernels``.

Example:
    ```python
    import torch
    from stiefel.parametrizations import available, maps, orthogonalize

    assert available()[-1] == "riemannian" and "riemannian" not in maps()
    rnn = orthogonalize(torch.nn.RNN(8, 8), "weight_hh_l0", method="householder")
    ```
"""

from . import kernels
from .base import (
    ENTRY_POINT_GROUP,
    RIEMANNIAN,
    OrthogonalMap,
    available,
    get,
    manifold_for,
    maps,
    register,
)

# Built-ins register in import order: householder, cwy, tcwy, exp, cayley, scaled_cayley.
# isort: off
from .reflections import CWY, TCWY, Householder
from .dense import Cayley, Exp, ScaledCayley

# isort: on
from .adapter import Rotation
from .constrain import OrthogonalMatrix, orthogonalize
from .deferred import initialize
from .factory import build
from .finetuning import merge, rotate, rotation
from .function import FunctionMap
from .point import ManifoldPoint

__all__ = [
    "orthogonalize",
    "build",
    "initialize",
    "available",
    "maps",
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
    "FunctionMap",
    "ManifoldPoint",
    "rotate",
    "merge",
    "rotation",
    "Rotation",
    "RIEMANNIAN",
    "ENTRY_POINT_GROUP",
    "kernels",
]

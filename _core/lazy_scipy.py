r"""Import geoopt without the scipy it needs only for its line search.

Note [geoopt without scipy at import]
The manifolds subclass geoopt's classes, so ``import stiefel`` imports geoopt.
``geoopt.optim.rlinesearch`` takes two functions from
``scipy.optimize._linesearch`` at import, and importing ``scipy.optimize``
costs about as much CPU as all of this package: paid by every user for an
optimizer (geoopt's ``RiemannianLineSearch``) this package never calls. While
geoopt is imported, that one module name is served by a stand-in whose two
functions import the real module at their first call and forward to it;
the stand-in leaves ``sys.modules`` as soon as geoopt is imported, so any
later ``import scipy.optimize`` (a user's, geoopt's line search at its first
step) gets scipy itself. When scipy's module is already imported, or geoopt
already is, nothing is done.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable

__all__ = ["import_geoopt"]

_LINESEARCH = "scipy.optimize._linesearch"
_NAMES = ("scalar_search_wolfe2", "scalar_search_armijo")


def _forward(name: str) -> Callable:
    def call(*args, **kwargs):
        return getattr(importlib.import_module(_LINESEARCH), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def import_geoopt() -> types.ModuleType:
    """``import geoopt``, with its line search's scipy import deferred to its first call."""
    if "geoopt" in sys.modules or _LINESEARCH in sys.modules:
        return importlib.import_module("geoopt")
    stand_in = types.ModuleType(_LINESEARCH)
    for name in _NAMES:
        setattr(stand_in, name, _forward(name))
    sys.modules[_LINESEARCH] = stand_in
    try:
        return importlib.import_module("geoopt")
    finally:
        if sys.modules.get(_LINESEARCH) is stand_in:
            del sys.modules[_LINESEARCH]

r"""Riemannian optimizers and the optimizer registry.

`create(name, params, **hyper)` builds any registered optimizer by name
(`available()` lists them, `info(name)` says what each declares: default
learning rate, FLOP model, variants); `register(name)` adds one (a decorator
on an `Optimizer` subclass or a factory); third-party packages register
through the entry-point group `stiefel.optimizers`. The built-in Riemannian
optimizers `rgd`, `radam` and `landing` subclass `RiemannianOptimizer` and
implement only its per-parameter rule against a `Geometry`.

Example:
    ```python
    import torch, geoopt
    from stiefel.manifolds import Stiefel
    from stiefel import optimizers

    st = Stiefel(64, 4)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = optimizers.create("radam", [w, b], lr=1e-2)
    opt.zero_grad()
    ((w.sum(0) - b) ** 2).sum().backward()
    opt.step()
    assert st.check_point_on_manifold(w)
    ```
"""

from . import registry as _registry
from .base import RiemannianOptimizer
from .geometry import (
    EuclideanGeometry,
    FrameGeometry,
    Geometry,
    GeooptGeometry,
    StiefelGeometry,
)
from .landing import Landing
from .muon import ManifoldMuon
from .pogo import POGO
from .radam import RAdam
from .registry import *  # noqa: F403
from .rgd import RGD
from .telemetry import orthogonality_errors

__all__ = [
    *_registry.__all__,
    "RiemannianOptimizer",
    "Geometry",
    "EuclideanGeometry",
    "StiefelGeometry",
    "GeooptGeometry",
    "FrameGeometry",
    "RGD",
    "RAdam",
    "Landing",
    "ManifoldMuon",
    "POGO",
    "orthogonality_errors",
]

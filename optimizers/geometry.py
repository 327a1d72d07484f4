r"""Which `Geometry` a parameter gets: the binding of parameters to their manifolds.

The geometry itself belongs to the manifold (`stiefel.manifolds.geometry`);
this module only decides, once per parameter, which one applies:

- plain tensors (and geoopt's ``Euclidean``): `EuclideanGeometry`, so every
  rule becomes its Euclidean form;
- this package's manifolds: ``manifold.geometry(metric, retraction)``, so a
  subclass with its own kernels or geometry is used by every optimizer;
- geoopt's Stiefel manifolds: this package's `StiefelGeometry` (Note
  [geoopt's Stiefel manifolds use our kernels]);
- any other geoopt manifold: `GeooptGeometry`, its own ``egrad2rgrad``,
  ``retr``, ``retr_transp``, ``component_inner``, ``projx``.

Example:
    ```python
    import geoopt
    import torch
    from stiefel.manifolds import Stiefel
    from stiefel.optimizers.geometry import geometry_for

    w = geoopt.ManifoldParameter(Stiefel(30, 3).random(dtype=torch.float64))
    geo = geometry_for(w, {"retraction": "qr"})
    y = geo.descend(w.detach(), geo.rgrad(w.detach(), torch.randn(30, 3).double()), 0.1)
    assert float(geo.error(y).max()) < 1e-12
    ```
"""

from __future__ import annotations

import geoopt
import torch
from torch.distributed.tensor import DTensor

from ..manifolds import Stiefel as _OurStiefel
from ..manifolds.geometry import EuclideanGeometry, Geometry, StiefelGeometry
from ..manifolds.sharded import ShardedGeometry, check_placements

__all__ = ["Geometry", "EuclideanGeometry", "StiefelGeometry", "GeooptGeometry", "geometry_for"]


def default_metric(manifold) -> str:
    """The metric a Stiefel-like manifold implies: ours say it; geoopt's by their class."""
    if isinstance(manifold, _OurStiefel):
        return manifold.metric
    return "euclidean" if isinstance(manifold, geoopt.EuclideanStiefel) else "canonical"


class GeooptGeometry(Geometry):
    """Any other geoopt manifold: its own operations (``metric``/``retraction`` do not apply)."""

    def __init__(self, manifold: geoopt.Manifold):
        self.manifold = manifold

    def rgrad(self, x, g):
        return self.manifold.egrad2rgrad(x, g)

    def retract(self, x, u):
        return self.manifold.retr(x, u)

    def descend(self, x, d, lr):
        return self.manifold.retr(x, -lr * d)

    def descend_transport(self, x, d, lr):
        return self.manifold.retr_transp(x, -lr * d, d)

    def component_inner(self, x, u):
        return self.manifold.component_inner(x, u)

    def project(self, x):
        return self.manifold.projx(x)


class _Binder:
    """Resolved once per parameter (outside any traced code); binds a group per step.

    Note [geoopt's Stiefel manifolds use our kernels]
    geoopt's ``CanonicalStiefel.retr`` moves along (I + XXᴴ)u, not u (its
    initial velocity; ours is u, a true retraction), and neither of geoopt's
    Stiefel manifolds knows the
    ``metric``/``retraction`` options or corrects float drift. Their points are
    the same matrices with orthonormal columns, so they get this package's
    `StiefelGeometry`, with the metric their class implies.
    """

    def __init__(self, manifold, param: torch.Tensor | None = None):
        self.manifold = manifold
        # a DTensor point: the same geometry on its local shards (ShardedGeometry)
        self.like = param.detach() if isinstance(param, DTensor) else None
        if manifold is None:
            self.kind, self._fixed = "euclidean", EuclideanGeometry()
        elif isinstance(manifold, _OurStiefel):
            self.kind = "ours"
            if self.like is not None:
                check_placements(self.like)  # an unsupported layout fails at construction
        elif isinstance(manifold, geoopt.Stiefel):
            self.kind = "geoopt-stiefel"
            if self.like is not None:
                check_placements(self.like)
        else:
            self.like = None  # another geoopt manifold: DTensor propagation, as geoopt does
            self.kind, self._fixed = "geoopt", GeooptGeometry(manifold)

    def bind(self, group: dict) -> Geometry:
        if self.kind in ("euclidean", "geoopt"):
            return self._fixed
        metric, retraction = group.get("metric"), group.get("retraction", "cayley")
        if self.kind == "ours":
            geo = self.manifold.geometry(metric, retraction)
        else:
            geo = StiefelGeometry(
                self.manifold, metric, retraction, default_metric=default_metric(self.manifold)
            )
        return geo if self.like is None else ShardedGeometry(geo, self.like)


def manifold_of(p: torch.Tensor) -> geoopt.Manifold | None:
    """The manifold of a parameter (None for a plain tensor or geoopt's Euclidean)."""
    man = getattr(p, "manifold", None) if isinstance(p, geoopt.ManifoldTensor) else None
    if man is None or isinstance(man, geoopt.Euclidean):
        return None
    return man


def geometry_for(p: torch.Tensor, group: dict) -> Geometry:
    """The `Geometry` of parameter ``p`` under param group ``group``."""
    return _Binder(manifold_of(p)).bind(group)

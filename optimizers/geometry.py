r"""The manifold operations an update rule is written against (the plugin interface).

A :class:`Geometry` is bound to one parameter and one param group: it knows the
parameter's manifold (or that it has none) and the group's ``metric`` and
``retraction``. A rule written with it works unchanged on

- plain tensors (:class:`EuclideanGeometry`: the Riemannian gradient is the
  gradient, the retraction is x + u, transport is the identity, so the rule
  becomes its Euclidean form);
- this package's manifolds and geoopt's Stiefel manifolds (:class:`StiefelGeometry`:
  the fused, drift-corrected kernels of :mod:`stiefel.optimizers.kernels`);
- any other geoopt manifold (:class:`GeooptGeometry`: the manifold's own
  ``egrad2rgrad``, ``retr``, ``retr_transp``, ``component_inner``, ``projx``).

``lr`` arguments may be floats or tensors broadcastable against
``component_inner``'s result (one step size per matrix on a manifold, per
element in the Euclidean case).

Example::

    >>> import torch
    >>> from stiefel.manifolds import Stiefel
    >>> from stiefel.optimizers.geometry import StiefelGeometry
    >>> geo = StiefelGeometry(Stiefel(30, 3), metric=None, retraction="qr")
    >>> x = Stiefel(30, 3).random(dtype=torch.float64)
    >>> y = geo.descend(x, geo.rgrad(x, torch.randn(30, 3, dtype=torch.float64)), 0.1)
    >>> bool(geo.error(y).max() < 1e-12)
    True
"""

from __future__ import annotations

import geoopt
import torch
from torch.distributed.tensor import DTensor

from ..manifolds import METRICS, RETRACTIONS, kernels
from ..manifolds import Stiefel as _OurStiefel
from ..manifolds._checks import choice
from ..manifolds.sharded import ShardedGeometry, check_placements
from . import kernels as ok

__all__ = ["Geometry", "EuclideanGeometry", "StiefelGeometry", "GeooptGeometry", "geometry_for"]

_RETR = {"qr": kernels.qr_retraction, "polar": kernels.polar_retraction}


class Geometry:
    """Interface of the per-parameter operations (subclasses override every method).

    Attributes:
        riemannian: False for a plain tensor.
        stiefel: True when points have orthonormal columns (XᴴX = I), so that
            Stiefel-specific rules (e.g. landing) and :meth:`error` apply.
    """

    riemannian: bool = True
    stiefel: bool = False

    def rgrad(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Riemannian gradient of the Euclidean gradient ``g`` (the group's metric)."""
        raise NotImplementedError

    def retract(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Retraction of the tangent vector ``u`` (the group's retraction)."""
        return self.descend(x, u, -1.0)

    def descend(self, x: torch.Tensor, d: torch.Tensor, lr) -> torch.Tensor:
        """retr(x, −lr·d)."""
        raise NotImplementedError

    def descend_transport(self, x: torch.Tensor, d: torch.Tensor, lr):
        """(retr(x, −lr·d), d transported to the new point)."""
        raise NotImplementedError

    def gradient_step(self, x: torch.Tensor, g: torch.Tensor, lr) -> torch.Tensor:
        """retr(x, −lr·rgrad(x, g)), fused where the kernels allow."""
        return self.descend(x, self.rgrad(x, g), lr)

    def component_inner(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """⟨u, u⟩ per manifold component: per matrix (..., 1, 1), or per element."""
        raise NotImplementedError

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The nearest point of the manifold (used by ``repair_every``)."""
        return x

    def apply(self, kernel, x: torch.Tensor, *args, **kwargs):
        """``kernel(x, *args, **kwargs)``: a kernel of `stiefel.manifolds.kernels` on this
        parameter's points (a sharded geometry runs it on the local shards)."""
        return kernel(x, *args, **kwargs)

    def error(self, x: torch.Tensor) -> torch.Tensor:
        """‖XᴴX − I‖_F per matrix (zeros where it does not apply)."""
        return x.new_zeros(x.shape[:-2] if x.dim() >= 2 else (), dtype=x.real.dtype)


class EuclideanGeometry(Geometry):
    """A plain tensor: every rule reduces to its Euclidean form."""

    riemannian = False

    def rgrad(self, x, g):
        return g

    def descend(self, x, d, lr):
        return x - lr * d

    def descend_transport(self, x, d, lr):
        return x - lr * d, d

    def component_inner(self, x, u):
        return (u.conj() * u).real if u.is_complex() else u * u


def default_metric(manifold) -> str:
    """The metric a Stiefel-like manifold implies: ours say it; geoopt's by their class."""
    if isinstance(manifold, _OurStiefel):
        return manifold.metric
    return "euclidean" if isinstance(manifold, geoopt.EuclideanStiefel) else "canonical"


class StiefelGeometry(Geometry):
    """This package's St(N, M), O(n), U(n), and geoopt's Stiefel manifolds.

    ``metric=None`` uses the manifold's metric (geoopt's ``CanonicalStiefel``:
    canonical, ``EuclideanStiefel``: Euclidean); the group's ``metric`` wins
    (DESIGN, Clarifications). ``"cayley"`` goes through the fused 2M×2M
    Woodbury kernels with the Newton–Schulz drift correction
    (:mod:`stiefel.optimizers.kernels`); ``"qr"`` and ``"polar"`` transport by
    projection onto the new tangent space. Their results, and the polar factor
    of ``project``, get one Newton–Schulz step too: in float32 the SVD's polar
    factor of a 1024×64 matrix is ~1e-5 off the manifold, one step brings it to
    float32 rounding (Note [Newton–Schulz drift correction]).

    Note [geoopt's Stiefel manifolds use our kernels]
    geoopt's ``CanonicalStiefel.retr`` moves along (I + XXᴴ)u, not u (DESIGN,
    Clarifications), and neither of geoopt's Stiefel manifolds knows the
    ``metric``/``retraction`` options or corrects float drift. Their points are
    the same matrices with orthonormal columns, so they get this geometry.
    """

    stiefel = True

    def __init__(self, manifold, metric: str | None, retraction: str):
        default = default_metric(manifold)
        self.metric = default if metric is None else choice("metric", metric, METRICS)
        self.retraction = choice("retraction", retraction, RETRACTIONS)

    def rgrad(self, x, g):
        if self.metric == "euclidean":
            return kernels.egrad2rgrad_euclidean(x, g)
        return kernels.egrad2rgrad_canonical(x, g)

    def descend(self, x, d, lr):
        if self.retraction == "cayley":
            return ok.cayley_descent(x, d, lr)
        return ok.newton_schulz(_RETR[self.retraction](x, -lr * d))

    def descend_transport(self, x, d, lr):
        if self.retraction == "cayley":
            return ok.cayley_descent(x, d, lr, transport=True)
        y = ok.newton_schulz(_RETR[self.retraction](x, -lr * d))
        return y, kernels.proj_tangent(y, d)

    def gradient_step(self, x, g, lr):
        if self.retraction == "cayley":
            return ok.cayley_gradient_step(x, g, lr, self.metric)
        return self.descend(x, self.rgrad(x, g), lr)

    def component_inner(self, x, u):
        inner = kernels.inner_euclidean if self.metric == "euclidean" else kernels.inner_canonical
        return inner(x, u, u, keepdim=True)

    def project(self, x):
        return ok.newton_schulz(kernels.polar(x))

    def error(self, x):
        return kernels.orthogonality_error(x)


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
    """Resolved once per parameter (outside any traced code); binds a group per step."""

    def __init__(self, manifold, param: torch.Tensor | None = None):
        self.manifold = manifold
        # a DTensor point: the same geometry on local shards (Note [Row-sharded kernels])
        self.like = param.detach() if isinstance(param, DTensor) else None
        if manifold is None:
            self.kind, self._euclid = "euclidean", EuclideanGeometry()
        elif isinstance(manifold, (_OurStiefel, geoopt.Stiefel)):
            self.kind = "stiefel"  # Note [geoopt's Stiefel manifolds use our kernels]
            if self.like is not None:
                check_placements(self.like)  # refuse an unsupported layout at construction
        else:
            self.kind, self._geoopt = "geoopt", GeooptGeometry(manifold)

    def bind(self, group: dict) -> Geometry:
        if self.kind == "euclidean":
            return self._euclid
        if self.kind == "geoopt":
            return self._geoopt
        geo = StiefelGeometry(self.manifold, group.get("metric"), group.get("retraction", "cayley"))
        return geo if self.like is None else ShardedGeometry(geo, self.like)


def manifold_of(p: torch.Tensor) -> geoopt.Manifold | None:
    """The manifold of a parameter (None for a plain tensor or geoopt's Euclidean)."""
    man = getattr(p, "manifold", None) if isinstance(p, geoopt.ManifoldTensor) else None
    if man is None or isinstance(man, geoopt.Euclidean):
        return None
    return man


def geometry_for(p: torch.Tensor, group: dict) -> Geometry:
    """The :class:`Geometry` of parameter ``p`` under param group ``group``."""
    return _Binder(manifold_of(p)).bind(group)

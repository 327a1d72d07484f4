r"""Which `Geometry` a parameter gets: the binding of parameters to their manifolds.

The geometry itself belongs to the manifold (`stiefel.manifolds.geometry`);
this module only decides, once per parameter, which one applies:

- plain tensors (and geoopt's ``Euclidean``): `EuclideanGeometry`, so every
  rule becomes its Euclidean form;
- any manifold with a ``geometry(metric, retraction)`` method (this package's,
  their subclasses, a third party's sphere or product): the geometry it returns,
  with ``retraction=`` checked against its ``retractions`` table;
- geoopt's Stiefel manifolds: this package's `StiefelGeometry` (Note
  [geoopt's Stiefel manifolds use our kernels]);
- any other geoopt manifold: `GeooptGeometry`, its own ``egrad2rgrad``,
  ``retr``, ``retr_transp``, ``transp``, ``component_inner``, ``projx``.

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

import warnings

import geoopt
import torch

from .._core import checks as _checks
from ..manifolds.binding import manifold_of
from ..manifolds.frame_geometry import FrameGeometry
from ..manifolds.geometry import EuclideanGeometry, Geometry, StiefelGeometry
from ..manifolds.kernels import RETRACTIONS, orthogonality_error
from ..manifolds.sharded import ShardedGeometry, check_placements, is_dtensor
from ..manifolds.stiefel import Stiefel

__all__ = [
    "Geometry",
    "EuclideanGeometry",
    "StiefelGeometry",
    "FrameGeometry",
    "GeooptGeometry",
    "Binding",
    "OPTIONS",
    "bind_parameter",
    "check_kind",
    "geometry_for",
    "manifold_of",
]


#: the param-group keys a parameter's geometry depends on
OPTIONS = ("metric", "retraction")


def default_metric(manifold) -> str:
    """The metric a geoopt Stiefel manifold implies by its class."""
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

    def transport(self, x, y, v):
        return self.manifold.transp(x, y, v)

    def component_inner(self, x, u):
        return self.manifold.component_inner(x, u)

    def project(self, x):
        return self.manifold.projx(x)


def retractions_of(manifold) -> tuple[str, ...] | None:
    """The retraction names a manifold offers (None: it takes no ``retraction=``)."""
    if manifold is None:
        return None
    if callable(getattr(manifold, "geometry", None)):
        table = getattr(manifold, "retractions", None)
        return None if table is None else tuple(table)
    if isinstance(manifold, geoopt.Stiefel):
        return tuple(RETRACTIONS)
    return None


class Binding:
    """One parameter's manifold, resolved once (outside any traced code); binds a group per step.

    Note [geoopt's Stiefel manifolds use our kernels]
    geoopt's ``CanonicalStiefel.retr`` moves along (I + XXᴴ)u, not u (its
    initial velocity; ours is u, a true retraction), and neither of geoopt's
    Stiefel manifolds knows the ``metric``/``retraction`` options or corrects
    float drift. Their points are the same matrices with orthonormal columns,
    so they get this package's `StiefelGeometry`, with the metric their class
    implies.

    Args:
        manifold: the parameter's manifold (None: a plain tensor).
        param: the parameter (a DTensor gets its geometry on the local shards).
        group: the param group (merged with the defaults), to resolve the geometry
            once and check ``retraction=`` against the manifold's table.
        transposed: the rule steps the parameter's transpose (a wide plain matrix an
            optimizer treats as a Stiefel point, `RiemannianOptimizer.implied_manifold`).
        implied: the manifold is the one the optimizer gives a plain parameter
            (`RiemannianOptimizer.implied_manifold`), not the parameter's or its group's.

    Attributes:
        kind: the manifold's class and options (None: a plain tensor), what parameters
            stepped together must share (`stiefel.optimizers.buckets`).
        complex: whether the parameter was complex when bound (None: no parameter).
        geo: the geometry under the options of the step's group, set by the step when
            they change (`RiemannianOptimizer.step`), so that a step does not bind again.

    Raises:
        ValueError: a retraction the manifold does not offer, an unsupported DTensor layout.
    """

    def __init__(self, manifold, param: torch.Tensor | None = None, group: dict | None = None,
                 transposed: bool = False, implied: bool = False):  # fmt: skip
        self.manifold = manifold
        self.transposed = transposed
        self.implied = implied
        self.retractions = retractions_of(manifold)
        group = {} if group is None else group
        if self.retractions is not None and "retraction" in group:
            _checks.choice("retraction", group["retraction"], self.retractions)
        # the point the rule sees: a transposed binding's shards split its columns
        self.like = self.orient(param.detach()) if is_dtensor(param) else None
        self._fixed = None
        self._made: dict[tuple, Geometry] = {}
        if manifold is None:
            self._fixed = EuclideanGeometry()
        elif self.retractions is None and not callable(getattr(manifold, "geometry", None)):
            self._fixed = GeooptGeometry(manifold)
        self.stiefel = self._inner(group).stiefel
        self.kind = None if manifold is None else (type(manifold), repr(manifold))
        self.complex = None if param is None else param.is_complex()
        if self.like is not None:
            if self.stiefel:  # an unsupported layout fails at construction
                try:
                    check_placements(self.like)
                except ValueError as err:
                    if not transposed:
                        raise
                    raise ValueError(
                        f"{err} (the point is the transpose of the {tuple(param.shape)} "
                        "parameter: its rows are its columns); allowed: for a square matrix "
                        "a param group manifold=Orthogonal(n), which keeps its rows; for any, "
                        "manifold=geoopt.Euclidean() to keep it free"
                    ) from err
            else:
                self.like = None  # DTensor propagation through the manifold's own operations
        self.geo = self.bind(group)

    def _inner(self, group: dict) -> Geometry:
        if self._fixed is not None:
            return self._fixed
        metric, retraction = map(group.get, OPTIONS)
        retraction = retraction or self.retractions[0]
        # one geometry per option pair, made outside any traced step (a traced step reads
        # this dict only: building a geometry reads the retraction tables)
        key = (metric, retraction)
        geo = self._made.get(key)
        if geo is None:
            if callable(getattr(self.manifold, "geometry", None)):
                geo = self.manifold.geometry(metric, retraction)
            else:
                geo = StiefelGeometry(
                    self.manifold, metric, retraction, default_metric=default_metric(self.manifold)
                )
            self._made[key] = geo
        return geo

    def orient(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` in the rule's orientation (its transpose for a transposed binding), or back."""
        return x.mT if self.transposed and x is not None else x

    def bind(self, group: dict) -> Geometry:
        """The geometry under this group's options."""
        geo = self._inner(group)
        return geo if self.like is None else ShardedGeometry(geo, self.like)

    def check_on_manifold(self, i: int, p: torch.Tensor, geo: Geometry, owner: str) -> None:
        """ValueError naming parameter ``i`` when it is not on its manifold."""
        man, x = self.manifold, p.detach()
        if self.transposed:
            x = x.mT
        # Note [geoopt's Stiefel manifolds use our kernels]: their own test takes XᵀX, which
        # refuses a complex unitary point and passes a complex-orthogonal one; they are
        # tested by this package's ‖XᴴX − I‖_F, as a sharded point (from the Gram of
        # its shards, no gather)
        if isinstance(geo, ShardedGeometry) or isinstance(man, geoopt.Stiefel):
            err = geo.error(x)
            err = float((err.to_local() if is_dtensor(err) else err).max()) if x.numel() else 0.0
            if hasattr(man, "default_atol"):
                bound = man.default_atol(x.dtype)
            else:  # geoopt's: as lenient as its own 1e-5 per entry, and no stricter than ours
                bound = max(1e-4, Stiefel(*x.shape[-2:]).default_atol(x.dtype))
            ok, reason = err <= bound, f"‖XᴴX − I‖_F = {err:.3e} exceeds {bound:.3e}"
        else:
            try:
                ok, reason = man.check_point_on_manifold(x, explain=True)
            except RuntimeError as err:  # its own tensors in another dtype (Lorentz's k)
                raise TypeError(
                    f"parameter {i} of the new param group is {x.dtype} and {man!r}'s own "
                    f"point test fails on it ({err}); allowed: a manifold whose tensors have "
                    f"the point's dtype (manifold.to({x.dtype}), as geoopt asks)"
                ) from None
        if not ok and "‖" not in str(reason):  # ours give ‖XᴴX − I‖_F already
            reason = f"{reason}; {_distance(man, x)}"
        if not ok:
            raise ValueError(
                f"parameter {i} of the new param group is not on its manifold {man!r}: {reason}. "
                f"{owner} needs points on the manifold (project with manifold.projx, or use "
                "'landing', which accepts points off it; a weight loaded from a float16/"
                "bfloat16 run: build the optimizer before loading, then load its state, whose "
                "float32 master is the precise point)"
            )


def _distance(man, x: torch.Tensor) -> str:
    """How far ``x`` is from ``man``, for an error message."""
    if isinstance(man, geoopt.Stiefel):
        return f"‖XᴴX − I‖_F = {float(orthogonality_error(x).max()):.3e}"
    try:
        dist = float(torch.linalg.vector_norm(x - man.projx(x)))
    except Exception as err:  # noqa: BLE001 - a manifold without projx: the reason must do
        return f"distance unknown (its projx raised {type(err).__name__})"
    return f"‖x − projx(x)‖ = {dist:.3e}"


def check_shape(i: int, p: torch.Tensor, man, transposed: bool = False) -> None:
    """ValueError when parameter ``i`` is not of its manifold's shape (geoopt's `_check_shape`).

    Every optimizer checks it, also those that accept points off the manifold: a
    point of another shape is not near it (a group's ``manifold=`` naming another
    size stepped a (5, 2) matrix as a point of St(10, 3)).
    """
    shape = (*p.shape[:-2], *p.shape[-2:][::-1]) if transposed else tuple(p.shape)
    ok, reason = man._check_shape(shape, "x") if hasattr(man, "_check_shape") else (True, None)
    if not ok:
        raise ValueError(
            f"parameter {i} of the new param group has shape {tuple(p.shape)}, not a point "
            f"of its manifold {man!r} ({reason}); allowed: a manifold of the parameter's "
            "shape (a ManifoldParameter's own, or the param group's manifold=)"
        )


def check_kind(where: str, p: torch.Tensor, man, owner: str) -> None:
    """TypeError when ``p``'s dtype kind (real, complex) is not its manifold's, or unsupported.

    Checked when a parameter is bound and again at every step: machinery that
    converts a module (``module.to(torch.complex64)``) changes the dtype of a
    parameter the optimizer bound as real.

    Args:
        where: the parameter, named for the message.
        p: the parameter.
        man: its manifold (one without a ``complex`` flag is not checked for the kind;
            a dtype without kernels, complex32 or float8, is refused on any manifold).
        owner: the optimizer's class name.
    """
    if man is not None and p.dtype not in _checks.DTYPES:  # complex32, float8: no kernels
        raise TypeError(
            f"{where} has dtype {p.dtype}; allowed on a manifold: "
            f"{', '.join(str(d) for d in _checks.DTYPES)}"
        )
    cplx = getattr(man, "complex", None)
    if not isinstance(cplx, bool) or p.is_complex() == cplx:
        return
    kind, other = ("complex", "real") if p.is_complex() else ("real", "complex")
    raise TypeError(
        f"{where} has dtype {p.dtype} but its manifold {man!r} is {other}; {owner} cannot "
        f"step a {kind} tensor on a {other} manifold: use a "
        + (
            "complex manifold (e.g. Stiefel(n, m, complex=True), Unitary(n)) or a real tensor"
            if p.is_complex()
            else "real manifold (Stiefel(n, m), Orthogonal(n)) or a complex tensor"
        )
    )


def bind_parameter(opt, i: int, p: torch.Tensor, group: dict) -> Binding:
    """Parameter ``i`` of a new group of optimizer ``opt``, bound to its manifold and checked.

    Note [Manifold from the param group]
    A wrapper that replaces parameters (FSDP2's fully_shard makes every
    parameter a plain DTensor Parameter) drops a ManifoldParameter's
    ``manifold``; the group's ``manifold=`` names it for the group's plain
    parameters. A parameter's own manifold wins; a plain parameter with neither
    gets the one the optimizer implies (``opt.implied_manifold``, None: Euclidean).

    Raises:
        TypeError: a complex parameter on a real manifold.
        ValueError: a retraction the manifold does not offer, a DTensor the optimizer
            cannot step, a point off its manifold (unless ``opt.accepts_off_manifold``),
            or what ``opt.check_parameter`` refuses.
    """
    owner = type(opt).__name__
    man, transposed = manifold_of(p), False
    # geoopt's Euclidean, on the parameter or named by the group, says "plain": no
    # manifold, not even the one the optimizer would imply
    euclidean = isinstance(getattr(p, "manifold", None), geoopt.Euclidean) or isinstance(
        group.get("manifold"), geoopt.Euclidean
    )
    if man is None and not euclidean:
        man = group.get("manifold")
    implied = False
    if man is None and not euclidean:
        man, transposed = opt.implied_manifold(p) or (None, False)
        implied = man is not None
    check_kind(f"parameter {i} of the new param group", p, man, owner)
    check_shape(i, p, man, transposed)
    binding = Binding(man, p, group, transposed, implied)  # ValueError: retraction, DTensor
    if binding.like is not None and not opt.dtensor_points:
        raise ValueError(
            f"parameter {i} of the new param group is a DTensor "
            f"(placements {tuple(binding.like.placements)}); {owner} calls kernels that do "
            "not run on shards. Optimizers that accept DTensor manifold points: "
            f"{', '.join(opt.dtensor_rules())}"
        )
    geo = binding.bind(group)
    if man is not None and not opt.accepts_off_manifold:
        binding.check_on_manifold(i, p, geo, owner)
    opt.check_parameter(i, p, geo, group)
    return binding


def bind_again(opt, i: int, p: torch.Tensor, group: dict) -> Binding:
    """`bind_parameter` for a parameter bound as a plain tensor that carries a manifold now.

    Note [A weight constrained after its plain steps]
    ``orthogonalize(module, method="riemannian")`` after the optimizer stepped the
    weight leaves a state made by the plain rule (an ambient momentum, radam's
    second moment per entry where the manifold rule keeps one per matrix, on whose
    shapes that rule fails). It means nothing on the manifold: it is dropped, with a
    warning, and the manifold rule starts afresh.
    """
    binding = bind_parameter(opt, i, p, group)
    keys = [k for k in opt.state.get(p, {}) if not k.startswith("_")]
    if keys and binding.manifold is not None:
        del opt.state[p]
        warnings.warn(
            f"{type(opt).__name__}: parameter {i} of its group (shape {tuple(p.shape)}) is a "
            f"point of {binding.manifold!r} now, after steps as a plain tensor; its state "
            f"({', '.join(keys)}) was made by the plain rule and starts afresh",
            RuntimeWarning,
            stacklevel=4,
        )
    return binding


def geometry_for(p: torch.Tensor, group: dict) -> Geometry:
    """The `Geometry` of parameter ``p`` under param group ``group``."""
    return Binding(manifold_of(p), group=group).bind(group)

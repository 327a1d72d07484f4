r"""Stiefel geometries on `torch.distributed.tensor.DTensor` points (FSDP2, sharded batches).

`ShardedGeometry` wraps the `Geometry` of one parameter: it runs the same
kernels on the local shard (`DTensor.to_local`) and wraps the results back with
the parameter's placements. Supported placements of a (..., N, M) point, per
mesh dimension: ``Replicate()``; ``Shard(d)`` on a batch dimension d < ndim − 2
(independent matrices: no communication); ``Shard(ndim − 2)``, the rows of the
matrices (FSDP2's ``Shard(0)`` of an N×M weight), on at most one mesh dimension:
the kernels then reduce every product over the rows across that mesh dimension
(Note [Row-sharded kernels] in `stiefel.manifolds.kernels.reduce`), so a step
all-reduces M×M matrices and never gathers the N×M point.

Beside it, what `stiefel.manifolds.binding` needs of FSDP2 and of rebuilt points:
`fsdp_sharded` (the sharded Parameter FSDP2 keeps for a module's name),
`warn_replaced` (an optimizer holding the Parameters ``fully_shard`` replaced) and
`admit` (a rebuilt point checked and projected, plain or sharded, with M×M Grams).

Example:
    ```text
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)          # model.head.weight: a DTensor, Shard(0) on its N rows
    opt = stiefel.optimizers.create(
        "rgd", [{"params": [model.head.weight], "manifold": stiefel.Stiefel(n, m)}], lr=0.1
    )
    ```
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from typing import TYPE_CHECKING

import geoopt
import torch
import torch.distributed as dist

from .geometry import Geometry, StiefelGeometry
from .kernels.reduce import gram

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "ShardedGeometry",
    "SUPPORTED_PLACEMENTS",
    "check_placements",
    "any_rank",
    "is_dtensor",
    "per_matrix",
    "fsdp_sharded",
    "geometry_of",
    "complex_message",
    "admit",
    "warn_replaced",
]

# Note [DTensor without importing it]
# ``torch.distributed.tensor`` imports sympy and much of torch's compiler stack
# (over a second of CPU), which a model without DTensors never needs. A tensor can
# be a DTensor only once that module is imported (it defines the class), so the
# test looks the module up in ``sys.modules`` instead of importing it.


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a `torch.distributed.tensor.DTensor` (Note [DTensor without ...])."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


SUPPORTED_PLACEMENTS = (
    "Replicate(); Shard(d) on a batch dimension d < ndim - 2; "
    "Shard(ndim - 2) on the rows (N) on at most one mesh dimension"
)


def check_placements(x: DTensor) -> int | None:
    """The mesh dimension that shards the rows of ``x`` (None if none); ValueError if unsupported.

    Args:
        x: a DTensor point of shape (..., N, M).

    Returns:
        The mesh dimension whose ``Shard`` splits dimension ndim − 2, or None.

    Raises:
        ValueError: a placement shards the columns (M) or is a partial sum, or
            the rows are sharded on more than one mesh dimension.
    """
    from torch.distributed.tensor import Replicate, Shard

    ndim, rows = x.dim(), []
    for i, pl in enumerate(x.placements):
        if isinstance(pl, Replicate):
            continue
        if isinstance(pl, Shard):
            d = pl.dim + ndim if pl.dim < 0 else pl.dim
            if d == ndim - 2:
                rows.append(i)
                continue
            if d < ndim - 2:
                continue
        raise ValueError(
            f"placement {pl} (mesh dimension {i}) of a DTensor point of shape "
            f"{tuple(x.shape)} (placements {tuple(x.placements)}) is not supported; "
            f"supported: {SUPPORTED_PLACEMENTS}"
        )
    if len(rows) > 1:
        raise ValueError(
            f"the rows of a DTensor point of shape {tuple(x.shape)} are sharded on mesh "
            f"dimensions {rows} (placements {tuple(x.placements)}); supported: "
            f"{SUPPORTED_PLACEMENTS}"
        )
    return rows[0] if rows else None


@functools.lru_cache(maxsize=256)
def takes_group(kernel) -> bool:
    """Whether ``kernel`` has a ``group`` parameter: it sums over the rows.

    A kernel without one is row-local (elementwise, or on M×M matrices only).
    """
    try:
        return "group" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # no signature (a builtin): row-local
        return False


def per_matrix(kernel):
    """Declare that every tensor ``kernel`` returns is per matrix (for `ShardedGeometry.apply`).

    Note [Per-matrix results are declared, not guessed]
    `ShardedGeometry.apply` wraps a kernel's result as rows of the point when it has
    the shape of the local rows, and as one value per matrix (replicated over the
    rows) otherwise. On an uneven layout the shapes do not tell them apart on every
    rank: St(1, 1) on two ranks holds (1, 1) rows on one and (0, 1) on the other, so
    a per-matrix (1, 1) result would be rows on the first rank and per matrix on the
    second, and the next DTensor operation on it (radam's ξ/μ) all-gathers on one
    rank only: a hang. A kernel whose results are all per matrix says so with this
    decorator, and every rank then wraps them alike, whatever rows it holds.
    """
    kernel.per_matrix = True
    return kernel


def any_rank(flags: torch.Tensor, mesh) -> torch.Tensor:
    """Bool ``flags`` OR-ed over every rank of ``mesh`` (one small all-reduce per mesh dim).

    Args:
        flags: a bool tensor, this rank's answers.
        mesh: a `DeviceMesh`.

    Returns:
        The flags, True where any rank said True (the same on every rank).
    """
    out = flags.to(torch.uint8)
    for i in range(mesh.ndim):
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=mesh.get_group(i))
    return out.bool()


def fsdp_sharded(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The sharded Parameter FSDP2 keeps for ``module.<name>`` (None when not sharded).

    During a forward FSDP2 puts an unsharded Parameter at that name; the one the
    optimizer steps is the sharded DTensor Parameter in FSDP2's state.
    """
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    for ref in list(_module_state_mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        group = getattr(state, "_fsdp_param_group", None) if isinstance(state, FSDPState) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            info = fsdp_param._module_info
            if info.module is module and info.param_name == name:
                return fsdp_param.sharded_param
    return None


def warn_replaced(opt: torch.optim.Optimizer) -> None:
    """Warn when ``opt`` holds Parameters that FSDP2's ``fully_shard`` replaced.

    Note [An optimizer built before fully_shard]
    ``fully_shard`` puts a new DTensor Parameter in the module; an optimizer built
    before holds the old tensors, which get no gradient: it trains nothing, silently.
    FSDP2 tags each Parameter it replaced (``_fsdp_orig_uid``).
    """
    for gi, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if getattr(p, "_fsdp_orig_uid", None) is not None:
                warnings.warn(
                    f"{type(opt).__name__}: parameter {i} of param group {gi} (shape "
                    f"{tuple(p.shape)}) was replaced by fully_shard after the optimizer was "
                    "built; it holds the old tensor, which gets no gradient, and the model "
                    "does not train. Build the optimizer after fully_shard.",
                    stacklevel=4,  # under the guard and torch's step wrapper
                )
                return


class ShardedGeometry(Geometry):
    """The operations of ``inner`` on DTensor points with the placements of ``like``.

    Args:
        inner: the geometry of the unsharded parameter (e.g. a `StiefelGeometry`).
        like: a DTensor with the parameter's mesh, placements and shape.

    Raises:
        ValueError: unsupported placements (see `check_placements`).
    """

    def __init__(self, inner, like: DTensor):
        from torch.distributed.tensor import Replicate

        row_dim = check_placements(like)
        self.mesh, self.placements = like.device_mesh, tuple(like.placements)
        self.row_group = None if row_dim is None else self.mesh.get_group(row_dim)
        # the kernels reduce over the row group as their ``group`` argument
        # (Note [Row-sharded geometries] in `stiefel.manifolds.geometry`)
        self.inner = inner.on_rows(self.row_group)
        self.riemannian, self.stiefel = inner.riemannian, inner.stiefel
        # reduced results (per matrix) are replicated over the row mesh dimension
        self.reduced = tuple(
            Replicate() if i == row_dim else pl for i, pl in enumerate(self.placements)
        )
        self._cache: tuple[DTensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ conversions
    def local(self, t):
        """The local shard of a DTensor (the same tensor object for the same DTensor)."""
        if not is_dtensor(t):
            return t
        if self._cache is not None and self._cache[0] is t:
            return self._cache[1]
        loc = t.to_local()
        self._cache = (t, loc)
        return loc

    def _wrap(self, t: torch.Tensor, shape, placements) -> DTensor:
        from torch.distributed.tensor import DTensor

        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            t, self.mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )

    def _like(self, x: DTensor, t: torch.Tensor) -> DTensor:
        return self._wrap(t, x.shape, self.placements)

    def _per_matrix(self, x: DTensor, t: torch.Tensor) -> DTensor:
        shape = (*x.shape[:-2], *t.shape[x.dim() - 2 :]) if t.dim() >= x.dim() - 2 else t.shape
        return self._wrap(t, shape, self.reduced)

    def _run(self, fn, *args):
        return fn(*(self.local(a) for a in args))

    def any_rank(self, flags: torch.Tensor) -> torch.Tensor:
        """``flags`` (bool) OR-ed over every rank of the mesh, so that all ranks agree."""
        return any_rank(flags, self.mesh)

    # ------------------------------------------------------------------ the Geometry API
    def rgrad(self, x, g):
        return self._like(x, self._run(self.inner.rgrad, x, g))

    def retract(self, x, u):
        return self._like(x, self._run(self.inner.retract, x, u))

    def descend(self, x, d, lr):
        return self._like(x, self._run(self.inner.descend, x, d, lr))

    def descend_transport(self, x, d, lr):
        y, td = self._run(self.inner.descend_transport, x, d, lr)
        return self._like(x, y), self._like(x, td)

    def gradient_step(self, x, g, lr):
        return self._like(x, self._run(self.inner.gradient_step, x, g, lr))

    def component_inner(self, x, u):
        return self._per_matrix(x, self._run(self.inner.component_inner, x, u))

    def project(self, x):
        return self._like(x, self._run(self.inner.project, x))

    def error(self, x):
        return self._per_matrix(x, self._run(self.inner.error, x))

    def apply(self, kernel, x, *args, **kwargs):
        """``kernel(x, *args)`` on the local rows: N×M results like ``x``, others per matrix.

        A kernel with a ``group`` parameter (`takes_group`) is handed the process
        group the rows are split over, when they are. The results of a kernel marked
        `per_matrix` are per matrix on every rank (Note [Per-matrix results are
        declared, not guessed]).
        """
        if self.row_group is not None and takes_group(kernel):
            kwargs = {**kwargs, "group": self.row_group}
        out = kernel(self.local(x), *(self.local(a) for a in args), **kwargs)
        loc = self.local(x)
        rows = not getattr(kernel, "per_matrix", False)

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            return self._like(x, t) if rows and t.shape == loc.shape else self._per_matrix(x, t)

        return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)

    def off_manifold(self, x, step=None, unchanged=False, **options):
        # this rank's answer: the optimizer ORs it over the ranks with its other flags
        inner = functools.partial(
            self.inner.off_manifold, step=step, unchanged=unchanged, **options
        )
        return self._run(inner, x)


def geometry_of(manifold) -> Geometry | None:
    """The geometry that tests and projects a recorded weight's values, or None.

    A manifold's own ``geometry()``; geoopt's Stiefel manifolds this package's kernels
    (Note [geoopt's Stiefel manifolds use our kernels]); None for another geoopt
    manifold (a sphere, a ball), whose values are then used as they are.
    """
    if callable(getattr(manifold, "geometry", None)):
        return manifold.geometry()
    return StiefelGeometry(manifold) if isinstance(manifold, geoopt.Stiefel) else None


def complex_message(label: str, manifold, dtype: torch.dtype, why: str) -> str:
    return (
        f"{label} is a point of the real manifold {manifold!r} but its Parameter is now "
        f"{dtype} ({why}); a real Riemannian weight cannot be stepped as a complex one: keep "
        "it real, or orthogonalize a complex weight (its manifold is then complex)"
    )


@torch.no_grad()
def admit(t: torch.Tensor, manifold, label: str, why: str) -> None:
    """Check the values of a rebuilt Parameter; project them if usable, refuse them if not.

    Note [The manifold lives on the module]. A plain and a DTensor point take the
    same path: the manifold's geometry (its `ShardedGeometry` on the local rows for
    a DTensor), M×M Grams only, every rank taking the same decision.

    Raises:
        TypeError: a complex tensor on a real manifold.
        ValueError: non-finite or rank-deficient values (naming ``label`` and the fix).
    """
    if t.is_complex() and not getattr(manifold, "complex", True):
        raise TypeError(complex_message(label, manifold, t.dtype, why))
    if t.device.type == "meta":
        return
    x, geo = t.detach(), geometry_of(manifold)
    if geo is None:  # values it cannot test: used as they are
        return
    sharded = is_dtensor(x)
    geo = ShardedGeometry(geo, x) if sharded else geo
    local = geo.local(x) if sharded else x
    # the rank's answer, OR-ed over the ranks (the same decision everywhere)
    everywhere = geo.any_rank if sharded else (lambda flag: flag)
    fix = "call the module's reset_parameters() or stiefel.parametrizations.initialize(model)"
    if bool(everywhere(~torch.isfinite(local).all().reshape(1))):
        raise ValueError(f"{label} holds non-finite values ({why}, e.g. to_empty): {fix}")
    err = geo.error(x)
    tol = 10 * x.shape[-1] * torch.finfo(x.dtype).eps
    if not bool(((geo.local(err) if sharded else err) > tol).any()):  # replicated per matrix
        return
    hi = torch.complex128 if x.is_complex() else torch.float64
    rows = geo.row_group if sharded else None  # the M×M Gram of all the rows
    w = torch.linalg.eigvalsh(gram(local, local, rows).to(hi))
    if bool((w[..., 0] <= 1e-12 * w[..., -1].clamp_min(1e-300)).any()):
        hint = (
            " A reset that drew every shard with the same generator (torch.manual_seed on "
            "every rank, on a CPU mesh) writes the same rows on every rank: seed the ranks "
            "differently before reset_parameters(), or initialize before fully_shard."
            if sharded
            else ""
        )
        raise ValueError(
            f"{label} holds a rank-deficient matrix ({why}, e.g. uninitialised memory after "
            f"to_empty), which is no point of {manifold!r} and has no nearest one.{hint} "
            f"Fix: {fix}"
        )
    t.copy_(geo.project(x))

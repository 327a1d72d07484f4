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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .geometry import Geometry

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "ShardedGeometry",
    "SUPPORTED_PLACEMENTS",
    "check_placements",
    "any_rank",
    "is_dtensor",
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
        group the rows are split over, when they are.
        """
        if self.row_group is not None and takes_group(kernel):
            kwargs = {**kwargs, "group": self.row_group}
        out = kernel(self.local(x), *(self.local(a) for a in args), **kwargs)
        loc = self.local(x)

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            return self._like(x, t) if t.shape == loc.shape else self._per_matrix(x, t)

        return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)

    def off_manifold(self, x, step=None, unchanged=False, **options):
        # this rank's answer: the optimizer ORs it over the ranks with its other flags
        inner = functools.partial(
            self.inner.off_manifold, step=step, unchanged=unchanged, **options
        )
        return self._run(inner, x)

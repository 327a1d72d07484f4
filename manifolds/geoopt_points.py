r"""geoopt's optimizers and the points they cannot step (see `check_geoopt`)."""

from __future__ import annotations

import geoopt
import torch

from .binding import claim, manifold_of
from .sharded import is_dtensor

__all__ = ["check_geoopt"]


def check_geoopt(opt: torch.optim.Optimizer) -> None:
    """Refuse the points geoopt's optimizer ``opt`` would step as Euclidean tensors.

    Note [geoopt steps only ManifoldTensors]
    geoopt's optimizers move a parameter on its manifold only when it is a
    ``geoopt.ManifoldTensor`` and step any other as a Euclidean tensor, silently: a
    DTensor point, whose manifold is an attribute (Note [Marking a tensor];
    ``fully_shard`` makes every Parameter one), and a plain parameter whose param
    group names ``manifold=``, which geoopt does not read. Such a parameter is
    refused (ValueError) when the optimizer is built by `stiefel.optimizers.create`
    and at a step that sees new parameters or marks (Note [The guard sees every
    param group]), after the rebuilt weights among them are claimed (`claim`: a
    plain one is a ManifoldParameter again, which geoopt steps on its manifold).
    """
    claim(p for group in opt.param_groups for p in group["params"])
    for gi, group in enumerate(opt.param_groups):
        named = group.get("manifold")
        named = named if isinstance(named, geoopt.Manifold) else None
        for i, p in enumerate(group["params"]):
            man = manifold_of(p) or (None if isinstance(named, geoopt.Euclidean) else named)
            if man is None or isinstance(p, geoopt.ManifoldTensor):
                continue
            why = "a DTensor, e.g. of fully_shard" if is_dtensor(p) else "marked by hand"
            raise ValueError(
                f"{type(opt).__name__}: parameter {i} of param group {gi} (shape "
                f"{tuple(p.shape)}) is a point of {man!r} but not a geoopt.ManifoldParameter "
                f"({why if manifold_of(p) else f'its group has manifold={named!r}'}); "
                "geoopt's optimizers step it as a Euclidean tensor, off its manifold. "
                "Allowed: this package's optimizers, which step it on its manifold "
                "(stiefel.optimizers.create('rgd' | 'radam' | 'landing' | ..., model))"
            )

"""Workers of test_fsdp_points (gloo, CPU): manifold points under FSDP2's ``fully_shard`` that
the optimizers once stepped wrongly or not at all, and row shards some rank holds none of.

Each scenario also runs in one process (``world=1``, no sharding): the test's reference.
"""

from __future__ import annotations

import os
import warnings

import geoopt
import torch
import torch.distributed as dist
from torch import nn

from stiefel import optimizers, orthogonalize
from stiefel.manifolds import Stiefel, kernels

F64 = torch.float64
N, M, BATCH, STEPS = 8, 3, 4, 5
NAMES = ("rgd", "radam", "landing", "manifold_muon", "pogo")
#: St(1, 1) on two ranks: one holds the row, the other none; St(3, 1): rows 2 + 1
SHAPES = ((1, 1), (3, 1))


class HandMade(nn.Module):
    """A ManifoldParameter set on the module by hand (the recipe of docs/optimizers.md)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        st = Stiefel(N, M)
        x = kernels.haar(N, M, dtype=F64, generator=g).contiguous()  # FSDP2 needs contiguous
        self.w = geoopt.ManifoldParameter(x, manifold=st)

    def forward(self, x):
        return x @ self.w


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, N, dtype=F64, generator=g)
    return x, torch.randn(BATCH, M, dtype=F64, generator=g)


def train(model: nn.Module, opt, rank: int = 0, world: int = 1) -> None:
    """The batch of each step split across ranks; each rank's loss is its share's mean."""
    share = BATCH // world
    for step in range(STEPS):
        x, y = (t[rank * share : (rank + 1) * share] for t in batch(step))
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def full(w: torch.Tensor) -> torch.Tensor:
    w = w.detach()
    return (w.full_tensor() if hasattr(w, "full_tensor") else w).clone()


def hand_made(name: str, given: str, rank: int = 0, world: int = 1) -> torch.Tensor:
    """A hand-made point trained by ``name``, sharded by fully_shard when ``world`` > 1."""
    model = HandMade()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    params = model if given == "model" else model.parameters()
    train(model, optimizers.create(name, params, lr=0.1), rank, world)
    return full(model.w)


def _riemannian() -> nn.Module:
    torch.manual_seed(0)
    return orthogonalize(nn.Linear(M, N, bias=False, dtype=F64), method="riemannian")


def geoopt_refusals() -> dict[str, object]:
    """geoopt's optimizers on a fully_shard-ed Riemannian weight: built by `create` from the
    model, and built directly from ``model.parameters()`` (refused at the first step)."""
    from torch.distributed.fsdp import fully_shard

    out: dict[str, object] = {}
    model = fully_shard(_riemannian())
    before = full(model.weight)
    for name in ("geoopt_rsgd", "geoopt_radam"):
        try:
            optimizers.create(name, model, lr=0.1)
            out[name] = ""
        except ValueError as err:
            out[name] = str(err)
    opt = geoopt.optim.RiemannianAdam(model.parameters(), lr=0.1)
    model(torch.randn(2, M, dtype=F64)).square().sum().backward()
    try:
        opt.step()
        out["direct"] = ""
    except ValueError as err:
        out["direct"] = str(err)
    out["unchanged"] = bool(torch.equal(full(model.weight), before))
    return out


def built_before_fully_shard() -> list[str]:
    """The warnings of a step of an optimizer built before fully_shard."""
    from torch.distributed.fsdp import fully_shard

    model = _riemannian()
    opt = optimizers.create("rgd", model, lr=0.1)
    fully_shard(model)
    model(torch.randn(2, M, dtype=F64)).square().sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def points_worker(rank: int, world: int, out: str) -> None:
    got = {
        f"{name}-{given}": hand_made(name, given, rank, world)
        for name in ("rgd", "radam")
        for given in ("model", "parameters")
    }
    refusals = geoopt_refusals()
    before = built_before_fully_shard()
    if rank == 0:
        torch.save(
            {"hand_made": got, "geoopt": refusals, "before": before},
            os.path.join(out, "points.pt"),
        )
    dist.barrier()


def _grads(n: int, m: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n * 10 + m)
    return [torch.randn(n, m, dtype=F64, generator=g) for _ in range(3)]


def row_sharded(name: str, n: int, m: int, mesh=None) -> torch.Tensor:
    """Three steps of ``name`` on St(n, m); rows sharded over ``mesh`` (DTensor Shard(0))."""
    st = Stiefel(n, m)
    x = kernels.haar(n, m, dtype=F64, generator=torch.Generator().manual_seed(3))
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        def shard(t):
            return distribute_tensor(t, mesh, [Shard(0)])
    else:

        def shard(t):
            return t

    w = nn.Parameter(shard(x))
    opt = optimizers.create(name, [{"params": [w], "manifold": st}], lr=0.1)
    for g in _grads(n, m):
        w.grad = shard(g)
        opt.step()
    return full(w)


def one_by_one(shard=None) -> torch.Tensor:
    """radam on St(1, 1) made by orthogonalize (sharded by ``shard``, e.g. fully_shard)."""
    torch.manual_seed(0)
    model = orthogonalize(nn.Linear(1, 1, bias=False, dtype=F64), method="riemannian")
    if shard is not None:
        shard(model)
    opt = optimizers.create("radam", model, lr=0.1)
    for step in range(2):
        opt.zero_grad()
        model(torch.full((2, 1), 1.0 + step, dtype=F64)).sum().backward()
        opt.step()
    return full(model.weight)


def empty_shard_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    got = {(name, n, m): row_sharded(name, n, m, mesh) for name in NAMES for n, m in SHAPES}
    got["fsdp"] = one_by_one(fully_shard)  # its one row on rank 0
    if rank == 0:
        torch.save(got, os.path.join(out, "empty_shard.pt"))
    del mesh
    dist.barrier()

"""Workers of test_dtensor: optimizer steps on DTensor points against the plain steps."""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from stiefel import Stiefel, optimizers
from stiefel.manifolds import kernels
from stiefel.optimizers import RiemannianOptimizer

M, STEPS = 4, 3
#: row-sharded points with few rows at world 4 (test_fewer_local_rows_than_columns), and
#: St(50, 4), whose local row counts (13, 13, 13, 11) fall on both sides of landing's
#: 3M = 12 (a branch on the local count: a collective mismatch, gloo aborted)
FEW_ROWS = ((8, M), (8, 8), (6, M), (3, 3), (50, M))


class Plugin(RiemannianOptimizer):
    """A rule written on the public interface only: transported heavy-ball."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr, retraction="cayley", repair_every=None))

    def update(self, geo, x, grad, state, group):
        xi = geo.rgrad(x, grad)
        buf = state.get("buf")
        buf = xi if buf is None else 0.5 * buf + xi
        scale = 1 / (1 + geo.component_inner(x, buf).sqrt())
        new, state["buf"] = geo.descend_transport(x, buf * scale, group["lr"])
        return new


class Refusing(Plugin):
    """A rule that declares that its kernels do not run on shards."""

    dtensor_points = False


# (label, optimizer name or class, hyper-parameters): every retraction, both metrics
CONFIGS = [
    ("rgd-cayley", "rgd", dict(lr=0.2)),
    ("rgd-cayley-canonical-momentum", "rgd", dict(lr=0.2, momentum=0.5, metric="canonical")),
    ("rgd-qr-momentum", "rgd", dict(lr=0.2, momentum=0.5, retraction="qr")),
    ("rgd-polar", "rgd", dict(lr=0.2, retraction="polar")),
    ("radam", "radam", dict(lr=0.05)),
    ("radam-qr", "radam", dict(lr=0.05, retraction="qr")),
    ("landing", "landing", dict(lr=0.1)),
    ("plugin", Plugin, dict(lr=0.1)),
    # msign by Polar Express, by Muon's quintic; the dual descent; momentum
    ("muon", "manifold_muon", dict(lr=0.1, momentum=0.5, inner_steps=2, msign_steps=5)),
    (
        "muon-ns-qr",
        "manifold_muon",
        dict(lr=0.1, msign="newton_schulz", inner_steps=2, retraction="qr"),
    ),
    ("pogo-adam", "pogo", dict(lr=0.05)),
    ("pogo-sgd", "pogo", dict(lr=0.02, base="sgd", momentum=0.5, nesterov=True)),
]
# M×M all-reduces a step may issue (the bound of test_dtensor's traffic test):
# manifold_muon: per inner step, msign's Grams and norm, XᴴΦ and a trace (steps + 4)
GRAMS = {"muon": 2 * (5 + 4) + 8, "muon-ns-qr": 2 * (5 + 4) + 8}


def _data(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = kernels.haar(*shape[-2:], *shape[:-2], dtype=torch.float64, generator=g)
    grads = [torch.randn(shape, dtype=torch.float64, generator=g) for _ in range(STEPS)]
    return x.detach().clone(), grads


def _optimizer(name, hyper, params, shape):
    groups = [{"params": params, "manifold": Stiefel(*shape[-2:])}]
    if isinstance(name, str):
        return optimizers.create(name, groups, **hyper)
    return name(groups, **hyper)


def plain_steps(name, hyper, shape, seed) -> torch.Tensor:
    x, grads = _data(shape, seed)
    p = torch.nn.Parameter(x)
    opt = _optimizer(name, hyper, [p], shape)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def sharded_steps(name, hyper, shape, seed, mesh, placements):
    """The same steps on a DTensor; (result, collectives, bytes) of the last step."""
    x, grads = _data(shape, seed)
    p = torch.nn.Parameter(distribute_tensor(x, mesh, placements))
    opt = _optimizer(name, hyper, [p], shape)
    from _comm import CommBytes

    for g in grads:
        p.grad = distribute_tensor(g, mesh, placements)
        with CommDebugMode() as debug, CommBytes() as counter:
            opt.step()
    counts = {str(k): v for k, v in debug.get_comm_counts().items()}
    return p.detach().full_tensor(), counts, counter.bytes


def dtensor_worker(rank: int, world: int, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for label, name, hyper in CONFIGS:
        for n in (64, 256):
            shape = (n, M)
            ref = plain_steps(name, hyper, shape, seed=n)
            got, counts, nbytes = sharded_steps(name, hyper, shape, n, mesh, [Shard(0)])
            results[(label, "rows", n)] = (float((got - ref).abs().max()), counts, nbytes)
        # at world 4: fewer local rows than columns (2 rows a rank: St(8, 4), O(8)), and a
        # rank with none (rows split as torch.chunk does: 6 as 2, 2, 2, 0; 3 as 1, 1, 1, 0)
        for shape in FEW_ROWS if world == 4 else ():
            ref = plain_steps(name, hyper, shape, seed=3)
            got, counts, nbytes = sharded_steps(name, hyper, shape, 3, mesh, [Shard(0)])
            results[(label, "few-rows", shape)] = (float((got - ref).abs().max()), counts)
        if world != 2:
            continue  # no communication depends on the world size: tested once
        for kind, shape, placements in (
            ("replicate", (40, M), [Replicate()]),
            ("batch", (world * 2, 40, M), [Shard(0)]),
        ):
            ref = plain_steps(name, hyper, shape, seed=7)
            got, counts, nbytes = sharded_steps(name, hyper, shape, 7, mesh, placements)
            results[(label, kind, shape[-2])] = (float((got - ref).abs().max()), counts, nbytes)
    # an unsupported layout: the columns of St(N, M) sharded
    p = torch.nn.Parameter(distribute_tensor(_data((64, M), 0)[0], mesh, [Shard(1)]))
    try:
        _optimizer("rgd", dict(lr=0.1), [p], (64, M))
        results["shard1"] = "no error"
    except ValueError as exc:
        results["shard1"] = str(exc)
    # pogo steps a square or wide plain matrix as its transpose: the parameter's row
    # shards are the point's column shards (before: a shape error mid-step)
    for key, shape in (("pogo-square", (M, M)), ("pogo-wide", (M, 64))):
        x = torch.linalg.qr(torch.randn(shape[::-1], dtype=torch.float64))[0].mT.contiguous()
        p = torch.nn.Parameter(distribute_tensor(x, mesh, [Shard(0)]))
        try:
            optimizers.create("pogo", [p], lr=0.1)
            results[key] = "no error"
        except ValueError as exc:
            results[key] = str(exc)
    # a rule whose kernels do not run on shards refuses a DTensor point; so does
    # manifold_muon's exact msign="svd" on row-sharded points (it runs on the others)
    for key, name, hyper in (
        ("refusing", Refusing, dict(lr=0.1)),
        ("muon-svd", "manifold_muon", dict(lr=0.1, msign="svd")),
    ):
        p = torch.nn.Parameter(distribute_tensor(_data((64, M), 0)[0], mesh, [Shard(0)]))
        try:
            _optimizer(name, hyper, [p], (64, M))
            results[key] = "no error"
        except ValueError as exc:
            results[key] = str(exc)
    hyper = dict(lr=0.1, msign="svd", inner_steps=2)
    unsplit = (("replicate", (40, M), [Replicate()]), ("batch", (world * 2, 40, M), [Shard(0)]))
    for kind, shape, placements in unsplit if world == 2 else ():  # no traffic: tested once
        ref = plain_steps("manifold_muon", hyper, shape, seed=5)
        got, _, nbytes = sharded_steps("manifold_muon", hyper, shape, 5, mesh, placements)
        results[("muon-svd", kind)] = (float((got - ref).abs().max()), nbytes)
    # manifold_muon's Muon step on plain 2-D weights sharded on their rows (FSDP2):
    # tall, and wide with fewer local rows than columns
    for shape in ((64, M), (2 * world, 16)):
        g = torch.Generator().manual_seed(11)
        x, grad = (torch.randn(shape, dtype=torch.float64, generator=g) for _ in range(2))
        p = torch.nn.Parameter(x.clone())
        opt = optimizers.create("manifold_muon", [p], lr=0.1, momentum=0.5)
        q = torch.nn.Parameter(distribute_tensor(x, mesh, [Shard(0)]))
        opt_q = optimizers.create("manifold_muon", [q], lr=0.1, momentum=0.5)
        for _ in range(2):
            p.grad, q.grad = grad.clone(), distribute_tensor(grad, mesh, [Shard(0)])
            opt.step()
            with CommDebugMode() as debug:
                opt_q.step()
        err = float((q.detach().full_tensor() - p.detach()).abs().max())
        counts = {str(k): v for k, v in debug.get_comm_counts().items()}
        results[("muon-plain", shape)] = (err, counts)
    # the float64 Gram by chunks (Note [The wide Gram by chunks]) on uneven row blocks
    # (21 rows: a different number of chunks per rank), all-reduced once
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 21, 3, dtype=torch.complex64, generator=g)
    local = torch.tensor_split(x, world, dim=-2)[rank]
    chunk, kernels.reduce.WIDE_CHUNK = kernels.reduce.WIDE_CHUNK, 4
    try:
        wide = kernels.reduce.wide_gram(local, mesh.get_group())
    finally:
        kernels.reduce.WIDE_CHUNK = chunk
    ref = x.to(torch.complex128).mH @ x.to(torch.complex128)
    results["wide_gram"] = (wide.dtype, float((wide - ref).abs().max()))
    if rank == 0:
        torch.save(results, os.path.join(out, f"dtensor_w{world}.pt"))

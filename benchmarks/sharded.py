"""Row-sharded Cayley step on St(N, 64): bytes communicated and time against gathering X.

Run from a checkout: ``python -m benchmarks.sharded`` (``--quick`` for small N;
``--sizes`` and ``--worlds`` to choose). Each world size p runs p gloo processes
on this machine, one thread each. The point X (N×M, float32) and its gradient
G are ``Shard(0)`` DTensors (FSDP2's layout); two ways to take one RGD step
with the Cayley retraction:

- ``sharded``: this package's optimizer step on the DTensor parameter: the
  kernels run on the local N/p rows and all-reduce M×M Grams only (Note
  [Row-sharded kernels] in ``stiefel.manifolds.kernels.reduce``);
- ``gather``: the anchor, all-gather X and G, take the same optimizer step on
  the whole matrix (a plain N×M parameter), keep the own rows.

Bytes are those of the collectives' tensors on one rank per step, counted by a
dispatch mode (an all-reduce of an M×M float32 Gram counts M²·4; an all-gather
of X counts its N×M output). Times are the median over repeats of the slowest
rank. The machine is shared by other jobs and has few cores: with p processes
on fewer cores the times are noisy and include time-slicing, so the byte
counts are the robust figure.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

M = 64
LR = 0.1


class _Bytes(TorchDispatchMode):
    """Sum of the tensor bytes of every collective run inside the block."""

    def __init__(self):
        super().__init__()
        self.bytes, self.calls = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        if name.startswith(("c10d::", "_c10d_functional::")) and "wait" not in name:
            flat, _ = tree_flatten((args, kwargs or {}))
            self.bytes += sum(t.numel() * t.element_size() for t in flat if torch.is_tensor(t))
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _local_point(n: int, rank: int, world: int, group):
    """This rank's rows of a point of St(n, M), orthonormalized through the Grams only."""
    from stiefel.manifolds.kernels import cholesky_qr2

    rows = n // world
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(rows, M, generator=g)
    x = cholesky_qr2(a, group)
    return x, torch.randn(rows, M, generator=g)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank
        times.append(float(t))
    return statistics.median(times)


def _run(rank: int, world: int, port: int, sizes, repeats: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
    rows_out = _measure(rank, world, sizes, repeats)
    if rank == 0:
        torch.save(rows_out, os.path.join(out, f"w{world}.pt"))
    if world > 1:
        # the meshes and DTensors of the run hold the group: collected first, while the
        # interpreter is whole (Note [Nothing of a run outlives its process group],
        # tests/distributed/_launch.py)
        gc.collect()
        dist.destroy_process_group()


def _measure(rank: int, world: int, sizes, repeats: int) -> list[tuple]:
    """The rows of one rank: (n, bytes and calls of the sharded step, bytes of the
    gather, median times of both)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from stiefel import Stiefel, optimizers

    rows_out = []
    for n in sizes:
        if world == 1:
            x, g = _local_point(n, 0, 1, None)
            p = torch.nn.Parameter(x)
        else:
            mesh = init_device_mesh("cpu", (world,))
            x, g = _local_point(n, rank, world, mesh.get_group(0))
            p = torch.nn.Parameter(DTensor.from_local(x, mesh, [Shard(0)], run_check=False))
            g = DTensor.from_local(g, mesh, [Shard(0)], run_check=False)
        opt = optimizers.create("rgd", [{"params": [p], "manifold": Stiefel(n, M)}], lr=LR)
        p.grad = g

        def sharded(opt=opt):
            opt.step()

        full = torch.nn.Parameter(torch.eye(n, M))  # overwritten by each gather
        full.grad = torch.empty(n, M)
        opt_full = optimizers.create("rgd", [{"params": [full], "manifold": Stiefel(n, M)}], lr=LR)

        def gather(x, g=p.grad, full=full, opt_full=opt_full, n=n):
            # the anchor: gather X and G, the same optimizer step on the whole matrix
            xs = x.to_local() if isinstance(x, DTensor) else x
            gs = g.to_local() if isinstance(g, DTensor) else g
            if world == 1:
                full.data.copy_(xs)
                full.grad.copy_(gs)
            else:
                dist.all_gather_into_tensor(full.data, xs.contiguous())
                dist.all_gather_into_tensor(full.grad, gs.contiguous())
            opt_full.step()
            return full.detach()[rank * (n // world) : (rank + 1) * (n // world)].clone()

        with _Bytes() as sb:
            sharded()
        with _Bytes() as gb:
            gather(p.detach())
        t_sharded = _median_time(sharded, repeats)
        t_gather = _median_time(functools.partial(gather, p.detach()), repeats)
        rows_out.append((n, sb.bytes, len(sb.calls), gb.bytes, t_sharded, t_gather))
    return rows_out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    """Parse arguments, run every world size, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in {4096, 16384}, 2 repeats")
    ap.add_argument("--sizes", type=int, nargs="*", default=[65536, 262144, 1048576])
    ap.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    sizes = [4096, 16384] if args.quick else args.sizes
    repeats = 2 if args.quick else args.repeats
    print(f"Row-sharded Cayley RGD step on St(N, {M}), float32, gloo, 1 thread per process")
    print(
        "| p | N | sharded bytes/step (collectives) | all-gather X bytes | ratio "
        "| gather X+G bytes | sharded step | gather+step | time ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for world in args.worlds:
            mp.spawn(_run, args=(world, _free_port(), sizes, repeats, out), nprocs=world)
            for n, sbytes, calls, gbytes, ts, tg in torch.load(os.path.join(out, f"w{world}.pt")):
                gather_x = n * M * 4 if world > 1 else 0
                ratio = f"1/{gather_x / sbytes:.0f}" if sbytes and gather_x else "-"
                print(
                    f"| {world} | {n} | {sbytes} ({calls}) | {gather_x} | {ratio} | {gbytes} "
                    f"| {ts * 1e3:.1f} ms | {tg * 1e3:.1f} ms | {tg / ts:.2f}× |"
                )


if __name__ == "__main__":
    main()

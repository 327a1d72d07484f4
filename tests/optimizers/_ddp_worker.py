"""The worker of test_ddp (a module of its own so that spawned processes can import it)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stiefel import optimizers, orthogonalize

N_IN, N_OUT, BATCH = 6, 16, 8


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(N_IN, N_OUT, dtype=torch.float64)
    return orthogonalize(lin, method="riemannian")  # weight: a ManifoldParameter on St(16, 6)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, N_IN, dtype=torch.float64, generator=g)
    y = torch.randn(BATCH, N_OUT, dtype=torch.float64, generator=g)
    return x, y


def loss_fn(model, x, y) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def worker(rank: int, world: int, port: int, configs: dict, steps: int, out: str):
    """Train one replica per config in ``configs`` ({name: hyper}); save each final state."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),  # fail, do not hang, if a peer dies
    )
    try:
        for name, hyper in configs.items():
            model = make_model(seed=rank)  # different on each rank: DDP broadcasts rank 0's
            ddp = DistributedDataParallel(model)
            opt = optimizers.create(name, ddp.parameters(), **hyper)
            for step in range(steps):
                x, y = batch(rank, step)
                opt.zero_grad()
                loss_fn(ddp, x, y).backward()
                opt.step()
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save(state, os.path.join(out, f"{name}_rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()

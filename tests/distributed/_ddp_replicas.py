"""DDP with the Riemannian optimizers: every rank trains one replica per config of
``CONFIGS`` and saves it (run by ``all_worker``; checked in test_ddp_replicas)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stiefel import optimizers, orthogonalize

N_IN, N_OUT, BATCH = 6, 16, 8
STEPS = 20
CONFIGS = {"rgd": dict(lr=0.05, momentum=0.5), "radam": dict(lr=0.01)}


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


def ddp_replicas_worker(rank: int, world: int, out: str) -> None:
    """Train one replica per config of ``CONFIGS``; save each final state."""
    for name, hyper in CONFIGS.items():
        model = make_model(seed=rank)  # different on each rank: DDP broadcasts rank 0's
        ddp = DistributedDataParallel(model)
        opt = optimizers.create(name, ddp.parameters(), **hyper)
        for step in range(STEPS):
            x, y = batch(rank, step)
            opt.zero_grad()
            loss_fn(ddp, x, y).backward()
            opt.step()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(out, f"ddp_{name}_w{world}_rank{rank}.pt"))
        dist.barrier()

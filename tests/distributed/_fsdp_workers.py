"""Workers of test_fsdp: a model with every registered map and a Riemannian layer, trained
single-process (the reference) or under FSDP2 / DDP with the batch split across ranks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from stiefel import optimizers, orthogonalize, parametrizations

D_IN, D_OUT, BATCH, STEPS, RESUMED = 6, 12, 8, 20, 5
LR = dict(lr=0.05, momentum=0.5)


def _map_names() -> list[str]:
    """The registered maps (the registry is the list; ``maps()`` once merged)."""
    if hasattr(parametrizations, "maps"):
        return list(parametrizations.maps())
    return [n for n in parametrizations.available() if n != "riemannian"]


class Net(nn.Module):
    """One 6×6 layer per registered map, then a Riemannian 6 → 12 layer (St(12, 6))."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        names = _map_names()
        self.names = names
        self.body = nn.ModuleList(
            orthogonalize(nn.Linear(D_IN, D_IN), method=name) for name in names
        )
        self.head = orthogonalize(nn.Linear(D_IN, D_OUT), method="riemannian")

    def forward(self, x):
        for layer in self.body:
            x = torch.tanh(layer(x))
        return self.head(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def make_optimizer(model: Net) -> torch.optim.Optimizer:
    """rgd on everything; the head's weight named a Stiefel parameter by its group.

    FSDP2 replaces the head's ManifoldParameter by a plain DTensor Parameter, so the
    manifold travels in the param group (``manifold=``), which works either way.
    """
    head_w = model.head.weight
    manifold = parametrizations.manifold_for((D_OUT, D_IN), False)
    rest = [p for p in model.parameters() if p is not head_w]
    return optimizers.create(
        "rgd", [{"params": rest}, {"params": [head_w], "manifold": manifold}], **LR
    )


def train(model: nn.Module, opt, rank=0, world=1, steps=range(STEPS)) -> list[float]:
    """The global batch of each step split across ranks; each rank's loss is its mean."""
    losses = []
    share = BATCH // world
    for step in steps:
        x, y = batch(step)
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().clone()
    return out


def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single process: the state after STEPS steps and after STEPS + RESUMED steps."""
    model = Net(seed=0)
    opt = make_optimizer(model)
    train(model, opt)
    first = full_state(model)
    train(model, opt, steps=range(STEPS, STEPS + RESUMED))
    return first, full_state(model)


def _sharded_net():
    from torch.distributed.fsdp import fully_shard

    model = Net(seed=0)
    for layer in [*model.body, model.head]:
        fully_shard(layer)
    fully_shard(model)
    return model


def fsdp_worker(rank: int, world: int, out: str, save: str | None, load: str | None) -> None:
    """FSDP2 training; ``save``: write a sharded checkpoint (model and optimizer) after
    STEPS steps; ``load``: start from that checkpoint (written by another world size)
    and train RESUMED more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _sharded_net()
    opt = make_optimizer(model)
    if load is None:
        train(model, opt, rank, world)
        tag = f"fsdp_w{world}"
    else:
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.load(state, checkpoint_id=load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        loaded = full_state(model)
        if rank == 0:
            torch.save(loaded, os.path.join(out, f"loaded_w{world}.pt"))
        train(model, opt, rank, world, steps=range(STEPS, STEPS + RESUMED))
        tag = f"resumed_w{world}"
    if save is not None:
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.save(state, checkpoint_id=save)
    final = full_state(model)
    if rank == 0:
        torch.save(final, os.path.join(out, f"{tag}.pt"))
    dist.barrier()


def ddp_worker(rank: int, world: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = Net(seed=0)
    ddp = DistributedDataParallel(model)
    train(ddp, make_optimizer(model), rank, world)
    torch.save(full_state(model), os.path.join(out, f"ddp_w{world}_rank{rank}.pt"))
    dist.barrier()

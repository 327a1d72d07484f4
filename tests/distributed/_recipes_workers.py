"""Workers of test_recipes: FSDP2's own recipes on a model with a Riemannian layer and
every map, with no extra line for the manifold (Note [The manifold lives on the module])."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _fsdp_workers import LR, Net, full_state, train
from torch import nn

from stiefel import optimizers


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in [*model.body, model.head]:
        fully_shard(layer)
    fully_shard(model)
    return model


def plain_list_worker(rank: int, world: int, out: str) -> None:
    """fully_shard, then the optimizer from ``model.parameters()`` (a bare list) and from
    the model itself: both step the head on its manifold, as the single process does."""
    for how in ("parameters", "model"):
        model = _shard(Net(seed=0))
        params = model.parameters() if how == "parameters" else model
        train(model, optimizers.create("rgd", params, **LR), rank, world)
        final = full_state(model)
        if rank == 0:
            torch.save(final, os.path.join(out, f"recipe_{how}_w{world}.pt"))
    dist.barrier()


def one_step_without_forward(model: nn.Module) -> dict[str, torch.Tensor]:
    """The optimizer from ``model.parameters()`` and one step of hand-set gradients (all
    ones, on every rank's shard alike), no forward before it: the state after it."""
    opt = optimizers.create("rgd", model.parameters(), **LR)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return full_state(model)


def no_forward_worker(rank: int, world: int, out: str) -> None:
    """fully_shard, then a step before any forward (Note [A rebuilt weight stepped before
    any forward]): the head is stepped on its manifold, as the single process does."""
    final = one_step_without_forward(_shard(Net(seed=0)))
    if rank == 0:
        torch.save(final, os.path.join(out, f"no_forward_w{world}.pt"))
    dist.barrier()


def _reset_all(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def meta_init_worker(rank: int, world: int, out: str) -> None:
    """FSDP2's deferred-init recipe: build on meta, shard, to_empty, reset_parameters."""
    with torch.device("meta"):
        model = Net(seed=0)
    _shard(model)
    model.to_empty(device="cpu")
    # on a CPU mesh every rank draws its shard from its own generator: seeded alike,
    # the ranks would write the same rows (a rank-deficient weight, refused)
    torch.manual_seed(rank)
    _reset_all(model)
    train(model, optimizers.create("rgd", model.parameters(), **LR), rank, world, range(3))
    state = full_state(model)
    if rank == 0:
        torch.save(state, os.path.join(out, f"meta_w{world}.pt"))
    dist.barrier()

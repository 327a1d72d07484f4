"""Worker of test_validity_fsdp: a parametrized weight read after ``fully_shard`` (outside the
forward) is refused with "call unshard() first", and read after ``unshard()`` it is the weight
of the same model never sharded."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from stiefel import orthogonalize

N = 8


def model(seed: int = 0) -> nn.Sequential:
    """Two 8×8 layers: a ``cwy`` map (its ``signs`` buffer is local) and an ``exp`` map."""
    torch.manual_seed(seed)
    return nn.Sequential(
        orthogonalize(nn.Linear(N, N), method="cwy"),
        orthogonalize(nn.Linear(N, N), method="exp"),
    )


def read_sharded_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    net = model()
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    refused, read = [], []
    for layer in net:
        try:
            layer.weight  # noqa: B018 (the read itself is what is tested)
        except Exception as err:  # the message is what the test checks
            refused.append(f"{type(err).__name__}: {err}")
        else:
            refused.append("")
        layer.unshard()
        read.append(layer.weight.detach().clone())
        layer.reshard()
    # the model still runs and trains after the reads (one forward/backward)
    net(torch.randn(3, N)).square().sum().backward()
    if rank == 0:
        torch.save({"refused": refused, "read": read}, os.path.join(out, "read_sharded.pt"))
    dist.barrier()

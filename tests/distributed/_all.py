"""One launch per world size runs every distributed scenario (process start-up dominates)."""

from __future__ import annotations

import os

from _ddp_replicas import ddp_replicas_worker
from _dtensor_workers import dtensor_worker
from _fsdp_workers import ddp_worker, fsdp_worker
from _recipes_workers import meta_init_worker, no_forward_worker, plain_list_worker


def all_worker(rank: int, world: int, out: str, save: bool, load: str | None) -> None:
    dtensor_worker(rank, world, out)
    fsdp_worker(rank, world, out, os.path.join(out, "ckpt") if save else None, None)
    if load is not None:
        fsdp_worker(rank, world, out, None, load)
    ddp_worker(rank, world, out)
    ddp_replicas_worker(rank, world, out)
    plain_list_worker(rank, world, out)
    no_forward_worker(rank, world, out)
    meta_init_worker(rank, world, out)

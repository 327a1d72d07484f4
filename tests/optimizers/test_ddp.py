"""DDP, gloo backend, 2 processes on localhost: replicas stay identical and orthogonal."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ddp_worker import batch, loss_fn, make_model, worker

from stiefel import optimizers

WORLD, STEPS = 2, 20
CONFIGS = {"rgd": dict(lr=0.05, momentum=0.5), "radam": dict(lr=0.01)}

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(name: str) -> dict[str, torch.Tensor]:
    """One process on both ranks' batches: DDP averages the ranks' gradients."""
    model = make_model(seed=0)
    opt = optimizers.create(name, model.parameters(), **CONFIGS[name])
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(loss_fn(model, *batch(rank, step)) for rank in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
    return model.state_dict()


def test_ddp_replicas_stay_identical_and_orthogonal(tmp_path):
    mp.spawn(
        worker, args=(WORLD, _free_port(), CONFIGS, STEPS, str(tmp_path)), nprocs=WORLD, join=True
    )
    for name in CONFIGS:
        reps = [
            torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=True) for r in range(WORLD)
        ]
        ref = _reference(name)
        start = make_model(seed=0).state_dict()
        for key in ("weight", "bias"):
            assert torch.equal(reps[0][key], reps[1][key]), (name, key)
            assert (reps[0][key] - ref[key]).abs().max() < 1e-12, (name, key)
            assert (reps[0][key] - start[key]).abs().max() > 1e-2, (name, key)  # it trained
        w = reps[0]["weight"].numpy()
        assert np.linalg.norm(w.T @ w - np.eye(w.shape[1])) < 1e-13, name

"""DDP, gloo, 2 and 4 processes on localhost: replicas stay identical and orthogonal,
and equal one process that averages the ranks' gradients (runs: the ``runs`` fixture)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ddp_replicas import CONFIGS, STEPS, batch, loss_fn, make_model

from stiefel import optimizers


def _reference(name: str, world: int) -> dict[str, torch.Tensor]:
    """One process on every rank's batches: DDP averages the ranks' gradients."""
    model = make_model(seed=0)
    opt = optimizers.create(name, model.parameters(), **CONFIGS[name])
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(loss_fn(model, *batch(rank, step)) for rank in range(world)) / world
        loss.backward()
        opt.step()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ddp_replicas_stay_identical_and_orthogonal(runs, world, name):
    reps = [
        torch.load(runs[world] / f"ddp_{name}_w{world}_rank{r}.pt", weights_only=True)
        for r in range(world)
    ]
    ref = _reference(name, world)
    start = make_model(seed=0).state_dict()
    for key in ("weight", "bias"):
        for rep in reps[1:]:
            assert torch.equal(reps[0][key], rep[key]), key
        assert (reps[0][key] - ref[key]).abs().max() < 1e-12, key
        assert (reps[0][key] - start[key]).abs().max() > 1e-2, key  # it trained
    w = reps[0]["weight"].numpy()
    assert np.linalg.norm(w.T @ w - np.eye(w.shape[1])) < 1e-13

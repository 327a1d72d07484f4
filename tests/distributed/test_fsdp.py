"""FSDP2 and DDP training of a model with every registered map and a Riemannian layer
(gloo, CPU): equal to the single-process run, orthogonal, resharded checkpoints."""

from __future__ import annotations

import pytest
import torch
from _fsdp_workers import Net, reference
from torch.nn.utils import parametrize

WORLDS = (2, 4)


@pytest.fixture(scope="module")
def ref():
    return reference()


def _rel(a: dict, b: dict) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b}


def _weights(state: dict) -> list[torch.Tensor]:
    model = Net(seed=0)
    model.load_state_dict(state)
    with torch.no_grad():
        return [layer.weight.double() for layer in [*model.body, model.head]]


def _assert_close(got: dict, want: dict, what: str) -> None:
    rel = _rel(got, want)
    assert max(rel.values()) < 1e-5, (what, {k: v for k, v in rel.items() if v >= 1e-5})


def _assert_orthogonal(state: dict) -> None:
    for w in _weights(state):
        q = w if w.shape[0] >= w.shape[1] else w.T
        err = torch.linalg.matrix_norm(q.T @ q - torch.eye(q.shape[1], dtype=q.dtype))
        assert err < 10 * q.shape[1] * torch.finfo(torch.float32).eps, float(err)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_training_equals_single_process(runs, ref, world):
    got = torch.load(runs[world] / f"fsdp_w{world}.pt", weights_only=True)
    _assert_close(got, ref[0], f"fsdp world {world}")
    start = Net(seed=0).state_dict()
    assert (got["head.weight"] - start["head.weight"]).abs().max() > 1e-3  # it trained
    _assert_orthogonal(got)


@pytest.mark.slow
def test_sharded_checkpoint_loads_into_another_world_size(runs, ref):
    saved = torch.load(runs[2] / "fsdp_w2.pt", weights_only=True)
    loaded = torch.load(runs[4] / "loaded_w4.pt", weights_only=True)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    # the optimizer state (momentum buffers) came along: resuming equals not stopping
    resumed = torch.load(runs[4] / "resumed_w4.pt", weights_only=True)
    _assert_close(resumed, ref[1], "resumed at world 4 from world 2")
    _assert_orthogonal(resumed)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_ddp_training_equals_single_process(runs, ref, world):
    reps = [
        torch.load(runs[world] / f"ddp_w{world}_rank{r}.pt", weights_only=True)
        for r in range(world)
    ]
    for rep in reps[1:]:
        for k in rep:
            assert torch.equal(rep[k], reps[0][k]), k
    _assert_close(reps[0], ref[0], f"ddp world {world}")
    _assert_orthogonal(reps[0])


def test_every_registered_map_is_in_the_model():
    from _fsdp_workers import _map_names

    model = Net(seed=0)
    assert len(model.body) == len(_map_names()) > 0
    assert all(parametrize.is_parametrized(layer, "weight") for layer in model.body)

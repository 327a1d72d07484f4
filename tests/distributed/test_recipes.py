"""FSDP2's own recipes keep every constraint: a Riemannian weight after fully_shard is
stepped on its manifold with the optimizer built from ``model.parameters()`` or from the
model, also when its first step comes before any forward; deferred init (meta, to_empty,
reset_parameters) gives points of the manifolds."""

from __future__ import annotations

import pytest
import torch
from _fsdp_workers import reference
from test_fsdp import _assert_close, _assert_orthogonal

WORLDS = (2, 4)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["parameters", "model"])
@pytest.mark.parametrize("world", WORLDS)
def test_fully_shard_keeps_the_manifold_without_a_param_group(runs, ref, world, how):
    got = torch.load(runs[world] / f"recipe_{how}_w{world}.pt", weights_only=True)
    _assert_close(got, ref[0], f"fsdp world {world}, optimizer from model.{how}")
    _assert_orthogonal(got)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_a_step_before_any_forward_after_fully_shard_keeps_the_manifold(runs, world):
    """Gradients set by hand, no forward: the rebuilt DTensor head is stepped as the
    never-sharded model's is (a Euclidean step would differ by about 0.1)."""
    from _fsdp_workers import Net
    from _recipes_workers import one_step_without_forward

    got = torch.load(runs[world] / f"no_forward_w{world}.pt", weights_only=True)
    want = one_step_without_forward(Net(seed=0))
    _assert_close(got, want, f"fsdp world {world}, a step before any forward")
    _assert_orthogonal(got)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_meta_init_by_torch_recipe_gives_points_of_the_manifolds(runs, world):
    got = torch.load(runs[world] / f"meta_w{world}.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in got.values())
    _assert_orthogonal(got)  # every map's weight and the Riemannian head

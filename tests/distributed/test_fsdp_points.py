"""Manifold points under FSDP2 and row sharding (gloo, CPU, world 2), against the same runs
in one process: a ManifoldParameter made by hand keeps its manifold through ``fully_shard``;
geoopt's optimizers refuse the sharded points they would step as Euclidean tensors; an
optimizer built before ``fully_shard`` is warned about; a row-sharded point of which one
rank holds no row is stepped by every optimizer (radam once hung there)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)

WORLD = 2


def _launched(tmp_path_factory, name: str, worker) -> dict:
    """What ``worker`` saved as ``<name>.pt``, run on WORLD gloo processes."""
    from _launch import launch

    out = tmp_path_factory.mktemp(name)
    launch(worker, WORLD, out, timeout=900)
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    from _points_workers import points_worker

    return _launched(tmp_path_factory, "points", points_worker)


@pytest.mark.slow
@pytest.mark.parametrize("given", ["model", "parameters"])
@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_a_hand_made_manifold_parameter_is_stepped_on_its_manifold_after_fully_shard(
    points, name, given
):
    from _points_workers import hand_made

    got, want = points["hand_made"][f"{name}-{given}"], hand_made(name, given)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    err = torch.linalg.matrix_norm(got.T @ got - torch.eye(got.shape[1], dtype=got.dtype))
    assert float(err) < 1e-12


@pytest.mark.slow
def test_geoopts_optimizers_refuse_a_sharded_point_and_write_nothing(points):
    got = points["geoopt"]
    for key in ("geoopt_rsgd", "geoopt_radam", "direct"):
        message = got[key]
        assert "parameter 0 of param group 0 (shape (8, 3))" in message, (key, message)
        assert "not a geoopt.ManifoldParameter (a DTensor" in message, (key, message)
        assert "stiefel.optimizers.create('rgd'" in message, (key, message)
    assert got["unchanged"]


@pytest.mark.slow
def test_a_step_of_an_optimizer_built_before_fully_shard_warns(points):
    found = [m for m in points["before"] if "replaced by fully_shard" in m]
    assert found and found[0].startswith("UserWarning"), points["before"]
    assert "Build the optimizer after fully_shard" in found[0]


@pytest.fixture(scope="module")
def empty_shard(tmp_path_factory):
    from _points_workers import empty_shard_worker

    return _launched(tmp_path_factory, "empty_shard", empty_shard_worker)


@pytest.mark.slow
def test_a_row_sharded_point_with_an_empty_shard_steps_as_in_one_process(empty_shard):
    from _points_workers import NAMES, SHAPES, one_by_one, row_sharded

    for name in NAMES:
        for n, m in SHAPES:
            got, want = empty_shard[(name, n, m)], row_sharded(name, n, m)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"{name} St({n}, {m})")
    torch.testing.assert_close(empty_shard["fsdp"], one_by_one(), rtol=0, atol=1e-12)

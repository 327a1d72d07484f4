"""Riemannian optimizers on DTensor points (gloo, CPU, 2 and 4 processes).

Row-sharded (Shard(0) of St(N, M)): the step equals the single-process step, issues
no all-gather and all-reduces O(M²) bytes independent of N. Replicate and batch-sharded
points: no communication but the step's agreement flag.
"""

from __future__ import annotations

import pytest
import torch
from _dtensor_workers import CONFIGS, M

WORLDS = (2, 4)
F64 = 8  # bytes per float64
LABELS = [c[0] for c in CONFIGS]


def _results(runs, world):
    return torch.load(runs[world] / f"dtensor_w{world}.pt", weights_only=False)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("label", LABELS)
def test_row_sharded_step_equals_plain_step(runs, world, label):
    res = _results(runs, world)
    for n in (64, 256):
        err, _, _ = res[(label, "rows", n)]
        assert err < 50 * n * torch.finfo(torch.float64).eps, (label, n, err)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("label", LABELS)
def test_row_sharded_step_all_reduces_gram_only(runs, world, label):
    res = _results(runs, world)
    (_, c64, b64), (_, c256, b256) = res[(label, "rows", 64)], res[(label, "rows", 256)]
    for counts in (c64, c256):
        assert set(counts) <= {"c10d.allreduce_"}, counts  # no all-gather, no scatter
    assert c64 == c256 and b64 == b256, (c64, c256, b64, b256)  # independent of N
    # a few M×M Grams (XᴴX, XᴴG, PdᴴPd, ...) plus a one-byte flag; an all-gather of
    # X alone would move N·M·8 = 8 KiB at N = 256
    assert b64 <= 8 * M * M * F64 + 8, b64
    assert b256 < 256 * M * F64 / 4


@pytest.mark.parametrize("kind", ["replicate", "batch"])
def test_replicated_and_batch_sharded_points(runs, kind):
    res = _results(runs, 2)
    for label in LABELS:
        err, counts, nbytes = res[(label, kind, 40)]
        assert err < 50 * 40 * torch.finfo(torch.float64).eps, (label, err)
        assert nbytes <= 8, (label, counts, nbytes)  # the agreement flag only


def test_rule_without_sharded_kernels_refuses_dtensor_points(runs):
    msg = _results(runs, 2)["muon"]
    assert "ManifoldMuon" in msg and "DTensor" in msg, msg
    assert "rgd" in msg and "radam" in msg and "landing" in msg, msg  # from the registry


@pytest.mark.parametrize("world", WORLDS)
def test_unsupported_placement_is_refused(runs, world):
    msg = _results(runs, world)["shard1"]
    assert "Shard(dim=1)" in msg and "not supported" in msg, msg
    assert "Replicate()" in msg and "Shard(ndim - 2)" in msg, msg

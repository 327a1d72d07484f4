"""Riemannian optimizers on DTensor points (gloo, CPU, 2 and 4 processes).

Every rule of CONFIGS (rgd with each retraction, radam, landing, a plugin,
manifold_muon, pogo). Row-sharded (Shard(0) of St(N, M)): the step equals the
single-process step, issues no all-gather and all-reduces O(M²) bytes independent of
N, also with fewer local rows than columns. Replicate and batch-sharded points: no
communication but the step's agreement flag.
"""

from __future__ import annotations

import pytest
import torch
from _dtensor_workers import CONFIGS, FEW_ROWS, GRAMS, M

WORLDS = (2, 4)
F64 = 8  # bytes per float64
LABELS = [c[0] for c in CONFIGS]


def _results(runs, world):
    return torch.load(runs[world] / f"dtensor_w{world}.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("label", LABELS)
def test_row_sharded_step_equals_plain_step(runs, world, label):
    res = _results(runs, world)
    for n in (64, 256):
        err, _, _ = res[(label, "rows", n)]
        assert err < 50 * n * torch.finfo(torch.float64).eps, (label, n, err)


@pytest.mark.slow
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
    assert b64 <= GRAMS.get(label, 8) * M * M * F64 + 8, b64
    assert b256 < 256 * M * F64 / (1 if label in GRAMS else 4)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_wide_gram_by_chunks_of_uneven_row_blocks(runs, world):
    # every rank widens its own rows by chunks (a different count per rank) and the
    # ranks all-reduce the float64 sums once: the Gram of the whole matrix
    dtype, err = _results(runs, world)["wide_gram"]
    assert dtype == torch.complex128
    assert err < 10 * 21 * torch.finfo(torch.float64).eps * 21, err


@pytest.mark.slow
@pytest.mark.parametrize("label", LABELS)
def test_fewer_local_rows_than_columns(runs, label):
    # St(8, 4) and O(8) row-sharded over 4 ranks: 2 rows per rank, fewer than M; St(6, 4)
    # and O(3): one rank holds no rows (its step failed on reshaping an empty shard)
    res = _results(runs, 4)
    for shape in FEW_ROWS:
        err, counts = res[(label, "few-rows", shape)]
        assert err < 50 * shape[0] * torch.finfo(torch.float64).eps, (label, shape, err)
        assert set(counts) <= {"c10d.allreduce_"}, counts


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicate", "batch"])
def test_replicated_and_batch_sharded_points(runs, kind):
    res = _results(runs, 2)
    for label in LABELS:
        err, counts, nbytes = res[(label, kind, 40)]
        assert err < 50 * 40 * torch.finfo(torch.float64).eps, (label, err)
        assert nbytes <= 8, (label, counts, nbytes)  # the agreement flag only


@pytest.mark.slow
def test_rule_without_sharded_kernels_refuses_dtensor_points(runs):
    msg = _results(runs, 2)["refusing"]
    assert "Refusing" in msg and "DTensor" in msg, msg
    for name in ("rgd", "radam", "landing", "manifold_muon", "pogo"):  # from the registry
        assert name in msg, msg


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_exact_msign_refuses_row_sharded_points(runs, world):
    msg = _results(runs, world)["muon-svd"]
    assert "msign='svd'" in msg and "row-sharded" in msg, msg
    assert "'polar_express'" in msg and "Replicate()" in msg, msg


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_muon_on_row_sharded_plain_weights(runs, world):
    # a plain 2-D weight (no manifold) with FSDP2's Shard(0): Muon's msign on the
    # local rows, M×M Grams all-reduced, no all-gather (DTensor's propagation gathers)
    res = _results(runs, world)
    for shape in ((64, M), (2 * world, 16)):
        err, counts = res[("muon-plain", shape)]
        assert err < 50 * max(shape) * torch.finfo(torch.float64).eps, (shape, err)
        assert set(counts) <= {"c10d.allreduce_"}, (shape, counts)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicate", "batch"])
def test_exact_msign_on_replicated_and_batch_sharded_points(runs, kind):
    err, nbytes = _results(runs, 2)[("muon-svd", kind)]
    assert err < 50 * 40 * torch.finfo(torch.float64).eps, err
    assert nbytes <= 8, nbytes


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_unsupported_placement_is_refused(runs, world):
    msg = _results(runs, world)["shard1"]
    assert "Shard(dim=1)" in msg and "not supported" in msg, msg
    assert "Replicate()" in msg and "Shard(ndim - 2)" in msg, msg
    for key in ("pogo-square", "pogo-wide"):  # the transpose of a row-sharded plain matrix
        msg = _results(runs, world)[key]
        assert "not supported" in msg and "transpose" in msg and "Orthogonal(n)" in msg, msg

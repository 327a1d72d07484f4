"""The roofline: the bytes models of every map and step, the measured bandwidth, and
time / max(FLOPs / GEMM rate, bytes / bandwidth) against hand values."""

import math

import pytest
import torch

from stiefel import optimizers, parametrizations
from stiefel.comparisons import cost
from stiefel.optimizers import registry
from stiefel.parametrizations import OrthogonalMap

#: (n, m, L) at which every model is read: square and tall, L below, at and above a block
SHAPES = [(8, 8, 8), (64, 16, 5), (300, 40, 200), (4096, 64, 64)]


def test_roofline_against_hand_values():
    # 1e9 FLOPs at 1e10 FLOP/s = 0.1 s; 4e8 bytes at 1e9 B/s = 0.4 s: bytes-bound
    assert cost.roofline(1e9, 1e10, 4e8, 1e9) == (pytest.approx(0.4), "bytes")
    assert cost.roofline(1e9, 1e10, 4e7, 1e9) == (pytest.approx(0.1), "flops")
    assert cost.roofline_multiple(0.8, 1e9, 1e10, 4e8, 1e9) == pytest.approx(2.0)
    assert cost.roofline_multiple(0.3, 1e9, 1e10, 4e7, 1e9) == pytest.approx(3.0)
    # the FLOP-only multiple is the same formula without the bytes term
    assert cost.roofline_multiple(0.3, 1e9, 1e10) == pytest.approx(3.0)
    assert cost.roofline(1e9, 1e10) == (pytest.approx(0.1), "flops")
    # a missing model (NaN or <= 0) leaves nothing to divide by
    for flops, nbytes in ((math.nan, 4e8), (1e9, math.nan), (0.0, 4e8), (1e9, 0.0)):
        assert math.isnan(cost.roofline_multiple(0.3, flops, 1e10, nbytes, 1e9))
        assert cost.roofline(flops, 1e10, nbytes, 1e9)[1] == "–"
    assert math.isnan(cost.roofline_multiple(0.3, -1.0, 1e10))


def _map_args(cls, n: int, m: int, L: int) -> tuple:
    return (n, m, L if cls.takes_reflections() else None)


@pytest.mark.parametrize("name", list(parametrizations.maps()))
def test_every_map_declares_a_finite_bytes_model(name):
    cls = parametrizations.maps()[name]
    for n, m, L in SHAPES:
        args = _map_args(cls, n, m, L)
        b4, b8 = cls.bytes(*args, itemsize=4), cls.bytes(*args, itemsize=8)
        # at least the n×m result is written; the model is in bytes of the given dtype
        assert math.isfinite(b4) and b4 >= n * m * 4, (n, m, L, b4)
        assert b8 == pytest.approx(2 * b4)
        assert cost.map_bytes(name, *args, 4) == b4


def test_map_bytes_models_against_their_formulas():
    n, m, L, s = 300, 40, 200, 4
    maps = parametrizations.maps()
    # Note [Block size]: blocks of m/2 reflections, clamped to [64, 256]
    for rows, cols, length, sizes in (
        (n, m, L, [64, 64, 64, 8]),
        (1024, 1024, 775, [256, 256, 256, 7]),
        (1024, 300, 1000, [150] * 6 + [100]),
    ):
        assert sum(sizes) == length
        model = (len(sizes) * 3 * rows * cols + rows * length + 4 * length * cols) * s
        assert maps["householder"].bytes(rows, cols, length, s) == model
        # Note [Householder FLOPs]: two thin products, a Gram and a solve per block
        flops = 4 * rows * cols * length + (2 * rows + cols) * sum(b * b for b in sizes)
        assert maps["householder"].flops(rows, cols, length) == flops
    assert maps["cwy"].bytes(n, m, L, s) == (3 * n * L + n * m + 2 * L * L + 2 * L * m) * s
    assert maps["tcwy"].bytes(n, m, L, s) == maps["cwy"].bytes(n, m, L, s)
    assert maps["cayley"].bytes(n, m, None, s) == (8 * n * n + 9 * n * m) * s
    assert maps["scaled_cayley"].bytes(n, m, None, s) == maps["cayley"].bytes(n, m, None, s)
    assert maps["exp"].bytes(n, m, None, s) == (39 * n * n + 2 * n * m) * s


def test_default_map_model_is_its_note():
    class Undeclared(OrthogonalMap):  # declares no bytes: Note [Bytes model]'s default
        pass

    for n, m, _ in SHAPES:
        # read the n×m original, write the n×m result
        assert Undeclared.bytes(n, m, None, 2) == 2 * n * m * 2
    assert parametrizations.ManifoldPoint.bytes(64, 8) == 0.0  # the identity moves nothing


def test_every_riemannian_step_declares_a_finite_bytes_model():
    steps = cost.optimizer_steps()
    assert steps  # read from the registry, every variant
    for label, (info, variant) in steps.items():
        for n, m, _ in SHAPES:
            b4 = info.bytes(n, m, 4, **variant)
            # any step reads X and G and writes X
            assert math.isfinite(b4) and b4 >= 3 * n * m * 4, (label, n, m, b4)
            assert info.bytes(n, m, 8, **variant) == pytest.approx(2 * b4)


class _Undeclared(torch.optim.SGD):
    pass


def test_default_step_model_is_its_note():
    saved = registry.OPTIMIZERS.snapshot()
    try:
        optimizers.register("undeclared_bytes", riemannian=True)(_Undeclared)
        info = optimizers.info("undeclared_bytes")
        # Note [Bytes model of a step]: read X, G and one N×M state, write X and the state
        assert info.bytes(4096, 64, 4) == 5 * 4096 * 64 * 4
        assert info.step_bytes is registry.DEFAULT_STEP_BYTES
        optimizers.register("declared_bytes", step_bytes=registry.Passes(1, 1))(_Undeclared)
        assert optimizers.info("declared_bytes").bytes(10, 3, 8) == 2 * 10 * 3 * 8
    finally:
        registry.OPTIMIZERS.restore(saved)
    assert registry.Passes(reads=4, writes=1)(100, 7, 2) == 5 * 100 * 7 * 2


def test_stream_bandwidth_is_positive_and_finite():
    bw = cost.stream_bandwidth(mib=1, repeats=2)
    assert math.isfinite(bw) and bw > 0

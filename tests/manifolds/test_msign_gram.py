"""msign's Gram engine (`stiefel.manifolds.kernels.polynomial_sign`) against the SVD and peers.

References: the exact polar factor U Vᴴ by a float64 SVD, the direct engine (the same
polynomials, X re-formed every step), and the gram-newton-schulz package's own Gram
iteration run on the same input.
"""

from __future__ import annotations

import types

import pytest
import torch
from _spectra import spectrum as _spectrum

from stiefel.manifolds.kernels import msign, msign_flops
from stiefel.manifolds.kernels.msign import MSIGN_ENGINES
from stiefel.manifolds.kernels.polynomial_sign import engine_flops, iterate


def _exact(g: torch.Tensor) -> torch.Tensor:
    # U Vᴴ by a float64 (complex128) SVD, independent of msign
    wide = torch.complex128 if g.is_complex() else torch.float64
    u, _, vh = torch.linalg.svd(g.to(wide), full_matrices=False)
    return u @ vh


def _error(q: torch.Tensor, g: torch.Tensor) -> float:
    exact = _exact(g)
    return float(torch.linalg.matrix_norm(q.to(exact.dtype) - exact, 2).max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape", [(60, 12), (12, 60), (3, 40, 8), (2, 8, 40)])
def test_gram_engine_converges_to_the_svd_polar_factor(dtype, shape):
    *batch, n, m = shape
    g = _spectrum(n, m, 50.0, dtype, tuple(batch))
    q = msign(g, "polar_express", 12, engine="gram")
    assert q.shape == g.shape and q.dtype == dtype
    assert _error(q, g) < 100 * max(n, m) * torch.finfo(torch.float64).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (3, 96, 24)])
@pytest.mark.parametrize("kind", ["gauss", "kappa1e3"])
def test_gram_engine_in_float32_is_as_accurate_as_the_direct_one(dtype, shape, kind):
    # Note [Restart every third step]: at equal steps, against the float64 SVD
    *batch, n, m = shape
    wide = torch.complex128 if dtype.is_complex else torch.float64
    if kind == "gauss":
        g = torch.randn(shape, dtype=wide, generator=torch.Generator().manual_seed(0))
    else:
        g = _spectrum(n, m, 1e3, wide, tuple(batch))
    for steps in (5, 10):
        direct = _error(msign(g.to(dtype), "polar_express", steps, engine="direct"), g)
        gram = _error(msign(g.to(dtype), "polar_express", steps, engine="gram"), g)
        assert gram <= 4 * direct + 1e-6, (steps, gram, direct)
    assert gram < 10 * max(n, m) * torch.finfo(torch.float32).eps  # ten steps: converged


def _package_gram_float32():
    """gram-newton-schulz's own pure-torch Gram iteration, run in float32.

    The package casts X to float16 before iterating (for its GPU kernels); its
    function is rebuilt with that dtype name bound to float32, nothing else changed.
    """
    gns = pytest.importorskip("gram_newton_schulz.gram_newton_schulz")

    class _Float32Torch:
        float16 = torch.float32

        def __getattr__(self, name):
            return getattr(torch, name)

    make = gns._make_compiled_gram
    glob = {**make.__globals__, "torch": _Float32Torch()}
    rebuilt = types.FunctionType(make.__code__, glob, make.__name__, make.__defaults__)
    pkg = pytest.importorskip("gram_newton_schulz")
    coefficients = [tuple(c) for c in pkg.POLAR_EXPRESS_COEFFICIENTS]
    return rebuilt(gns._TORCH_BACKEND, coefficients, [2], 0.0, None), coefficients


@pytest.mark.parametrize("shape", [(192, 48), (48, 192)])
def test_gram_engine_equals_gram_newton_schulz_package(shape):
    theirs, coefficients = _package_gram_float32()
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    want = theirs(g.unsqueeze(0))[0]
    tall = g if shape[0] >= shape[1] else g.mT
    ours = iterate(tall, coefficients, 1.0, "gram")
    ours = ours if shape[0] >= shape[1] else ours.mT
    # the same polynomials; restarts at 2 (theirs) and 3 (ours) differ only by rounding
    assert float((ours - want).abs().max()) < 1e-4
    # and the package's five steps are as far from U Vᴴ as our Polar Express's five
    ref = _error(want, g.double())
    assert abs(_error(msign(g, "polar_express", 5), g.double()) - ref) < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(40, 6), (6, 40)])
def test_rank_deficient_input_stays_finite_and_exact_on_its_range(dtype, shape):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(shape[0], 2, dtype=torch.float64, generator=gen)
    g = a @ torch.randn(2, shape[1], dtype=torch.float64, generator=gen)  # rank 2
    q = msign(g.to(dtype), "polar_express", 12, engine="gram")
    assert torch.isfinite(q).all()
    exact = msign(g, "svd")
    tol = 10 * max(shape) * torch.finfo(dtype).eps ** 0.5 if dtype == torch.float32 else 1e-10
    assert float((q.double() - exact).abs().max()) < tol
    assert torch.equal(msign(torch.zeros(shape, dtype=dtype), engine="gram"), torch.zeros(shape))


@pytest.mark.parametrize("scale", [1e30, 1e-30])
def test_gram_engine_at_any_scale(scale):
    g = torch.randn(96, 16, generator=torch.Generator().manual_seed(3))
    want = msign(g, "polar_express", engine="gram")
    got = msign(g * scale, "polar_express", engine="gram")
    assert torch.isfinite(got).all()
    assert float((got - want).abs().max()) < 10 * 96 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("method", ["newton_schulz", "newton_schulz_cubic", "polar_express"])
@pytest.mark.parametrize("shape", [(100, 10), (10, 100), (15, 10), (32, 32)])
def test_auto_takes_the_engine_of_fewer_flops(method, shape):
    n, m = shape
    steps = {"newton_schulz": 5, "newton_schulz_cubic": 30, "polar_express": 10}[method]
    costs = {e: msign_flops(n, m, method, steps, engine=e) for e in ("direct", "gram")}
    cheaper = min(costs, key=costs.get)
    assert msign_flops(n, m, method, steps) == costs[cheaper]
    assert cheaper == ("gram" if max(shape) > 1.5 * min(shape) else "direct")
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert torch.equal(msign(g, method, steps), msign(g, method, steps, engine=cheaper))


def test_gram_flops_count_products():
    # 100×10, five quintic steps, one restart: N×M products at the start, the restart
    # (two) and the end, 2·100·10² each; M×M products 5 (R²) + 3·(5 − 1 − 1), 2·10³ each
    assert engine_flops(100, 10, 5, True, "gram") == 4 * 2e4 + 14 * 2e3 + 2e3
    assert engine_flops(100, 10, 5, True, "direct") == 5 * (4e4 + 2e3) + 2e3
    assert msign_flops(10, 100, "polar_express", 5, engine="gram") == 110_000.0


def test_bad_engine():
    with pytest.raises(ValueError, match="engine='qr'.*auto, direct, gram"):
        msign(torch.randn(5, 3), engine="qr")
    with pytest.raises(ValueError, match="engine='qr'"):
        msign_flops(5, 3, engine="qr")
    assert MSIGN_ENGINES == ("auto", "direct", "gram")


def _ops(fn) -> int:
    from stiefel.benchmarks.launch import StepCounter  # a dispatch mode, written once

    with StepCounter() as count:
        fn()
    return count.ops


@pytest.mark.parametrize("quintic", [True, False])
def test_a_gram_step_between_restarts_is_four_ops(quintic):
    # Note [The identity term as a scale]: V, Q ← aQ + QV, RW = aR + RV, W(RW) = a(RW) + V(RW)
    # (a cubic's V is a scaling, not a product); the 8th step is one between restarts and
    # makes the 7th (the first after a restart, W formed whole) update R: 2 + 2 ops
    x = torch.randn(3, 40, 8, dtype=torch.float64)
    coefficient = (1.875, -1.25, 0.375) if quintic else (1.5, -0.5, 0.0)
    seven = _ops(lambda: iterate(x, [coefficient] * 7, 1.0, "gram"))
    eight = _ops(lambda: iterate(x, [coefficient] * 8, 1.0, "gram"))
    assert eight - seven == 4, (seven, eight)


@pytest.mark.parametrize("shape", [(256, 256), (300, 64), (64, 300), (3, 96, 24)])
def test_the_direct_engine_keeps_a_well_conditioned_float32_sign_within_a_few_ulps(shape):
    # Note [The identity term as a scale]: the direct engine forms W = aI + V whole; aX + XV
    # rounds at |a| + |b + c| near convergence and was about 4x less accurate here
    *batch, n, m = shape
    g = _spectrum(n, m, 1.0, torch.float64, tuple(batch))
    q = msign(g.float(), "polar_express", engine="direct")
    assert _error(q, g) < 8 * torch.finfo(torch.float32).eps

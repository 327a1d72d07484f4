"""The matrix-sign engine against the SVD polar factor (float64), shapes, dtypes, errors."""

from __future__ import annotations

import pytest
import torch
from _spectra import spectrum as _spectrum

from stiefel.manifolds.kernels import MSIGN_METHODS, msign, msign_flops
from stiefel.manifolds.kernels.msign import MSIGN_DEFAULT_STEPS


def _polar_reference(g: torch.Tensor) -> torch.Tensor:
    # Independent reference: G (GᴴG)^{-1/2} through the eigendecomposition of GᴴG.
    tall = g if g.shape[-2] >= g.shape[-1] else g.mH
    w, v = torch.linalg.eigh(tall.mH @ tall)
    inv_sqrt = (v * w.rsqrt().to(v.dtype).unsqueeze(-2)) @ v.mH
    out = tall @ inv_sqrt
    return out if g.shape[-2] >= g.shape[-1] else out.mH


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape", [(30, 6), (6, 30), (12, 12), (3, 20, 5)])
@pytest.mark.parametrize(
    "method,steps", [("svd", None), ("polar_express", 12), ("newton_schulz_cubic", 40)]
)
def test_converged_methods_equal_polar_factor(dtype, shape, method, steps):
    *batch, n, m = shape
    g = _spectrum(n, m, 50.0, dtype, tuple(batch))
    q = msign(g, method, steps)
    ref = _polar_reference(g)
    assert q.shape == g.shape and q.dtype == dtype
    tol = 100 * max(n, m) * torch.finfo(torch.float64).eps
    assert (q - ref).abs().max() < tol


def test_quintic_newton_schulz_is_rough_but_bounded():
    # Muon's coefficients do not converge: singular values end in about [0.68, 1.13].
    g = torch.randn(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(msign(g, "newton_schulz", 5))
    assert s.min() > 0.5 and s.max() < 1.25
    assert (s - 1).abs().max() > 1e-3  # not the polar factor


def test_zero_and_rank_deficient():
    assert msign(torch.zeros(2, 5, 3)).abs().max() == 0
    a = torch.randn(8, 1, dtype=torch.float64)
    g = a @ torch.randn(1, 4, dtype=torch.float64)  # rank 1
    exact = msign(g, "svd")
    u = a / a.norm()
    assert torch.allclose(exact @ exact.mH @ u, u, atol=1e-12)
    assert torch.linalg.matrix_rank(exact) == 1
    assert torch.allclose(msign(g, "polar_express", 12), exact, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128, torch.float32])
@pytest.mark.parametrize("method", ["polar_express", "newton_schulz_cubic"])
def test_the_sharpened_sign_has_a_dead_zone(method, dtype):
    # Note [A dead zone for the dual descent]: the sign of the dual descent keeps a
    # converged polar factor and maps rounding in the null space of a rank-deficient
    # matrix to 0, where msign multiplies it by its slope at 0 (2.2e4, 1.9e5)
    from stiefel.manifolds.kernels.msign import _msign

    eps = torch.finfo(dtype).eps
    steps = MSIGN_DEFAULT_STEPS[method]
    g = _spectrum(24, 8, 50.0, dtype)
    sharp = _msign(g, method, steps, "auto", None, sharpen=True)
    assert (sharp - msign(g, "svd")).abs().max() < 100 * 24 * eps
    gen = torch.Generator().manual_seed(3)
    b = torch.randn(8, 3, dtype=dtype, generator=gen)
    z = torch.randn(24, 3, dtype=dtype, generator=gen) @ b.mH  # rank 3
    null = torch.linalg.svd(b.mH)[2][3:].mH  # 8×5: z @ null = rounding
    plain = msign(z, method, steps)
    sharp = _msign(z, method, steps, "auto", None, sharpen=True)
    assert (plain @ null).abs().max() > 1000 * eps  # the slope at 0 at work
    assert (sharp @ null).abs().max() < 100 * eps  # the SVD: 1 eps
    assert (sharp - msign(z, "svd")).abs().max() < 100 * 24 * eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_lower_precision(dtype):
    g = torch.randn(40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    g = g.to(dtype) if not dtype.is_complex else (g + 1j * g.flip(0)).to(dtype)
    q = msign(g, "polar_express")
    assert q.dtype == dtype
    gram = q.to(torch.complex128 if dtype.is_complex else torch.float64)
    err = (gram.mH @ gram - torch.eye(8, dtype=gram.dtype)).abs().max()
    eps = torch.finfo(torch.float32 if dtype != torch.bfloat16 else torch.bfloat16).eps
    assert err < 50 * eps


def test_bad_input():
    g = torch.randn(5, 3)
    with pytest.raises(ValueError, match="method='qr'.*newton_schulz.*polar_express.*svd"):
        msign(g, "qr")
    with pytest.raises(ValueError, match="steps=0"):
        msign(g, "polar_express", 0)
    with pytest.raises(ValueError, match="shape"):
        msign(torch.randn(5))
    with pytest.raises(TypeError):
        msign(torch.ones(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="method"):
        msign_flops(10, 3, "nope")


def test_flops_model_counts_products():
    # Polar Express on 100×10, 5 direct steps: per step 4NM² + 2M³, plus the scaling 2NM;
    # on 12×10 (N < 1.5M) "auto" is the direct engine.
    assert msign_flops(100, 10, "polar_express", 5, engine="direct") == 5 * (4e4 + 2e3) + 2e3
    assert msign_flops(12, 10, "polar_express", 5) == 5 * (4 * 1200 + 2e3) + 240
    assert msign_flops(10, 100, "polar_express", 5) == msign_flops(100, 10, "polar_express", 5)
    assert set(MSIGN_DEFAULT_STEPS) == set(MSIGN_METHODS)


def test_accuracy_table():
    """Print the accuracy table of the module docstring and assert its converged entries."""
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(256, 64, dtype=torch.float64, generator=gen)
    cond = _spectrum(256, 64, 1e3, torch.float64)

    def dev(method, g, steps):
        return float((torch.linalg.svdvals(msign(g, method, steps)) - 1).abs().max())

    rows = {}
    for steps in (3, 5, 6, 7, 8, 10, 12, 20, 30):
        rows[steps] = [
            dev(m, g, steps)
            for m in ("newton_schulz", "newton_schulz_cubic", "polar_express")
            for g in (gauss, cond)
        ]
        print(steps, " ".join(f"{x:.2g}" for x in rows[steps]))
    tight = 1e-13
    assert rows[8][4] < tight and rows[10][5] < tight  # Polar Express
    assert rows[12][2] < tight and rows[30][3] < tight  # cubic Newton–Schulz
    assert rows[5][4] > 1e-2 and rows[20][3] > 1e-2  # not converged earlier
    assert all(0.25 < rows[s][0] < 0.4 for s in (3, 10, 30))  # Muon's quintic stalls


@pytest.mark.parametrize("complex_", [False, True], ids=["real", "complex"])
@pytest.mark.parametrize(
    ("n", "m", "inner"),
    [(9, 8, 10), (12, 8, 10), (40, 4, 1), (16, 4, 1)],  # N − M < M, or one inner step
)
def test_the_spectral_direction_is_tangent_and_within_the_unit_ball(n, m, inner, complex_):
    # Note [The tangent direction within the ball]: the projection onto the tangent space
    # left the ball by up to 15 % before the dual residual vanished (reference: the SVD)
    from stiefel.manifolds.kernels.msign import spectral_direction

    dtype = torch.complex128 if complex_ else torch.float64
    gen = torch.Generator().manual_seed(n * m)
    x = torch.linalg.qr(torch.randn(6, n, m, dtype=dtype, generator=gen))[0]
    g = torch.randn(6, n, m, dtype=dtype, generator=gen)
    phi = spectral_direction(x, g, inner, "svd", square=False)
    eps = torch.finfo(torch.float64).eps
    assert float(torch.linalg.matrix_norm(phi, 2).max()) <= 1 + 100 * eps
    assert float((x.mH @ phi + phi.mH @ x).abs().max()) <= 100 * n * eps
    # still an ascent direction of Re tr(GᴴΦ)
    assert bool(((g.conj() * phi).real.sum((-2, -1)) > 0).all())

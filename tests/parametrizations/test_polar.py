"""The nearest point (``_polar.nearest_point``: the SVD polar factor after a power-of-two
scaling) against the float64 SVD polar factor UVᴴ on ill-conditioned, rank-deficient, complex,
batched and badly scaled inputs."""

from __future__ import annotations

import math

import pytest
import torch

from stiefel.manifolds.kernels import polar
from stiefel.parametrizations._polar import nearest_point

F32, F64, C128 = torch.float32, torch.float64, torch.complex128


def _with_singular_values(n: int, m: int, sigma: torch.Tensor, seed: int, dtype: torch.dtype):
    """A = U diag(σ) Vᴴ (n×m) with Haar U, V of ``dtype``; returns A, U, V."""
    g = torch.Generator().manual_seed(seed)
    real = torch.empty((), dtype=dtype).real.dtype
    draw = (lambda *s: torch.randn(*s, generator=g, dtype=real)) if real == dtype else None
    if draw is None:
        draw = lambda *s: torch.complex(  # noqa: E731
            torch.randn(*s, generator=g, dtype=real), torch.randn(*s, generator=g, dtype=real)
        )
    u = torch.linalg.qr(draw(n, m))[0]
    v = torch.linalg.qr(draw(m, m))[0]
    return (u * sigma.to(dtype)) @ v.mH, u, v


def _orth(q: torch.Tensor) -> float:
    """‖QᴴQ − I‖_F in double precision (largest over a batch)."""
    q = q.to(torch.complex128 if q.is_complex() else F64)
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    return float(torch.linalg.matrix_norm(q.mH @ q - eye).max())


@pytest.mark.parametrize("dtype", [F64, C128])
@pytest.mark.parametrize(("n", "m"), [(48, 48), (60, 20)])
def test_ill_conditioned_input_matches_the_svd_polar_factor(dtype, n, m):
    kappa = 1e6
    a, _, _ = _with_singular_values(n, m, torch.logspace(0, -6, m, dtype=F64), n + m, dtype)
    q = nearest_point(a)
    eps = torch.finfo(F64).eps
    assert q.dtype == dtype and _orth(q) <= 20 * math.sqrt(m) * eps
    # the polar factor moves by up to ~κ·eps under a relative perturbation eps of A
    assert float((q - polar(a)).abs().max()) <= 10 * kappa * eps


@pytest.mark.parametrize("dtype", [F64, C128])
def test_rank_deficient_input_keeps_the_polar_factor_on_the_range(dtype):
    n, r = 40, 28
    sigma = torch.cat([torch.logspace(0, -3, r, dtype=F64), torch.zeros(n - r, dtype=F64)])
    a, u, v = _with_singular_values(n, n, sigma, 11, dtype)
    q = nearest_point(a)
    eps = torch.finfo(F64).eps
    assert _orth(q) <= 20 * math.sqrt(n) * eps
    # UVᴴ is unique on the range of Aᴴ (Q V_r = U_r), free on the kernel, for us as for the SVD
    assert float((q @ v[:, :r] - u[:, :r]).abs().max()) <= 10 * 1e3 * eps
    assert float((q @ v[:, :r] - polar(a) @ v[:, :r]).abs().max()) <= 10 * 1e3 * eps


def test_batch_of_conditions_and_tiny_sizes():
    kappas = [1.0, 1e3, 1e8]
    spectra = [torch.logspace(0, -math.log10(k), 12, dtype=F64) for k in kappas]
    a = torch.stack([_with_singular_values(12, 12, s, k, F64)[0] for k, s in enumerate(spectra)])
    q = nearest_point(a)
    eps = torch.finfo(F64).eps
    assert _orth(q) <= 20 * math.sqrt(12) * eps
    for k, kappa in enumerate(kappas):
        assert float((q[k] - polar(a[k])).abs().max()) <= 10 * kappa * eps
    one = nearest_point(torch.tensor([[-2.5]], dtype=F64))
    assert torch.equal(one, torch.tensor([[-1.0]], dtype=F64))
    turn = torch.tensor([[0.0, 2.0], [-3.0, 0.0]], dtype=F64)  # polar factor [[0, 1], [-1, 0]]
    assert torch.allclose(nearest_point(turn), turn.sign(), atol=4 * eps)


@pytest.mark.parametrize("scale", [2.0**70, 2.0**-70, 1e-40])
def test_badly_scaled_float32_input_gives_the_polar_factor_of_the_unscaled_one(scale):
    # entries ~1e21, ~1e-21 and subnormal in float32: the same polar factor as the float64 A
    n, kappa = 16, 1e2
    a64, _, _ = _with_singular_values(n, n, torch.logspace(0, -2, n, dtype=F64), 9, F64)
    q = nearest_point((a64 * scale).float())
    eps = torch.finfo(F32).eps
    assert q.dtype == F32 and bool(torch.isfinite(q).all())
    assert _orth(q) <= 20 * math.sqrt(n) * eps
    tol = 10 * kappa * eps * (1e4 if scale < 1e-37 else 1)  # a subnormal A keeps fewer digits
    assert float((q.double() - polar(a64)).abs().max()) <= tol

"""Retractions from points far off the manifold never diverge (Note [Retraction from a
point off the manifold]): such a point is replaced by its polar factor first."""

import pytest
import torch

from stiefel.manifolds import Orthogonal, Stiefel


def _polar64(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("man", [Stiefel(20, 4), Orthogonal(6), Stiefel(8, 3, complex=True)])
@pytest.mark.parametrize("method", ["cayley", "qr", "polar"])
def test_repeated_retractions_from_a_randn_point_stay_bounded(man, method):
    g = torch.Generator().manual_seed(0)
    dtype = torch.complex128 if man.complex else torch.float64
    y = 3 * torch.randn(2, man.n, man.m, dtype=dtype, generator=g)
    for _ in range(30):
        u = man.proju(y, 0.1 * torch.randn(y.shape, dtype=dtype, generator=g))
        y = man.retr(y, u, method=method)
        assert torch.isfinite(y).all()
    assert float(man.orthogonality_error(y).max()) < 100 * man.m * torch.finfo(torch.float64).eps


def test_a_far_point_is_retracted_from_its_polar_factor():
    man = Stiefel(12, 3)
    g = torch.Generator().manual_seed(1)
    x = 5 * torch.randn(12, 3, dtype=torch.float64, generator=g)
    p = _polar64(x)
    u = man.proju(p, 0.05 * torch.randn(12, 3, dtype=torch.float64, generator=g))
    y, v = man.retr_transp(x, u, u)
    y_ref, v_ref = man.retr_transp(p, u, u)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-12)


def test_a_near_point_keeps_its_correction():
    man = Stiefel(12, 3)
    g = torch.Generator().manual_seed(2)
    x = _polar64(torch.randn(12, 3, dtype=torch.float64, generator=g))
    x = x + 1e-3 * torch.randn(12, 3, dtype=torch.float64, generator=g)  # ‖E‖ ≈ 1e-3
    y = man.retr(x, torch.zeros_like(x))
    before = float(man.orthogonality_error(x))
    assert float(man.orthogonality_error(y)) < 10 * before**2  # Newton–Schulz: E → O(E²)
    assert float((y - x).abs().max()) < 10 * before  # corrected, not projected far away

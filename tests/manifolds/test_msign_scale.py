"""msign does not depend on the scale of its input (Note [msign at any scale])."""

import pytest
import torch

from stiefel.manifolds.kernels import msign


@pytest.mark.parametrize("method", ["polar_express", "newton_schulz", "newton_schulz_cubic"])
@pytest.mark.parametrize("scale", [1e30, 1e-25, 1e-40, 3e36])
def test_msign_of_a_scaled_matrix_equals_msign_of_the_matrix(method, scale):
    g = torch.randn(48, 12, generator=torch.Generator().manual_seed(3))
    want = msign(g, method)  # unit scale: the iteration's own accuracy
    got = msign(g * scale, method)
    assert torch.isfinite(got).all()
    tol = 10 * 48 * torch.finfo(torch.float32).eps
    assert float((got - want).abs().max()) < tol


def test_msign_scale_reaches_the_svd_factor():
    g = torch.randn(48, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    exact = msign(g, "svd")
    for scale in (1e30, 1e-25):
        got = msign((g * scale).float(), "polar_express", steps=12).double()
        assert float((got - exact).abs().max()) < 1e-5


def test_msign_of_zero_is_zero():
    assert torch.equal(msign(torch.zeros(5, 3)), torch.zeros(5, 3))

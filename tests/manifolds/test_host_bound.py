"""μ = 1 exactly where max|d| is below `free_scale`, chosen per matrix with no host read.

Note [Step weights as tensors]: `normalize` divides by μ = 1 (no bit changes) for
every matrix whose largest entry is below `free_scale`, and by max|d| elsewhere;
the steps never write into the caller's direction, give the numbers of the
scaled path to rounding, and a batch holding one huge gradient scales that matrix
only and stays finite.
"""

import pytest
import torch

from stiefel.manifolds import kernels
from stiefel.manifolds.kernels import scaling


def _batch(dtype, batch=(3,), n=40, m=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.linalg.qr(torch.randn(*batch, n, m, dtype=torch.float64, generator=gen))[0]
    g = torch.randn(*batch, n, m, dtype=torch.float64, generator=gen)
    return x.to(dtype), g.to(dtype)


@pytest.mark.parametrize("grad", [False, True])
def test_mu_is_one_below_free_scale_with_or_without_autograd(grad):
    d = torch.ones(2, 4, 3)
    with torch.set_grad_enabled(grad):
        dn, mu = scaling.normalize(d)
    assert dn is not d and torch.equal(dn, d) and torch.equal(mu, torch.ones(2, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_free_scale_keeps_every_gram_finite(dtype):
    # at the bound itself the entries of a step's Grams stay below max/16
    x, g = _batch(dtype, n=64, m=16)
    mu = scaling.free_scale(g)
    d = g / g.abs().amax() * mu
    assert 4 * 64 * 16 * mu**2 <= torch.finfo(dtype).max / 16 * (1 + 1e-6)
    with torch.no_grad():
        assert torch.equal(scaling.normalize(d)[0], d)
        y = kernels.cayley_gradient_step(x, d, 1e-3 / mu)
    assert torch.isfinite(y).all()
    assert float(kernels.orthogonality_error(y).max()) < 100 * 64 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(40, 5), (6, 4), (5, 5)])  # SMW, dense, square
def test_steps_leave_the_callers_direction_alone_and_match_the_scaled_path(dtype, shape):
    x, g = _batch(dtype, n=shape[0], m=shape[1])
    keep = g.clone()
    with torch.no_grad():
        fast = kernels.cayley_gradient_step(x, g, 0.05)
        fast_d, fast_v = kernels.cayley_descent(x, g, 0.05, g)
    assert torch.equal(g, keep)  # neither step wrote over G
    scaled = kernels.cayley_gradient_step(x, g, 0.05)  # autograd on: divides by μ
    scaled_d, scaled_v = kernels.cayley_descent(x, g, 0.05, g)
    tol = 100 * shape[0] * torch.finfo(dtype).eps
    for a, b in ((fast, scaled), (fast_d, scaled_d), (fast_v, scaled_v)):
        assert float((a - b).abs().max()) < tol * max(1.0, float(b.abs().max()))


def test_a_batch_with_one_huge_gradient_takes_the_scaled_path():
    x, g = _batch(torch.float32, batch=(4,))
    g[2] *= 1e30  # past free_scale: the whole batch is divided by its μ
    keep = g.clone()
    with torch.no_grad():
        assert float(scaling.rows_absmax(g).amax()) > scaling.free_scale(g)
        dn, mu = scaling.normalize(g)
        y = kernels.cayley_gradient_step(x, g, 0.05)
    assert mu.shape == (4, 1, 1) and float(dn[2].abs().max()) == 1.0
    assert torch.equal(dn[[0, 1, 3]], g[[0, 1, 3]])  # μ = 1 for the ordinary ones
    assert torch.equal(g, keep)
    assert torch.isfinite(y).all()
    assert float(kernels.orthogonality_error(y).max()) < 100 * 40 * torch.finfo(torch.float32).eps
    # the ordinary matrices of that batch take the step they take alone
    with torch.no_grad():
        alone = kernels.cayley_gradient_step(x[[0, 1, 3]], g[[0, 1, 3]], 0.05)
    assert float((y[[0, 1, 3]] - alone).abs().max()) < 1e-5

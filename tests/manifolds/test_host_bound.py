"""The batch's largest |d| read on the host: the division by μ skipped where it is safe.

Note [Step weights on the host]: `normalize` returns d itself (μ = 1) when the
host may read the batch's largest entry and finds it below `free_scale`; the
steps then never write into the caller's direction, give the numbers of the
scaled path to rounding, and a batch holding one huge gradient takes the scaled
path for all its matrices and stays finite.
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


def test_the_bound_is_read_on_the_cpu_outside_autograd_only():
    d = torch.ones(2, 4, 3)
    with torch.no_grad():
        assert scaling.host_bound(d)
        assert scaling.normalize(d)[0] is d and scaling.normalize(d)[1] == 1.0
        # the scalar numbers stay for one matrix and a float lr
        assert scaling.host_scalars(d[0], 0.1) and not scaling.host_scalars(d, 0.1)
    assert not scaling.host_bound(d)  # autograd on: the tensor path, a division
    dn, mu = scaling.normalize(d)
    assert dn is not d and torch.equal(mu, torch.ones(2, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_free_scale_keeps_every_gram_finite(dtype):
    # at the bound itself the entries of a step's Grams stay below max/16
    x, g = _batch(dtype, n=64, m=16)
    mu = scaling.free_scale(g)
    d = g / g.abs().amax() * mu
    assert 4 * 64 * 16 * mu**2 <= torch.finfo(dtype).max / 16 * (1 + 1e-6)
    with torch.no_grad():
        assert scaling.normalize(d)[0] is d
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
    assert dn is not g and mu.shape == (4, 1, 1) and float(dn.abs().max()) == 1.0
    assert torch.equal(g, keep)
    assert torch.isfinite(y).all()
    assert float(kernels.orthogonality_error(y).max()) < 100 * 40 * torch.finfo(torch.float32).eps
    # the ordinary matrices of that batch take the step they take alone
    with torch.no_grad():
        alone = kernels.cayley_gradient_step(x[[0, 1, 3]], g[[0, 1, 3]], 0.05)
    assert float((y[[0, 1, 3]] - alone).abs().max()) < 1e-5

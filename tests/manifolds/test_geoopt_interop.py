"""Our manifolds inside geoopt's ManifoldParameter and optimizers."""

import geoopt
import pytest
import torch

from stiefel.manifolds import Orthogonal, Stiefel, Unitary


def _procrustes(n, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # A unitary makes ‖AX − B‖ = ‖X − AᴴB‖, whose minimizer over St is the polar factor
    # of AᴴB from its SVD: the closed form the optimizers must reach.
    a = torch.linalg.qr(torch.randn(n, n, dtype=dtype, generator=g))[0]
    b = torch.randn(n, m, dtype=dtype, generator=g)
    return a, b


def _polar(c):
    u, _, vh = torch.linalg.svd(c, full_matrices=False)
    return u @ vh


def _optimum(a, b):
    # min ‖AX − B‖ over St = max Re tr(Xᴴ AᴴB) for unitary A: polar factor of AᴴB (SVD)
    return float(torch.linalg.norm(a @ _polar(a.mH @ b) - b) ** 2)


@pytest.mark.parametrize(
    "man,dtype",
    [
        (Stiefel(12, 3), torch.float64),
        (Stiefel(12, 3, metric="canonical"), torch.float64),
        (Orthogonal(6), torch.float64),
        (Stiefel(10, 3, complex=True), torch.complex128),
        (Unitary(5), torch.complex128),
    ],
)
@pytest.mark.parametrize("opt", ["rsgd", "radam"])
def test_geoopt_optimizers_reach_procrustes_optimum(man, dtype, opt):
    a, b = _procrustes(man.n, man.m, dtype)
    x0 = man.random(dtype=dtype, generator=torch.Generator().manual_seed(1))
    if man.n == man.m and not x0.is_complex():
        # O(n) has two components; a descent path cannot cross det = 0, so start in the
        # component of the optimum (U(n) and St(n, m < n) are connected).
        target = torch.linalg.det(_polar(a.mH @ b))
        if float(torch.linalg.det(x0) * target) < 0:
            x0[:, 0] = -x0[:, 0]
    x = geoopt.ManifoldParameter(x0, manifold=man)
    if opt == "rsgd":
        o = geoopt.optim.RiemannianSGD([x], lr=0.2, momentum=0.5)
    else:
        o = geoopt.optim.RiemannianAdam([x], lr=0.2)
    sched = torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.99)
    for _ in range(600):
        o.zero_grad()
        loss = torch.linalg.norm(a @ x - b) ** 2
        loss.backward()
        o.step()
        sched.step()
    best = _optimum(a, b)
    assert abs(float(loss) - best) < 1e-6 * (1 + best)
    assert float(man.orthogonality_error(x.detach())) < 100 * man.n * torch.finfo(dtype).eps

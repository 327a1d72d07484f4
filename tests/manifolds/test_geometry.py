"""The manifold owns its geometry: one retraction table, read by `retr` and every optimizer."""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import RETRACTIONS, Stiefel, StiefelGeometry, Unitary, kernels

CASES = [
    (Stiefel(20, 4), torch.float64),  # SMW path
    (Stiefel(20, 4, complex=True), torch.complex128),
    (Stiefel(7, 5), torch.float64),  # dense path (2M ≥ N)
    (Unitary(4), torch.complex128),
]


@pytest.mark.parametrize("method", list(kernels.RETRACTIONS))
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
@pytest.mark.parametrize("man,dtype", CASES, ids=lambda c: repr(c))
def test_retr_equals_one_rgd_step(man, dtype, method, metric):
    gen = torch.Generator().manual_seed(0)
    x = man.random(3, man.n, man.m, dtype=dtype, generator=gen)
    g = torch.randn(3, man.n, man.m, dtype=dtype, generator=gen)
    lr = 0.3
    expected = man.retr(x, -lr * man.egrad2rgrad(x, g, metric=metric), method=method)
    w = geoopt.ManifoldParameter(x.clone(), manifold=man)
    w.grad = g.clone()
    optimizers.create("rgd", [w], lr=lr, metric=metric, retraction=method).step()
    assert float((w.detach() - expected).abs().max()) < 1e-12
    # and the step moved: the comparison is not between two unchanged points
    assert float((expected - x).abs().max()) > 1e-2


def test_retraction_table_is_the_one_list():
    assert RETRACTIONS == tuple(kernels.RETRACTIONS) == tuple(Stiefel.retractions)
    geo = Stiefel(9, 2).geometry(retraction="qr")
    assert isinstance(geo, StiefelGeometry) and geo.retraction == "qr"
    with pytest.raises(ValueError, match="retraction='householder'.*cayley, qr, polar"):
        Stiefel(9, 2).geometry(retraction="householder")


class _CountingStiefel(Stiefel):
    """A subclass that replaces the Cayley kernel: every optimizer must use it."""

    calls = 0

    @staticmethod
    def _cayley(x, d, lr, v=None, *, xx=None):
        _CountingStiefel.calls += 1
        return kernels.cayley_descent(x, d, lr, v, xx=xx)

    retractions = {**Stiefel.retractions, "cayley": _cayley}


@pytest.mark.parametrize("name", ["rgd", "radam"])
def test_subclass_kernels_reach_every_optimizer(name):
    man = _CountingStiefel(12, 3)
    x = man.random(dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = geoopt.ManifoldParameter(x.clone(), manifold=man)
    hyper = dict(momentum=0.5) if name == "rgd" else {}
    opt = optimizers.create(name, [w], lr=0.1, **hyper)
    before = _CountingStiefel.calls
    for _ in range(3):
        w.grad = torch.randn(12, 3, dtype=torch.float64)
        opt.step()
    assert _CountingStiefel.calls - before == 3
    assert float(man.orthogonality_error(w.detach())) < 1e-12
    # Stiefel.retr reads the same table
    man.retr(x, 0 * x)
    assert _CountingStiefel.calls - before == 4


def test_geoopt_stiefel_gets_our_geometry():
    w = geoopt.ManifoldParameter(
        Stiefel(10, 2).random(dtype=torch.float64).as_subclass(torch.Tensor),
        manifold=geoopt.CanonicalStiefel(),
    )
    opt = optimizers.create("rgd", [w], lr=0.1)
    geo = opt._bindings[0][0].bind(opt.param_groups[0])
    assert isinstance(geo, StiefelGeometry) and geo.metric == "canonical"

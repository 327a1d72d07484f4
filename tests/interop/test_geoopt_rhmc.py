"""Port of geoopt's ``tests/test_rhmc.py`` with
our manifolds. geoopt's samplers refuse a manifold whose ``reversible`` is not True
("Sampling methods can't me applied to manifolds that do not implement reversible
retraction"), which is every manifold here today.

Properties: RHMC's leapfrog step (``_step``) taken n times with ε and n times with −ε
returns to the start (to O(n·ε²), geoopt's check); RHMC, RSGLD and SGRHMC run on a
ManifoldParameter of ours (batched or not) and keep it on the manifold, finite and
contiguous (geoopt's test_sampling_manifold, "should just work").
"""

from __future__ import annotations

import geoopt
import geoopt.samplers.rhmc
import pytest
import torch
from _interop_cases import MANIFOLDS, dtype_of, manifold, random_point


class NormalOnManifold(torch.nn.Module):
    def __init__(self, case: str, mu: torch.Tensor, sigma: torch.Tensor, batch=()):
        super().__init__()
        self.mu, self.sigma = mu, sigma
        self.x = geoopt.ManifoldParameter(random_point(case, 0, *batch), manifold=manifold(case))

    def forward(self):
        diff = (self.x - self.mu).abs() / self.sigma
        return -(diff**2).sum() / 2


def model(case: str, batch=()):
    shape = (*batch, *MANIFOLDS[case][1])
    g = torch.Generator().manual_seed(42)
    mu = torch.randn(shape, dtype=dtype_of(case), generator=g)
    sigma = torch.rand(shape, dtype=torch.float64, generator=g) + 0.5
    return NormalOnManifold(case, mu, sigma, batch)


@pytest.mark.parametrize("epsilon,n_steps", [(1e-3, 1), (1e-4, 1), (1e-3, 3), (1e-4, 10)], ids=str)
@pytest.mark.parametrize("case", list(MANIFOLDS))
def test_leapfrog_reversibility(case, epsilon, n_steps):
    nd = model(case)
    init = nd.x.detach().clone()
    sampler = geoopt.samplers.rhmc.RHMC(nd.parameters(), epsilon=epsilon, n_steps=n_steps)
    r = nd.x.manifold.proju(nd.x.detach(), torch.randn_like(init))
    for eps in (epsilon, -epsilon):
        for _ in range(n_steps):
            nd().backward()
            with torch.no_grad():
                sampler._step(nd.x, r, eps)
                nd.x.grad.zero_()
    torch.testing.assert_close(nd.x.detach(), init, atol=10 * n_steps * epsilon**2, rtol=1e-5)


SAMPLERS = {
    "RHMC": dict(sampler="RHMC", epsilon=0.2, n_steps=5, n_burn=5, n_samples=20),
    "RSGLD": dict(sampler="RSGLD", epsilon=1e-3, n_burn=5, n_samples=20),
    "SGRHMC": dict(sampler="SGRHMC", epsilon=1e-3, n_steps=1, alpha=0.5, n_burn=5, n_samples=20),
}
# geoopt's RHMC is real-only: its Hamiltonian ½(r * r).sum() is complex for complex momenta
# (math.exp raises), so RHMC runs on the real manifolds; RSGLD and SGRHMC on all four.
SAMPLING_CASES = [
    (case, name)
    for case in MANIFOLDS
    for name in SAMPLERS
    if not (name == "RHMC" and MANIFOLDS[case][2])
]


@pytest.mark.parametrize("batch", [(), (3,)], ids=str)
@pytest.mark.parametrize("case,sampler", SAMPLING_CASES)
def test_sampling_manifold(case, sampler, batch):
    params = dict(SAMPLERS[sampler])
    torch.manual_seed(42)
    n_burn, n_samples = params.pop("n_burn"), params.pop("n_samples")
    nd = model(case, batch)
    sampler = getattr(geoopt.samplers, params.pop("sampler"))(nd.parameters(), **params)
    for _ in range(n_burn):
        sampler.step(nd)
    sampler.burnin = False
    for _ in range(n_samples):
        sampler.step(nd)
    assert nd.x.is_contiguous()
    assert bool(torch.isfinite(nd.x).all())
    nd.x.manifold.assert_check_point_on_manifold(nd.x.detach())

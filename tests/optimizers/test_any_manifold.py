"""A manifold outside Stiefel, with its own geometry, trains with rgd and radam unedited.

The unit sphere Sⁿ⁻¹ below is what a third party would write: a geoopt manifold
with ``geometry(metric, retraction)`` and a ``retractions`` table of its own
("exp", the great circle, and "proj", x + u normalised), neither of which the
Stiefel manifolds have. The optimizers take the geometry from the manifold
(`stiefel.optimizers.geometry.Binding`) and check ``retraction=`` against its
table. The reference is numpy's eigendecomposition: minimising xᵀAx on the sphere
gives the eigenvector of A's smallest eigenvalue.
"""

from __future__ import annotations

import geoopt
import numpy as np
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Geometry


def _exp(x, u):
    norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(1e-300)
    y = torch.cos(norm) * x + torch.sin(norm) * u / norm
    return y / torch.linalg.vector_norm(y, dim=-1, keepdim=True)  # rounding drift removed


def _proj(x, u):
    y = x + u
    return y / torch.linalg.vector_norm(y, dim=-1, keepdim=True)


class SphereGeometry(Geometry):
    """The operations an update rule calls, on the unit sphere."""

    def __init__(self, retraction):
        self.retr = retraction

    def rgrad(self, x, g):
        return g - (g * x).sum(-1, keepdim=True) * x

    def descend(self, x, d, lr):
        SphereMan.calls += 1
        return self.retr(x, -lr * d)

    def transport(self, x, y, v):
        return v - (v * y).sum(-1, keepdim=True) * y

    def descend_transport(self, x, d, lr):
        y = self.descend(x, d, lr)
        return y, self.transport(x, y, d)

    def component_inner(self, x, u):
        return (u * u).sum(-1, keepdim=True)

    def project(self, x):
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


class SphereMan(geoopt.Manifold):
    """The unit sphere {x : ‖x‖ = 1}; it owns its geometry."""

    name = "UnitSphere"
    ndim = 1
    reversible = False
    retractions = {"exp": _exp, "proj": _proj}
    calls = 0

    def geometry(self, metric=None, retraction="exp"):
        return SphereGeometry(self.retractions[retraction])

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        ok = torch.allclose(torch.linalg.vector_norm(x, dim=-1), x.new_ones(()), atol=atol)
        return ok, None if ok else "‖x‖ != 1"

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        return True, None

    def projx(self, x):
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)

    def proju(self, x, u):
        return u - (u * x).sum(-1, keepdim=True) * x

    def inner(self, x, u, v=None, *, keepdim=False):
        return (u * (u if v is None else v)).sum(-1, keepdim=keepdim)

    def retr(self, x, u):
        return _proj(x, u)

    def transp(self, x, y, v):
        return self.proju(y, v)

    def expmap(self, x, u):
        return _exp(x, u)

    def egrad2rgrad(self, x, u):
        return self.proju(x, u)

    def component_inner(self, x, u, v=None):
        return self.inner(x, u, v, keepdim=True)


def _problem(n=6, seed=0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = (q * np.linspace(1.0, 4.0, n)) @ q.T
    return torch.tensor(a), np.linalg.eigh(a)[1][:, 0]


@pytest.mark.parametrize(
    "name,hyper,steps",
    [
        ("rgd", dict(lr=0.1, retraction="exp", momentum=0.5), 300),
        ("rgd", dict(lr=0.1, retraction="proj", momentum=0.5, nesterov=True), 300),
        ("radam", dict(lr=0.05, retraction="proj"), 600),
    ],
)
def test_sphere_trains_with_its_own_geometry(name, hyper, steps):
    a, vec = _problem()
    man = SphereMan()
    x = geoopt.ManifoldParameter(man.projx(torch.ones(6, dtype=torch.float64)), manifold=man)
    opt = optimizers.create(name, [x], **hyper)
    before = SphereMan.calls
    for _ in range(steps):
        opt.zero_grad()
        (x @ a @ x).backward()
        opt.step()
    assert SphereMan.calls - before == steps  # every step through the sphere's geometry
    assert abs(float(torch.linalg.vector_norm(x.detach())) - 1) < 1e-12
    assert float(np.abs(np.abs(vec @ x.detach().numpy()) - 1)) < 1e-8


def test_retraction_is_checked_against_the_manifold_table():
    man = SphereMan()
    x = geoopt.ManifoldParameter(man.projx(torch.ones(4, dtype=torch.float64)), manifold=man)
    with pytest.raises(
        ValueError, match="retraction='cayley' is not supported; allowed: exp, proj"
    ):
        optimizers.create("rgd", [x], lr=0.1)  # rgd's default retraction is Stiefel's
    with pytest.raises(ValueError, match="retraction='exp' .*allowed: cayley, qr, polar"):
        optimizers.create("rgd", [torch.nn.Parameter(torch.zeros(2))], lr=0.1, retraction="exp")

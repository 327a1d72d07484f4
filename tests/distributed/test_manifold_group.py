"""The param-group ``manifold=`` key (in one process): a plain Parameter stepped on St(N, M)."""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel import Stiefel, optimizers
from stiefel.manifolds import kernels


def test_group_manifold_steps_a_plain_parameter_like_a_manifold_parameter():
    st = Stiefel(30, 4)
    x0 = kernels.haar(30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = torch.randn(30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plain = torch.nn.Parameter(x0.clone())
    tagged = geoopt.ManifoldParameter(x0.clone(), manifold=st)
    opt_a = optimizers.create("rgd", [{"params": [plain], "manifold": st}], lr=0.3, momentum=0.5)
    opt_b = optimizers.create("rgd", [tagged], lr=0.3, momentum=0.5)
    for _ in range(3):
        plain.grad, tagged.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(plain.detach(), tagged.detach())
    assert float(kernels.orthogonality_error(plain.detach())) < 1e-13
    # without the key the same parameter takes a Euclidean step and leaves the manifold
    euclid = torch.nn.Parameter(x0.clone())
    opt_c = optimizers.create("rgd", [euclid], lr=0.3)
    euclid.grad = g.clone()
    opt_c.step()
    assert float(kernels.orthogonality_error(euclid.detach())) > 1e-2


def test_group_manifold_is_checked():
    p = torch.nn.Parameter(torch.randn(30, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"manifold='St' is not allowed; allowed: None or"):
        optimizers.create("rgd", [{"params": [p], "manifold": "St"}], lr=0.1)
    with pytest.raises(ValueError, match="not on its manifold"):
        optimizers.create("rgd", [{"params": [p], "manifold": Stiefel(30, 4)}], lr=0.1)

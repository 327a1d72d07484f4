"""One step does not depend on the scale of the gradient (Note [msign at any scale]).

manifold_muon's direction is msign of the gradient (plus a dual term that scales with
it) and pogo's first VectorAdam step is G/‖G‖_F (its ε set below c·‖G‖_F so that
Adam's ε, which by definition breaks the invariance, does not enter): a step with
gradient c·G must land where the step with G lands, for c far beyond float32's
squared range (‖cG‖²_F overflows for c = 1e20 and underflows for c = 1e-30).
"""

from __future__ import annotations

import warnings

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel

N, M = 32, 8
OPTIONS = {"manifold_muon": dict(lr=0.05), "pogo": dict(lr=0.05, eps=1e-44)}


def _one_step(name: str, x0: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, str]:
    st = Stiefel(N, M)
    p = geoopt.ManifoldParameter(x0.clone(), manifold=st)
    opt = optimizers.create(name, [p], **OPTIONS[name])
    p.grad = g.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return p.detach().clone(), " ".join(str(c.message) for c in caught)


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("c", [1e20, 1e-30])
def test_one_step_is_the_same_for_a_scaled_gradient(name, c):
    gen = torch.Generator().manual_seed(0)
    x0 = Stiefel(N, M).random(dtype=torch.float32, generator=gen)
    g = torch.randn(N, M, generator=gen)
    ref, quiet = _one_step(name, x0, g)
    assert not quiet
    assert float((ref - x0).abs().max()) > 1e-3  # the reference step moved
    scaled, caught = _one_step(name, x0, g * c)
    assert torch.isfinite(g * c).all() and bool((g * c != 0).all())
    tol = 50 * N * torch.finfo(torch.float32).eps
    assert float((scaled - ref).abs().max()) < tol, caught
    assert not caught

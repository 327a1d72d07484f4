"""What every step refuses before it writes: a dtype kind its manifold cannot hold, a state
of another shape (named, with the parameter). The reference is the parameter as it was."""

from __future__ import annotations

import geoopt
import pytest
import torch
from _optim_problems import rule_names

import stiefel
from stiefel import optimizers
from stiefel.manifolds import Stiefel, Unitary


@pytest.mark.parametrize("name", rule_names())
def test_a_real_point_on_a_complex_manifold_is_refused_by_every_rule(name):
    x = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))[0]
    p = geoopt.ManifoldParameter(x, manifold=Unitary(4))
    with pytest.raises(TypeError, match="dtype torch.float64 but its manifold Unitary.*is complex"):
        optimizers.create(name, [p], lr=0.01)


@pytest.mark.parametrize("name", rule_names())
def test_a_weight_converted_to_complex_is_refused_at_step_and_left_as_it_was(name):
    lin = torch.nn.Linear(3, 6, bias=False)
    stiefel.orthogonalize(lin, method="riemannian")
    opt = optimizers.create(name, lin, lr=0.1)
    lin.to(torch.complex64)  # no forward: the optimizer is the one that writes
    lin.weight.grad = torch.randn(6, 3, dtype=torch.complex64)
    before = lin.weight.detach().clone()
    with pytest.raises(TypeError, match="complex64 but its manifold Stiefel.*is real"):
        opt.step()
    assert torch.equal(lin.weight.detach(), before)


@pytest.mark.parametrize(("name", "hyper"), [("manifold_muon", {"momentum": 0.9}), ("pogo", {})])
def test_a_state_of_another_shape_names_the_parameter(name, hyper):
    st = Stiefel(6, 2)
    ps = [geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st) for _ in range(2)]
    opt = optimizers.create(name, ps, lr=0.01, **hyper)
    for p in ps:
        p.grad = torch.randn(6, 2, dtype=torch.float64)
    opt.step()
    for key, value in list(opt.state[ps[1]].items()):
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            opt.state[ps[1]][key] = torch.zeros(3, 3, dtype=torch.float64)
    before = [p.detach().clone() for p in ps]
    with pytest.raises(RuntimeError, match=r"index 1 of param group 0, shape \(6, 2\).*\(3, 3\)"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before, strict=True))

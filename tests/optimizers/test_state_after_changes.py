"""A model changed between steps: a weight constrained, cast, or given a sparse gradient.

References: the manifold rule's step from a fresh state (a second optimizer built after
the change), torch's Adam's refusal of sparse gradients, and each message's content.
"""

from __future__ import annotations

import geoopt
import pytest
import torch

import stiefel
from stiefel import optimizers

RULES = ["rgd", "radam", "landing", "pogo", "manifold_muon"]


# pogo steps a plain matrix as a point from the start (its implied manifold): no rebinding
@pytest.mark.parametrize("name", [n for n in RULES if n != "pogo"])
def test_a_weight_constrained_after_plain_steps_starts_its_state_afresh(name):
    # radam's per-entry second moment made the manifold rule fail on its shapes
    # (Note [A weight constrained after its plain steps])
    torch.manual_seed(0)
    x = torch.randn(32, 4, dtype=torch.float64)
    lin = torch.nn.Linear(4, 16, dtype=torch.float64)
    opt = optimizers.create(name, lin.parameters(), lr=0.01)
    lin(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    stiefel.orthogonalize(lin, method="riemannian")
    twin = optimizers.create(name, [lin.weight], lr=0.01)  # built after: a fresh state
    lin(x).square().sum().backward()
    start = lin.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="after steps as a plain tensor; its state"):
        opt.step()
    stepped = lin.weight.detach().clone()
    with torch.no_grad():
        lin.weight.copy_(start)
    twin.step()
    assert torch.allclose(stepped, lin.weight.detach(), rtol=0, atol=1e-12)
    if optimizers.info(name).feasible:  # landing approaches the manifold over steps
        assert float(lin.weight.manifold.orthogonality_error(stepped)) < 1e-10


@pytest.mark.parametrize("name", ["radam", "pogo"])
def test_a_state_left_in_another_dtype_by_a_module_cast_is_named(name):
    lin = stiefel.orthogonalize(torch.nn.Linear(4, 16), method="riemannian")
    opt = optimizers.create(name, lin.parameters(), lr=0.05)
    lin(torch.randn(8, 4)).square().sum().backward()
    opt.step()
    lin.to(torch.float64)
    lin(torch.randn(8, 4, dtype=torch.float64)).square().sum().backward()
    with pytest.raises(
        RuntimeError, match="is torch.float32 on cpu where the parameter is torch.float64"
    ):
        opt.step()


@pytest.mark.parametrize("name", RULES)
def test_a_sparse_gradient_is_refused_before_anything_moves(name):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.nn.Parameter(torch.randn(3))
    opt = optimizers.create(name, [dense, emb.weight], lr=0.1)
    dense.grad = torch.ones(3)
    emb(torch.tensor([1, 2])).sum().backward()
    before = dense.detach().clone()
    with pytest.raises(
        TypeError, match=r"parameter 1 of its group \(shape \(10, 4\)\) has a torch.sparse_coo"
    ):
        opt.step()
    assert torch.equal(dense.detach(), before)
    with pytest.raises(RuntimeError, match="sparse gradients"):  # torch's, for comparison
        torch.optim.Adam([emb.weight]).step()


def test_a_complex_points_real_moment_is_not_taken_for_a_cast():
    # a complex point keeps a real per-matrix second moment: a failure on a state edited by
    # hand was blamed on a module cast
    from stiefel.manifolds import Stiefel

    st = Stiefel(8, 3, complex=True)
    x = torch.linalg.qr(torch.randn(8, 3, dtype=torch.complex128)).Q
    w = geoopt.ManifoldParameter(x, manifold=st)
    opt = optimizers.create("radam", [w], lr=0.01)
    w.grad = torch.randn(8, 3, dtype=torch.complex128)
    opt.step()
    opt.state[w]["exp_avg"] = torch.zeros(8, 4, dtype=torch.complex128)
    with pytest.raises(RuntimeError, match="a state of another shape"):
        opt.step()

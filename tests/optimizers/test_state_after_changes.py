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
        TypeError, match=r"parameter 1 of param group 0 \(shape \(10, 4\)\) has a torch.sparse_coo"
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


def _qf(a: torch.Tensor) -> torch.Tensor:
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(-2)


def _proj(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = x.T @ v
    return v - x @ ((s + s.T) / 2)


@pytest.mark.parametrize("foreach", [False, True])
def test_a_momentum_buffer_is_carried_through_steps_without_momentum(foreach):
    # Note [A momentum buffer through steps without momentum]: a schedule passing through
    # momentum 0 left the buffer at an old point, and the step after it added a vector
    # that is not tangent (‖XᵀB + BᵀX‖ ≈ 1.7). Reference: the float64 QR rule by hand,
    # the buffer transported by projection at every step, torch's B = ξ at the first.
    from stiefel.manifolds import Stiefel

    st = Stiefel(10, 3)
    torch.manual_seed(0)
    points = [st.random(dtype=torch.float64) for _ in range(2)]
    ws = [geoopt.ManifoldParameter(p.clone(), manifold=st) for p in points]
    opt = optimizers.create("rgd", ws, lr=0.1, momentum=0.9, retraction="qr", foreach=foreach)
    refs, bufs = [p.clone() for p in points], [None, None]
    for mu in (0.9, 0.9, 0.0, 0.0, 0.9, 0.9):
        opt.param_groups[0]["momentum"] = mu
        grads = [torch.randn(10, 3, dtype=torch.float64) for _ in ws]
        for w, g in zip(ws, grads, strict=True):
            w.grad = g
        opt.step()
        for i, g in enumerate(grads):
            x = refs[i]
            xi = _proj(x, g)
            if mu:
                bufs[i] = xi if bufs[i] is None else mu * bufs[i] + xi
            new = _qf(x - 0.1 * (bufs[i] if mu else xi))
            bufs[i] = None if bufs[i] is None else _proj(new, bufs[i])
            refs[i] = new
        for w, ref, buf in zip(ws, refs, bufs, strict=True):
            assert torch.allclose(w.detach(), ref, atol=1e-12)
            assert torch.allclose(opt.state[w]["momentum_buffer"], buf, atol=1e-12)


def test_a_momentum_buffer_saved_as_none_starts_afresh_through_steps_without_momentum():
    # torch's SGD before 2.0 saved momentum_buffer = None at momentum 0; the step that
    # carries the buffer through such steps took None for a tensor (AttributeError)
    from stiefel.manifolds import Stiefel

    st = Stiefel(10, 3)
    torch.manual_seed(0)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    opt = optimizers.create("rgd", [w], lr=0.1, momentum=0.0, retraction="qr")
    w.grad = torch.randn(10, 3, dtype=torch.float64)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["momentum_buffer"] = None
    opt.load_state_dict(saved)
    w.grad = torch.randn(10, 3, dtype=torch.float64)
    opt.step()  # momentum 0: nothing to carry
    assert st.check_point_on_manifold(w.detach())
    opt.param_groups[0]["momentum"] = 0.9
    x, g = w.detach().clone(), torch.randn(10, 3, dtype=torch.float64)
    w.grad = g
    opt.step()  # the first buffer is the Riemannian gradient, as torch's first buffer is g
    s = x.T @ g
    buf = opt.state[w]["momentum_buffer"]  # carried to the new point by projection
    assert torch.allclose(buf, _proj(w.detach(), g - x @ ((s + s.T) / 2)), atol=1e-12)

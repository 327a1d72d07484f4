"""Weight decay, momentum and stabilize written once (`stiefel.optimizers.terms`).

Each rule that had its own copy now calls the shared piece. The references are the
rules' former bodies, written out here verbatim as plugin subclasses (the formulas
of v0.2, before the pieces were shared): every optimizer/option combination must
give bit-for-bit the same trajectory (``torch.equal``, float64 and complex128).
POGO's kernel itself was rewritten since (Note [POGO's midpoint without ψ], VectorAdam's
scale folded into the step size): its trajectory equals v0.2's to rounding, and so does
rgd's Cayley momentum on the square point, kept in its frame since (Note [Moments in the
frame of X]).
"""

from __future__ import annotations

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel, Unitary
from stiefel.manifolds.kernels.basic import polar_step
from stiefel.manifolds.kernels.reduce import gram
from stiefel.optimizers import terms
from stiefel.optimizers.rgd import _transport


class OldRGD(optimizers.RGD):
    def update(self, geo, x, grad, state, group):
        lr, mu = group["lr"], group["momentum"]
        if group["weight_decay"]:
            grad = grad.add(x, alpha=group["weight_decay"])
        if mu == 0:
            return geo.gradient_step(x, grad, lr)
        xi = geo.rgrad(x, grad)
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = xi.clone()
        else:
            buf = buf.mul(mu).add_(xi, alpha=1 - group["dampening"])
        if not group["nesterov"]:
            new, state["momentum_buffer"] = geo.descend_transport(x, buf, lr)
            return new
        new = geo.descend(x, xi.add(buf, alpha=mu), lr)
        state["momentum_buffer"] = _transport(geo, x, new, buf)
        return new


class OldRAdam(optimizers.RAdam):
    def update(self, geo, x, grad, state, group):
        if group["weight_decay"]:
            grad = grad.add(x, alpha=group["weight_decay"])
        return super().update(geo, x, grad, state, {**group, "weight_decay": 0.0})


class OldMuon(optimizers.ManifoldMuon):
    def update(self, geo, x, grad, state, group):
        mu = group["momentum"]
        b = grad
        if mu > 0:
            buf = state.get("momentum_buffer")
            buf = grad.clone() if buf is None else buf.mul(mu).add_(grad)
            state["momentum_buffer"] = buf
            b = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        # the rest of the rule, with the momentum already applied
        return super().update(geo, x, b, {}, {**group, "momentum": 0.0, "nesterov": False})


class OldPOGO(optimizers.POGO):
    """v0.2's POGO with pogo-torch's weight decay ``grad.add_(point, alpha=wd)``."""

    def update(self, geo, x, grad, state, group):
        wd = group["weight_decay"]
        g = grad if wd == 0 else grad.add(x, alpha=wd)
        if group["base"] == "sgd":
            mu = group["momentum"]
            if mu != 0:
                buf = state.get("momentum_buffer")
                buf = g if buf is None else buf
                buf = state["momentum_buffer"] = buf.mul(mu).add_(g, alpha=1 - group["dampening"])
                g = g.add(buf, alpha=mu) if group["nesterov"] else buf
        else:
            m, scale = self._vector_adam(g, state, group, geo)
            g = m * scale
        if geo.stiefel:  # v0.2's pogo_step, written out
            xx = gram(x, x)
            mid = x - group["lr"] * (0.5 * (g @ xx - x @ gram(g, x)))
            return polar_step(mid, group["lam"])
        return x - group["lr"] * g


CASES = [
    (OldRGD, "rgd", dict(lr=0.1)),
    (OldRGD, "rgd", dict(lr=0.1, weight_decay=0.3)),
    (OldRGD, "rgd", dict(lr=0.1, momentum=0.7)),
    (OldRGD, "rgd", dict(lr=0.1, momentum=0.7, dampening=0.4, weight_decay=0.1)),
    (OldRGD, "rgd", dict(lr=0.1, momentum=0.7, nesterov=True, retraction="qr")),
    (OldRGD, "rgd", dict(lr=0.1, momentum=0.5, metric="canonical", stabilize=2)),
    (OldRAdam, "radam", dict(lr=0.05, weight_decay=0.2)),
    (OldRAdam, "radam", dict(lr=0.05, weight_decay=0.2, amsgrad=True, retraction="qr")),
    (OldMuon, "manifold_muon", dict(lr=0.05, momentum=0.8)),
    (OldMuon, "manifold_muon", dict(lr=0.05, momentum=0.8, nesterov=True, inner_steps=2)),
    (OldPOGO, "pogo", dict(lr=0.05, base="sgd", momentum=0.9)),
    (OldPOGO, "pogo", dict(lr=0.05, base="sgd", momentum=0.6, dampening=0.2, nesterov=False)),
    (OldPOGO, "pogo", dict(lr=0.05, base="sgd", momentum=0.9, nesterov=True, weight_decay=0.1)),
    (OldPOGO, "pogo", dict(lr=0.05, base="adam", weight_decay=0.05)),
]


def _params(dtype):
    gen = torch.Generator().manual_seed(0)
    st = Stiefel(12, 3, complex=dtype.is_complex)
    u = Unitary(4) if dtype.is_complex else Stiefel(4, 4)
    a = geoopt.ManifoldParameter(st.random(dtype=dtype, generator=gen), manifold=st)
    b = geoopt.ManifoldParameter(u.random(dtype=dtype, generator=gen), manifold=u)
    c = torch.nn.Parameter(torch.randn(5, dtype=dtype, generator=gen))
    return [a, b, c]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("old,name,hyper", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_shared_terms_give_the_former_trajectories_bit_for_bit(old, name, hyper, dtype):
    ours, theirs = _params(dtype), _params(dtype)
    opt = optimizers.create(name, ours, **hyper)
    ref = old(theirs, **hyper)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(ours, theirs, strict=True):
            g = torch.randn(p.shape, dtype=dtype, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            framed = name == "rgd" and i == 1 and _framed_momentum(hyper)
            if name != "pogo" and not framed:
                assert torch.equal(p.detach(), q.detach())
            else:  # 12 = the largest dimension, a few roundings per step
                tol = 10 * 12 * torch.finfo(torch.float64).eps
                assert float((p.detach() - q.detach()).abs().max()) < tol


def _framed_momentum(hyper: dict) -> bool:
    """rgd keeps this group's momentum of the square parameter in its frame."""
    return (
        hyper.get("momentum", 0) > 0
        and not hyper.get("nesterov", False)
        and (hyper.get("retraction", "cayley") == "cayley")
    )


def test_momentum_against_the_dense_formulas():
    gen = torch.Generator().manual_seed(2)
    g, b = (torch.randn(7, 3, dtype=torch.float64, generator=gen) for _ in range(2))
    assert torch.equal(terms.momentum(None, g, 0.9), g)
    first = terms.momentum(None, g, 0.9, 0.3, update_first=True)  # pogo-torch's first buffer
    assert torch.allclose(first, 0.9 * g + 0.7 * g, rtol=0, atol=1e-15)
    assert torch.allclose(terms.momentum(b, g, 0.9, 0.3), 0.9 * b + 0.7 * g, rtol=0, atol=1e-15)
    assert torch.allclose(terms.nesterov(g, b, 0.9), g + 0.9 * b, rtol=0, atol=1e-15)
    x = torch.randn(7, 3, dtype=torch.float64, generator=gen)
    assert torch.allclose(terms.weight_decay(g, x, 0.2), g + 0.2 * x, rtol=0, atol=1e-15)
    assert terms.weight_decay(g, x, 0.0) is g
    b0 = b.clone()
    terms.momentum(b, g, 0.5)
    assert torch.equal(b, b0)  # the buffer is replaced, never written


@pytest.mark.parametrize(
    "group,period",
    [
        ({}, None),
        ({"stabilize": 3}, 3),
        ({"repair_every": 2}, 2),
        ({"stabilize": 4, "repair_every": 4}, 4),
    ],
)
def test_repair_period_reads_either_name(group, period):
    assert terms.repair_period(group) == period


def test_repair_period_refuses_two_values():
    with pytest.raises(ValueError, match="stabilize=2 and repair_every=3 both given"):
        terms.repair_period({"stabilize": 2, "repair_every": 3})
    with pytest.raises(ValueError, match="repair_every=0 is not allowed; allowed: None or an int"):
        terms.repair_period({"stabilize": 0})

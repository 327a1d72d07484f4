"""geoopt's optimizer options on ``rgd``/``radam`` (issue 13,
"Drop-in for geoopt and torch users"): ``rgd`` takes RiemannianSGD's ``nesterov``,
``dampening``, ``weight_decay`` and ``stabilize`` (alias of ``repair_every``); ``radam``
takes RiemannianAdam's ``amsgrad``, ``weight_decay`` and ``stabilize``; unknown
param-group keys raise. Ports of geoopt's test_rsgd.py (params nesterov/dampening,
test_init_manifold with stabilize=1) and test_adam.py (amsgrad with lr = 1,
``stabilize=4500`` in a param group), plus step-by-step references: torch's SGD/Adam
on plain tensors with the same options, geoopt's RiemannianAdam (amsgrad, weight_decay)
on the same manifold, and the Riemannian heavy-ball reference of
_optim_ports.momentum_reference for nesterov/dampening.
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from _interop_cases import MANIFOLDS, dtype_of, manifold, random_point
from _optim_ports import euclidean_grad, momentum_reference, procrustes_start, run_to_target

from stiefel import optimizers

CASES = list(MANIFOLDS)


@pytest.mark.parametrize(
    "params",
    [dict(lr=0.05, momentum=0.5, nesterov=True), dict(lr=0.05, momentum=0.5, dampening=0.1)],
    ids=["nesterov", "dampening"],
)
@pytest.mark.parametrize("case", CASES)
def test_rsgd_options_reach_target(case, params):
    x, target = procrustes_start(case)
    opt = optimizers.create("rgd", [x], **params)
    run_to_target(opt, x, target, 2000)
    assert x.is_contiguous()
    torch.testing.assert_close(x.detach(), target, atol=1e-5, rtol=0.0)
    opt.load_state_dict(opt.state_dict())
    opt.step(lambda: 0.0)


@pytest.mark.parametrize("case", CASES)
def test_adam_amsgrad_and_stabilize_in_group_reach_target(case):
    x, target = procrustes_start(case)
    opt = optimizers.create("radam", [dict(params=[x], stabilize=4500)], lr=0.2, amsgrad=True)
    group = opt.param_groups[0]
    assert group.get("stabilize", group.get("repair_every")) == 4500
    run_to_target(opt, x, target, 2000)
    torch.testing.assert_close(x.detach(), target, atol=1e-5, rtol=0.0)


@pytest.mark.parametrize("name", ["rgd", "radam"])
@pytest.mark.parametrize("case", CASES)
def test_stabilize_is_repair_every(case, name):
    man = manifold(case)
    x0 = random_point(case, 1)
    a = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    b = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    oa = optimizers.create(name, [a], lr=0.1, stabilize=2)
    ob = optimizers.create(name, [b], lr=0.1, repair_every=2)
    for k in range(4):
        for p, o in ((a, oa), (b, ob)):
            p.grad = euclidean_grad(case, p, k)
            o.step()
    torch.testing.assert_close(a.detach(), b.detach(), atol=0.0, rtol=0.0)


@pytest.mark.parametrize("case", CASES)
def test_init_manifold_with_stabilize(case):
    """geoopt's test_init_manifold verbatim in its options: ``lr=1, stabilize=1``."""
    man = manifold(case)
    p0 = geoopt.ManifoldParameter(random_point(case, 1), manifold=man)
    p1 = geoopt.ManifoldParameter(
        torch.randn(4, 4, dtype=dtype_of(case)), manifold=geoopt.Euclidean(ndim=2)
    )
    for p in (p0, p1):
        p.grad = torch.zeros_like(p)
    old0, old1 = p0.detach().clone(), p1.detach().clone()
    opt = optimizers.create("rgd", [p0, p1], lr=1.0, stabilize=1)
    opt.step()
    assert p0.is_contiguous()
    tol = 100 * man.n * torch.finfo(p0.dtype).eps
    torch.testing.assert_close(p0.detach(), man.projx(old0), atol=tol, rtol=0.0)
    torch.testing.assert_close(p1.detach(), old1, atol=0.0, rtol=0.0)


@pytest.mark.parametrize(
    "name,theirs,hyper",
    [
        ("rgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
        ("rgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
        ("rgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
        ("radam", torch.optim.Adam, dict(lr=0.1, amsgrad=True)),
        ("radam", torch.optim.Adam, dict(lr=0.1, weight_decay=0.01)),
    ],
)
def test_plain_tensors_get_torch_updates_with_options(name, theirs, hyper):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(4, 3, dtype=torch.float64, generator=g)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oa, ob = optimizers.create(name, [a], **hyper), theirs([b], **hyper)
    for _ in range(4):
        grad = torch.randn(4, 3, dtype=torch.float64, generator=g)
        for p, o in ((a, oa), (b, ob)):
            p.grad = grad.clone()
            o.step()
    torch.testing.assert_close(a.detach(), b.detach(), atol=1e-14, rtol=1e-12)


# geoopt's amsgrad is real-only (torch.max on its complex exp_avg_sq raises)
RADAM_REFERENCE_CASES = [
    (case, opt)
    for case in CASES
    for opt in ("amsgrad", "weight_decay")
    if not (opt == "amsgrad" and MANIFOLDS[case][2])
]
RADAM_OPTIONS = {"amsgrad": dict(amsgrad=True), "weight_decay": dict(weight_decay=0.1)}


@pytest.mark.parametrize("case,option", RADAM_REFERENCE_CASES)
def test_radam_options_equal_geoopt_riemannian_adam(case, option):
    hyper = RADAM_OPTIONS[option]
    man = manifold(case)
    x0 = random_point(case, 2)
    a = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    b = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    oa = optimizers.create("radam", [a], lr=0.05, **hyper)
    ob = geoopt.optim.RiemannianAdam([b], lr=0.05, **hyper)
    for k in range(4):
        for p, o in ((a, oa), (b, ob)):
            p.grad = euclidean_grad(case, p, 40 + k) * (3.0 if k == 1 else 1.0)
            o.step()
    tol = 1e3 * torch.finfo(x0.dtype).eps
    torch.testing.assert_close(a.detach(), b.detach(), atol=tol, rtol=0.0)


@pytest.mark.parametrize("hyper", [dict(dampening=0.3)], ids=["dampening"])
@pytest.mark.parametrize("case", CASES)
def test_rgd_momentum_options_equal_reference(case, hyper):
    """Pins torch's SGD conventions on the manifold (first buffer ξ, later
    B ← μτ(B) + (1 − dampening)ξ, B moved by retr_transp); geoopt's own
    RiemannianSGD differs only in its first buffer (μ·G + (1 − dampening)ξ).
    Nesterov is not compared here: rgd transports Nesterov's buffer by
    projection (its docstring), tested against its own reference in
    tests/optimizers/test_dropin.py."""
    man = manifold(case)
    x0 = random_point(case, 3)
    x = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    opt = optimizers.create("rgd", [x], lr=0.1, momentum=0.7, **hyper)
    grads = [euclidean_grad(case, x0, 50 + k) for k in range(4)]
    for g in grads:
        x.grad = g.clone()
        opt.step()
    ref = momentum_reference(man, x0, grads, 0.1, 0.7, **hyper)
    tol = 1e3 * torch.finfo(x0.dtype).eps
    torch.testing.assert_close(x.detach(), ref, atol=tol, rtol=0.0)


@pytest.mark.parametrize("name", ["rgd", "radam", "landing"])
def test_unknown_param_group_key_raises(name):
    man = manifold("stiefel_real")
    x = geoopt.ManifoldParameter(random_point("stiefel_real", 1), manifold=man)
    with pytest.raises((TypeError, ValueError), match="bogus"):
        optimizers.create(name, [dict(params=[x], bogus=1)], lr=0.1)

"""Port of geoopt's ``tests/test_rsgd.py`` and ``tests/test_adam.py`` (Stiefel cases).

geoopt's properties: from a random point, Riemannian SGD (plain, momentum) and
Riemannian Adam reach X* of min ‖X − X*‖² + 100‖XᴴX − I‖² to 1e-5; the parameter stays
contiguous; ``load_state_dict(state_dict())`` then ``step`` works; with zero gradients a
step leaves a Euclidean parameter unchanged and (with stabilisation every step) puts the
manifold parameter at projx. Here for ``rgd``/``radam`` (by name, through
``stiefel.optimizers.create``) over
O(n), U(n) and real/complex St(N, M) (geoopt's optimizers reaching an optimum on our
manifolds is tested in tests/manifolds/test_geoopt_interop.py). geoopt's ``stabilize`` is
spelled ``repair_every`` here; geoopt's option names (``stabilize``, ``nesterov``, ``dampening``,
``weight_decay``, ``amsgrad``) are ported in ``pending/test_geoopt_optim_options.py``.
geoopt's SPD, Lorentz, Poincaré and Siegel cases have no counterpart in this package.

Step-by-step references: geoopt's ``RiemannianAdam`` and ``RiemannianSGD`` (no
momentum) on the same manifold object, and torch's ``SGD``/``Adam`` for plain tensors.
"""

from __future__ import annotations

import copy

import geoopt
import pytest
import torch
from _interop_cases import MANIFOLDS, dtype_of, manifold, random_point
from _optim_ports import euclidean_grad, momentum_reference, procrustes_start, run_to_target

from stiefel import optimizers

CASES = list(MANIFOLDS)
RSGD_PARAMS = {"plain": dict(lr=0.2), "momentum": dict(lr=0.05, momentum=0.5)}


@pytest.mark.parametrize("params", list(RSGD_PARAMS))
@pytest.mark.parametrize("case", CASES)
def test_rsgd_reaches_target(case, params):
    x, target = procrustes_start(case)
    opt = optimizers.create("rgd", [x], **RSGD_PARAMS[params])
    assert float((x.detach() - target).norm()) > 1e-5
    run_to_target(opt, x, target, 2000)
    assert x.is_contiguous()
    torch.testing.assert_close(x.detach(), target, atol=1e-5, rtol=0.0)
    opt.load_state_dict(opt.state_dict())
    opt.zero_grad()
    (x - target).abs().pow(2).sum().backward()
    opt.step()
    assert manifold(case).check_point_on_manifold(x.detach())


@pytest.mark.parametrize("case", CASES)
def test_adam_reaches_target(case):
    x, target = procrustes_start(case)
    opt = optimizers.create("radam", [dict(params=[x], repair_every=4500)], lr=0.2)
    assert opt.param_groups[0]["repair_every"] == 4500
    assert float((x.detach() - target).norm()) > 1e-5
    run_to_target(opt, x, target, 2000)
    assert x.is_contiguous()
    torch.testing.assert_close(x.detach(), target, atol=1e-5, rtol=0.0)
    opt.load_state_dict(opt.state_dict())
    opt.step(lambda: 0.0)


@pytest.mark.parametrize("name", ["rgd", "radam"])
@pytest.mark.parametrize("case", CASES)
def test_state_dict_round_trip_then_step_matches_untouched_twin(case, name):
    """geoopt steps after ``load_state_dict(state_dict())``; here the step must also equal
    that of an untouched copy of the optimizer (nothing lost in the round trip)."""
    hyper = dict(lr=0.05, momentum=0.5) if name == "rgd" else dict(lr=0.05)
    xs = [geoopt.ManifoldParameter(random_point(case, 1), manifold=manifold(case)) for _ in "ab"]
    opts = [optimizers.create(name, [x], **hyper) for x in xs]
    for k in range(3):
        for x, opt in zip(xs, opts, strict=True):
            x.grad = euclidean_grad(case, x, k)
            opt.step()
    opts[0].load_state_dict(copy.deepcopy(opts[0].state_dict()))
    for x, opt in zip(xs, opts, strict=True):
        x.grad = euclidean_grad(case, x, 9)
        opt.step()
    torch.testing.assert_close(xs[0].detach(), xs[1].detach(), atol=0.0, rtol=0.0)


@pytest.mark.parametrize("case", CASES)
def test_init_manifold_zero_grad_step(case):
    """geoopt's test_init_manifold: a manifold and a Euclidean parameter in one optimizer,
    zero gradients, lr = 1 and stabilisation every step: the Euclidean one is unchanged
    and the manifold one is at projx of where it was."""
    man = manifold(case)
    p0 = geoopt.ManifoldParameter(random_point(case, 1), manifold=man)
    p1 = geoopt.ManifoldParameter(
        torch.randn(4, 4, dtype=dtype_of(case)), manifold=geoopt.Euclidean(ndim=2)
    )
    p2 = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    for p in (p0, p1, p2):
        p.grad = torch.zeros_like(p)
    old = [p.detach().clone() for p in (p0, p1, p2)]
    opt = optimizers.create("rgd", [p0, p1, p2], lr=1.0, repair_every=1)
    opt.zero_grad(set_to_none=False)
    opt.step()
    assert p0.is_contiguous()
    tol = 100 * man.n * torch.finfo(p0.dtype).eps
    torch.testing.assert_close(p0.detach(), man.projx(old[0]), atol=tol, rtol=0.0)
    torch.testing.assert_close(p1.detach(), old[1], atol=0.0, rtol=0.0)
    torch.testing.assert_close(p2.detach(), old[2], atol=0.0, rtol=0.0)


# ---------------------------------------------------------------- step-by-step references
def _twin(case: str):
    man = manifold(case)
    x0 = random_point(case, 2)
    return [geoopt.ManifoldParameter(x0.clone(), manifold=man) for _ in range(2)]


def _steps(pairs, case: str, n: int = 4) -> None:
    for k in range(n):
        for x, opt in pairs:
            x.grad = euclidean_grad(case, x, 40 + k)
            opt.step()


@pytest.mark.parametrize("case", CASES)
def test_radam_steps_equal_geoopt_riemannian_adam(case):
    """Our ``radam`` and geoopt's ``RiemannianAdam`` on the same manifold: the same rule
    (one second moment per matrix, moments transported by ``retr_transp``)."""
    a, b = _twin(case)
    hyper = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-8)
    pairs = [
        (a, optimizers.create("radam", [a], **hyper)),
        (b, geoopt.optim.RiemannianAdam([b], **hyper)),
    ]
    _steps(pairs, case)
    tol = 1e3 * torch.finfo(a.dtype).eps
    torch.testing.assert_close(a.detach(), b.detach(), atol=tol, rtol=0.0)


@pytest.mark.parametrize("case", CASES)
def test_rgd_steps_equal_geoopt_riemannian_sgd(case):
    a, b = _twin(case)
    pairs = [
        (a, optimizers.create("rgd", [a], lr=0.1)),
        (b, geoopt.optim.RiemannianSGD([b], lr=0.1)),
    ]
    _steps(pairs, case)
    tol = 1e3 * torch.finfo(a.dtype).eps
    torch.testing.assert_close(a.detach(), b.detach(), atol=tol, rtol=0.0)


@pytest.mark.parametrize("case", CASES)
def test_rgd_momentum_equals_reference(case):
    man = manifold(case)
    x0 = random_point(case, 3)
    x = geoopt.ManifoldParameter(x0.clone(), manifold=man)
    opt = optimizers.create("rgd", [x], lr=0.1, momentum=0.7)
    grads = [euclidean_grad(case, x0, 50 + k) for k in range(4)]
    for g in grads:
        x.grad = g.clone()
        opt.step()
    ref = momentum_reference(man, x0, grads, 0.1, 0.7)
    tol = 1e3 * torch.finfo(x0.dtype).eps
    torch.testing.assert_close(x.detach(), ref, atol=tol, rtol=0.0)


@pytest.mark.parametrize(
    "name,theirs,hyper",
    [
        ("rgd", torch.optim.SGD, dict(lr=0.1)),
        ("rgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        ("radam", torch.optim.Adam, dict(lr=0.1)),
        ("radam", torch.optim.Adam, dict(lr=0.1, betas=(0.5, 0.7), eps=1e-6)),
    ],
)
def test_plain_tensors_get_torch_updates(name, theirs, hyper):
    """Plain parameters in our optimizers get torch's Euclidean update (geoopt's
    optimizers do the same on non-manifold parameters)."""
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

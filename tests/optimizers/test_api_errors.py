"""The plugin API, continued: bad input, non-finite gradients, repair_every, telemetry."""

from __future__ import annotations

import warnings

import geoopt
import numpy as np
import pytest
import torch
from _optim_problems import haar_np, manifold_param, retraction_rule_names, rule_names

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.optimizers import StiefelGeometry

RNG = np.random.default_rng(23)


def _orth_err_np(x: np.ndarray) -> float:
    """‖XᴴX − I‖_F in float64, max over a batch (independent of the package)."""
    x = np.asarray(x, dtype=np.complex128 if np.iscomplexobj(x) else np.float64)
    x = x.reshape(-1, *x.shape[-2:])
    eye = np.eye(x.shape[-1])
    return max(float(np.linalg.norm(b.conj().T @ b - eye)) for b in x)


def _polar_np(a):
    u, _, vh = np.linalg.svd(a, full_matrices=False)
    return u @ vh


def _plain():
    return torch.nn.Parameter(torch.zeros(3))


# ---------------------------------------------------------------- bad input
def test_unknown_name_lists_available():
    with pytest.raises(ValueError, match="name='adamm'") as info:
        optimizers.create("adamm", [_plain()], lr=0.1)
    for name in optimizers.available():
        assert name in str(info.value)
    with pytest.raises(TypeError, match="name must be a str"):
        optimizers.create(None, [_plain()], lr=0.1)


@pytest.mark.parametrize(
    "name,hyper,match",
    [
        ("rgd", dict(lr=-0.1), "lr=-0.1"),
        ("radam", dict(lr=-1e-3), "lr=-0.001"),
        ("landing", dict(lr=-1.0), "lr=-1.0"),
        ("rgd", dict(lr=float("nan")), "lr=nan"),
        ("rgd", dict(lr=0.1, momentum=1.0), "momentum=1.0"),
        ("radam", dict(lr=0.1, betas=(1.0, 0.9)), r"betas\[0\]=1.0"),
        ("radam", dict(lr=0.1, betas=(0.9, -0.1)), r"betas\[1\]=-0.1"),
        ("radam", dict(lr=0.1, betas=(0.9, 1.5)), r"betas\[1\]=1.5"),
        ("radam", dict(lr=0.1, eps=0.0), "eps=0.0"),
        ("rgd", dict(lr=0.1, metric="riemannian"), "metric='riemannian'.*euclidean, canonical"),
        ("rgd", dict(lr=0.1, retraction="exp"), "retraction='exp'.*cayley, qr, polar"),
        ("radam", dict(lr=0.1, retraction="svd"), "retraction='svd'.*cayley, qr, polar"),
        ("landing", dict(lr=0.1, attraction=0.0), "attraction=0.0"),
        ("landing", dict(lr=0.1, eps=1.0), "eps=1.0"),
        ("rgd", dict(lr=0.1, repair_every=0), "repair_every=0"),
    ],
)
def test_bad_hyper_parameters_raise_value_error(name, hyper, match):
    with pytest.raises(ValueError, match=match):
        optimizers.create(name, [_plain()], **hyper)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="lr"):
        optimizers.create("rgd", [_plain()], lr="0.1")
    with pytest.raises(TypeError, match="betas"):
        optimizers.create("radam", [_plain()], lr=0.1, betas=0.9)
    with pytest.raises(TypeError, match="safe_step"):
        optimizers.create("landing", [_plain()], lr=0.1, safe_step=1)
    with pytest.raises(TypeError, match=r"metric=1 \(int\).*euclidean, canonical"):
        optimizers.create("rgd", [_plain()], lr=0.1, metric=1)
    with pytest.raises(TypeError, match=r"retraction=None \(NoneType\)"):
        optimizers.create("rgd", [_plain()], lr=0.1, retraction=None)


def test_bad_param_group_leaves_optimizer_unchanged():
    w = manifold_param(torch.tensor(haar_np(RNG, 8, 2, False)))
    opt = optimizers.create("rgd", [w], lr=0.1)
    off = manifold_param(torch.tensor(haar_np(RNG, 8, 2, False)) * 1.1)
    for group, err in [({"params": [_plain()], "lr": -1.0}, "lr"), ({"params": [off]}, "distance")]:
        with pytest.raises(ValueError, match=err if err == "lr" else "not on its manifold"):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1
    w.grad = torch.ones_like(w)
    opt.step()  # still consistent
    assert _orth_err_np(w.detach().numpy()) < 1e-13


@pytest.mark.parametrize("name", rule_names())
def test_a_group_manifold_of_another_shape_is_refused_by_every_optimizer(name):
    # landing and pogo accept points off their manifold, not points of another shape;
    # the others had said "distance unknown (the manifold has no projx)"
    w = manifold_param(torch.tensor(haar_np(RNG, 8, 2, False)))
    opt = optimizers.create(name, [w], lr=0.1)
    q = torch.nn.Parameter(torch.randn(5, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shape \(5, 2\).*Stiefel\(n=10, m=3.*got \(5, 2\)"):
        opt.add_param_group({"params": [q], "manifold": Stiefel(10, 3)})
    assert len(opt.param_groups) == 1 and q not in opt.state


@pytest.mark.parametrize("name", rule_names())
def test_a_manifold_weight_of_a_dtype_without_kernels_is_refused(name):
    # complex32 had raised a bare NotImplementedError ("addmm_impl_cpu_") mid-step
    st = Stiefel(6, 3, complex=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
        w = geoopt.ManifoldParameter(st.random().to(torch.complex32), manifold=st)
    with pytest.raises(
        TypeError, match=r"dtype torch\.complex32; allowed on a manifold: .*complex64"
    ):
        optimizers.create(name, [w], lr=0.1)


@pytest.mark.parametrize("name", rule_names())
def test_a_zero_learning_rate_is_accepted_and_keeps_the_point(name):
    # as torch's optimizers (a schedule may reach 0): the step only corrects rounding
    man = Stiefel(12, 4)
    w = geoopt.ManifoldParameter(man.random(dtype=torch.float64), manifold=man)
    x0 = w.detach().clone()
    opt = optimizers.create(name, [w], lr=0.0)
    for _ in range(3):
        w.grad = torch.randn_like(w)
        opt.step()
    assert float((w.detach() - x0).abs().max()) < 100 * 12 * torch.finfo(torch.float64).eps


def _off_manifold_cases():
    x = haar_np(RNG, 10, 3, False) + 0.02 * RNG.standard_normal((10, 3))
    v = RNG.standard_normal(5)
    v = 1.3 * v / np.linalg.norm(v)
    yield Stiefel(10, 3), x, _orth_err_np(x)
    yield geoopt.EuclideanStiefel(), x, _orth_err_np(x)
    yield geoopt.CanonicalStiefel(), x, _orth_err_np(x)
    yield geoopt.Sphere(), v, abs(np.linalg.norm(v) - 1)  # distance to v/‖v‖


@pytest.mark.parametrize("name", retraction_rule_names())
def test_retraction_optimizers_refuse_points_off_the_manifold(name):
    for man, x, dist in _off_manifold_cases():
        w = geoopt.ManifoldParameter(torch.tensor(x), manifold=man)
        # a Stiefel-only rule (pogo) refuses another manifold before looking at the point
        with pytest.raises(ValueError, match="not on its manifold|not a Stiefel manifold") as info:
            optimizers.create(name, [w], lr=0.1)
        if "not a Stiefel manifold" in str(info.value):
            assert not isinstance(man, geoopt.Stiefel), (man, str(info.value))
            continue
        assert f"{dist:.3e}" in str(info.value), (man, str(info.value))
        opt = optimizers.create("landing", [w], lr=0.1)  # landing accepts it
        assert len(opt.param_groups[0]["params"]) == 1


def test_landing_brings_an_off_manifold_point_back():
    x = 1.2 * haar_np(RNG, 30, 4, False) + 0.1 * RNG.standard_normal((30, 4))
    w = manifold_param(torch.tensor(x))
    opt = optimizers.create("landing", [w], lr=0.2)
    for _ in range(150):
        w.grad = torch.tensor(1e-3 * RNG.standard_normal((30, 4)))
        opt.step()
    assert _orth_err_np(x) > 0.3 and _orth_err_np(w.detach().numpy()) < 1e-4


# ---------------------------------------------------------------- non-finite gradients
@pytest.mark.parametrize("name", rule_names())
def test_non_finite_gradient_skips_that_parameter_and_warns_once(name):
    w1 = manifold_param(torch.tensor(haar_np(RNG, 12, 3, False)))
    w2 = manifold_param(torch.tensor(haar_np(RNG, 12, 3, False)))
    b = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    opt = optimizers.create(name, [w1, w2, b], lr=0.1)
    x1, x2, b0 = (p.detach().clone() for p in (w1, w2, b))
    bad = torch.tensor(RNG.standard_normal((12, 3)))
    bad[3, 1] = float("nan")
    w1.grad, w2.grad = bad, torch.tensor(RNG.standard_normal((12, 3)))
    b.grad = torch.ones(4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="non-finite gradient") as record:
        opt.step()
    assert len([r for r in record if "non-finite" in str(r.message)]) == 1
    assert torch.equal(w1, x1) and len(opt.state[w1]) == 0  # skipped, state untouched
    assert not torch.equal(w2, x2) and not torch.equal(b, b0)  # the others stepped
    w1.grad = torch.full((12, 3), float("inf"), dtype=torch.float64)
    b.grad = torch.tensor([1.0, -float("inf"), 0.0, 0.0], dtype=torch.float64)
    b1 = b.detach().clone()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        opt.step()
    assert not [r for r in again if "non-finite" in str(r.message)]  # warned once only
    assert torch.equal(w1, x1) and torch.equal(b, b1)
    assert _orth_err_np(w1.detach().numpy()) < 1e-13  # the skipped point stays on it
    # an infeasible method (landing) stays within its safe radius eps
    bound = 1e-13 if optimizers.info(name).feasible else 0.5
    assert torch.isfinite(w2).all() and _orth_err_np(w2.detach().numpy()) < bound
    w1.grad = torch.tensor(RNG.standard_normal((12, 3)))
    opt.step()  # a finite gradient moves it again
    assert not torch.equal(w1, x1) and float(opt.state[w1]["step"]) == 1


# ---------------------------------------------------------------- repair_every
def test_repair_every_reprojects_on_the_k_th_steps():
    x = haar_np(RNG, 20, 4, False) + 0.05 * RNG.standard_normal((20, 4))
    w, free = manifold_param(torch.tensor(x)), manifold_param(torch.tensor(x))
    opt = optimizers.create("landing", [w], lr=0.05, repair_every=3)
    ref = optimizers.create("landing", [free], lr=0.05)
    for t in range(1, 7):
        g = torch.tensor(RNG.standard_normal((20, 4)))
        w.grad, free.grad = g, g.clone()
        opt.step()
        ref.step()
        if t % 3:
            assert torch.allclose(w, free, rtol=0, atol=1e-14)
            assert _orth_err_np(w.detach().numpy()) > 1e-4
        else:  # the step, then the polar factor
            polar = _polar_np(free.detach().numpy())
            assert np.abs(w.detach().numpy() - polar).max() < 1e-13
            with torch.no_grad():
                free.copy_(torch.tensor(polar))


@pytest.mark.parametrize("name", retraction_rule_names())
def test_repair_every_counts_steps_per_parameter(name, monkeypatch):
    calls = []
    original = StiefelGeometry.project

    def counting(self, x):
        calls.append(tuple(x.shape))
        return original(self, x)

    monkeypatch.setattr(StiefelGeometry, "project", counting)
    w = manifold_param(torch.tensor(haar_np(RNG, 9, 3, False)))
    opt = optimizers.create(name, [w], lr=0.1, repair_every=2)
    for _ in range(5):
        w.grad = torch.tensor(RNG.standard_normal((9, 3)))
        opt.step()
    assert calls == [(9, 3), (9, 3)]  # steps 2 and 4
    # after the unrepaired step 5: to rounding, or near the manifold for an infeasible rule
    bound = 1e-13 if optimizers.info(name).feasible else 1e-3
    assert _orth_err_np(w.detach().numpy()) < bound


# ---------------------------------------------------------------- telemetry
def test_telemetry_records_orthogonality_error_per_step():
    xs = [
        haar_np(RNG, 16, 3, False) + 0.05 * RNG.standard_normal((16, 3)),
        np.stack([haar_np(RNG, 6, 6, True) for _ in range(2)]),
    ]
    xs[1][1] += 0.02 * RNG.standard_normal((6, 6))
    ws = [manifold_param(torch.tensor(x)) for x in xs]
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = optimizers.create("landing", [ws[0], b, ws[1]], lr=0.1, telemetry=True)
    expected = []
    for _ in range(4):
        for p in (*ws, b):
            p.grad = 0.1 * torch.ones_like(p)
        opt.step()
        expected.append([_orth_err_np(w.detach().numpy()) for w in ws])
    hist = opt.orthogonality_history
    assert len(hist) == 4 and all(h.shape == (2,) for h in hist)  # the plain tensor excluded
    got = torch.stack(hist).double().numpy()
    assert np.allclose(got, expected, rtol=1e-5, atol=0)  # float32 record
    assert got[0, 0] > got[-1, 0] > 0  # landing approaches the manifold
    assert np.allclose(optimizers.orthogonality_errors(opt).numpy(), expected[-1], rtol=1e-5)
    quiet = optimizers.create("landing", [ws[0]], lr=0.1)
    with pytest.raises(TypeError, match="telemetry"):
        optimizers.create("landing", [ws[0]], lr=0.1, telemetry="yes")
    assert quiet.orthogonality_history == [] and not quiet.telemetry


@pytest.mark.parametrize("name", ["geoopt_rsgd", "geoopt_radam"])
def test_a_geoopt_step_with_a_non_finite_gradient_moves_nothing(name):
    # geoopt steps parameter by parameter and Stiefel.retr refuses a NaN step: the first two
    # points had moved before the third raised, with a message naming no parameter
    st = Stiefel(8, 3)
    ws = [geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st) for _ in range(3)]
    before = [w.detach().clone() for w in ws]
    opt = optimizers.create(name, ws, lr=0.1)
    for w in ws:
        w.grad = torch.randn_like(w)
    ws[2].grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"parameter 2 of param group 0 \(shape \(8, 3\)\)"):
        opt.step()
    assert all(torch.equal(b, w.detach()) for b, w in zip(before, ws, strict=True))

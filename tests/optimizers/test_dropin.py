"""Drop-in behaviour and hostile input (issue 13): geoopt's options, plugins that clash,
state loaded into other shapes, complex tensors on real manifolds, radam's step length."""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys
import textwrap

import geoopt
import numpy as np
import pytest
import torch
from _optim_problems import haar_np, manifold_param, rule_names

from stiefel import optimizers
from stiefel.manifolds import Stiefel

RNG = np.random.default_rng(31)


def _qr_np(a):
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))


# ------------------------------------------------------------------ clashing plugins
def test_entry_point_named_like_a_builtin_never_breaks_import(tmp_path):
    """A distribution whose entry points are named rgd/radam/landing: built-ins win, warned."""
    dist = tmp_path / "evil_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[stiefel.optimizers]\n"
        "rgd = evil_plugin:Broken\nradam = evil_plugin:Broken\nlanding = evil_plugin:Broken\n"
    )
    (tmp_path / "evil_plugin.py").write_text("raise RuntimeError('the plugin must not load')\n")
    code = textwrap.dedent(
        """
        import warnings, torch
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as rec:
            import stiefel
            from stiefel import optimizers
            names = optimizers.available()
            for name in ("rgd", "radam", "landing"):
                opt = optimizers.create(name, [torch.nn.Parameter(torch.zeros(2))], lr=0.1)
                assert type(opt) is optimizers.get(name) and type(opt).__module__.startswith(
                    "stiefel."
                ), type(opt)
        msgs = [str(r.message) for r in rec if "evil" in str(r.message)]
        assert len(msgs) == 3 and all("evil-plugin" in m for m in msgs), msgs
        print("OK", sorted(m.split("'")[1] for m in msgs))
        """
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pathlib.Path(__file__).parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK ['landing', 'radam', 'rgd']" in out.stdout


# ------------------------------------------------------------------ geoopt's RiemannianSGD options
def _run_pair(ours, ref, params, grads):
    for gs in grads:
        for (p, q), g in zip(params, gs, strict=True):
            p.grad, q.grad = torch.tensor(g), torch.tensor(g)
        ours.step()
        ref.step()


@pytest.mark.parametrize(
    "hyper",
    [
        dict(momentum=0.9, nesterov=True, weight_decay=0.1),
        dict(momentum=0.5, dampening=0.3, weight_decay=0.01),
        dict(momentum=0.0, weight_decay=0.2),
    ],
)
def test_rgd_on_plain_tensors_is_torch_sgd(hyper):
    """Plain parameters: exactly torch.optim.SGD with the same options."""
    x = RNG.standard_normal((5, 3))
    p, q = torch.nn.Parameter(torch.tensor(x)), torch.nn.Parameter(torch.tensor(x))
    grads = [[RNG.standard_normal((5, 3))] for _ in range(4)]
    _run_pair(
        optimizers.create("rgd", [p], lr=0.1, **hyper),
        torch.optim.SGD([q], lr=0.1, **hyper),
        [(p, q)],
        grads,
    )
    assert torch.allclose(p, q, rtol=0, atol=1e-15)


def test_rgd_momentum_dampening_matches_geoopt_on_plain_tensors():
    """geoopt starts the buffer from μG + (1 − δ)ξ, torch from ξ: equal when δ = μ."""
    x = RNG.standard_normal((4, 3))
    p, q = torch.nn.Parameter(torch.tensor(x)), torch.nn.Parameter(torch.tensor(x))
    hyper = dict(momentum=0.6, dampening=0.6)
    grads = [[RNG.standard_normal((4, 3))] for _ in range(4)]
    ours = optimizers.create("rgd", [p], lr=0.1, **hyper)
    _run_pair(ours, geoopt.optim.RiemannianSGD([q], lr=0.1, **hyper), [(p, q)], grads)
    assert torch.allclose(p, q, rtol=0, atol=1e-15)


def test_rgd_weight_decay_and_stabilize_match_geoopt_on_euclidean_stiefel():
    """geoopt's EuclideanStiefel retracts by QR and re-projects (stabilize) by polar: so do we."""
    x = haar_np(RNG, 12, 3, False)
    man = geoopt.EuclideanStiefel()
    p = geoopt.ManifoldParameter(torch.tensor(x), manifold=man)
    q = geoopt.ManifoldParameter(torch.tensor(x), manifold=man)
    hyper = dict(weight_decay=0.3, stabilize=2)
    ours = optimizers.create("rgd", [p], lr=0.2, retraction="qr", **hyper)
    assert ours.param_groups[0]["repair_every"] == 2
    grads = [[RNG.standard_normal((12, 3))] for _ in range(5)]
    _run_pair(ours, geoopt.optim.RiemannianSGD([q], lr=0.2, **hyper), [(p, q)], grads)
    assert (p - q).abs().max() < 1e-12


def test_rgd_nesterov_on_the_manifold_against_numpy():
    """d = ξ + μB, X ← qf(X − lr·d), B transported by projection; numpy reference."""
    x = haar_np(RNG, 10, 3, False)
    p = manifold_param(torch.tensor(x), Stiefel(10, 3))
    opt = optimizers.create("rgd", [p], lr=0.1, retraction="qr", momentum=0.7, nesterov=True)
    buf = None
    for _ in range(4):
        g = RNG.standard_normal((10, 3))
        p.grad = torch.tensor(g)
        opt.step()
        h = x.T @ g
        xi = g - x @ (0.5 * (h + h.T))
        buf = xi if buf is None else 0.7 * buf + xi
        x = _qr_np(x - 0.1 * (xi + 0.7 * buf))
        h = x.T @ buf
        buf = buf - x @ (0.5 * (h + h.T))
    assert np.abs(p.detach().numpy() - x).max() < 1e-12


# ------------------------------------------------------------------ geoopt's RiemannianAdam options
@pytest.mark.parametrize("amsgrad", [False, True])
def test_radam_matches_geoopt_on_euclidean_stiefel(amsgrad):
    """Same rule (per-matrix second moment, QR, projection transport): geoopt's own optimizer."""
    x, b = haar_np(RNG, 12, 3, False), RNG.standard_normal(4)
    man = geoopt.EuclideanStiefel()
    p = geoopt.ManifoldParameter(torch.tensor(x), manifold=man)
    q = geoopt.ManifoldParameter(torch.tensor(x), manifold=man)
    pb, qb = torch.nn.Parameter(torch.tensor(b)), torch.nn.Parameter(torch.tensor(b))
    hyper = dict(amsgrad=amsgrad, weight_decay=0.05, stabilize=3, betas=(0.8, 0.95))
    ours = optimizers.create("radam", [p, pb], lr=0.05, retraction="qr", **hyper)
    ref = geoopt.optim.RiemannianAdam([q, qb], lr=0.05, **hyper)
    # decreasing gradients make amsgrad's running maximum matter
    grads = [
        [RNG.standard_normal((12, 3)) / (1 + 3 * k), RNG.standard_normal(4) / (1 + 3 * k)]
        for k in range(6)
    ]
    _run_pair(ours, ref, [(p, q), (pb, qb)], grads)
    assert (p - q).abs().max() < 1e-12 and (pb - qb).abs().max() < 1e-14


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("complex_", [False, True])
def test_radam_on_plain_tensors_is_torch_adam(complex_, foreach):
    # a complex entry is two real ones with their own second moments, as torch's Adam
    # takes it (Note [A plain complex tensor is its real and imaginary parts])
    def draw(*shape):
        a = RNG.standard_normal(shape)
        return a + 1j * RNG.standard_normal(shape) if complex_ else a

    x = draw(5, 2)
    p, q = torch.nn.Parameter(torch.tensor(x)), torch.nn.Parameter(torch.tensor(x))
    twin = torch.nn.Parameter(torch.tensor(x))  # a second of the bucket, stepped as well
    hyper = dict(amsgrad=True, weight_decay=0.1, betas=(0.9, 0.99))
    grads = [[draw(5, 2) / (1 + k * k)] for k in range(5)]
    ours = optimizers.create("radam", [p, twin], lr=0.01, foreach=foreach, **hyper)
    ref = torch.optim.Adam([q], lr=0.01, **hyper)
    for (g,) in grads:
        p.grad, twin.grad, q.grad = (torch.tensor(g) for _ in range(3))
        ours.step()
        ref.step()
    assert torch.allclose(p, q, rtol=0, atol=1e-15)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):  # torch's state, entry for entry
        assert torch.allclose(ours.state[p][key], ref.state[q][key], rtol=1e-14, atol=0)
    # and a state of torch's Adam continues here
    mid = optimizers.create("radam", [q], lr=0.01, **hyper)
    mid.load_state_dict(ref.state_dict())
    for opt, w in ((ours, p), (mid, q)):
        w.grad = torch.tensor(grads[0][0])
        opt.step()
    assert torch.allclose(p, q, rtol=0, atol=1e-15)


def test_radam_on_a_complex_scalar_is_torch_adam():
    # a 0-dim complex parameter: its complex state reached torch.maximum at the second step
    p = torch.nn.Parameter(torch.tensor(1.0 + 1.0j, dtype=torch.complex128))
    q = torch.nn.Parameter(p.detach().clone())
    ours = optimizers.create("radam", [p], lr=0.02, amsgrad=True)
    ref = torch.optim.Adam([q], lr=0.02, amsgrad=True)
    for k in range(4):
        g = torch.tensor(complex(1.0 / (1 + k), -2.0 + k), dtype=torch.complex128)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(p, q, rtol=0, atol=1e-15)


def test_radam_step_length_against_adam():
    """Note [Step length of radam against Adam]: lr in Frobenius norm vs Adam's lr·√(NM)."""
    n, m, lr = 64, 4, 1e-4
    x = torch.tensor(haar_np(RNG, n, m, False))
    g = torch.tensor(RNG.standard_normal((n, m)))
    w = manifold_param(x)
    w.grad = g.clone()
    optimizers.create("radam", [w], lr=lr).step()
    radam_len = float(torch.linalg.matrix_norm(w.detach() - x))
    a = torch.nn.Parameter(x.clone())
    a.grad = g.clone()
    torch.optim.Adam([a], lr=lr).step()
    adam_len = float(torch.linalg.matrix_norm(a.detach() - x))
    assert radam_len == pytest.approx(lr, rel=1e-3)
    assert adam_len == pytest.approx(lr * (n * m) ** 0.5, rel=1e-3)


def test_radam_default_lr_moves_like_rgd_on_pca():
    """At its default lr, radam makes progress comparable to rgd's (not 'barely moves')."""
    n, m = 30, 3
    q = haar_np(RNG, n, n, False)
    a = torch.tensor((q * np.linspace(3.0, 0.1, n)) @ q.T)
    top = float(np.linspace(3.0, 0.1, n)[:m].sum())
    gaps = {}
    for name in ("rgd", "radam"):
        w = manifold_param(torch.tensor(haar_np(np.random.default_rng(0), n, m, False)))
        opt = optimizers.create(name, [w], lr=optimizers.info(name).default_lr)
        for _ in range(150):
            opt.zero_grad()
            (-(w * (a @ w)).sum()).backward()
            opt.step()
        gaps[name] = top - float((w * (a @ w)).sum())
    assert gaps["radam"] < 0.05 * top and gaps["rgd"] < 0.05 * top, gaps


# ------------------------------------------------------------------ hostile input
@pytest.mark.parametrize("name", rule_names())
def test_unknown_param_group_key_raises(name):
    w = manifold_param(torch.tensor(haar_np(RNG, 8, 2, False)))
    with pytest.raises(ValueError, match="'momentun'.*allowed: .*lr") as info:
        optimizers.create(name, [{"params": [w], "momentun": 0.9}], lr=0.1)
    assert "params" in str(info.value)
    opt = optimizers.create(name, [w], lr=0.1)
    with pytest.raises(ValueError, match="'betas2'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas2": 1})
    assert len(opt.param_groups) == 1
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # adds initial_lr: still accepted
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "initial_lr": 0.1})
    assert sched is not None and len(opt.param_groups) == 2


@pytest.mark.parametrize("name", rule_names())
def test_state_loaded_into_other_shapes_fails_at_load(name):
    ws = [
        manifold_param(torch.tensor(haar_np(RNG, 8, 3, False))),
        torch.nn.Parameter(torch.ones(4)),
    ]
    opt = optimizers.create(name, ws, lr=0.1)
    for w in ws:
        w.grad = torch.ones_like(w)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other = [
        manifold_param(torch.tensor(haar_np(RNG, 8, 3, False))),
        torch.nn.Parameter(torch.ones(5)),
    ]
    opt2 = optimizers.create(name, other, lr=0.1)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 has shape \(5,\).*\(4,\)"):
        opt2.load_state_dict(saved)
    assert opt2.state_dict()["state"] == before["state"]  # nothing loaded
    same = [manifold_param(ws[0].detach()), torch.nn.Parameter(torch.ones(4))]
    opt3 = optimizers.create(name, same, lr=0.3)
    opt3.load_state_dict(saved)  # same shapes: fine, and the saved shapes do not leak
    assert "param_shapes" not in opt3.param_groups[0]


@pytest.mark.parametrize("name", rule_names())
def test_complex_tensor_on_real_manifold_raises_type_error(name):
    st = Stiefel(6, 2)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64).to(torch.complex128), manifold=st)
    with pytest.raises(TypeError, match=r"complex128.*Stiefel\(n=6, m=2"):
        optimizers.create(name, [w], lr=0.1)


@pytest.mark.parametrize(
    "name,hyper,error,match",
    [
        ("rgd", dict(nesterov=True), ValueError, "nesterov=True with momentum=0.0"),
        ("rgd", dict(momentum=0.5, dampening=0.1, nesterov=True), ValueError, "dampening"),
        ("rgd", dict(dampening=1.5), ValueError, "dampening=1.5"),
        ("rgd", dict(weight_decay=-1.0), ValueError, "weight_decay=-1.0"),
        ("rgd", dict(nesterov=1), TypeError, "nesterov=1"),
        ("rgd", dict(stabilize=2, repair_every=3), ValueError, "stabilize=2 and repair_every=3"),
        ("rgd", dict(stabilize=0), ValueError, "repair_every=0"),
        ("radam", dict(amsgrad="yes"), TypeError, "amsgrad='yes'"),
        ("radam", dict(weight_decay=float("inf")), ValueError, "weight_decay=inf"),
        ("radam", dict(stabilize=1, repair_every=1), ValueError, "stabilize=1"),
    ],
)
def test_bad_geoopt_options_raise(name, hyper, error, match):
    with pytest.raises(error, match=match):
        optimizers.create(name, [torch.nn.Parameter(torch.zeros(2))], lr=0.1, **hyper)

"""The plugin API: registry, entry points, a user plugin, and the torch.optim.Optimizer contract."""

from __future__ import annotations

import copy
import importlib.metadata
import io
import sys

import geoopt
import numpy as np
import pytest
import torch
from _optim_problems import haar_np, manifold_param, procrustes, rule_names

import stiefel.optimizers.registry as registry
from stiefel import optimizers, orthogonalize
from stiefel.manifolds import Stiefel
from stiefel.optimizers import RiemannianOptimizer
from stiefel.optimizers.base import check_number

RNG = np.random.default_rng(11)
BUILTIN = ["sgd", "adam", "adamw", "rmsprop", "adagrad", "geoopt_rsgd", "geoopt_radam"]


def _qr_np(a):
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))


def _rgd_qr_np(x, g, lr):
    """retr_qr(X, −lr(G − X sym(XᵀG))), real."""
    h = x.T @ g
    return _qr_np(x - lr * (g - x @ (0.5 * (h + h.T))))


@pytest.fixture
def sandbox(monkeypatch):
    """Registry state private to one test (names registered here vanish afterwards)."""
    saved = registry.OPTIMIZERS.snapshot()
    yield
    registry.OPTIMIZERS.restore(saved)


# ---------------------------------------------------------------- registry
def test_available_names_torch_geoopt_and_ours():
    names = optimizers.available()
    assert names == sorted(names)
    assert set(BUILTIN + ["rgd", "radam", "landing"]) <= set(names)
    p = torch.nn.Parameter(torch.zeros(3))
    assert type(optimizers.create("sgd", [p], lr=0.1)) is torch.optim.SGD
    assert type(optimizers.create("adagrad", [p], lr=0.1)) is torch.optim.Adagrad
    assert type(optimizers.create("geoopt_radam", [p], lr=0.1)) is geoopt.optim.RiemannianAdam
    assert type(optimizers.create("rgd", [p], lr=0.1)) is optimizers.RGD


def test_register_class_and_factory(sandbox):
    @optimizers.register("my_sgd")
    class MySGD(torch.optim.SGD):
        pass

    @optimizers.register("half_adam")
    def half_adam(params, lr):
        return torch.optim.Adam(params, lr=lr / 2)

    assert {"my_sgd", "half_adam"} <= set(optimizers.available())
    p = torch.nn.Parameter(torch.zeros(3))
    assert type(optimizers.create("my_sgd", [p], lr=0.1)) is MySGD
    opt = optimizers.create("half_adam", [p], lr=0.5)
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["lr"] == 0.25


def test_register_twice_or_non_optimizer_raises(sandbox):
    @optimizers.register("twice")
    class First(torch.optim.SGD):
        pass

    for name in ("twice", "rgd", "adam"):
        with pytest.raises(ValueError, match=f"name='{name}'"):

            @optimizers.register(name)
            class Second(torch.optim.SGD):
                pass

    assert optimizers.get("twice") is First  # the first registration is kept
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        optimizers.register("not_opt")(dict)
    with pytest.raises(ValueError, match="name="):
        optimizers.register("has space")
    assert "not_opt" not in optimizers.available()
    bad = optimizers.register("returns_list")(lambda params, lr: [])
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        optimizers.create("returns_list", [torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert bad is optimizers.get("returns_list")


def test_entry_point_discovery(sandbox, monkeypatch, tmp_path):
    module = "stiefel_test_ep_plugin"
    (tmp_path / f"{module}.py").write_text(
        "import torch\n\n"
        "class HalfSGD(torch.optim.SGD):\n"
        "    def __init__(self, params, lr):\n"
        "        super().__init__(params, lr=lr / 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    group = registry.ENTRY_POINT_GROUP
    eps = [
        importlib.metadata.EntryPoint("ep_half_sgd", f"{module}:HalfSGD", group),
        importlib.metadata.EntryPoint("rgd", f"{module}:HalfSGD", group),  # clashes
        importlib.metadata.EntryPoint("elsewhere", f"{module}:HalfSGD", "other.group"),
    ]
    asked = []

    def fake_entry_points(**kw):
        asked.append(kw)
        return importlib.metadata.EntryPoints([e for e in eps if e.group == kw.get("group")])

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    with pytest.warns(RuntimeWarning, match="'rgd'"):
        found = optimizers.load_entry_points(force=True)
    assert asked == [{"group": "stiefel.optimizers"}] and found == ["ep_half_sgd"]
    assert "ep_half_sgd" in optimizers.available() and "elsewhere" not in optimizers.available()
    assert module not in sys.modules  # loaded only when created
    p = torch.nn.Parameter(torch.ones(3))
    opt = optimizers.create("ep_half_sgd", [p], lr=1.0)
    assert type(opt).__name__ == "HalfSGD" and module in sys.modules
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), 0.5))
    assert type(optimizers.create("rgd", [p], lr=1.0)) is optimizers.RGD  # registered one wins
    with pytest.raises(ValueError, match="ep_half_sgd"):
        optimizers.register("ep_half_sgd")(torch.optim.SGD)


def test_hyper_parameters_are_read_from_signatures_and_unknown_ones_refused(sandbox):
    p = torch.nn.Parameter(torch.zeros(3))
    opts = registry.OPTIMIZERS.options
    assert opts("sgd")["lr"] == 0.001 and "params" not in opts("sgd")
    assert opts("rgd")["retraction"] == "cayley" and "telemetry" in opts("rgd")  # keyword-only
    assert {"stabilize", "betas", "amsgrad"} <= set(opts("geoopt_radam"))  # factory → its class
    for error in (ValueError, TypeError):  # RegistryError is both; torch raised TypeError
        with pytest.raises(error, match=r"'momentun' for optimizer name='sgd'.*momentum=0"):
            optimizers.create("sgd", [p], lr=0.1, momentun=0.9)
        with pytest.raises(error, match=r"'retractoin'.*retraction='cayley'"):
            optimizers.create("rgd", [p], lr=0.1, retractoin="qr")
    with pytest.raises(ValueError, match="'stabilise'.*stabilize=None"):
        optimizers.create("geoopt_radam", [p], lr=0.1, stabilise=10)
    assert optimizers.create("geoopt_radam", [p], lr=0.1, stabilize=10)._stabilize == 10

    @optimizers.register("open_sgd")
    def open_sgd(params, **hyper):  # **hyper says nothing: the factory checks them itself
        return torch.optim.SGD(params, **hyper)

    assert optimizers.create("open_sgd", [p], lr=0.1, momentum=0.5).defaults["momentum"] == 0.5
    with pytest.raises(TypeError, match="momentun"):
        optimizers.create("open_sgd", [p], lr=0.1, momentun=0.5)


# ---------------------------------------------------------------- a user plugin
def test_user_plugin_trains_a_model(sandbox):
    @optimizers.register("capped_rgd")
    class CappedRGD(RiemannianOptimizer):
        """Riemannian GD whose step length lr·‖ξ‖ is capped at ``max_step``."""

        def __init__(self, params, lr, max_step=0.5, retraction="qr", repair_every=None):
            defaults = dict(
                lr=lr, max_step=max_step, retraction=retraction, repair_every=repair_every
            )
            super().__init__(params, defaults)

        def check_group(self, group, defaults=False):
            super().check_group(group, defaults)
            check_number("max_step", group["max_step"])

        def update(self, geo, x, grad, state, group):
            xi = geo.rgrad(x, grad)
            length = group["lr"] * geo.component_inner(x, xi).sqrt()
            scale = (group["max_step"] / length.clamp_min(1e-300)).clamp(max=1.0)
            return geo.descend(x, scale * xi, group["lr"])

    n, m = 12, 4
    loss_w, error, target = procrustes(RNG, n, m, False)
    w = manifold_param(torch.tensor(haar_np(RNG, n, m, False)))
    b = torch.nn.Parameter(torch.zeros(m, dtype=torch.float64))
    t = torch.linspace(-1, 1, m, dtype=torch.float64)
    opt = optimizers.create("capped_rgd", [w, b], lr=0.2, max_step=0.3)
    assert error(w.detach().numpy()) > 0.1
    for _ in range(300):
        opt.zero_grad()
        (loss_w(w) + ((b - t) ** 2).sum()).backward()
        opt.step()
    assert error(w.detach().numpy()) < 1e-9
    assert (b.detach() - t).abs().max() < 1e-9
    assert np.linalg.norm(w.detach().numpy().T @ w.detach().numpy() - np.eye(m)) < 1e-13
    with pytest.raises(ValueError, match="max_step"):
        optimizers.create("capped_rgd", [w], lr=0.1, max_step=-1.0)


# ---------------------------------------------------------------- torch.optim contract
def test_param_groups_with_their_own_lr():
    x1, x2 = haar_np(RNG, 12, 3, False), haar_np(RNG, 9, 2, False)
    w1, w2 = manifold_param(torch.tensor(x1)), manifold_param(torch.tensor(x2))
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    b0 = b.detach().numpy().copy()
    groups = [{"params": [w1]}, {"params": [w2], "lr": 0.05}, {"params": [b], "lr": 0.3}]
    opt = optimizers.create("rgd", groups, lr=0.2, retraction="qr")
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.05, 0.3]
    for _ in range(2):
        g1, g2, gb = RNG.standard_normal((12, 3)), RNG.standard_normal((9, 2)), np.ones(4)
        w1.grad, w2.grad, b.grad = torch.tensor(g1), torch.tensor(g2), torch.tensor(gb)
        opt.step()
        x1, x2, b0 = _rgd_qr_np(x1, g1, 0.2), _rgd_qr_np(x2, g2, 0.05), b0 - 0.3 * gb
    assert np.abs(w1.detach().numpy() - x1).max() < 1e-12
    assert np.abs(w2.detach().numpy() - x2).max() < 1e-12
    assert np.abs(b.detach().numpy() - b0).max() < 1e-14


@pytest.mark.parametrize("name", rule_names())
def test_step_lr_scheduler_changes_the_step(name):
    """StepLR halves lr each step: the same run as three optimizers with those lrs."""
    x0 = torch.tensor(haar_np(RNG, 10, 3, False))
    grads = [torch.tensor(RNG.standard_normal((10, 3))) for _ in range(3)]
    w = manifold_param(x0)
    opt = optimizers.create(name, [w], lr=0.2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref = manifold_param(x0)
    ref_opt = optimizers.create(name, [ref], lr=0.2)
    for k, g in enumerate(grads):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5**k)
        ref_opt.param_groups[0]["lr"] = 0.2 * 0.5**k
        w.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        sched.step()
    assert torch.allclose(w, ref, rtol=0, atol=1e-14)
    const = manifold_param(x0)  # without the schedule the result differs
    const_opt = optimizers.create(name, [const], lr=0.2)
    for g in grads:
        const.grad = g.clone()
        const_opt.step()
    assert (const - w).abs().max() > 1e-3


@pytest.mark.parametrize("name", rule_names())
def test_zero_grad(name):
    w = manifold_param(torch.tensor(haar_np(RNG, 10, 3, False)))
    b = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = optimizers.create(name, [w, b], lr=0.1)
    ((w**3).sum() + (b**2).sum()).backward()
    opt.step()
    opt.zero_grad()
    assert w.grad is None and b.grad is None
    before = (w.detach().clone(), b.detach().clone(), float(opt.state[w]["step"]))
    opt.step()  # no gradient: nothing moves, no state advances
    assert torch.equal(w, before[0]) and torch.equal(b, before[1])
    assert float(opt.state[w]["step"]) == before[2]
    ((w**3).sum() + (b**2).sum()).backward()
    opt.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("name", rule_names())
def test_step_with_closure(name):
    x0 = torch.tensor(haar_np(RNG, 10, 3, False))
    c = torch.tensor(RNG.standard_normal((10, 3)))
    w, ref = manifold_param(x0), manifold_param(x0)
    opt = optimizers.create(name, [w], lr=0.1, **({"momentum": 0.5} if name == "rgd" else {}))
    ref_opt = optimizers.create(name, [ref], lr=0.1, **({"momentum": 0.5} if name == "rgd" else {}))
    calls = []

    def closure():
        opt.zero_grad()
        loss = -(c * w).sum()
        loss.backward()
        calls.append(float(loss.detach()))
        return loss

    for _ in range(3):
        with torch.no_grad():  # step(closure) enables grad for the closure
            loss = opt.step(closure)
        assert float(loss.detach()) == calls[-1]
        ref_opt.zero_grad()
        (-(c * ref).sum()).backward()
        ref_opt.step()
    assert len(calls) == 3 and calls[2] < calls[0]
    assert torch.equal(w, ref)


CONFIGS = [
    ("rgd", dict(lr=0.05, momentum=0.9)),
    ("rgd", dict(lr=0.05, momentum=0.5, metric="canonical", retraction="qr")),
    ("radam", dict(lr=0.02, betas=(0.8, 0.9))),
    ("radam", dict(lr=0.02, retraction="polar")),
    ("landing", dict(lr=0.1, attraction=2.0)),
]


def _loss(ws):
    """Σ_w Σ_ij a_i |w_ij|² + Re(c_ij w_ij): a smooth, bounded-curvature test loss."""
    total = 0
    for w in ws:
        a = torch.linspace(1.0, 2.0, w.shape[0], dtype=torch.float64)[:, None]
        c = torch.cos(torch.arange(w.numel(), dtype=torch.float64)).reshape(w.shape)
        total = total + (a * (w.conj() * w).real).sum() + (c * w).real.sum()
    return total


def _run(opt, ws, steps):
    for _ in range(steps):
        opt.zero_grad()
        _loss(ws).backward()
        opt.step()


@pytest.mark.parametrize("via_bytes", [False, True], ids=["in_memory", "torch_save"])
@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CONFIGS)])
def test_state_dict_round_trip_resumes_identically(config, via_bytes):
    name, hyper = config
    starts = [haar_np(RNG, 16, 4, False), haar_np(RNG, 6, 6, True), RNG.standard_normal((5, 2))]

    def params():
        ws = [manifold_param(torch.tensor(x)) for x in starts[:2]]
        return ws + [torch.nn.Parameter(torch.tensor(starts[2]))]

    ws = params()
    opt = optimizers.create(name, ws, **hyper)
    _run(opt, ws, 5)
    if via_bytes:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
    else:
        saved = copy.deepcopy(opt.state_dict())
    mid = [w.detach().clone() for w in ws]
    _run(opt, ws, 5)

    resumed = params()
    with torch.no_grad():
        for r, x in zip(resumed, mid, strict=True):
            r.copy_(x)
    other = dict(hyper, lr=123.0)  # the loaded groups bring the real lr back
    opt2 = optimizers.create(name, resumed, **other)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == hyper["lr"]
    _run(opt2, resumed, 5)
    for a, b in zip(ws, resumed, strict=True):
        assert torch.equal(a, b)
    # the state matters: a fresh optimizer from the same point goes elsewhere
    fresh = params()
    with torch.no_grad():
        for r, x in zip(fresh, mid, strict=True):
            r.copy_(x)
    _run(optimizers.create(name, fresh, **hyper), fresh, 5)
    if name != "landing":  # landing keeps no state
        assert max(float((a - b).abs().max()) for a, b in zip(ws, fresh, strict=True)) > 1e-6


@pytest.mark.parametrize(
    "shape",
    [(64, 16), (32, 32)],
    ids=["St(64,16)", "O(32)"],  # correction period 2 for both
)
@pytest.mark.parametrize(
    "name", [n for n in optimizers.available() if optimizers.info(n).riemannian]
)
def test_a_float32_run_resumed_off_its_correction_steps_repeats_the_original_bit_for_bit(
    name, shape
):
    # a loaded optimizer has no record of its last writes: it tests every point at its
    # first step, which falls between two drift corrections here (7 steps taken); the
    # test must not correct the point then, or the run leaves the original by rounding
    gen = torch.Generator().manual_seed(5)
    man = Stiefel(*shape)
    starts = [man.random(generator=gen) for _ in range(3)]
    grads = [[torch.randn(shape, generator=gen) for _ in starts] for _ in range(12)]
    lr = optimizers.info(name).default_lr

    def run(ws, opt, steps):
        for gs in steps:
            for w, g in zip(ws, gs, strict=True):
                w.grad = g.clone()
            opt.step()

    ws = [geoopt.ManifoldParameter(x.clone(), manifold=man) for x in starts]
    opt = optimizers.create(name, ws, lr=lr)
    run(ws, opt, grads[:7])
    saved = copy.deepcopy(opt.state_dict())
    mid = [w.detach().clone() for w in ws]
    run(ws, opt, grads[7:])
    resumed = [geoopt.ManifoldParameter(x.clone(), manifold=man) for x in mid]
    again = optimizers.create(name, resumed, lr=lr)
    again.load_state_dict(saved)
    run(resumed, again, grads[7:])
    for a, b in zip(ws, resumed, strict=True):
        assert torch.equal(a, b)


def test_state_dict_contents_are_plain():
    w = manifold_param(torch.tensor(haar_np(RNG, 8, 3, False)))
    opt = optimizers.create("radam", [w], lr=0.1)
    _run(opt, [w], 2)
    sd = opt.state_dict()
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_sq_scale", "short_path_bounds"}
    assert float(st["step"]) == 2
    # what the last step measured for its short paths (Note [Euler's product sized by the
    # last step], Note [Scales taken as one from the last step])
    bounds = st["short_path_bounds"]
    scales = {"gradient scale", "direction scale", "second moment scale"}
    assert set(bounds) == {"woodbury T", "woodbury S", *scales}
    assert all(type(v) is float for v in bounds.values())
    assert 0 <= bounds["woodbury T"] < 1 and 0 <= bounds["woodbury S"] < 1
    assert all(bounds[site] == 1.0 for site in scales)
    assert st["exp_avg_sq"].shape == (1, 1)  # one second moment per matrix
    assert float(st["exp_avg_sq_scale"]) == 1.0  # ordinary gradients: v unscaled
    assert sd["param_groups"][0]["betas"] == (0.9, 0.999)


# ---------------------------------------------------------------- kinds of parameters
def test_orthogonalize_riemannian_parameters_are_manifold_parameters():
    torch.manual_seed(0)
    W = orthogonalize(torch.randn(12, 4, dtype=torch.float64), method="riemannian")
    lin = orthogonalize(torch.nn.Linear(3, 9, dtype=torch.float64), method="riemannian")
    assert isinstance(W.weight, geoopt.ManifoldParameter)
    x1, x2 = W.weight.detach().numpy().copy(), lin.weight.detach().numpy().copy()
    b0 = lin.bias.detach().numpy().copy()
    opt = optimizers.create("rgd", [*W.parameters(), *lin.parameters()], lr=0.1, retraction="qr")
    g1, g2, gb = (RNG.standard_normal(s) for s in ((12, 4), (9, 3), (9,)))
    W.weight.grad, lin.weight.grad, lin.bias.grad = map(torch.tensor, (g1, g2, gb))
    opt.step()
    assert np.abs(W.weight.detach().numpy() - _rgd_qr_np(x1, g1, 0.1)).max() < 1e-12
    assert np.abs(lin.weight.detach().numpy() - _rgd_qr_np(x2, g2, 0.1)).max() < 1e-12
    assert np.abs(lin.bias.detach().numpy() - (b0 - 0.1 * gb)).max() < 1e-15  # Euclidean rule
    assert len(optimizers.orthogonality_errors(opt)) == 2


def _canonical_cayley_np(x, g, lr):
    """Wen & Yin: (I + lr/2 A)⁻¹(I − lr/2 A)X, A = GXᵀ − XGᵀ."""
    a = g @ x.T - x @ g.T
    eye = np.eye(x.shape[0])
    return np.linalg.solve(eye + 0.5 * lr * a, (eye - 0.5 * lr * a) @ x)


@pytest.mark.parametrize(
    "man,hyper,reference",
    [
        (geoopt.Stiefel(), {}, _canonical_cayley_np),
        (geoopt.CanonicalStiefel(), {"retraction": "qr", "metric": "euclidean"}, _rgd_qr_np),
        (geoopt.EuclideanStiefel(), {"retraction": "qr"}, _rgd_qr_np),
    ],
    ids=["Stiefel", "CanonicalStiefel-metric", "EuclideanStiefel"],
)
def test_geoopt_manifolds_are_accepted(man, hyper, reference):
    x, g = haar_np(RNG, 20, 3, False), RNG.standard_normal((20, 3))
    w = geoopt.ManifoldParameter(torch.tensor(x), manifold=man)
    w.grad = torch.tensor(g)
    optimizers.create("rgd", [w], lr=0.3, **hyper).step()
    assert np.abs(w.detach().numpy() - reference(x, g, 0.3)).max() < 1e-12
    for name in rule_names():
        w = geoopt.ManifoldParameter(torch.tensor(x), manifold=man)
        opt = optimizers.create(name, [w], lr=0.05, telemetry=True)
        _run(opt, [w], 3)
        y = w.detach().numpy()
        # an infeasible method (landing) stays within its safe radius eps = 0.5
        bound = 1e-13 if optimizers.info(name).feasible else 0.5
        assert np.linalg.norm(y.T @ y - np.eye(3)) < bound
        assert len(opt.orthogonality_history) == 3


def test_other_geoopt_manifold_uses_its_own_operations():
    sphere = geoopt.Sphere()
    x = torch.tensor(RNG.standard_normal(5))
    x = x / x.norm()
    w, ref = geoopt.ManifoldParameter(x, manifold=sphere), geoopt.ManifoldParameter(x, sphere)
    g = torch.tensor(RNG.standard_normal(5))
    w.grad, ref.grad = g.clone(), g.clone()
    optimizers.create("rgd", [w], lr=0.2).step()
    geoopt.optim.RiemannianSGD([ref], lr=0.2).step()
    assert torch.allclose(w, ref, rtol=0, atol=1e-15) and abs(float(w.norm()) - 1) < 1e-15


def test_stiefel_parameter_with_our_manifold_metric_default():
    """metric=None follows the manifold; metric= wins over it."""
    x, g = haar_np(RNG, 20, 3, False), RNG.standard_normal((20, 3))
    out = []
    for man_metric, opt_metric in [("canonical", None), ("euclidean", "canonical")]:
        w = geoopt.ManifoldParameter(torch.tensor(x), manifold=Stiefel(20, 3, metric=man_metric))
        w.grad = torch.tensor(g)
        optimizers.create("rgd", [w], lr=0.3, metric=opt_metric).step()
        out.append(w.detach().numpy())
    ref = _canonical_cayley_np(x, g, 0.3)
    assert np.abs(out[0] - ref).max() < 1e-12 and np.abs(out[1] - ref).max() < 1e-12

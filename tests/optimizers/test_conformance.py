"""Conformance of every registered optimizer, driven by the registry (`optimizers.available()`).

A name registered in-tree or through the entry-point group `stiefel.optimizers`
is covered here with no edit (`test_entry_point_plugin_is_covered` proves it):

- every optimizer whose `info(name).riemannian` is True, on St(N, M) real,
  St(N, M) complex and O(n): stays on the manifold (tolerance scaled by dtype;
  a method declared `feasible=False` must land on it once the gradient
  vanishes), decreases a Procrustes loss, resumes identically from a saved
  `state_dict`, and honours param groups with different learning rates (the first
  property on every device of the ``device`` fixture: cuda when visible);
- every optimizer: a plain parameter in the same optimizer gets a Euclidean
  update that decreases a quadratic.
"""

from __future__ import annotations

import copy
import importlib.metadata
import sys

import geoopt
import numpy as np
import pytest
import torch
from _optim_problems import SPACES, haar_np, manifold, procrustes

import stiefel.optimizers.registry as registry
from stiefel import optimizers
from stiefel.manifolds.kernels.frame import MAX_PERIOD


def _names(riemannian_only: bool = False) -> list[str]:
    names = optimizers.available()
    return [n for n in names if optimizers.info(n).riemannian] if riemannian_only else names


def _param(x: np.ndarray, dtype: torch.dtype, device: str = "cpu") -> geoopt.ManifoldParameter:
    n, m = x.shape
    t = torch.tensor(x).to(dtype=dtype, device=device)
    return geoopt.ManifoldParameter(t, manifold=manifold(n, m, t.is_complex()))


def _dtype(cplx: bool, double: bool) -> torch.dtype:
    return {
        (False, False): torch.float32,
        (False, True): torch.float64,
        (True, False): torch.complex64,
        (True, True): torch.complex128,
    }[cplx, double]


def _orth_err(x: torch.Tensor) -> float:
    """‖XᴴX − I‖_F computed in float64 / complex128, independent of the package."""
    x = x.detach().cpu().to(torch.complex128 if x.is_complex() else torch.float64)
    return float(torch.linalg.matrix_norm(x.mH @ x - torch.eye(x.shape[-1], dtype=x.dtype)))


def _tol(n: int, dtype: torch.dtype) -> float:
    return 100 * n * torch.finfo(dtype).eps


def _run(opt, w, loss, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss(w).backward()
        opt.step()


# ------------------------------------------------------------------ checks (one per property)
def check_manifold(name: str, space, double: bool, device: str = "cpu") -> None:
    _, n, m, cplx = space
    rng = np.random.default_rng(1)
    dtype = _dtype(cplx, double)
    info = optimizers.info(name)
    c = torch.tensor(_procrustes_target(rng, n, m, cplx)).to(dtype=dtype, device=device)

    def loss(w):
        return -(c.conj() * w).real.sum()

    w = _param(haar_np(rng, n, m, cplx), dtype, device)
    opt = optimizers.create(name, [w], lr=info.default_lr)
    start = float(loss(w).detach())
    _run(opt, w, loss, 30)
    assert w.device.type == device, (name, w.device)
    end = float(loss(w).detach())
    assert end < start - 1e-3 * abs(start), (name, start, end)
    tol = _tol(n, dtype)
    if info.feasible:
        assert _orth_err(w) < tol, (name, _orth_err(w), tol)
    else:  # an infeasible method lands once the gradient vanishes
        for _ in range(3000):
            w.grad = torch.zeros_like(w)
            opt.step()
            if _orth_err(w) < tol:
                break
        assert _orth_err(w) < tol, (name, _orth_err(w), tol)


def _procrustes_target(rng, n, m, cplx) -> np.ndarray:
    a = haar_np(rng, n, m, cplx) * np.linspace(2.0, 1.0, m)
    return a @ haar_np(rng, m, m, cplx).conj().T


def check_state_dict_resume(name: str) -> None:
    rng = np.random.default_rng(2)
    lr = optimizers.info(name).default_lr
    loss_np, _, _ = procrustes(rng, 10, 3, False)
    x0, b0 = haar_np(rng, 10, 3, False), rng.standard_normal(4)
    target = torch.tensor(rng.standard_normal(4))

    def loss(ps):
        return loss_np(ps[0]) + ((ps[1] - target) ** 2).sum()

    def fresh():
        return [_param(x0, torch.float64), torch.nn.Parameter(torch.tensor(b0))]

    ps = fresh()
    opt = optimizers.create(name, ps, lr=lr)
    _run(opt, ps, loss, 4)
    saved = copy.deepcopy(opt.state_dict())
    mid = [p.detach().clone() for p in ps]
    _run(opt, ps, loss, 3)
    resumed = fresh()
    with torch.no_grad():
        for r, x in zip(resumed, mid, strict=True):
            r.copy_(x)
    opt2 = optimizers.create(name, resumed, lr=lr * 3)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == lr
    _run(opt2, resumed, loss, 3)
    for a, b in zip(ps, resumed, strict=True):
        assert torch.equal(a.detach(), b.detach()), name


def check_param_groups(name: str) -> None:
    """Two groups with their own lr step as two optimizers with those lrs would."""
    rng = np.random.default_rng(3)
    lr = optimizers.info(name).default_lr
    x1, x2 = haar_np(rng, 10, 3, False), haar_np(rng, 8, 2, False)
    g1, g2 = rng.standard_normal((10, 3)), rng.standard_normal((8, 2))

    def stepped(groups_lrs, xs, gs):
        ps = [_param(x, torch.float64) for x in xs]
        groups = [{"params": [p], "lr": r} for p, r in zip(ps, groups_lrs, strict=True)]
        opt = optimizers.create(name, groups, lr=lr)
        for _ in range(2):
            for p, g in zip(ps, gs, strict=True):
                p.grad = torch.tensor(g)
            opt.step()
        return [p.detach() for p in ps]

    both = stepped([lr, lr / 4], [x1, x2], [g1, g2])
    alone1 = stepped([lr], [x1], [g1])[0]
    alone2 = stepped([lr / 4], [x2], [g2])[0]
    assert torch.equal(both[0], alone1) and torch.equal(both[1], alone2), name
    other = stepped([lr], [x2], [g2])[0]  # the group's lr matters
    assert float((other - alone2).abs().max()) > 1e-6, name


def check_euclidean_parameter(name: str) -> None:
    """A plain parameter (beside a manifold one if allowed) decreases a quadratic."""
    rng = np.random.default_rng(4)
    info = optimizers.info(name)
    b = torch.nn.Parameter(torch.tensor(rng.standard_normal(5)))
    target = torch.tensor(rng.standard_normal(5))
    params = [b]
    if info.riemannian:
        params.append(_param(haar_np(rng, 6, 2, False), torch.float64))

    def loss(_):
        return ((b - target) ** 2).sum() + sum((p**2).sum() for p in params[1:])

    opt = optimizers.create(name, params, lr=info.default_lr)
    start = float(loss(None))
    _run(opt, None, loss, 20)
    assert float(((b - target) ** 2).sum()) < (1 - 1e-3) * start, name


# ------------------------------------------------------------------ the suite
@pytest.mark.parametrize("double", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("space", SPACES, ids=[s[0] for s in SPACES])
@pytest.mark.parametrize("name", _names(riemannian_only=True))
def test_stays_on_manifold_and_decreases_procrustes(name, space, double, device):
    check_manifold(name, space, double, device)


@pytest.mark.parametrize("name", _names(riemannian_only=True))
def test_state_dict_resume(name):
    check_state_dict_resume(name)


@pytest.mark.parametrize("name", _names(riemannian_only=True))
def test_param_groups_own_lr(name):
    check_param_groups(name)


@pytest.mark.parametrize("name", _names())
def test_plain_parameter_gets_euclidean_update(name):
    check_euclidean_parameter(name)


@pytest.mark.parametrize("shape", [(0, 10, 4), (0, 4, 4)], ids=["St", "O"])
@pytest.mark.parametrize("name", _names(riemannian_only=True))
def test_an_empty_batch_of_points_steps(name, shape):
    # as torch's optimizers step an empty tensor: no host read of an empty maximum
    # (`host_max`), the points stay an empty batch, the steps are counted where kept
    from stiefel.manifolds import Orthogonal, Stiefel

    man = Orthogonal(4) if shape[-2] == shape[-1] else Stiefel(*shape[-2:])
    p = geoopt.ManifoldParameter(torch.zeros(shape), manifold=man)
    opt = optimizers.create(name, [p], lr=optimizers.info(name).default_lr)
    for _ in range(MAX_PERIOD + 1):  # through a correcting step (its off-manifold test)
        p.grad = torch.zeros(shape)
        opt.step()
    assert p.shape == shape
    assert int(opt.state[p].get("step", MAX_PERIOD + 1)) == MAX_PERIOD + 1


def test_info_of_the_builtins_keeps_the_harness_numbers():
    """The values moved from the harness's hand lists (CWY paper Table 2 and our fused step)."""
    n, m = 1000, 10
    rgd = optimizers.info("rgd")
    gemm = 2 * n * m * m  # one N×M×M product
    for metric in ("canonical", "euclidean"):
        assert rgd.flops(n, m, metric=metric, retraction="cayley") == 6 * gemm + 6 * m**3
        # XᴴX, XᴴS, SᴴS, X·C − S and (X·C − S)·R⁻¹: for N ≥ 8M the product by the M×M
        # inverse (M³/3), else the solve (half a product); three M×M products (the
        # congruence's two, CᴴH) and Cholesky (Notes [QR retraction through the Gram of
        # X − lr·d], [Right triangular solves])
        qr = 5 * gemm + 3 * 2 * m**3 + m**3 / 3 + m**3 / 3
        assert rgd.flops(n, m, metric=metric, retraction="qr") == pytest.approx(qr)
        short = 4.5 * (2 * 60 * m * m) + 3 * 2 * m**3 + m**3 / 3  # N = 60 < 8M: the solve
        assert rgd.flops(60, m, metric=metric, retraction="qr") == pytest.approx(short)
        # O(n): XᴴS, X·F and the wide XᴴX of one step in k = 8 (n ≥ 256); Cayley an LU solve with
        # n right-hand sides, QR PᴴP, Cholesky and a triangular solve (Note [Square
        # steps in the frame of X])
        cube = 2 * n**3
        lu_solve = 2 * n**3 / 3 + 2 * n**3
        assert rgd.flops(n, n, metric=metric, retraction="cayley") == pytest.approx(
            2 * cube + lu_solve + cube / 8
        )
        qr = 3 * cube + n**3 / 3 + n**3 + cube / 8
        assert rgd.flops(n, n, metric=metric, retraction="qr") == pytest.approx(qr)
    assert rgd.paper(metric="euclidean", retraction="qr") == "14NM² − 2M³/3"
    assert rgd.paper(metric="canonical", retraction="cayley").startswith("28NM² + 16M³")
    assert {(v["metric"], v["retraction"]) for v in rgd.variants} == {
        (a, b) for a in ("canonical", "euclidean") for b in ("cayley", "qr")
    }
    radam = optimizers.info("radam")
    # XᴴG and ξ, Xᴴd and dᴴd, two products for Y and two for the moment's image (Note
    # [Pd through d]); the float64 XᴴX of every step at M = 10 (k = 1)
    assert radam.flops(n, m, retraction="cayley") == 8 * gemm + 6 * m**3 + gemm
    # O(n): the moment in the frame of X, rgd's square step (Note [Moments in the frame of X])
    assert radam.flops(n, n, retraction="cayley") == rgd.flops(n, n, retraction="cayley")
    assert optimizers.info("landing").flops(n, m) == 8 * n * m * m
    assert not optimizers.info("landing").feasible and optimizers.info("adam").default_lr == 1e-2
    assert optimizers.info("geoopt_radam").riemannian and not optimizers.info("sgd").riemannian


def test_info_fields_are_consistent():
    """Every registered optimizer has a usable info (the harness reads it)."""
    for name in _names():
        info = optimizers.info(name)
        assert info.name == name and info.default_lr > 0 and isinstance(info.formula, str)
        assert isinstance(info.variants, list) and info.variants
        for hyper in info.variants:
            optimizers.create(name, [torch.nn.Parameter(torch.zeros(2))], lr=0.1, **hyper)
            if info.step_flops is not None:
                assert info.flops(256, 8, **hyper) > 0
            assert isinstance(info.paper(**hyper), str)


# ------------------------------------------------------------------ a plugin is covered
_PLUGIN = '''
from stiefel.optimizers import RiemannianOptimizer


class PolarSGD(RiemannianOptimizer):
    """Riemannian SGD with the polar retraction, written on the public interface."""

    default_lr = 0.05

    def __init__(self, params, lr=0.05, repair_every=None):
        super().__init__(params, dict(lr=lr, retraction="polar", repair_every=repair_every))

    def update(self, geo, x, grad, state, group):
        d = geo.rgrad(x, grad)
        if "momentum_buffer" not in state:  # some state, so that resuming is checked
            state["momentum_buffer"] = d.clone()
        new, state["momentum_buffer"] = geo.descend_transport(
            x, 0.5 * d + 0.5 * state["momentum_buffer"], group["lr"]
        )
        return new
'''


def test_entry_point_plugin_is_covered(monkeypatch, tmp_path):
    module = "stiefel_conformance_plugin"
    (tmp_path / f"{module}.py").write_text(_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    saved = registry.OPTIMIZERS.snapshot()
    try:
        group = registry.ENTRY_POINT_GROUP
        ep = importlib.metadata.EntryPoint("plugin_polar_sgd", f"{module}:PolarSGD", group)

        def fake_entry_points(**kw):
            return importlib.metadata.EntryPoints([ep] if kw.get("group") == ep.group else [])

        monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
        registry.load_entry_points(force=True)
        # the suite's own lists now hold the plugin, so every test above covers it
        assert "plugin_polar_sgd" in _names(riemannian_only=True)
        assert "plugin_polar_sgd" in _names()
        for space in SPACES:
            for double in (False, True):
                check_manifold("plugin_polar_sgd", space, double)
        check_state_dict_resume("plugin_polar_sgd")
        check_param_groups("plugin_polar_sgd")
        check_euclidean_parameter("plugin_polar_sgd")
        info = optimizers.info("plugin_polar_sgd")
        assert info.riemannian and info.default_lr == 0.05 and info.step_flops is None
    finally:
        registry.OPTIMIZERS.restore(saved)

"""One step of each rule against independent dense references (numpy), and the kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _optim_problems import haar_np, manifold_param

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.manifolds import kernels as mk

RNG = np.random.default_rng(7)


def _sym(a):
    return 0.5 * (a + a.conj().T)


def _cayley_np(x, u):
    """Dense Cayley (I − ½A)⁻¹(I + ½A)X with A = (Pu)Xᴴ − X(Pu)ᴴ, P = I − ½XXᴴ."""
    n = x.shape[0]
    pu = u - 0.5 * x @ (x.conj().T @ u)
    a = pu @ x.conj().T - x @ pu.conj().T
    return np.linalg.solve(np.eye(n) - 0.5 * a, (np.eye(n) + 0.5 * a) @ x), a


def _rgrad_np(x, g, metric):
    if metric == "euclidean":
        return g - x @ _sym(x.conj().T @ g)
    return g - x @ g.conj().T @ x


def _qr_np(a):
    q, r = np.linalg.qr(a)
    d = np.diag(r)
    return q * (d / np.abs(d))


def _polar_np(a):
    u, _, vh = np.linalg.svd(a, full_matrices=False)
    return u @ vh


def _setup(n, m, cplx):
    x = haar_np(RNG, n, m, cplx)
    g = RNG.standard_normal((n, m)) + (1j * RNG.standard_normal((n, m)) if cplx else 0)
    return x, g


SHAPES = [(40, 4, False), (40, 4, True), (6, 6, False), (7, 4, True)]


@pytest.mark.parametrize("n,m,cplx", SHAPES)
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
@pytest.mark.parametrize("retraction", ["cayley", "qr", "polar"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_rgd_two_steps_match_dense_reference(n, m, cplx, metric, retraction, nesterov):
    x, g = _setup(n, m, cplx)
    lr, mu = 0.3, 0.7
    w = manifold_param(torch.tensor(x))
    opt = optimizers.create(
        "rgd", [w], lr=lr, momentum=mu, metric=metric, retraction=retraction, nesterov=nesterov
    )
    xr, buf = x, None
    for _ in range(2):
        w.grad = torch.tensor(g)
        opt.step()
        xi = _rgrad_np(xr, g, metric)
        buf = xi if buf is None else mu * buf + xi
        d = xi + mu * buf if nesterov else buf
        if retraction == "cayley":
            y, a = _cayley_np(xr, -lr * d)
            q = np.linalg.solve(np.eye(n) - 0.5 * a, np.eye(n) + 0.5 * a)
            if not nesterov:
                buf = q @ buf  # isometric transport by the same Cayley map
        else:
            y = (_qr_np if retraction == "qr" else _polar_np)(xr - lr * d)
        if nesterov or retraction != "cayley":
            buf = buf - y @ _sym(y.conj().T @ buf)  # transport by projection
        xr = y
    assert np.abs(w.detach().numpy() - xr).max() < 1e-12
    # a square point's Cayley momentum is kept in its frame, B = X·Ω (Note [Moments in
    # the frame of X]), Nesterov's is not: its transport is the projection
    state = opt.state[w]
    if n == m and retraction == "cayley" and not nesterov:
        assert "momentum_buffer" not in state
        held = w.detach() @ state["momentum_buffer_frame"]
    else:
        assert "momentum_buffer_frame" not in state
        held = state["momentum_buffer"]
    assert np.abs(held.numpy() - buf).max() < 1e-12


def test_canonical_cayley_is_wen_yin():
    """For the canonical gradient, A equals Wen & Yin's GXᴴ − XGᴴ."""
    x, g = _setup(30, 3, False)
    w = manifold_param(torch.tensor(x))
    w.grad = torch.tensor(g)
    optimizers.create("rgd", [w], lr=0.2, metric="canonical").step()
    a = g @ x.T - x @ g.T
    ref = np.linalg.solve(np.eye(30) + 0.1 * a, (np.eye(30) - 0.1 * a) @ x)
    assert np.abs(w.detach().numpy() - ref).max() < 1e-12


@pytest.mark.parametrize("n,m,cplx", SHAPES)
def test_radam_three_steps_match_reference(n, m, cplx):
    x, _ = _setup(n, m, cplx)
    lr, b1, b2, eps = 0.1, 0.8, 0.9, 1e-8
    w = manifold_param(torch.tensor(x))
    opt = optimizers.create("radam", [w], lr=lr, betas=(b1, b2), eps=eps, retraction="qr")
    xr, mom, v = x, 0 * x, 0.0
    for t in range(1, 4):
        _, g = _setup(n, m, cplx)
        w.grad = torch.tensor(g)
        opt.step()
        xi = _rgrad_np(xr, g, "euclidean")
        mom = b1 * mom + (1 - b1) * xi
        v = b2 * v + (1 - b2) * float(np.sum(np.abs(xi) ** 2))
        step = lr / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps)
        y = _qr_np(xr - step * mom)
        mom = mom - y @ _sym(y.conj().T @ mom)
        xr = y
    assert np.abs(w.detach().numpy() - xr).max() < 1e-12


def _radam_cayley_np(x, grads, lr, b1, b2, metric, eps=1e-8):
    """Dense Riemannian Adam with the Cayley step, m transported by the same map."""
    n = x.shape[0]
    xr, mom, v = x, 0 * x, 0.0
    for t, g in enumerate(grads, start=1):
        xi = _rgrad_np(xr, g, metric)
        sq = float(np.sum(np.abs(xi) ** 2))
        if metric == "canonical":  # ⟨ξ, ξ⟩ − ½‖Xᴴξ‖²
            sq -= 0.5 * float(np.sum(np.abs(xr.conj().T @ xi) ** 2))
        mom = b1 * mom + (1 - b1) * xi
        v = b2 * v + (1 - b2) * sq
        step = lr / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps)
        y, a = _cayley_np(xr, -step * mom)
        mom = np.linalg.solve(np.eye(n) - 0.5 * a, (np.eye(n) + 0.5 * a) @ mom)
        xr = y
    return xr, mom


@pytest.mark.parametrize("n,m,cplx", [(6, 6, False), (5, 5, True), (40, 4, False), (7, 4, True)])
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
def test_radam_cayley_steps_match_reference(n, m, cplx, metric):
    """The Cayley step with m transported; a square point holds m in its frame, m = X·Ω
    (Note [Moments in the frame of X]), a tall one holds m."""
    x, _ = _setup(n, m, cplx)
    grads = [_setup(n, m, cplx)[1] for _ in range(4)]
    hyper = dict(lr=0.1, betas=(0.8, 0.9))
    w = manifold_param(torch.tensor(x), Stiefel(n, m, complex=cplx, metric=metric))
    opt = optimizers.create("radam", [w], **hyper)
    for g in grads:
        w.grad = torch.tensor(g)
        opt.step()
    xr, mom = _radam_cayley_np(x, grads, 0.1, 0.8, 0.9, metric)
    state = opt.state[w]
    assert np.abs(w.detach().numpy() - xr).max() < 1e-12
    if n == m:
        assert "exp_avg" not in state
        held = (w.detach() @ state["exp_avg_frame"]).numpy()
    else:
        assert "exp_avg_frame" not in state
        held = state["exp_avg"].numpy()
    assert np.abs(held - mom).max() < 1e-12


def test_radam_moment_saved_ambient_is_carried_into_the_frame():
    """A checkpoint holding m itself (``exp_avg``, an earlier version) continues as if
    it had been saved in the frame: Ω = skew(Xᴴm)."""
    x, _ = _setup(6, 6, False)
    grads = [torch.tensor(_setup(6, 6, False)[1]) for _ in range(4)]
    a, b = manifold_param(torch.tensor(x)), manifold_param(torch.tensor(x))
    opt_a = optimizers.create("radam", [a], lr=0.1)
    for g in grads[:3]:
        a.grad = g.clone()
        opt_a.step()
    saved = opt_a.state_dict()
    st = saved["state"][0]
    st["exp_avg"] = a.detach() @ st.pop("exp_avg_frame")  # the ambient form
    with torch.no_grad():
        b.copy_(a)
    opt_b = optimizers.create("radam", [b], lr=0.1)
    opt_b.load_state_dict(saved)
    a.grad, b.grad = grads[3].clone(), grads[3].clone()
    opt_a.step()
    opt_b.step()
    assert "exp_avg" not in opt_b.state[b]
    assert float((a.detach() - b.detach()).abs().max()) < 1e-12
    diff = opt_a.state[a]["exp_avg_frame"] - opt_b.state[b]["exp_avg_frame"]
    assert float(diff.abs().max()) < 1e-12


def test_radam_frame_moment_carried_out_when_the_retraction_changes():
    """A square point whose group switches to QR (no frame step) lifts Ω to m = XΩ,
    then steps as the dense QR reference."""
    x, _ = _setup(6, 6, False)
    lr, b1, b2, eps = 0.1, 0.8, 0.9, 1e-8
    w = manifold_param(torch.tensor(x))
    opt = optimizers.create("radam", [w], lr=lr, betas=(b1, b2), eps=eps)
    for _ in range(2):
        w.grad = torch.tensor(_setup(6, 6, False)[1])
        opt.step()
    xr = w.detach().numpy().copy()
    state = opt.state[w]
    mom = xr @ state["exp_avg_frame"].numpy()
    v = float(state["exp_avg_sq"])
    opt.param_groups[0]["retraction"] = "qr"
    g = _setup(6, 6, False)[1]
    w.grad = torch.tensor(g)
    opt.step()
    xi = _rgrad_np(xr, g, "euclidean")
    mom = b1 * mom + (1 - b1) * xi
    v = b2 * v + (1 - b2) * float(np.sum(xi**2))
    step = lr / (1 - b1**3) / (np.sqrt(v / (1 - b2**3)) + eps)
    y = _qr_np(xr - step * mom)
    mom = mom - y @ _sym(y.T @ mom)
    assert "exp_avg_frame" not in state
    assert np.abs(w.detach().numpy() - y).max() < 1e-12
    assert np.abs(state["exp_avg"].numpy() - mom).max() < 1e-12


@pytest.mark.parametrize("n,m,cplx", SHAPES)
def test_landing_step_matches_dense_formula(n, m, cplx):
    x, g = _setup(n, m, cplx)
    x = x + 0.01 * RNG.standard_normal(x.shape)  # slightly off the manifold
    lam, lr = 2.0, 0.05
    w = manifold_param(torch.tensor(x))
    w.grad = torch.tensor(g)
    optimizers.create("landing", [w], lr=lr, attraction=lam, safe_step=False).step()
    psi = 0.5 * (g @ x.conj().T - x @ g.conj().T)  # N×N, dense reference
    field = psi @ x + lam * x @ (x.conj().T @ x - np.eye(m))
    assert np.abs(w.detach().numpy() - (x - lr * field)).max() < 1e-12


@pytest.mark.parametrize("n,m", [(8, 8), (12, 4), (13, 4), (30, 4)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_landing_direction_both_forms_against_dense(n, m, dtype):
    """ψX + λX(XᴴX − I), ‖Λ‖² and ‖ψX‖²: the M×M form (N > 3M) and ψX first (N ≤ 3M)."""
    gen = torch.Generator().manual_seed(n + m)

    def draw(*shape):
        a = torch.randn(*shape, dtype=torch.float64, generator=gen)
        if dtype.is_complex:
            a = a + 1j * torch.randn(*shape, dtype=torch.float64, generator=gen)
        return a.to(dtype)

    x = 1.01 * torch.linalg.qr(draw(3, n, m))[0] + 1e-3 * draw(3, n, m)  # off the manifold
    g = draw(3, n, m)
    field, dist, a2, psi2 = mk.landing_direction(x, g, 0.7)
    xh = x.mH
    psi = 0.5 * (g @ xh - x @ g.mH) @ x  # N×N, dense reference
    ref = psi + 0.7 * x @ (xh @ x - torch.eye(m, dtype=dtype))
    tol = 10 * n * torch.finfo(torch.float64).eps
    assert float((field - ref).abs().max()) < tol
    assert torch.allclose(a2.flatten(), ref.abs().square().sum((-2, -1)), rtol=tol, atol=0)
    psi2_ref = psi.abs().square().sum((-2, -1))
    assert torch.allclose(psi2.flatten(), psi2_ref, rtol=100 * tol, atol=tol)
    err = torch.linalg.matrix_norm(xh @ x - torch.eye(m, dtype=dtype))
    assert torch.allclose(dist.flatten(), err, rtol=tol, atol=0)


def test_landing_safe_step_keeps_within_eps():
    x, _ = _setup(50, 5, False)
    w = manifold_param(torch.tensor(x))
    opt = optimizers.create("landing", [w], lr=10.0, eps=0.3)
    for _ in range(50):
        w.grad = torch.tensor(100 * RNG.standard_normal((50, 5)))
        opt.step()
        assert float(mk.orthogonality_error(w.detach())) <= 0.3 + 1e-12


@pytest.mark.parametrize("scale", [1.05, 3.0, 30.0])
def test_landing_off_manifold_start_returns_without_nan(scale):
    x, _ = _setup(60, 6, False)
    x0 = scale * x + 0.3 * RNG.standard_normal(x.shape)
    w = manifold_param(torch.tensor(x0))
    opt = optimizers.create("landing", [w], lr=0.5)
    for _ in range(400):
        w.grad = torch.tensor(RNG.standard_normal((60, 6)) * 1e-3)
        opt.step()
        assert torch.isfinite(w).all()
    assert float(mk.orthogonality_error(w.detach())) < 1e-2


def test_plain_parameters_get_torch_euclidean_rules():
    """rgd ≡ torch SGD(momentum), radam ≡ torch Adam, landing ≡ SGD on plain tensors."""
    torch.manual_seed(0)
    cases = [
        ("rgd", dict(lr=0.1, momentum=0.9), torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        ("radam", dict(lr=0.1, betas=(0.8, 0.9)), torch.optim.Adam, dict(lr=0.1, betas=(0.8, 0.9))),
        ("landing", dict(lr=0.1), torch.optim.SGD, dict(lr=0.1)),
    ]
    for name, hyper, ref_cls, ref_hyper in cases:
        # torch's Adam treats a complex entry as two real ones; ours as one ℂ component
        for dtype in (torch.float64,) if name == "radam" else (torch.float64, torch.complex128):
            a = torch.nn.Parameter(torch.randn(5, 3, dtype=dtype))
            b = torch.nn.Parameter(a.detach().clone())
            ours, ref = optimizers.create(name, [a], **hyper), ref_cls([b], **ref_hyper)
            for _ in range(5):
                g = torch.randn(5, 3, dtype=dtype)
                a.grad, b.grad = g.clone(), g.clone()
                ours.step()
                ref.step()
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-13), name


@pytest.mark.parametrize("n,m", [(50, 5), (8, 8), (9, 5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_fused_kernels_match_manifold_kernels(n, m, dtype):
    x = mk.haar(n, m, 2, dtype=dtype)
    g = torch.randn(2, n, m, dtype=dtype)
    d = mk.proj_tangent(x, g)
    lr = torch.tensor([0.1, 0.4], dtype=torch.float64).reshape(2, 1, 1)
    y, td = mk.cayley_descent(x, d, lr, d)
    yr, tr = mk.cayley_dense(x, -lr * d, d)
    assert (y - yr).abs().max() < 1e-12 and (td - tr).abs().max() < 1e-12
    for metric, rg in [
        ("euclidean", mk.egrad2rgrad_euclidean),
        ("canonical", mk.egrad2rgrad_canonical),
    ]:
        ys = mk.cayley_gradient_step(x, g, 0.2, metric)
        assert (ys - mk.cayley_dense(x, -0.2 * rg(x, g))).abs().max() < 1e-12


def test_newton_schulz_correction_is_quadratic():
    x = mk.haar(100, 8, dtype=torch.float64)
    e0 = 1e-4
    y = x + e0 * torch.randn(100, 8, dtype=torch.float64)
    before = float(mk.orthogonality_error(y))
    after = float(mk.orthogonality_error(mk.newton_schulz(y)))
    assert after < 10 * before**2

"""manifold_muon: the direction against an independent float64 solver, training, errors."""

from __future__ import annotations

import geoopt
import numpy as np
import pytest
import scipy.optimize
import torch

from stiefel import optimizers
from stiefel.manifolds import Orthogonal, Stiefel
from stiefel.manifolds.kernels import msign
from stiefel.manifolds.kernels.msign import spectral_direction

from ._optim_problems import PROBLEMS, haar_np, manifold_param, start_point


def _herm_basis(m: int, cplx: bool) -> list[np.ndarray]:
    basis = []
    for i in range(m):
        for j in range(i, m):
            e = np.zeros((m, m), dtype=complex if cplx else float)
            e[i, j] = e[j, i] = 1.0
            basis.append(e)
            if cplx and i != j:
                f = np.zeros((m, m), dtype=complex)
                f[i, j], f[j, i] = 1j, -1j
                basis.append(f)
    return basis


def _scipy_solution(x: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, float]:
    """Independent solver: minimise the dual ‖G + XΛ‖_* over Hermitian Λ with BFGS.

    Returns the maximiser msign(G + XΛ*) (numpy SVD) and the dual optimal value, which
    bounds Re tr(GᴴΦ) from above for every feasible Φ (weak duality).
    """
    basis = _herm_basis(x.shape[1], np.iscomplexobj(x))

    def lam(theta):
        return sum(t * b for t, b in zip(theta, basis, strict=True))

    def fun(theta):
        z = g + x @ lam(theta)
        u, s, vh = np.linalg.svd(z, full_matrices=False)
        grad_lam = x.conj().T @ (u @ vh)  # d‖Z‖_* / dΛ paired with each basis element
        return s.sum(), np.array([np.real(np.sum(grad_lam.conj() * b)) for b in basis])

    res = scipy.optimize.minimize(
        fun, np.zeros(len(basis)), jac=True, method="BFGS", options={"gtol": 1e-13, "maxiter": 5000}
    )
    u, _, vh = np.linalg.svd(g + x @ lam(res.x), full_matrices=False)
    return u @ vh, float(res.fun)


@pytest.mark.parametrize("n,m,cplx", [(8, 3, False), (12, 4, False), (20, 5, False), (9, 3, True)])
def test_direction_equals_independent_convex_solution(n, m, cplx):
    rng = np.random.default_rng(n * 10 + m)
    x = haar_np(rng, n, m, cplx)
    g = rng.standard_normal((n, m)) + (1j * rng.standard_normal((n, m)) if cplx else 0)
    ref, dual_value = _scipy_solution(x, g)
    phi = spectral_direction(torch.tensor(x), torch.tensor(g), 400, "svd").numpy()
    # feasible: tangent and in the spectral unit ball
    assert np.abs(x.conj().T @ phi + phi.conj().T @ x).max() < 1e-9
    assert np.linalg.norm(phi, 2) < 1 + 1e-9
    # optimal: the primal value reaches the dual bound, and Φ equals scipy's maximiser
    primal = float(np.real(np.sum(g.conj() * phi)))
    assert abs(primal - dual_value) < 1e-9 * abs(dual_value)
    assert np.abs(phi - ref).max() < 1e-6
    # Polar Express gives the same direction
    phi_pe = spectral_direction(torch.tensor(x), torch.tensor(g), 400, "polar_express", 12)
    assert np.abs(phi_pe.numpy() - phi).max() < 1e-9


@pytest.mark.parametrize("cplx", [False, True])
def test_square_case_is_closed_form(cplx):
    # On O(n)/U(n): Φ = X msign(skew(XᴴG)), the maximiser over all skew Ω with ‖Ω‖₂ ≤ 1.
    rng = np.random.default_rng(3)
    x = torch.tensor(haar_np(rng, 6, 6, cplx))
    g = torch.tensor(
        rng.standard_normal((6, 6)) + (1j * rng.standard_normal((6, 6)) if cplx else 0)
    )
    h = x.mH @ g
    expected = x @ msign(0.5 * (h - h.mH), "svd")
    assert torch.allclose(spectral_direction(x, g, 1, "svd"), expected, atol=1e-12)
    ref, dual_value = _scipy_solution(x.numpy(), g.numpy())
    assert abs(float((g.conj() * expected).real.sum()) - dual_value) < 1e-8


def test_batched_direction_equals_per_matrix():
    x = torch.linalg.qr(torch.randn(4, 10, 3, dtype=torch.float64))[0]
    g = torch.randn(4, 10, 3, dtype=torch.float64)
    batched = spectral_direction(x, g, 20, "polar_express")
    single = torch.stack([spectral_direction(x[i], g[i], 20, "polar_express") for i in range(4)])
    assert torch.allclose(batched, single, atol=1e-12)
    # a column-major batch (LAPACK's layout, as points from torch.linalg.qr are): the
    # same direction, kept in the gradient's layout through the dual descent
    cm = spectral_direction(x.mT.contiguous().mT, g.mT.contiguous().mT, 20, "polar_express")
    assert torch.allclose(cm, batched, atol=1e-12) and cm.stride(-2) == 1
    xs = torch.linalg.qr(torch.randn(4, 3, 3, dtype=torch.float64))[0]
    gs = torch.randn(4, 3, 3, dtype=torch.float64)  # O(3): the closed form
    cms = spectral_direction(xs.mT.contiguous().mT, gs.mT.contiguous().mT, 1, "polar_express")
    assert torch.allclose(cms, spectral_direction(xs, gs, 1, "polar_express"), atol=1e-12)
    assert cms.stride(-2) == 1


@pytest.mark.parametrize(
    "problem,n,m,cplx,method",
    [
        (problem, n, m, cplx, "polar_express")
        for problem in sorted(PROBLEMS)
        for n, m, cplx in [(10, 3, False), (8, 2, True), (5, 5, False)]
    ]
    + [("procrustes", 10, 3, False, "svd"), ("brockett", 8, 2, True, "newton_schulz_cubic")],
)
def test_training_decreases_loss_and_stays_on_manifold(problem, n, m, cplx, method):
    rng = np.random.default_rng(7)
    loss_fn, error, target = PROBLEMS[problem](rng, n, m, cplx)
    w = manifold_param(start_point(rng, n, m, cplx, target))
    opt = optimizers.create("manifold_muon", [w], lr=0.3, momentum=0.5, msign=method, inner_steps=4)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.96)
    first = float(loss_fn(w.detach()))
    for _ in range(120):
        opt.zero_grad()
        loss_fn(w).backward()
        opt.step()
        sched.step()
        assert float(w.manifold.orthogonality_error(w.detach())) < 1e-12
    assert float(loss_fn(w.detach())) < first
    assert error(w.detach().numpy()) < 1e-2


def test_each_step_has_spectral_length_lr():
    # retr(X, −lr·Φ) with Cayley: ‖X_new − X‖₂ = lr·‖Φ‖₂ + O(lr²), ‖Φ‖₂ = 1.
    st = Stiefel(30, 4)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    x0 = w.detach().clone()
    opt = optimizers.create("manifold_muon", [w], lr=1e-4, inner_steps=50)
    w.grad = torch.randn_like(w)
    opt.step()
    step = float(torch.linalg.matrix_norm(w.detach() - x0, 2))
    assert abs(step - 1e-4) < 1e-7


def test_plain_tensors_muon_and_sgd():
    a = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt = optimizers.create("manifold_muon", [a, b], lr=0.1, msign="svd")
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    u, _, vh = torch.linalg.svd(a.grad, full_matrices=False)
    opt.step()
    assert torch.allclose(a.detach(), a0 - 0.1 * (u @ vh), atol=1e-12)
    assert torch.allclose(b.detach(), b0 - 0.1 * b.grad, atol=1e-15)


@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (40, 40)])
def test_plain_weights_step_as_torch_muon(shape):
    # torch.optim.Muon: the same quintic (in bfloat16), momentum as a lerp (a rescaled
    # buffer, the same direction); its lr scale sqrt(max(1, A/B)) is undone for tall
    # weights. Wide and tall 4:1 run msign's Gram engine, square the direct one.
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) / 10
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    lr = 0.1
    ours = optimizers.create(
        "manifold_muon", [p], lr=lr, momentum=0.9, nesterov=True, msign="newton_schulz"
    )
    scale = max(1.0, shape[0] / shape[1]) ** 0.5
    ref = torch.optim.Muon([q], lr=lr / scale, momentum=0.9, nesterov=True, weight_decay=0.0)
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    moved = float((q.detach() - w).abs().max())
    assert moved > lr / 10
    assert float((p.detach() - q.detach()).abs().max()) < 0.05 * moved  # bfloat16 rounding


def test_nesterov_momentum_on_plain_tensor_matches_torch_sgd():
    p = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    ours = optimizers.create("manifold_muon", [p], lr=0.1, momentum=0.9, nesterov=True)
    ref = torch.optim.SGD([q], lr=0.1, momentum=0.9, nesterov=True)
    for k in range(4):
        g = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(p, q, atol=1e-14)


def test_info_attributes():
    cls = type(optimizers.create("manifold_muon", [torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    assert cls.default_lr > 0 and cls.formula
    assert cls.step_flops(4096, 64) > cls.step_flops(4096, 64, inner_steps=1) > 0


@pytest.mark.parametrize(
    "hyper,exc,match",
    [
        ({"lr": -1.0}, ValueError, r"lr=-1\.0 is out of range; allowed: \[0\.0, inf\)"),
        ({"lr": 0.1, "msign": "qr"}, ValueError, r"msign='qr'.*newton_schulz.*polar_express.*svd"),
        ({"lr": 0.1, "inner_steps": 0}, ValueError, r"inner_steps=0.*int >= 1"),
        ({"lr": 0.1, "inner_steps": 2.5}, ValueError, r"inner_steps=2\.5"),
        ({"lr": 0.1, "msign_steps": 0}, ValueError, r"msign_steps=0"),
        (
            {"lr": 0.1, "nesterov": True},
            ValueError,
            r"nesterov=True with momentum=0\.0; allowed: momentum > 0",
        ),
        ({"lr": 0.1, "nesterov": 1}, TypeError, r"nesterov=1"),
        ({"lr": 0.1, "retraction": "exp"}, ValueError, r"retraction='exp'.*cayley"),
        ({"lr": 0.1, "dual_step": 0}, ValueError, r"dual_step=0"),
    ],
)
def test_bad_hyper_parameters(hyper, exc, match):
    w = geoopt.ManifoldParameter(Orthogonal(3).random(dtype=torch.float64), manifold=Orthogonal(3))
    with pytest.raises(exc, match=match):
        optimizers.create("manifold_muon", [w], **hyper)

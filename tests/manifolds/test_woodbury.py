"""The 2M×2M system of the Woodbury Cayley step, by block elimination or one LU.

Note [Woodbury system by block elimination]: both paths against the float64
2M×2M solve of the system as the Note writes it (scaled, block by block), the
test that picks the path at its bounds, the batch rule (one matrix out of bounds
sends the batch to the LU), gradients, tracing, and the Cayley step on both paths
against the dense N×N formula.
"""

import pytest
import torch

from stiefel.manifolds import kernels
from stiefel.manifolds.kernels import woodbury
from stiefel.manifolds.kernels.woodbury import elimination_bounds, solve_step_system

ALL = [torch.float32, torch.float64, torch.complex64, torch.complex128]


def _wide(dtype):
    return torch.complex128 if dtype.is_complex else torch.float64


def _data(batch, n, m, dtype, gen, v=False):
    """XᴴPd, XᴴX, PdᴴPd (and Xᴴv, Pdᴴv) of a point near St(n, m) and a tangent step."""
    w = _wide(dtype)
    x = torch.linalg.qr(torch.randn(*batch, n, m, dtype=w, generator=gen))[0]
    x = x + 1e-6 * torch.randn(*batch, n, m, dtype=w, generator=gen)  # a little drift
    d = kernels.proj_tangent(x, torch.randn(*batch, n, m, dtype=w, generator=gen))
    pd = d - 0.5 * x @ (x.mH @ d)
    out = [x.mH @ pd, x.mH @ x, pd.mH @ pd]
    if v:
        vv = torch.randn(*batch, n, m, dtype=w, generator=gen)
        out += [x.mH @ vv, pd.mH @ vv]
    return [a.to(dtype) for a in out]


def _reference(xpd, g, pdpd, lr, xv=None, pdv=None):
    """(V₁/t, Z₂) by one float64 solve of the scaled system, written out as in the docstring."""
    xpd, g, pdpd = (a.to(_wide(a.dtype)) for a in (xpd, g, pdpd))
    t = pdpd.diagonal(dim1=-2, dim2=-1).real.sum(-1).sqrt()[..., None, None]  # ‖Pd‖_F
    beta = lr * t
    gamma, sigma = 1 / beta.abs().clamp_min(1), beta.clamp(-1, 1)
    h = sigma / 2
    e, f = xpd / t, pdpd / t**2
    eye = torch.eye(g.shape[-1], dtype=g.dtype)
    lhs = torch.cat(
        (
            torch.cat((gamma * eye + h * e, -h * g), -1),
            torch.cat((h * f, gamma * eye - h * e.mH), -1),
        ),
        -2,
    )
    top, bottom = g, e.mH
    if xv is not None:
        top = torch.cat((g, xv.to(g.dtype)), -1)
        bottom = torch.cat((e.mH, pdv.to(g.dtype) / t), -1)
    z = torch.linalg.solve(lhs, sigma * torch.cat((top, bottom), -2))
    m = g.shape[-1]
    return z[..., :m, :] / t, z[..., m:, :]


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("eliminate", [True, False])
@pytest.mark.parametrize("transport", [False, True])
@pytest.mark.parametrize("lr", [1e-3, 0.02, 0.05])
def test_both_paths_solve_the_scaled_system(dtype, eliminate, transport, lr, device):
    # |β| = lr·‖Pd‖_F ≈ lr·20 here: up to about 1, inside the bounds of elimination
    gen = torch.Generator().manual_seed(3)
    data = _data((5,), 60, 8, dtype, gen, v=transport)
    args = [a.to(device) for a in data]
    t = args[2].diagonal(dim1=-2, dim2=-1).real.sum(-1)[..., None, None].sqrt()
    assert elimination_bounds(*args[:2], t, lr) is not None
    z1, z2 = solve_step_system(*args[:3], lr, *args[3:], lu=not eliminate)
    r1, r2 = _reference(*data[:3], lr, *data[3:])
    tol = 50 * 8 * torch.finfo(dtype).eps
    scale = max(float(r1.abs().max()), float(r2.abs().max()))
    assert z1.dtype == dtype and z1.shape == r1.shape and z2.shape == r2.shape
    assert float((z1.cpu().to(r1.dtype) - r1).abs().max()) < tol * scale
    assert float((z2.cpu().to(r2.dtype) - r2).abs().max()) < tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_elimination_is_accurate_at_its_bounds(dtype, device):
    # |β| = 4 and |β|·‖E‖_F = 1, the corner the Note bounds (cond T ≤ 3, growth ≤ 2‖G‖):
    # E is scaled to ‖E‖_F = ¼ by a step along X itself mixed with one orthogonal to it
    gen = torch.Generator().manual_seed(7)
    w = _wide(dtype)
    n, m = 40, 6
    x = torch.linalg.qr(torch.randn(4, n, m, dtype=w, generator=gen))[0]
    inner = torch.randn(4, m, m, dtype=w, generator=gen)
    inner = inner - inner.mH
    normal = torch.randn(4, n, m, dtype=w, generator=gen)
    normal = normal - x @ (x.mH @ normal)
    pd = x @ inner + normal
    xpd, pdpd = x.mH @ pd, pd.mH @ pd
    # scale the normal part so that ‖XᴴPd‖_F = ¼‖Pd‖_F, then lr so that |β| = 4
    a2 = torch.linalg.matrix_norm(xpd, keepdim=True) ** 2
    c2 = torch.linalg.matrix_norm(normal, keepdim=True) ** 2
    pd = x @ inner + normal * (15 * a2 / c2).sqrt()
    xpd, pdpd = x.mH @ pd, pd.mH @ pd
    t = torch.linalg.matrix_norm(pd, keepdim=True)
    pd, xpd, pdpd = pd / t, xpd / t, pdpd / t**2  # t = 1: lr = β
    data = [a.to(dtype) for a in (xpd, x.mH @ x, pdpd)]
    args = [a.to(device) for a in data]
    lr = 4.0 * (1 - 1e-3)
    assert elimination_bounds(*args[:2], torch.ones(4, 1, 1, device=device), lr) is not None
    z1, z2 = solve_step_system(*args, lr)
    r1, r2 = _reference(*data, lr)
    tol = 50 * m * torch.finfo(dtype).eps
    assert float((z1.cpu().to(r1.dtype) - r1).abs().max()) < tol * float(r1.abs().max())
    assert float((z2.cpu().to(r2.dtype) - r2).abs().max()) < tol * float(r2.abs().max())


def test_the_test_follows_both_bounds(device):
    t = torch.ones(2, 1, 1, device=device)
    g = torch.eye(3, device=device).expand(2, 3, 3)

    def eliminable(xpd, lr):
        return elimination_bounds(xpd, g, t, lr) is not None

    small = torch.zeros(2, 3, 3, device=device)
    small[..., 0, 1] = 0.1  # ‖XᴴPd‖_F = 0.1 < t/4: |β| ≤ 4 decides
    assert eliminable(small, 4.0)
    assert eliminable(small, -4.0)
    assert not eliminable(small, 4.01)
    big = torch.zeros(2, 3, 3, device=device)
    big[..., 0, 1] = 0.5  # ‖XᴴPd‖_F = 0.5 > t/4: |β|·‖E‖_F ≤ 1 decides
    assert eliminable(big, 2.0)
    assert not eliminable(big, 2.01)
    # one matrix out of bounds sends the whole batch to the LU
    mixed = torch.stack((small[0], big[0]))
    assert eliminable(mixed, 2.0) and not eliminable(mixed, 3.0)
    # a step size per matrix
    lr = torch.tensor([4.0, 2.0], device=device)[:, None, None]
    assert eliminable(mixed, lr) and not eliminable(mixed, lr.flip(0))
    assert not eliminable(small, float("nan"))
    assert not eliminable(small, float("inf"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("lr", [1e-3, 0.05, 0.5, 2.0])
@pytest.mark.parametrize("drift", [0.0, 1e-2])
def test_the_bounds_hold_the_blocks_norms(dtype, lr, drift):
    # Note [Near-identity blocks of the elimination]: r_T ≥ ‖T − I‖₂ and r_S ≥ ‖S − I‖₂
    # for every matrix, T and S formed densely from the data; drifted points too
    gen = torch.Generator().manual_seed(9)
    x = torch.linalg.qr(torch.randn(6, 40, 5, dtype=dtype, generator=gen))[0]
    x = x + drift * torch.randn(6, 40, 5, dtype=dtype, generator=gen)
    d = 0.1 * torch.randn(6, 40, 5, dtype=dtype, generator=gen)
    d = d * torch.rand(6, 1, 1, generator=gen)  # lengths 0–1.4: |β| up to about 3
    pd = d - 0.5 * x @ (x.mH @ d)
    xpd, g, pdpd = x.mH @ pd, x.mH @ x, pd.mH @ pd
    t = torch.linalg.matrix_norm(pd, keepdim=True)
    bounds = elimination_bounds(xpd, g, t, lr)
    assert bounds is not None
    a = 0.5 * lr
    eye = torch.eye(5, dtype=dtype)
    kt = a * xpd
    w1 = a * a * pdpd @ torch.linalg.solve(eye + kt, g) - kt.mH
    assert float(torch.linalg.matrix_norm(kt, 2).max()) <= bounds[0] * (1 + 1e-12)
    assert float(torch.linalg.matrix_norm(w1, 2).max()) <= bounds[1] * (1 + 1e-12)


def test_training_steps_take_the_series_and_long_ones_the_solve(monkeypatch):
    # Note [Near-identity blocks of the elimination]: on the CPU (r ≤ 1/8 in float32)
    # a short step solves neither block by LU, a longer one S (r_S = 0.15) or both
    # (r_T = 0.13), and a step out of the elimination's bounds one 2M×2M LU; each
    # against the reference
    calls = []
    solve = torch.linalg.solve

    def counting(lhs, rhs, **kwargs):
        calls.append(lhs.shape[-1])
        return solve(lhs, rhs, **kwargs)

    monkeypatch.setattr(torch.linalg, "solve", counting)
    gen = torch.Generator().manual_seed(3)
    data = _data((4,), 60, 8, torch.float32, gen)
    t = data[2].diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None].sqrt()
    for lr, expected in ((1e-3, []), (0.02, [8]), (0.1, [8, 8]), (0.5, [16])):
        calls.clear()
        bounds = elimination_bounds(*data[:2], t, lr)
        z1, z2 = solve_step_system(*data, lr)
        assert calls == expected, (lr, bounds)
        r1, r2 = _reference(*data, lr)
        scale = max(float(r1.abs().max()), float(r2.abs().max()))
        tol = 50 * 8 * torch.finfo(torch.float32).eps * scale
        assert float((z1.double() - r1).abs().max()) < tol
        assert float((z2.double() - r2).abs().max()) < tol


def test_elimination_has_the_gradients_of_the_system():
    gen = torch.Generator().manual_seed(11)
    data = [a.requires_grad_() for a in _data((2,), 12, 3, torch.float64, gen, v=True)]

    def fn(*a):
        return solve_step_system(*a[:3], 0.03, *a[3:])

    t = torch.ones(1, 1, 1, dtype=torch.float64)
    assert elimination_bounds(*(a.detach() for a in data[:2]), t, 0.03) is not None
    assert torch.autograd.gradcheck(fn, data)


@pytest.mark.slow  # an Inductor compilation of the whole solve: about 12 s
def test_a_traced_call_takes_the_lu():
    # the test is a host read: under torch.compile(fullgraph=True) the LU runs, with
    # the numbers of the eager LU
    gen = torch.Generator().manual_seed(5)
    data = _data((3,), 30, 4, torch.float64, gen)
    compiled = torch.compile(lambda *a: solve_step_system(*a, 0.01), fullgraph=True)
    traced = compiled(*data)
    eager = solve_step_system(*data, 0.01, lu=True)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("lr", [1e-3, 0.03, 2.0])
def test_cayley_step_on_both_paths_equals_the_dense_formula(dtype, lr, device, monkeypatch):
    # the whole step (and its transport); lr = 2 is out of bounds for this data: the LU
    gen = torch.Generator().manual_seed(2)
    w = _wide(dtype)
    x = torch.linalg.qr(torch.randn(3, 50, 6, dtype=w, generator=gen))[0]
    d = kernels.proj_tangent(x, torch.randn(3, 50, 6, dtype=w, generator=gen))
    ref_y, ref_v = kernels.cayley_dense(x, -lr * d, -lr * d)
    test = woodbury.elimination_bounds
    out, taken = {}, []
    for allowed in (True, False):

        def spy(*args, allowed=allowed):
            bounds = test(*args) if allowed else None
            taken.append(bounds is not None)
            return bounds

        monkeypatch.setattr(woodbury, "elimination_bounds", spy)
        xd, dd = x.to(dtype).to(device), d.to(dtype).to(device)
        y, v = kernels.cayley_descent(xd, dd, lr, dd)
        out[allowed] = y.cpu(), v.cpu()
    assert taken == [lr < 1, False]
    tol = 100 * 50 * torch.finfo(dtype).eps
    for y, v in out.values():
        assert float((y.to(w) - ref_y).abs().max()) < tol
        err = float((v.to(w) * -lr - ref_v).abs().max())
        assert err < tol * max(1.0, lr) * float(d.abs().max())


def test_an_empty_batch_gives_empty_results():
    # no matrix to bound or solve: the elimination returns empty blocks, and the step
    # (with its transport) an empty batch of points
    empty = torch.zeros(0, 4, 4, dtype=torch.float64)
    t = torch.zeros(0, 1, 1, dtype=torch.float64)
    assert elimination_bounds(empty, empty, t, 0.1) == (0.0, 0.0)
    z1, z2 = solve_step_system(empty, empty, empty, 0.1)
    assert z1.shape == z2.shape == (0, 4, 4)
    x = torch.zeros(0, 10, 4, dtype=torch.float64)
    y, v = kernels.cayley_descent(x, x, 0.1, x)
    assert y.shape == v.shape == (0, 10, 4)

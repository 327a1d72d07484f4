"""Kernels against independent dense references (explicit products, float64 formulas)."""

import pytest
import torch

from stiefel.parametrizations import kernels as K
from stiefel.parametrizations._inverse import cayley_scaling, reflections_from_point

REAL = (torch.float32, torch.float64)
CPLX = (torch.complex64, torch.complex128)


def eps(dtype):
    return torch.finfo(dtype).eps


def reflection(v):
    """Dense H(v) = I − 2vvᴴ/‖v‖², in float64 / complex128."""
    v = v.to(torch.complex128 if v.is_complex() else torch.float64)
    return torch.eye(v.shape[0], dtype=v.dtype) - 2 * torch.outer(v, v.conj()) / torch.vdot(v, v)


def reference(v, d, m):
    """H(v₁)⋯H(v_L)[diag(d); 0] as an explicit product of dense reflections."""
    n, L = v.shape
    hi = torch.complex128 if v.is_complex() else torch.float64
    q = torch.eye(n, dtype=hi)
    for k in range(L):
        q = q @ reflection(v[:, k])
    return q[:, :m] * d.to(hi)


def random_diag(m, dtype, gen):
    if dtype.is_complex:
        return torch.polar(
            torch.ones(m, dtype=torch.float64), torch.randn(m, generator=gen, dtype=torch.float64)
        )
    return torch.sign(torch.randn(m, generator=gen, dtype=torch.float64))


SHAPES = [(6, 6, 6), (6, 6, 2), (9, 3, 3), (9, 3, 7), (9, 4, 1)]


@pytest.mark.parametrize("n,m,L", SHAPES)
@pytest.mark.parametrize("dtype", REAL + CPLX)
def test_reflection_kernels_match_explicit_product(n, m, L, dtype):
    gen = torch.Generator().manual_seed(n * 100 + m * 10 + L)
    v = torch.randn(n, L, dtype=dtype, generator=gen)
    d = random_diag(m, dtype, gen)
    ref = reference(v, d, m)
    tol = 10 * n * eps(dtype)
    for q in (K.cwy_matrix(v, d, m), K.householder_matrix(v, d, m, block=2)):
        assert q.dtype == dtype and q.shape == (n, m)
        assert (q.to(ref.dtype) - ref).abs().max() < tol
    x = torch.randn(5, m, dtype=dtype, generator=gen)
    xt = torch.randn(5, n, dtype=dtype, generator=gen)
    for lin in (K.cwy_linear, K.householder_linear):
        y = lin(v, x, d.to(dtype))
        assert (y.to(ref.dtype) - x.to(ref.dtype) @ ref.mT).abs().max() < 10 * tol
        yt = lin(v, xt, d.to(dtype), transposed=True)
        assert (yt.to(ref.dtype) - xt.to(ref.dtype) @ ref).abs().max() < 10 * tol


@pytest.mark.parametrize(
    "dtype,tol",
    [
        (torch.float32, 1e-5),
        (torch.float64, 1e-12),
        (torch.complex64, 1e-5),
        (torch.complex128, 1e-12),
    ],
)
def test_householder_equals_cwy(dtype, tol):
    gen = torch.Generator().manual_seed(1)
    for n, m, L in [(16, 16, 16), (32, 8, 8), (16, 16, 5)]:
        v = torch.randn(3, n, L, dtype=dtype, generator=gen)
        d = random_diag(m, dtype, gen)
        a, b = K.cwy_matrix(v, d, m), K.householder_matrix(v, d, m)
        assert (a - b).abs().max() < tol


def test_tcwy_is_theorem3_and_never_square():
    gen = torch.Generator().manual_seed(2)
    n, m = 50, 3
    v = torch.randn(n, m, dtype=torch.float64, generator=gen)
    u = v / v.norm(dim=0)
    s = 0.5 * torch.eye(m, dtype=torch.float64) + torch.triu(u.T @ u, 1)
    gamma = torch.eye(n, m, dtype=torch.float64) - u @ torch.linalg.inv(s) @ u[:m].T
    q = K.tcwy_matrix(v, m)
    assert (q - gamma).abs().max() < 1e-13
    assert (q.T @ q - torch.eye(m, dtype=torch.float64)).norm() < 10 * n * eps(torch.float64)


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
@pytest.mark.parametrize("block", (1, 2, 3, 64))
def test_householder_backward_gradcheck(dtype, block):
    # block 3 does not divide L = 4: blocks of 3 and 1 reflections
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(2, 5, 4, dtype=dtype, generator=gen, requires_grad=True)
    x = torch.randn(2, 5, 3, dtype=dtype, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, x: K.householder_apply(v, x, block), (v, x))


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_householder_gradient_of_one_input_against_the_dense_product(dtype):
    """Only V or only X needs a gradient: the backward pass skips the innermost block's
    updates (V only) or the sweep of the output (X only); both against autograd through
    the explicit product of dense reflections, for blocks of 3, 3 and 1 reflections."""
    gen = torch.Generator().manual_seed(13)
    n, L, p = 8, 7, 5
    v = torch.randn(n, L, dtype=dtype, generator=gen)
    x = torch.randn(n, p, dtype=dtype, generator=gen)
    g = torch.randn(n, p, dtype=dtype, generator=gen)

    def dense(v, x):
        q = torch.eye(n, dtype=dtype)
        for k in range(L):
            u = v[:, k : k + 1]
            q = q - 2 * (q @ u) @ u.mH / (u.mH @ u)
        return q @ x

    tol = 100 * n * eps(dtype)
    for wrt in (0, 1):
        a = [v.clone(), x.clone()]
        a[wrt].requires_grad_()
        (ours,) = torch.autograd.grad(K.householder_apply(*a, 3), a[wrt], g)
        (ref,) = torch.autograd.grad(dense(*a), a[wrt], g)
        assert (ours - ref).abs().max() < tol * ref.abs().max()
    assert torch.autograd.gradcheck(lambda w: K.householder_apply(w, x, 3), (v.requires_grad_(),))


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_householder_one_block_equals_one_reflection_at_a_time(dtype):
    """block ≥ L (one compact WY block, Proposition 1) against block = 1 (Algorithm 1's
    reflection-by-reflection loop): output and both gradients to 10·n·eps."""
    gen = torch.Generator().manual_seed(14)
    n, L, p = 12, 9, 4
    v = torch.randn(n, L, dtype=dtype, generator=gen)
    x = torch.randn(n, p, dtype=dtype, generator=gen)
    g = torch.randn(n, p, dtype=dtype, generator=gen)
    results = []
    for block in (1, L, 4 * L):
        a, b = v.clone().requires_grad_(), x.clone().requires_grad_()
        y = K.householder_apply(a, b, block)
        results.append((y, *torch.autograd.grad(y, (a, b), g)))
    tol = 10 * n * eps(dtype)
    for other in results[1:]:
        for ours, ref in zip(other, results[0], strict=True):
            assert (ours - ref).abs().max() < tol * max(1.0, float(ref.abs().max()))


def test_householder_backward_matches_algorithm1_by_hand():
    """Lines 4–18 of Algorithm 1, written out for one vector, against the custom backward."""
    gen = torch.Generator().manual_seed(4)
    n, m = 6, 4
    u = torch.randn(n, m, dtype=torch.float64, generator=gen)
    h = torch.randn(n, dtype=torch.float64, generator=gen)
    dc = torch.randn(n, dtype=torch.float64, generator=gen)
    norms = (u * u).sum(0)
    hs = [None] * (m + 1)
    hs[m] = h
    ht = torch.zeros(m, dtype=torch.float64)
    for k in reversed(range(m)):  # H_{*,k} = H_{*,k+1} − h̃_k U_{*,k}
        ht[k] = 2 / norms[k] * u[:, k] @ hs[k + 1]
        hs[k] = hs[k + 1] - ht[k] * u[:, k]
    g, grad_u = dc.clone(), torch.zeros_like(u)
    for k in range(m):
        ct = 2 / norms[k] * u[:, k] @ g
        g = g - ct * u[:, k]
        grad_u[:, k] = -ht[k] * g - ct * hs[k + 1]
    uu, hh = u.clone().requires_grad_(), h.clone().requires_grad_()
    y = K.householder_apply(uu, hh[:, None], block=1)[:, 0]
    y.backward(dc)
    assert (y.detach() - hs[0]).abs().max() < 1e-13
    assert (hh.grad - g).abs().max() < 1e-13
    # the paper's Theorem 2 ignores ‖u‖'s dependence on u only through N; ours is exact
    assert (uu.grad - grad_u).abs().max() < 1e-12


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_map_kernels_gradcheck(dtype):
    gen = torch.Generator().manual_seed(5)
    n, m = 4, 3
    v = torch.randn(n, m, dtype=dtype, generator=gen, requires_grad=True)
    x = torch.randn(2, m, dtype=dtype, generator=gen, requires_grad=True)
    d = random_diag(m, dtype, gen).to(dtype)
    assert torch.autograd.gradcheck(lambda v: K.cwy_matrix(v, d, m), (v,))
    assert torch.autograd.gradcheck(lambda v, x: K.cwy_linear(v, x, d), (v, x))
    assert torch.autograd.gradcheck(lambda v, x: K.householder_linear(v, x, d), (v, x))
    raw = torch.randn(n, n, dtype=dtype, generator=gen, requires_grad=True)
    base = torch.linalg.qr(torch.randn(n, n, dtype=dtype, generator=gen))[0]
    assert torch.autograd.gradcheck(lambda r: K.exp_map(K.skew_from_raw(r), base, m), (raw,))
    assert torch.autograd.gradcheck(lambda r: K.cayley_map(K.skew_from_raw(r), base), (raw,))
    assert torch.autograd.gradcheck(lambda r: K.scaled_cayley_map(K.skew_from_raw(r), d), (raw,))


def test_skew_and_dense_maps_against_formulas():
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float64, torch.complex128):
        x = torch.randn(5, 5, dtype=dtype, generator=gen)
        a = K.skew_from_raw(x)
        assert (a + a.mH).abs().max() == 0
        assert (K.skew_from_raw(K.raw_from_skew(a)) - a).abs().max() == 0
        eye = torch.eye(5, dtype=dtype)
        base = torch.linalg.qr(torch.randn(5, 5, dtype=dtype, generator=gen))[0]
        cay = torch.linalg.inv(eye + a) @ (eye - a) @ base
        assert (K.cayley_map(a, base) - cay).abs().max() < 1e-13
        # expm by its series (‖A‖ small enough after scaling by 1/8, squared 3 times)
        e, term = eye.clone(), eye.clone()
        for k in range(1, 30):
            term = term @ (a / 8) / k
            e = e + term
        e = e @ e @ e @ e @ e @ e @ e @ e
        assert (K.exp_map(a, base) - base @ e).abs().max() < 1e-11


def test_scaled_cayley_theorem2_gradients():
    """θ and A gradients of scuRNN against the closed forms of Theorem 2 of the paper."""
    gen = torch.Generator().manual_seed(7)
    n, dt = 5, torch.complex128
    raw = torch.randn(n, n, dtype=dt, generator=gen, requires_grad=True)
    theta = torch.randn(n, dtype=torch.float64, generator=gen, requires_grad=True)
    cm = torch.randn(n, n, dtype=dt, generator=gen)
    a = K.skew_from_raw(raw)
    d = torch.polar(torch.ones_like(theta), theta)
    w = K.scaled_cayley_map(a, d)
    (cm.conj() * w).real.sum().backward()  # L = Re Σ C̄ W, so ∂L/∂W = C̄/2 (Wirtinger)
    with torch.no_grad():
        eye = torch.eye(n, dtype=dt)
        dldw = cm.conj() / 2
        kk = torch.linalg.solve(eye + a, eye - a)
        grad_theta = 2 * (1j * torch.diagonal(dldw.mT @ kk) * d).real
        assert (theta.grad - grad_theta).abs().max() < 1e-12
        c = torch.linalg.inv(eye + a).mT @ dldw @ (torch.diag(d) + w.mT)
        grad_a = c.mT - c.conj()  # ∂L/∂Ā, skew-Hermitian
        for _ in range(3):  # directional derivatives along raw directions agree
            e = torch.randn(n, n, dtype=dt, generator=gen)
            ours = (raw.grad.conj() * e).real.sum()
            paper = (grad_a.conj() * K.skew_from_raw(e)).real.sum()
            assert abs(float(ours - paper)) < 1e-11


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_reflections_from_point_full_and_padded(dtype):
    gen = torch.Generator().manual_seed(8)
    for n, m, L in [(5, 5, 5), (7, 3, 3), (7, 3, 6)]:
        q = torch.linalg.qr(torch.randn(n, m, dtype=dtype, generator=gen))[0]
        for target in (q, -q):
            v, d = reflections_from_point(target, L, tol=1e-10)
            assert v.shape == (n, L) and (v.norm(dim=0) > 0.5).all()
            assert (reference(v, d, m) - target).abs().max() < 1e-13


@pytest.mark.parametrize("dtype", (torch.float64, torch.complex128))
def test_reflections_from_point_fewer_reflections(dtype):
    """Square, L < n: exact with the buffer kept (up to the first sign), Unreachable otherwise."""
    gen = torch.Generator().manual_seed(9)
    n, L = 8, 3
    v0 = torch.randn(n, L, dtype=dtype, generator=gen)
    d0 = random_diag(n, dtype, gen).to(dtype)
    q = reference(v0, d0, n)
    for budget in (3, 4, 5):  # exact, odd padding (first sign flips), even padding
        v, d = reflections_from_point(q, budget, tol=1e-10, diagonal=d0)
        assert (d[1:] == d0[1:]).all()
        assert (reference(v, d, n) - q).abs().max() < 1e-12
    with pytest.raises(ValueError, match="not reachable"):
        reflections_from_point(q, 2, tol=1e-10, diagonal=d0)
    haar = torch.linalg.qr(torch.randn(n, n, dtype=dtype, generator=gen))[0]
    with pytest.raises(ValueError, match="not reachable"):
        reflections_from_point(haar, n - 2, tol=1e-10)  # rank(Q − I) ≥ n − 1


def test_reflections_from_point_tall_few():
    gen = torch.Generator().manual_seed(11)
    n, m = 9, 4
    v0 = torch.randn(n, 2, dtype=torch.float64, generator=gen)
    q = reference(v0, torch.ones(m, dtype=torch.float64), m)
    v, d = reflections_from_point(q, 3, tol=1e-10)
    assert (reference(v, d, m) - q).abs().max() < 1e-12


def test_cayley_scaling_makes_every_point_reachable(device):
    gen = torch.Generator().manual_seed(10)
    rot = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    hard = [
        -torch.eye(4, dtype=torch.float64),  # all eigenvalues −1
        torch.block_diag(rot @ rot, torch.eye(2, dtype=torch.float64)),  # eigenvalue −1
        torch.linalg.qr(torch.randn(6, 6, dtype=torch.complex128, generator=gen))[0],
    ]
    for p in hard:
        d = cayley_scaling(p.to(device))
        assert d.device.type == device
        d = d.cpu()
        k = p * d.conj()
        eye = torch.eye(p.shape[0], dtype=p.dtype)
        assert torch.linalg.cond(eye + k) < 1e3
        assert (d.abs() - 1).abs().max() < 1e-14
    # its work arrays follow the input's device (checkable without a GPU: meta tensors)
    assert cayley_scaling(torch.empty(2, 5, 5, dtype=torch.float64, device="meta")).is_meta


def test_householder_survives_huge_vectors_with_scaled_gradient():
    # Note [Reflection vectors scaled by their max-abs]: H(cv) = H(v), so the output is the
    # same at entries 1e20 (‖v‖² would overflow float32) and the gradient scales by 1/c.
    gen = torch.Generator().manual_seed(12)
    v = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    x = torch.randn(6, 2, dtype=torch.float64, generator=gen)
    q32 = K.householder_matrix((1e20 * v).float())
    assert bool(torch.isfinite(q32).all())
    assert (q32.double() - K.householder_matrix(v)).abs().max() < 1e-5
    g = torch.randn(6, 2, dtype=torch.float64, generator=gen)
    for c in (1.0, 1e12):
        vc = (c * v).requires_grad_()
        (gv,) = torch.autograd.grad(K.householder_matrix(vc, m=2), vc, g)
        if c == 1.0:
            ref = gv
        else:
            assert (c * gv - ref).abs().max() < 1e-10 * ref.abs().max()
    vv = v.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda w: K.householder_apply(w, x, 2), (vv,))


def test_skew_maps_under_vmap_equal_the_batched_call():
    # Under torch.func.vmap ‖A‖₁ cannot be read back (one_norm is None): the maps keep
    # their LU kernel / torch's matrix_exp and give what the batched call gives.
    gen = torch.Generator().manual_seed(13)
    a = K.skew_from_raw(torch.randn(3, 5, 5, dtype=torch.float64, generator=gen))
    base = torch.eye(5, 2, dtype=torch.float64)
    d = torch.tensor([1.0, -1.0], dtype=torch.float64)
    for f in (
        lambda x: K.exp_map(x, torch.eye(5, dtype=torch.float64), 2),
        lambda x: K.cayley_map(x, base),
        lambda x: K.scaled_cayley_map(x, d),
    ):
        assert torch.allclose(torch.func.vmap(f)(a), f(a), atol=1e-12)
        per_sample = torch.func.vmap(torch.func.grad(lambda x, f=f: f(x).pow(3).sum()))(a)
        (batched,) = torch.autograd.grad(f(a.requires_grad_()).pow(3).sum(), a)
        a = a.detach()
        assert torch.allclose(per_sample, batched, atol=1e-10)

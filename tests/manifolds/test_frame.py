"""Square steps in the frame of X (Note [Square steps in the frame of X]).

The frame update and the shifted Gram against their dense float64 formulas; the
square QR and Cayley steps against dense references on batches that mix the
frame path, the path with the product E·D (‖D‖_F > ½) and the explicit path;
and float32 drift that does not accumulate on O(n) and U(n).
"""

import functools

import pytest
import torch

from stiefel.manifolds import kernels
from stiefel.manifolds.kernels import frame

CPLX = [False, True]


def _dtype(cplx, low=False):
    if low:
        return torch.complex64 if cplx else torch.float32
    return torch.complex128 if cplx else torch.float64


def _near_point(n, batch, dtype, off, gen):
    """A point ``off`` away from the manifold (in float64/complex128)."""
    x = kernels.haar(n, n, *batch, dtype=dtype, generator=gen)
    return x + off * torch.randn(*batch, n, n, dtype=dtype, generator=gen)


def _err(x):
    x = x.to(torch.complex128 if x.is_complex() else torch.float64)
    eye = torch.eye(x.shape[-1], dtype=x.dtype)
    return torch.linalg.matrix_norm(x.mH @ x - eye)


@pytest.mark.parametrize("cplx", CPLX)
def test_frame_update_is_x_corrected_times_q(cplx):
    # Y = X(I − ½E)(I + D), E = XᴴX − I: for a long D (‖D‖_F > ½) exactly, for a
    # short D without the product E·D (Y = X + X(D − ½E)); one batch holds both,
    # and each matrix's result is the one it gets alone
    dtype = _dtype(cplx)
    gen = torch.Generator().manual_seed(0)
    n = 9
    x = _near_point(n, (2,), dtype, 1e-4, gen)
    q = kernels.haar(n, n, 2, dtype=dtype, generator=gen)
    eye = torch.eye(n, dtype=dtype)
    small = torch.linalg.matrix_exp(0.01 * (q[0] - q[0].mH))  # unitary, close to I
    d = torch.stack((small - eye, q[1] - eye))
    assert (
        float(torch.linalg.matrix_norm(d[0])) < frame.D_MAX < float(torch.linalg.matrix_norm(d[1]))
    )
    xx = x.mH @ x
    e = xx - eye
    exact = x @ (eye - 0.5 * e) @ (eye + d)
    with torch.no_grad():  # the optimizers' mode: D is overwritten
        y = frame.frame_update(x, d.clone(), xx)
    assert float((y[1] - exact[1]).abs().max()) < 1e-13
    assert float((y[0] - (x[0] + x[0] @ (d[0] - 0.5 * e[0]))).abs().max()) < 1e-13
    assert float((y[0] - exact[0]).abs().max()) < 1e-4 * 0.1  # ½‖X E D‖
    for i in range(2):  # batch independence (to rounding: one product, not batched)
        assert float((frame.frame_update(x[i], d[i].clone(), xx[i]) - y[i]).abs().max()) < 1e-14
    # a column-major X (LAPACK's layout) gives the same Y, stored like X (the sum
    # X + X·F reads both operands in one order)
    with torch.no_grad():
        y_cm = frame.frame_update(x.mT.contiguous().mT, d.clone(), xx)
    assert float((y_cm - y).abs().max()) < 1e-14 and y_cm.stride(-2) == 1
    # the error of X is not carried over: O(‖E‖²) for the long step, O(‖E‖·‖D‖) short
    assert float(_err(x).min()) > 1e-4
    assert float(_err(y[1])) < 1e-6
    dn = float(torch.linalg.matrix_norm(d[0]))  # ‖E‖ multiplied by at most ‖D‖ + ‖D‖²
    assert float(_err(y[0])) < (dn + dn**2) * float(_err(x[0])) + 1e-12


def test_square_steps_are_differentiable():
    # with autograd on, the kernels take their out-of-place path: gradcheck through
    # the square QR and Cayley steps (real and complex), against finite differences
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float64, torch.complex128):
        x = kernels.haar(4, 4, dtype=dtype, generator=gen)
        g = torch.randn(4, 4, dtype=dtype, generator=gen, requires_grad=True)
        for step in (kernels.qr_gradient_step, kernels.cayley_gradient_step):
            for metric in ("euclidean", "canonical"):
                fn = functools.partial(step, x, lr=0.1, metric=metric)
                assert torch.autograd.gradcheck(fn, (g,))


@pytest.mark.parametrize("cplx", CPLX)
@pytest.mark.parametrize("skew", [True, False])
def test_shifted_gram_equals_the_product(cplx, skew):
    dtype = _dtype(cplx)
    gen = torch.Generator().manual_seed(1)
    p = 0.1 * torch.randn(3, 6, 6, dtype=dtype, generator=gen)
    if skew:
        p = p - p.mH
    gamma = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64).reshape(3, 1, 1)
    b = p + gamma * torch.eye(6, dtype=dtype)
    got = frame.shifted_gram(p, gamma.to(dtype), skew)
    assert float((got - b.mH @ b).abs().max()) < 1e-14


def test_shifted_gram_keeps_digits_in_float32():
    # Note [Delta form of a shifted Gram]: the plain float32 product loses its
    # diagonal; the delta form stays within a few eps of the float64 Gram
    gen = torch.Generator().manual_seed(2)
    n = 512
    h = 1e-3 * torch.randn(n, n, dtype=torch.float64, generator=gen)
    p64 = h - h.mT
    b64 = torch.eye(n, dtype=torch.float64) + p64
    ref = b64.mT @ b64
    p = p64.float()
    b = b64.float()
    one = torch.ones(1, 1)
    delta = float(torch.linalg.matrix_norm(frame.shifted_gram(p, one, True).double() - ref))
    plain = float(torch.linalg.matrix_norm((b.mT @ b).double() - ref))
    eps = torch.finfo(torch.float32).eps
    assert delta < 2 * n**0.5 * eps
    assert plain > 2 * delta


def _dense_cayley(x, u):
    n = x.shape[-1]
    eye = torch.eye(n, dtype=x.dtype)
    p = eye - 0.5 * x @ x.mH
    a = (p @ u) @ x.mH - x @ (p @ u).mH
    return torch.linalg.solve(eye - 0.5 * a, (eye + 0.5 * a) @ x)


@pytest.mark.parametrize("cplx", CPLX)
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
def test_square_steps_mix_their_paths_in_one_batch(cplx, metric):
    # one step size per matrix: frame path (1e-3), frame path with E·D (0.3; Cayley
    # β ≈ 2.2 in the frame for the Euclidean metric, β ≈ 4.4 explicit for the
    # canonical one), explicit path (1e3: Cayley β > 4, QR Cholesky refused), against
    # the dense Cayley formula and the Householder Q of X − lr·d in float64
    dtype = _dtype(cplx)
    gen = torch.Generator().manual_seed(3)
    n = 10
    x = kernels.haar(n, n, 3, dtype=dtype, generator=gen)
    g = torch.randn(3, n, n, dtype=dtype, generator=gen)
    lr = torch.tensor([1e-3, 0.3, 1e3], dtype=torch.float64).reshape(3, 1, 1)
    rgrad = {"euclidean": kernels.egrad2rgrad_euclidean, "canonical": kernels.egrad2rgrad_canonical}
    d = rgrad[metric](x, g)
    tol = 1e3 * n * torch.finfo(dtype).eps
    ref_qr = kernels.qr_unique(x - lr * d)
    ref_cay = _dense_cayley(x, -lr * d)
    for y in (kernels.qr_gradient_step(x, g, lr, metric), kernels.qr_descent(x, d, lr)):
        assert float((y - ref_qr).abs().max()) < tol
    y = kernels.cayley_gradient_step(x, g, lr, metric)
    assert float((y - ref_cay).abs().max()) < tol
    for i in range(3):  # each path alone
        yi = kernels.cayley_gradient_step(x[i], g[i], float(lr[i]), metric)
        assert float((yi - ref_cay[i]).abs().max()) < tol
        yi = kernels.qr_gradient_step(x[i], g[i], float(lr[i]), metric)
        assert float((yi - ref_qr[i]).abs().max()) < tol


def _float32_case(cplx, kind, seed):
    """(float32/complex64 dtype, generator, the square gradient step of ``kind``)."""
    step = kernels.qr_gradient_step if kind == "qr" else kernels.cayley_gradient_step
    return _dtype(cplx, low=True), torch.Generator().manual_seed(seed), step


@pytest.mark.parametrize("cplx", CPLX)
@pytest.mark.parametrize("kind", ["qr", "cayley"])
def test_square_float32_error_is_corrected_not_carried(cplx, kind):
    # a point 1e-3 off O(n)/U(n) in float32: short steps (the frame path, no E·D, no
    # explicit path) correct it with the point's own Gram (Newton–Schulz to first order)
    dtype, gen, step = _float32_case(cplx, kind, 4)
    n = 64
    x = _near_point(n, (), _dtype(cplx), 1e-3 / n, gen).to(dtype)
    start = float(_err(x))
    for lr in (1e-3,) * 4:
        x = step(x, torch.randn(n, n, dtype=dtype, generator=gen), lr)
    eps = torch.finfo(dtype).eps
    assert start > 1e-4
    assert float(_err(x)) < 20 * n**0.5 * eps, (start, float(_err(x)))


@pytest.mark.parametrize("cplx", CPLX)
@pytest.mark.parametrize("kind", ["qr", "cayley"])
def test_square_float32_drift_does_not_accumulate(cplx, kind):
    # 400 random-gradient steps on O(128)/U(128) in float32: the error stays at the
    # rounding of one step (measured ~2·√n·eps), it does not grow with the steps
    dtype, gen, step = _float32_case(cplx, kind, 5)
    n = 128
    x = kernels.haar(n, n, dtype=_dtype(cplx), generator=gen).to(dtype)
    errs = []
    for k in range(400):
        x = step(x, torch.randn(n, n, dtype=dtype, generator=gen), 2e-3)
        if k in (49, 399):
            errs.append(float(_err(x)))
    eps = torch.finfo(dtype).eps
    assert errs[1] < 10 * n**0.5 * eps, errs
    assert errs[1] < 2 * errs[0] + n**0.5 * eps, errs


@pytest.mark.parametrize("cplx", CPLX)
def test_uncorrected_and_wide_gram_updates_against_dense_formulas(cplx):
    # UNCORRECTED: Y = X + X·D exactly; a float64 Gram for a float32 point and a short
    # D (‖D‖_F < ½, no E·D): Y = X(I + D − ½E) in float64, to the float32 rounding of Y
    gen = torch.Generator().manual_seed(11)
    n, dt64, dt32 = 24, _dtype(cplx), _dtype(cplx, low=True)
    x64 = _near_point(n, (2,), dt64, 1e-4, gen)
    q = kernels.haar(n, n, 2, dtype=dt64, generator=gen)
    eye = torch.eye(n, dtype=dt64)
    d64 = 0.02 * (q - eye)  # any small D
    assert torch.allclose(frame.frame_update(x64, d64.clone(), frame.UNCORRECTED), x64 + x64 @ d64)
    x32, d32 = x64.to(dt32), d64.to(dt32)
    xw = x32.to(dt64)
    e = xw.mH @ xw - eye
    assert float(torch.linalg.matrix_norm(d32).max()) < frame.D_MAX
    ref = xw @ (eye + d32.to(dt64) - 0.5 * e)
    xx = frame.wide_gram(x32)
    assert xx.dtype == dt64
    got = frame.frame_update(x32, d32.clone(), xx)
    eps = torch.finfo(dt32).eps
    assert float((got.to(dt64) - ref).abs().max()) < 4 * eps
    # a D stored by columns (the QR step's, from LAPACK's solve) against a Gram stored
    # by rows (E is then copied from the Gram's adjoint view): the same Y to rounding
    d_cols = d32.mT.contiguous().mT
    assert d_cols.stride(-2) == 1 and xx.stride(-1) == 1
    got = frame.frame_update(x32, d_cols.clone(), xx)
    assert float((got.to(dt64) - ref).abs().max()) < 4 * eps


@pytest.mark.parametrize("cplx", CPLX)
def test_unit_columns_normalizes_the_columns_of_i_plus_d(cplx):
    from stiefel.manifolds.kernels.factor import _unit_columns

    # an exactly unitary Q near I, its columns scaled by 1 + c_j (c_j ~ 1e-7):
    # after the fix ‖q_j‖ = 1 to O(c²) + O(c·‖d_j‖²), far below the 1e-7 it had
    gen = torch.Generator().manual_seed(12)
    n, dt = 32, _dtype(cplx)
    eye = torch.eye(n, dtype=dt)
    s = kernels.proj_tangent(eye, 1e-2 * torch.randn(n, n, dtype=dt, generator=gen))
    q = torch.linalg.solve(eye - 0.5 * s, eye + 0.5 * s)  # Cayley: unitary
    c = 1e-7 * torch.randn(n, dtype=torch.float64, generator=gen)
    d = q * (1 + c) - eye
    before = torch.linalg.vector_norm(eye + d, dim=-2) - 1
    after = torch.linalg.vector_norm(eye + _unit_columns(d.clone()), dim=-2) - 1
    assert float(before.abs().max()) > 5e-8
    bound = 2 * float(c.abs().max()) * float((d.abs() ** 2).sum(-2).max()) + 1e-14
    assert float(after.abs().max()) < bound < 1e-8
    # and it moved nothing else than the diagonal
    off = ~torch.eye(n, dtype=torch.bool)
    assert torch.equal(_unit_columns(d.clone())[off], d[off])


@pytest.mark.parametrize("cplx", CPLX)
@pytest.mark.parametrize("kind", ["qr", "cayley"])
def test_square_float32_drift_with_the_scheduled_correction(cplx, kind):
    # the optimizers' schedule: the wide Gram every k-th step (k = 4 at n = 128),
    # UNCORRECTED in between. Measured 0.6·√n·eps after 400 steps with k = 4 (0.87 with 8;
    # 1.6 with 4 without the unit columns of the QR factor); 300 uncorrected steps only
    # add their random walk (5.3·√n·eps; 69 for the QR step without the unit columns,
    # whose error grows linearly)
    dtype, gen, step = _float32_case(cplx, kind, 5)
    n, eps = 128, torch.finfo(_dtype(cplx, low=True)).eps
    x = kernels.haar(n, n, dtype=_dtype(cplx), generator=gen).to(dtype)
    for k in range(400):
        xx = frame.UNCORRECTED if k % frame.correction_period(n) else frame.wide_gram(x)
        x = step(x, torch.randn(n, n, dtype=dtype, generator=gen), 2e-3, xx=xx)
    assert float(_err(x)) < 1.5 * n**0.5 * eps
    for _ in range(300):
        x = step(x, torch.randn(n, n, dtype=dtype, generator=gen), 2e-3, xx=frame.UNCORRECTED)
    assert float(_err(x)) < 10 * n**0.5 * eps


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.complex64, torch.bfloat16, torch.float16]
)
def test_rows_absmax_is_the_largest_modulus_per_matrix(dtype):
    from stiefel.manifolds.kernels.reduce import rows_absmax

    gen = torch.Generator().manual_seed(6)
    base = torch.complex64 if dtype.is_complex else torch.float32
    t = torch.randn(3, 2, 5, 4, dtype=base, generator=gen).to(dtype)
    t[0, 1, 2, 3] = -1e3  # the largest modulus is a negative entry
    ref = t.abs().to(torch.float64).flatten(-2).amax(-1)[..., None, None]
    got = rows_absmax(t)
    assert got.shape == (3, 2, 1, 1)
    assert torch.equal(got.to(torch.float64), ref)
    assert float(rows_absmax(t)[0, 1]) == 1e3
    empty = torch.zeros(2, 0, 4, dtype=dtype)
    assert torch.equal(rows_absmax(empty), torch.zeros(2, 1, 1, dtype=empty.abs().dtype))


def test_a_handed_absmax_holds_for_that_tensor_unchanged_only():
    """Note [One pass over the gradient for its test and its scale]: the geometry of a
    step passes the optimizer's max|G| on for the very tensor at the same version only."""
    from stiefel.manifolds import Stiefel

    gen = torch.Generator().manual_seed(7)
    g = torch.randn(9, 4, generator=gen)
    other = g.clone()
    marker = torch.full((1, 1), 123.0)  # not max|g|: shows which value was read
    geo = Stiefel(9, 4).geometry().for_step([], g, marker)
    assert geo._absmax(g) is marker
    assert geo._absmax(other) is None  # equal values, another tensor
    g.mul_(2)  # written since: the stated maximum no longer holds
    assert geo._absmax(g) is None
    assert Stiefel(9, 4).geometry().for_step([], other, None)._absmax(other) is None


def test_a_step_reads_the_gradient_once_for_its_test_and_scale():
    """The optimizer's finiteness test hands max|G| on: rgd's step equals the kernel's own."""
    import geoopt

    from stiefel import optimizers
    from stiefel.manifolds import Stiefel
    from stiefel.manifolds.kernels import cayley_gradient_step, qr_gradient_step

    gen = torch.Generator().manual_seed(8)
    st = Stiefel(40, 5)
    x0 = st.random(dtype=torch.float64, generator=gen)
    g = 1e3 * torch.randn(40, 5, dtype=torch.float64, generator=gen)  # a scaled step (lr·μ > 1)
    for retraction, kernel in (("cayley", cayley_gradient_step), ("qr", qr_gradient_step)):
        w = geoopt.ManifoldParameter(x0.clone(), manifold=st)
        w.grad = g.clone()
        optimizers.create("rgd", [w], lr=0.01, retraction=retraction).step()
        with torch.no_grad():
            ref = kernel(x0.clone(), g.clone(), 0.01)
        assert float((w.detach() - ref).abs().max()) < 10 * 40 * torch.finfo(torch.float64).eps


@pytest.mark.parametrize("host", [True, False])
def test_square_qr_condition_test_falls_back_to_rho(monkeypatch, host):
    # Note in _qr_square: ‖P‖²_F = tr(BᴴB) − nγ² ≤ 4γ² decides most steps from the
    # trace; a skew P with ‖P‖_F > 2 but κ(B)² ≤ 3 still takes the frame path
    # through the ρ-test, and one with κ(B)² large takes the explicit (Householder)
    # path; all equal X·qf(I + P) computed densely. Both tests are tensors, no host
    # read (Note [Step weights as tensors]); host: autograd off, else on.
    from stiefel.manifolds.kernels import factor

    calls, rho = [], []
    householder = factor._householder
    monkeypatch.setattr(factor, "_householder", lambda a: calls.append(1) or householder(a))
    gen = torch.Generator().manual_seed(13)
    n = 64
    x = kernels.haar(n, n, dtype=torch.float64, generator=gen)
    a = torch.randn(n, n, dtype=torch.float64, generator=gen)
    v = kernels.haar(n, n, dtype=torch.float64, generator=gen)
    j = torch.zeros(n, n, dtype=torch.float64)
    j[torch.arange(0, n, 2), torch.arange(1, n, 2)] = 1.0
    j = j - j.mT  # PᴴP = θ²I for P = θ·VJVᵀ: ρ = 0, κ(B)² = 1 + θ²
    eye = torch.eye(n, dtype=torch.float64)
    gamma = torch.ones(1, 1, dtype=torch.float64)
    cases = (  # P, the ρ-test asked, explicit path
        (0.02 * (a - a.mT) / 2, False, False),
        (1.9 * (a - a.mT) / torch.linalg.matrix_norm(a - a.mT), False, False),  # ‖P‖₁ > √2
        (0.5 * v @ j @ v.mT, True, False),
        (3.0 * (a - a.mT) / 2, True, True),
    )
    for p, asked, explicit in cases:
        assert (float(torch.linalg.matrix_norm(p)) > 2) == asked
        calls.clear(), rho.clear()
        with torch.set_grad_enabled(not host):
            y = factor._qr_square(
                x, p.clone(), True, gamma, frame.UNCORRECTED, lambda p=p: p.clone()
            )
        assert bool(calls) == explicit
        ref = x @ kernels.qr_unique(eye + p)
        assert float((y - ref).abs().max()) < 1e3 * n * torch.finfo(torch.float64).eps


@pytest.mark.parametrize("scale", [1.0, 1e37])
def test_scaled_gram_equals_the_gram_of_the_scaled_step(scale):
    # Note [Step weights as tensors]: the float32 Xᴴ(c·σ·d/μ) against the scaled copy
    # formed in float64, also where XᴴD itself would overflow (scale 1e37)
    from stiefel.manifolds.kernels import scaling

    gen = torch.Generator().manual_seed(21)
    n = 64
    x = kernels.haar(n, n, generator=gen)
    d = scale * torch.randn(n, n, generator=gen)
    with torch.no_grad():
        h, gamma = scaling.scaled_gram(x, d, 0.01, -0.5)
    s, gamma_ref = scaling.scaled_step(d.double(), 0.01)
    ref = x.double().mT @ (-0.5 * s)
    assert torch.isfinite(h).all()
    tol = 10 * n * torch.finfo(torch.float32).eps
    assert float((h.double() - ref).abs().max()) <= tol * float(ref.abs().max())
    assert abs(float(gamma) - float(gamma_ref)) <= tol * float(gamma_ref)


def test_correction_period_is_half_root_n_as_a_power_of_two_up_to_check_every():
    # Note [The correction period grows with n]; every period divides the host read's
    expected = {1: 1, 15: 1, 16: 2, 63: 2, 64: 4, 128: 4, 255: 4, 256: 8, 4096: 8}
    for n, k in expected.items():
        assert frame.correction_period(n) == k
        assert frame.MAX_PERIOD % k == 0


@pytest.mark.parametrize("far", [0.3, 0.6, 3.0])
def test_frame_update_takes_no_correction_outside_its_basin(far):
    # Note [A correction only inside its basin]: a matrix with ‖E‖_F ≥ E_MAX = 1 is
    # stepped as X + X·D (its distance kept), the others of the batch are corrected
    n = 12
    gen = torch.Generator().manual_seed(9)
    x = kernels.haar(n, n, 3, dtype=torch.float64, generator=gen)
    x[1] = x[1] * (1 + far / n**0.5)  # ‖XᴴX − I‖_F ≈ 2·far: 0.63, 1.3, 7.6
    q = kernels.haar(n, n, 3, dtype=torch.float64, generator=gen)
    d = 1e-2 * (q - torch.eye(n, dtype=torch.float64))
    xx = x.mH @ x
    e = xx - torch.eye(n, dtype=torch.float64)
    y = frame.frame_update(x, d.clone(), xx)
    inside = float(torch.linalg.matrix_norm(e[1])) < 1
    assert inside == (far < 0.5)
    for i in range(3):
        corrected = i != 1 or inside
        ref = x[i] + x[i] @ (d[i] - 0.5 * e[i] if corrected else d[i])  # ‖D‖_F < ½: no E·D
        assert torch.allclose(y[i], ref, rtol=0, atol=1e-14)

"""The SMW Cayley kernel against dense N×N references, and the other kernels.

The Cayley and QR step tests run on every device of the ``device`` fixture (cuda
when visible): inputs drawn on the CPU and moved, references dense and computed
on the CPU in float64/complex128, results compared after ``.cpu()``.
"""

import pytest
import torch

from stiefel.manifolds import kernels

DTYPES = [torch.float64, torch.complex128]


def _point_and_grad(n, m, dtype, batch=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = kernels.haar(n, m, *batch, dtype=dtype, generator=g)
    grad = torch.randn(*batch, n, m, dtype=dtype, generator=g)
    return x, grad


def _high(t):
    return t.cpu().to(torch.complex128 if t.is_complex() else torch.float64)


def _dense_cayley_reference(x, u):
    """(I − ½A)⁻¹(I + ½A)X with A = (Pu)Xᴴ − X(Pu)ᴴ, all N×N, written out."""
    n = x.shape[-2]
    eye = torch.eye(n, dtype=x.dtype)
    p = eye - 0.5 * x @ x.mH
    a = (p @ u) @ x.mH - x @ (p @ u).mH
    return torch.linalg.inv(eye - 0.5 * a) @ (eye + 0.5 * a) @ x


def _paper_update(x, g, eta, metric):
    """The CWY paper's appendix B update Cayley(ηA)Ω = Ω − B(I + ½CᴴB)⁻¹CᴴΩ (2M or 3M)."""
    if metric == "canonical":
        b = eta * torch.cat((g, x), -1)
        c = torch.cat((x, -g), -1)
    else:
        e = g.mH @ x - x.mH @ g
        b = eta * torch.cat((g, x, 0.5 * x @ e), -1)
        c = torch.cat((x, -g, x), -1)
    k = b.shape[-1]
    return x - b @ torch.linalg.solve(torch.eye(k, dtype=x.dtype) + 0.5 * c.mH @ b, c.mH @ x)


def _rel(a, b):
    """Relative Frobenius error, on the CPU (``a`` may live on any device)."""
    a = a.cpu()
    return float(torch.linalg.matrix_norm(a - b).max() / torch.linalg.matrix_norm(b).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_smw_equals_dense_reference(dtype, metric, batch, device):
    x, g = _point_and_grad(40, 6, dtype, batch)
    rgrad = {"euclidean": kernels.egrad2rgrad_euclidean, "canonical": kernels.egrad2rgrad_canonical}
    u = -0.3 * rgrad[metric](x, g)
    ref = _dense_cayley_reference(x, u)
    x, u = x.to(device), u.to(device)
    assert _rel(kernels.cayley_smw(x, u), ref) < 1e-10
    assert _rel(kernels.cayley_dense(x, u), ref) < 1e-10
    assert _rel(kernels.cayley_retraction(x, u), ref) < 1e-10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
def test_smw_2m_matches_paper_formula(dtype, metric):
    # Our 2M form applied to u = −η·rgrad equals the paper's update (3M for Euclidean).
    x, g = _point_and_grad(50, 5, dtype, (2,), seed=1)
    eta = 0.2
    rgrad = {"euclidean": kernels.egrad2rgrad_euclidean, "canonical": kernels.egrad2rgrad_canonical}
    ours = kernels.cayley_smw(x, -eta * rgrad[metric](x, g))
    assert _rel(ours, _paper_update(x, g, eta, metric)) < 1e-10


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_transport_is_the_same_orthogonal_map(dtype):
    x, g = _point_and_grad(30, 4, dtype, seed=2)
    u = kernels.proj_tangent(x, 0.5 * g)
    v = kernels.proj_tangent(x, torch.randn_like(g))
    for fn in (kernels.cayley_smw, kernels.cayley_dense):
        y, tv = fn(x, u, v)
        n = x.shape[-2]
        eye = torch.eye(n, dtype=dtype)
        p = eye - 0.5 * x @ x.mH
        a = (p @ u) @ x.mH - x @ (p @ u).mH
        q = torch.linalg.solve(eye - 0.5 * a, eye + 0.5 * a)
        assert _rel(y, q @ x) < 1e-10
        assert _rel(tv, q @ v) < 1e-10
        # isometric and tangent at y
        assert abs(float(torch.linalg.norm(tv) - torch.linalg.norm(v))) < 1e-10
        assert float(torch.linalg.matrix_norm(kernels.sym(y.mH @ tv))) < 1e-10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("off", [0.0, 1e-6, 1e-3])
@pytest.mark.parametrize("lr", [0.01, 3.0])
@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_image_of_the_step_direction_is_the_cayley_map_of_it(dtype, off, lr, batch):
    # Note [Image of the step direction]: Cayley(A)·d from X and Pd alone, against
    # the dense N×N map, for any d (not only a tangent one: W ≠ 0); exact on the
    # manifold, off it within the drift ‖XᴴX − I‖_F (Q·Pd(I − XᴴX) taken as Pd(I − XᴴX))
    from stiefel.manifolds.kernels.cayley import cayley_descent

    x, d = _point_and_grad(40, 6, dtype, batch, seed=11)
    x = x + off * torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(12))
    y, tv = cayley_descent(x, d, lr, d)
    eye = torch.eye(40, dtype=dtype)
    pu = -lr * (d - 0.5 * x @ (x.mH @ d))
    a = pu @ x.mH - x @ pu.mH
    q = torch.linalg.solve(eye - 0.5 * a, eye + 0.5 * a)
    drift = float(torch.linalg.matrix_norm(x.mH @ x - torch.eye(6, dtype=dtype)).max())
    assert _rel(tv, q @ d) < 2 * drift + 1e-12
    k = 1.5 * torch.eye(6, dtype=dtype) - 0.5 * x.mH @ x
    assert _rel(y, q @ x @ k) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
def test_cayley_is_first_order_retraction(dtype):
    x, g = _point_and_grad(20, 3, dtype, seed=3)
    u = kernels.proj_tangent(x, g)
    for t in (1e-3, 1e-4):
        err = torch.linalg.norm(kernels.cayley_smw(x, t * u) - x - t * u)
        assert float(err) < 10 * t * t * float(torch.linalg.norm(u)) ** 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_qr_unique_has_positive_diagonal_and_is_continuous(dtype):
    x, g = _point_and_grad(12, 4, dtype, seed=4)
    a = x + 0.1 * g
    q = kernels.qr_unique(a)
    r = q.mH @ a
    d = torch.diagonal(r)
    assert torch.allclose(
        d.imag if d.is_complex() else torch.zeros_like(d.real), torch.zeros_like(d.real), atol=1e-12
    )
    assert bool((d.real > 0).all())
    assert torch.allclose(q @ r, a, atol=1e-12)
    # continuity: a tiny step moves the factor a tiny amount
    q2 = kernels.qr_unique(a + 1e-9 * g)
    assert float(torch.linalg.norm(q2 - q)) < 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
def test_polar_is_nearest_point(dtype):
    _, a = _point_and_grad(10, 3, dtype, seed=5)
    p = kernels.polar(a)
    # the polar factor maximises Re tr(QᴴA) over St, so it beats random points
    best = float(torch.linalg.norm(a - p))
    for s in range(20):
        other = kernels.haar(10, 3, dtype=dtype, generator=torch.Generator().manual_seed(s))
        assert best <= float(torch.linalg.norm(a - other)) + 1e-12
    # and it is stationary: Aᴴ P is Hermitian positive (semi)definite
    h = a.mH @ p
    assert torch.allclose(h, h.mH, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [kernels.expmap_euclidean, kernels.expmap_canonical])
def test_expmap_on_manifold_with_initial_velocity(dtype, fn):
    x, g = _point_and_grad(15, 4, dtype, seed=6)
    u = kernels.proj_tangent(x, g)
    assert float(kernels.orthogonality_error(fn(x, u))) < 1e-12
    t = 1e-5
    assert float(torch.linalg.norm((fn(x, t * u) - x) / t - u)) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
@pytest.mark.parametrize("shape", [(40, 6), (8, 6)])  # SMW path and dense path
def test_fused_rgd_step_equals_unfused_and_dense(dtype, metric, shape, device):
    x, g = _point_and_grad(*shape, dtype, (2,), seed=8)
    rgrad = {"euclidean": kernels.egrad2rgrad_euclidean, "canonical": kernels.egrad2rgrad_canonical}
    u = -0.3 * rgrad[metric](x, g)
    ref = _dense_cayley_reference(x, u)
    x, g = x.to(device), g.to(device)
    assert _rel(kernels.cayley_gradient_step(x, g, 0.3, metric), ref) < 1e-10
    with pytest.raises(ValueError, match="metric='flat'"):
        kernels.cayley_gradient_step(x, g, 0.3, "flat")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_square_frame_step_equals_dense_reference(dtype, batch):
    # Note [Square Cayley step in the frame of X]: X·Cayley(skew(Xᴴu)) on O(n)/U(n)
    # against the N×N formula; n = 7 is odd, so skew(Xᴴu) is singular (real case).
    x, g = _point_and_grad(7, 7, dtype, batch, seed=9)
    v = torch.randn_like(g)
    for metric in ("euclidean", "canonical"):
        rgrad = {
            "euclidean": kernels.egrad2rgrad_euclidean,
            "canonical": kernels.egrad2rgrad_canonical,
        }
        u = -0.3 * rgrad[metric](x, g)
        ref = _dense_cayley_reference(x, u)
        q = ref @ x.mH  # Cayley(A) itself, X being unitary
        assert _rel(kernels.cayley_gradient_step(x, g, 0.3, metric), ref) < 1e-12
        assert _rel(kernels.cayley_retraction(x, u), ref) < 1e-12
        y, tv = kernels.cayley_retraction_transport(x, u, v)
        assert _rel(y, ref) < 1e-12 and _rel(tv, q @ v) < 1e-12
        y, tu = kernels.cayley_descent(x, -u, 1.0, -u)  # v is d: the fused transport
        assert _rel(y, ref) < 1e-12 and _rel(tu, -(q @ u)) < 1e-12
    # the generic dense solve (forced) agrees as well
    assert _rel(kernels.cayley_dense(x, u), _dense_cayley_reference(x, u)) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape", [(40, 5), (12, 12)])
def test_qr_steps_equal_the_householder_q_of_x_minus_lr_d(dtype, shape, device):
    # the Gram/Cholesky path (short steps) and the Householder fallback (long or
    # rank-deficient steps) in one batch, one step size per matrix: every matrix
    # equals the float64 Householder Q (positive diagonal) of X − lr·d
    n, m = shape
    gen = torch.Generator().manual_seed(7)
    x = kernels.haar(n, m, 4, dtype=dtype, generator=gen)
    g = torch.randn(4, n, m, dtype=dtype, generator=gen)
    g[3] = x[3] @ (x[3].mH @ g[3])  # a gradient almost normal to the manifold
    lr = torch.tensor([1e-3, 0.2, 1e6, 5.0], dtype=torch.float64).reshape(4, 1, 1)
    tol = 100 * n * torch.finfo(dtype).eps
    for metric, rgrad in (
        ("euclidean", kernels.egrad2rgrad_euclidean),
        ("canonical", kernels.egrad2rgrad_canonical),
    ):
        d = rgrad(x, g)
        ref = kernels.qr_unique(x - lr * d)
        xd, gd, dd, lrd = x.to(device), g.to(device), d.to(device), lr.to(device)
        y = kernels.qr_gradient_step(xd, gd, lrd, metric)
        assert y.device.type == device
        assert float((y.cpu() - ref).abs().max()) < tol
        assert float((kernels.qr_descent(xd, dd, lrd).cpu() - ref).abs().max()) < tol
        for i in range(4):  # unbatched, each path alone
            y = kernels.qr_gradient_step(xd[i], gd[i], float(lr[i]), metric)
            assert float((y.cpu() - ref[i]).abs().max()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.float64])
@pytest.mark.parametrize("shape", [(40, 6), (8, 8)])  # SMW / Gram paths and square frame path
def test_cayley_and_qr_steps_in_working_precision_on_device(dtype, shape, device):
    # the steps computed on ``device`` in ``dtype`` against the float64/complex128 dense
    # references on the CPU; tolerance by dtype (a step's rounding is O(n·eps))
    n, m = shape
    x, g = _point_and_grad(n, m, torch.complex128 if dtype.is_complex else torch.float64, (2,))
    tol = 100 * n * torch.finfo(dtype).eps
    for metric, rgrad in (
        ("euclidean", kernels.egrad2rgrad_euclidean),
        ("canonical", kernels.egrad2rgrad_canonical),
    ):
        u = -0.3 * rgrad(x, g)
        ref = _dense_cayley_reference(x, u)
        xd, gd = x.to(device=device, dtype=dtype), g.to(device=device, dtype=dtype)
        y = kernels.cayley_gradient_step(xd, gd, 0.3, metric)
        assert y.device.type == device and y.dtype == dtype
        assert _rel(_high(y), ref) < tol, (metric, _rel(_high(y), ref))
        assert (
            _rel(_high(kernels.cayley_retraction(xd, u.to(device=device, dtype=dtype))), ref) < tol
        )
        y = kernels.qr_gradient_step(xd, gd, 0.3, metric)
        assert y.device.type == device and y.dtype == dtype
        assert _rel(_high(y), kernels.qr_unique(x - 0.3 * rgrad(x, g))) < tol
        assert float(kernels.orthogonality_error(_high(y)).max()) < tol


@pytest.mark.parametrize("shape", [(3, 64, 8), (3, 20, 8), (8, 8)])  # inverse, solve, square
@pytest.mark.parametrize("layout", ["row", "column"])
def test_right_solve_equals_the_triangular_solve(shape, layout):
    # A·R⁻¹ by the explicit inverse (tall) or the solve (short, in place if allowed and
    # A is column-major, LAPACK's layout): each equals a float64 solve of the float32
    # data to rounding, and A is written over only on the in-place path
    from stiefel.manifolds.kernels.factor import _right_solve

    gen = torch.Generator().manual_seed(3)
    a = torch.randn(shape, generator=gen)
    a = a if layout == "row" else a.mT.contiguous().mT
    m = shape[-1]
    r = torch.linalg.cholesky(a.mT @ a / shape[-2] + torch.eye(m), upper=True)
    ref = torch.linalg.solve_triangular(r.double(), a.double(), upper=True, left=False)
    tol = 10 * m * torch.finfo(torch.float32).eps * float(ref.abs().max())
    for over_a in (False, True):
        before = a.clone()
        got = _right_solve(a, r, over_a=over_a)
        assert float((got.double() - ref).abs().max()) < tol, (over_a, layout)
        written = got.data_ptr() == a.data_ptr()
        assert written == (over_a and shape[-2] < 8 * m and layout == "column")
        assert torch.equal(a, before) or written
        a.copy_(before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_upper_cholesky_is_r_stored_by_rows(dtype):
    # the square QR step's factor (Note [The square step's Cholesky factor stored by
    # rows]): upper triangular with a positive real diagonal, RᴴR = A to rounding,
    # each matrix stored by rows; a matrix that is not positive definite has info > 0
    from stiefel.manifolds.kernels.factor import _upper_cholesky

    gen = torch.Generator().manual_seed(5)
    n = 12
    b = torch.randn(4, n, n, dtype=dtype, generator=gen)
    a = b.mH @ b + n * torch.eye(n, dtype=dtype)
    a[3] = -a[3]
    r, info = _upper_cholesky(a)
    assert info.tolist() == [0, 0, 0, 1]
    r = r[:3]
    assert r.stride(-1) == 1 and r.stride(-2) == n
    diag = torch.view_as_real(r.diagonal(dim1=-2, dim2=-1).to(torch.complex128))
    assert torch.equal(r, r.triu()) and bool((diag[..., 0] > 0).all())
    assert float(diag[..., 1].abs().max()) == 0
    tol = 10 * n * torch.finfo(dtype).eps * float(a[:3].abs().max())
    assert float((r.mH @ r - a[:3]).abs().max()) < tol


def test_qr_step_float32_error_does_not_accumulate():
    # the Gram of X − lr·d uses the computed XᴴX: a point 1e-3 off is brought back
    gen = torch.Generator().manual_seed(8)
    x = kernels.haar(256, 8, dtype=torch.float64, generator=gen)
    x = (x + 1e-3 * torch.randn(256, 8, dtype=torch.float64, generator=gen)).float()
    g = torch.randn(256, 8, generator=gen)
    for _ in range(20):
        x = kernels.qr_gradient_step(x, g, 1e-3)
    x64 = x.double()
    err = float(torch.linalg.matrix_norm(x64.T @ x64 - torch.eye(8, dtype=torch.float64)))
    assert err < 50 * 256**0.5 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
@pytest.mark.parametrize("column_major", [False, True])
def test_add_product_accumulates_in_place_in_the_layout_of_out(dtype, batch, column_major, device):
    # Note [Accumulating into a column-major batch]: β·out + α·A·B, written over out,
    # whose storage and strides stay; against the product formed in float64 apart
    from stiefel.manifolds.kernels.basic import add_product_

    g = torch.Generator().manual_seed(7)
    a, b, out = (
        torch.randn(*batch, *shape, dtype=dtype, generator=g).to(device)
        for shape in ((6, 4), (4, 5), (6, 5))
    )
    if column_major:  # LAPACK's layout: each matrix stored by columns
        out = out.mT.contiguous().mT
    ref = 0.5 * out + (-2.0) * (a @ b)
    strides, ptr = out.stride(), out.data_ptr()
    got = add_product_(out, a, b, alpha=-2.0, beta=0.5)
    assert got.data_ptr() == ptr and got.stride() == strides  # out's storage and layout
    assert float((out - ref).abs().max()) < 1e-13 and torch.equal(got, out)
    # a batch whose dimensions do not merge is copied by the flattening: the result
    # still holds the right values
    unmerged = torch.randn(3, 2, 6, 5, dtype=dtype, generator=g).to(device).transpose(0, 1)
    a2 = torch.randn(2, 3, 6, 4, dtype=dtype, generator=g).to(device)
    b2 = torch.randn(2, 3, 4, 5, dtype=dtype, generator=g).to(device)
    ref2 = unmerged + a2 @ b2
    assert float((add_product_(unmerged, a2, b2) - ref2).abs().max()) < 1e-13


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
@pytest.mark.parametrize("column_major", [False, True])
def test_out_of_place_products_keep_the_layout_of_their_first_operand(
    dtype, batch, column_major, device
):
    # βU + αAB (product_on), AB (product_like), A B + C E (two_products) and
    # V + A B + C E (three_products) against the float64 formula; each result is stored
    # like U (resp. A), so that a step on column-major points makes no transposing copy
    # (Note [Accumulating into a column-major batch]); a K×K factor may be shared by
    # the batch
    from stiefel.manifolds.kernels.basic import (
        product_like,
        product_on,
        three_products,
        two_products,
    )
    from stiefel.manifolds.kernels.reduce import by_columns

    g = torch.Generator().manual_seed(9)
    u, a, c = (torch.randn(*batch, 6, 4, dtype=dtype, generator=g).to(device) for _ in "uac")
    b, e = (torch.randn(*batch, 4, 4, dtype=dtype, generator=g).to(device) for _ in "be")
    shared = torch.randn(4, 4, dtype=dtype, generator=g).to(device)
    if column_major:
        u, a, c = (t.mT.contiguous().mT for t in (u, a, c))
    tol = 1e-13
    got = product_on(u, a, b, alpha=-2.0, beta=0.5)
    assert float((got - (0.5 * u - 2.0 * (a @ b))).abs().max()) < tol
    assert got.shape == u.shape and by_columns(got) == column_major
    for factor in (b, shared):
        got = product_like(a, factor)
        assert float((got - a @ factor).abs().max()) < tol
        assert got.shape == a.shape and by_columns(got) == column_major
    got = two_products(a, shared, c, e, a.shape)
    assert float((got - (a @ shared + c @ e)).abs().max()) < tol
    assert by_columns(got) == column_major
    got = three_products(u, a, b, c, shared)
    assert float((got - (u + a @ b + c @ shared)).abs().max()) < tol
    assert by_columns(got) == column_major


@pytest.mark.parametrize("column_major", [False, True])
def test_reductions_of_a_column_major_batch_read_it_in_memory_order(column_major):
    # ‖t‖²_F and max|t| per matrix against float64; a column-major batch is reduced by
    # columns, to the same accuracy as by rows
    from stiefel.manifolds.kernels.reduce import rows_absmax, rows_sum_squares

    g = torch.Generator().manual_seed(10)
    t = torch.randn(5, 4000, 7, generator=g)
    if column_major:
        t = t.mT.contiguous().mT
    ref = t.double().square().sum(dim=(-2, -1), keepdim=True)
    got = rows_sum_squares(t)
    assert got.shape == (5, 1, 1)
    assert float(((got.double() - ref) / ref).abs().max()) < 16 * torch.finfo(t.dtype).eps
    assert torch.equal(rows_absmax(t), t.abs().amax(dim=(-2, -1), keepdim=True))


@pytest.mark.parametrize("retraction", ["cayley", "qr"])
def test_steps_of_a_column_major_batch_equal_those_of_its_row_major_copy(retraction):
    # a batch of points from torch.linalg.qr (column-major per matrix) and its gradient
    # in the same layout step to the values of the row-major copies (the in-place
    # products over G then accumulate into the transposed batch)
    import geoopt

    from stiefel import optimizers
    from stiefel.manifolds import Stiefel

    g = torch.Generator().manual_seed(8)
    q = torch.linalg.qr(torch.randn(5, 12, 4, dtype=torch.float64, generator=g))[0]
    assert q.stride(-2) == 1  # column-major matrices
    grad = 2 * (q - torch.linalg.qr(torch.randn(5, 12, 4, dtype=torch.float64, generator=g))[0])
    results = []
    for x, gx in ((q, grad), (q.contiguous(), grad.contiguous())):
        w = geoopt.ManifoldParameter(x.clone(), manifold=Stiefel(12, 4))
        opt = optimizers.create("rgd", [w], lr=0.1, retraction=retraction)
        w.grad = gx.clone()
        opt.step()
        results.append(w.detach().clone())
    assert results[0].stride(-2) == 1  # the parameter kept its layout
    assert float((results[0] - results[1]).abs().max()) < 1e-13


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_gram_minus_identity_takes_its_diagonal_from_offset_squares(dtype, layout, device):
    # Note [The Gram's diagonal from offset squares]: near the manifold, the diagonal of
    # XᴴX − I in float32 is exact to the rounding of X's squares (~eps/(2√N) per entry),
    # where the float32 product's own diagonal is off by ~eps; the off-diagonal entries
    # are the product's, or those of a Gram handed in
    from stiefel.manifolds.kernels.reduce import columns_defect

    gen = torch.Generator().manual_seed(11)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    n, m = 64, 16
    x = torch.linalg.qr(torch.randn(256, n, m, dtype=wide, generator=gen))[0].to(device, dtype)
    x = x.contiguous() if layout == "rows" else x.mT.contiguous().mT
    x64 = x.to(wide)
    exact = x64.mH @ x64 - torch.eye(m, dtype=wide, device=device)
    eps = torch.finfo(x.real.dtype).eps

    def rms(d):
        return float(d.abs().square().mean().sqrt())

    e = kernels.gram_minus_identity(x)
    assert e.dtype == dtype and e.shape == (256, m, m)
    diag = (e - exact).diagonal(dim1=-2, dim2=-1)
    plain = (x.mH @ x - torch.eye(m, dtype=dtype, device=device)).to(wide) - exact
    assert rms(diag) < eps / 4 < rms(plain.diagonal(dim1=-2, dim2=-1))
    assert torch.allclose(e.to(wide), exact, rtol=0, atol=4 * eps)
    # a Gram handed in keeps its off-diagonal entries and is not written to
    xx = x.mH @ x
    kept = xx.clone()
    e2 = kernels.gram_minus_identity(x, xx)
    assert torch.equal(xx, kept)
    off = ~torch.eye(m, dtype=torch.bool, device=device)
    assert torch.equal(e2[..., off], xx[..., off])
    # the defect does not depend on the estimate it is offset by, to its own rounding
    d1 = columns_defect(x, xx.diagonal(dim1=-2, dim2=-1))
    d2 = columns_defect(x, torch.ones(256, m, dtype=dtype, device=device))
    assert d1.dtype == x.real.dtype and d1.shape == (256, m)
    assert rms(d1.to(wide) - exact.diagonal(dim1=-2, dim2=-1)) < eps / 4
    assert torch.allclose(d1, d2, rtol=0, atol=4 * eps)
    # squares past float32's range: the diagonal is infinite, as the product's, not NaN
    huge = kernels.gram_minus_identity(x[:2] * 1e20).diagonal(dim1=-2, dim2=-1)
    assert bool((huge.real == float("inf")).all())
    # also where the product's diagonal came out NaN (inf − inf in cuBLAS's complex product)
    nan_near = torch.full((2, m), float("nan"), dtype=dtype, device=device)
    assert bool((columns_defect(x[:2] * 1e20, nan_near) == float("inf")).all())
    if not dtype.is_complex:  # a complex product's overflow is inf + NaN·i off the diagonal
        assert bool(kernels.orthogonality_error(x[:2] * 1e20).isinf().all())
    assert bool(kernels.orthogonality_error(x[:2] * float("nan")).isnan().all())

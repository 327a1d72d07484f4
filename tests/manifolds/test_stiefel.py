"""The manifold classes: geometry, Haar sampling, checks, identity and bad input."""

import math

import pytest
import torch

from stiefel.manifolds import Orthogonal, Stiefel, Unitary, kernels

CASES = [
    (Stiefel(30, 5), torch.float32),
    (Stiefel(30, 5), torch.float64),
    (Stiefel(30, 5, complex=True), torch.complex64),
    (Stiefel(30, 5, complex=True), torch.complex128),
    (Orthogonal(8), torch.float64),
    (Unitary(8), torch.complex128),
    (Stiefel(12, 10), torch.float32),  # nearly square: dense Cayley path
]
DOUBLE_CASES = [c for c in CASES if c[1] in (torch.float64, torch.complex128)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _tol(man, dtype):
    return 10 * man.n * torch.finfo(dtype).eps


@pytest.mark.parametrize("man,dtype", CASES)
@pytest.mark.parametrize("method", ["cayley", "qr", "polar"])
def test_retr_lands_on_manifold(man, dtype, method):
    x = man.random(4, man.n, man.m, dtype=dtype, generator=_gen())
    g = torch.randn(x.shape, dtype=dtype, generator=_gen(1))
    y = man.retr(x, -0.5 * man.egrad2rgrad(x, g), method=method)
    assert y.shape == x.shape and y.dtype == dtype
    assert float(man.orthogonality_error(y).max()) <= _tol(man, dtype)
    assert man.check_point_on_manifold(y)


@pytest.mark.parametrize("man,dtype", CASES)
def test_retr_transp_is_tangent(man, dtype):
    x = man.random(2, man.n, man.m, dtype=dtype, generator=_gen())
    u = man.proju(x, torch.randn(x.shape, dtype=dtype, generator=_gen(1)))
    v = man.proju(x, torch.randn(x.shape, dtype=dtype, generator=_gen(2)))
    for method in ("cayley", "qr", "polar"):
        y, tv = man.retr_transp(x, 0.3 * u, v, method=method)
        assert torch.allclose(y, man.retr(x, 0.3 * u, method=method), atol=_tol(man, dtype))
        scale = float(torch.linalg.norm(v))
        assert float(torch.linalg.matrix_norm(kernels.sym(y.mH @ tv)).max()) <= _tol(man, dtype) * (
            scale + 1
        )
    assert torch.allclose(man.transp(x, y, v), man.proju(y, v))


@pytest.mark.parametrize("man,dtype", CASES)
def test_projection_idempotent_and_skew(man, dtype):
    x = man.random(3, man.n, man.m, dtype=dtype, generator=_gen())
    u = torch.randn(x.shape, dtype=dtype, generator=_gen(1))
    for metric in ("euclidean", "canonical"):
        xi = man.proju(x, u, metric=metric)
        tol = _tol(man, dtype) * float(torch.linalg.norm(u))
        assert float(torch.linalg.norm(man.proju(x, xi) - xi)) <= tol
        assert float(torch.linalg.norm(kernels.sym(x.mH @ xi))) <= tol


def test_geoopt_canonical_proju_is_not_idempotent_but_ours_is():
    import geoopt

    man = geoopt.CanonicalStiefel()
    x = kernels.haar(10, 3, dtype=torch.float64, generator=_gen())
    u = torch.randn(10, 3, dtype=torch.float64, generator=_gen(1))
    once = man.proju(x, u)
    assert float(torch.linalg.norm(man.proju(x, once) - once)) > 1e-3  # geoopt: not a projection
    ours = Stiefel(10, 3, metric="canonical")
    once = ours.proju(x, u)
    assert float(torch.linalg.norm(ours.proju(x, once) - once)) < 1e-13


@pytest.mark.parametrize("man,dtype", DOUBLE_CASES)
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
def test_inner_symmetric_and_gradient_is_riesz(man, dtype, metric):
    x = man.random(dtype=dtype, generator=_gen())
    u = man.proju(x, torch.randn(x.shape, dtype=dtype, generator=_gen(1)))
    v = man.proju(x, torch.randn(x.shape, dtype=dtype, generator=_gen(2)))
    a, b = man.inner(x, u, v, metric=metric), man.inner(x, v, u, metric=metric)
    assert not a.is_complex()
    assert abs(float(a - b)) < 1e-12
    assert float(man.inner(x, u, metric=metric)) > 0
    # ⟨rgrad, η⟩_metric = Re tr(Gᴴη) for every tangent η (definition of the gradient)
    g = torch.randn(x.shape, dtype=dtype, generator=_gen(3))
    lhs = man.inner(x, man.egrad2rgrad(x, g, metric=metric), v, metric=metric)
    rhs = (g.conj() * v).sum().real
    assert abs(float(lhs - rhs)) < 1e-12 * (1 + abs(float(rhs)))


@pytest.mark.parametrize("man,dtype", DOUBLE_CASES)
@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
def test_egrad2rgrad_is_descent_direction(man, dtype, metric):
    # f(X) = ½‖AX − B‖², a quadratic; finite difference along −rgrad through retr
    gen = _gen(7)
    a = torch.randn(man.n, man.n, dtype=dtype, generator=gen)
    b = torch.randn(man.n, man.m, dtype=dtype, generator=gen)
    x = man.random(dtype=dtype, generator=gen)

    def f(z):
        return 0.5 * float(torch.linalg.norm(a @ z - b) ** 2)

    egrad = a.mH @ (a @ x - b)
    xi = man.egrad2rgrad(x, egrad, metric=metric)
    slope = float((egrad.conj() * xi).sum().real)  # directional derivative of f along xi
    assert slope > 0
    t = 1e-6
    fd = (f(man.retr(x, -t * xi)) - f(x)) / t
    assert fd < 0
    assert abs(fd + slope) < 1e-3 * slope


@pytest.mark.parametrize("complex_", [False, True])
def test_haar_statistics(complex_):
    n = 16
    dtype = torch.complex128 if complex_ else torch.float64
    man = Unitary(n) if complex_ else Orthogonal(n)
    q = man.random(4000, man.n, man.m, dtype=dtype, generator=_gen(11))
    entries = q.reshape(-1)
    count = entries.numel()
    # E[q_ij] = 0 and E|q_ij|² = 1/n; standard errors from the sample size
    assert abs(complex(entries.mean())) < 5 / math.sqrt(count * n)
    var = float((entries.abs() ** 2).mean())
    assert abs(var - 1 / n) < 5 * math.sqrt(2 / count) / n
    # Haar O(n): the trace has mean 0 and variance 1 (Diaconis–Shahshahani)
    tr = torch.diagonal(q, dim1=-2, dim2=-1).sum(-1)
    assert abs(complex(tr.mean())) < 5 / math.sqrt(4000)
    assert abs(float((tr.abs() ** 2).mean()) - 1) < 0.15
    if not complex_:
        # half the Haar measure has det −1 (the sign fix must not bias it)
        neg = float((torch.linalg.det(q) < 0).double().mean())
        assert abs(neg - 0.5) < 5 * 0.5 / math.sqrt(4000)


def test_random_shapes_dtypes_and_generator():
    man = Stiefel(7, 3, complex=True)
    x = man.random(2, 5, man.n, man.m, generator=_gen(1))
    assert x.shape == (2, 5, 7, 3) and x.dtype == torch.complex64
    y = man.random(2, 5, man.n, man.m, generator=_gen(1))
    assert torch.equal(x, y)
    assert Stiefel(7, 3).random(dtype=torch.float64).dtype == torch.float64
    # row-major like torch.randn (LAPACK's Q is column-major), and still Haar-exact
    z = Stiefel(9, 4).random(3, 9, 4, dtype=torch.float64)
    assert z.is_contiguous() and z.clone().is_contiguous()
    assert float(kernels.orthogonality_error(z).max()) < 10 * 9 * torch.finfo(torch.float64).eps


@pytest.mark.parametrize("man,dtype", [CASES[1], CASES[3]])
def test_random_with_a_cpu_generator_gives_the_same_points_on_every_device(man, dtype, device):
    x = man.random(2, man.n, man.m, dtype=dtype, device=device, generator=_gen(4))
    assert x.device.type == device and x.dtype == dtype and x.manifold is man
    ref = man.random(2, man.n, man.m, dtype=dtype, generator=_gen(4))
    assert torch.equal(x.cpu(), ref)
    assert float(man.orthogonality_error(ref).max()) <= _tol(man, dtype)


@pytest.mark.parametrize("man,dtype", CASES)
def test_projx_is_polar_and_idempotent(man, dtype):
    a = torch.randn(2, man.n, man.m, dtype=dtype, generator=_gen(3))
    p = man.projx(a)
    assert float(man.orthogonality_error(p).max()) <= _tol(man, dtype)
    assert torch.allclose(man.projx(p), p, atol=_tol(man, dtype))


def test_check_point_on_manifold_and_reasons():
    man = Stiefel(10, 3)
    x = man.random(dtype=torch.float64)
    assert man.check_point_on_manifold(x) is True
    ok, reason = man.check_point_on_manifold(2 * x, explain=True)
    assert ok is False and "XᴴX" in reason
    assert man.check_point_on_manifold(2 * x, atol=10.0)
    ok, reason = man.check_point_on_manifold(torch.zeros(4, 3), explain=True)
    assert not ok and "(10, 3)" in reason
    with pytest.raises(ValueError, match="projx"):
        man.assert_check_point_on_manifold(2 * x)
    man.assert_check_point_on_manifold(x)


def test_orthogonality_error_per_batch_element():
    man = Stiefel(6, 2)
    x = man.random(3, man.n, man.m, dtype=torch.float64)
    x[1] *= 2
    err = man.orthogonality_error(x)
    assert err.shape == (3,)
    assert float(err[0]) < 1e-14 and abs(float(err[1]) - 3 * math.sqrt(2)) < 1e-12


def test_dim_repr_and_equality():
    assert Stiefel(5, 2).dim == 5 * 2 - 3
    assert Orthogonal(4).dim == 6
    assert Unitary(4).dim == 16
    assert Stiefel(5, 2, complex=True).dim == 2 * 5 * 2 - 4
    assert Stiefel(5, 2) == Stiefel(5, 2)
    assert Stiefel(5, 2) != Stiefel(5, 2, metric="canonical")
    assert Stiefel(5, 2) != Stiefel(5, 2, complex=True)
    assert Orthogonal(3) == Stiefel(3, 3)
    assert len({Stiefel(5, 2), Stiefel(5, 2)}) == 1
    assert repr(Stiefel(5, 2)) == "Stiefel(n=5, m=2, metric='euclidean')"
    assert repr(Unitary(3)) == "Unitary(n=3, metric='euclidean')"


# ----------------------------------------------------------------------------- bad input
def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="m=5 > n=3"):
        Stiefel(3, 5)
    with pytest.raises(ValueError, match="metric='riemann'.*euclidean, canonical"):
        Stiefel(3, 2, metric="riemann")
    with pytest.raises(ValueError, match="n=0 is not allowed; allowed: an int >= 1"):
        Stiefel(0, 0)
    with pytest.raises(ValueError, match="n=.* is not allowed; allowed: an int >= 1"):
        Orthogonal(2.5)


def test_bad_points():
    man = Stiefel(6, 2)
    x = man.random(dtype=torch.float64)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        man.projx(x.tolist())
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        man.projx(torch.ones(6))
    with pytest.raises(ValueError, match=r"trailing shape \(6, 2\).*\(6, 3\)"):
        man.projx(torch.ones(6, 3))
    with pytest.raises(TypeError, match="complex.*real"):
        man.projx(x.to(torch.complex128))
    with pytest.raises(TypeError, match="real.*complex"):
        Stiefel(6, 2, complex=True).projx(x)
    with pytest.raises(TypeError, match="torch.int64"):
        man.projx(torch.ones(6, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype=torch.complex64"):
        man.random(dtype=torch.complex64)


def test_bad_values_and_names():
    man = Stiefel(6, 2)
    x = man.random(dtype=torch.float64)
    u = man.proju(x, torch.randn_like(x))
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="x has 1 non-finite"):
        man.projx(bad)
    with pytest.raises(ValueError, match="x has 1 non-finite"):
        man.retr(bad, u)
    u_bad = u.clone()
    u_bad[1, 1] = float("inf")
    with pytest.raises(ValueError, match="u has 1 non-finite"):
        man.retr(x, u_bad)
    with pytest.raises(ValueError, match="method='exp'.*cayley, qr, polar"):
        man.retr(x, u, method="exp")
    with pytest.raises(ValueError, match="metric='flat'"):
        man.egrad2rgrad(x, u, metric="flat")
    with pytest.raises(TypeError, match="must match"):
        man.retr(x, u.float())


_MIXED = [
    ("proju", lambda m, x, u: m.proju(x, u)),
    ("egrad2rgrad", lambda m, x, u: m.egrad2rgrad(x, u)),
    ("egrad2rgrad canonical", lambda m, x, u: m.egrad2rgrad(x, u, metric="canonical")),
    ("retr cayley", lambda m, x, u: m.retr(x, u)),
    ("retr qr", lambda m, x, u: m.retr(x, u, method="qr")),
    ("expmap", lambda m, x, u: m.expmap(x, u)),
    ("transp", lambda m, x, u: m.transp(x, m.retr(x, u), u)),
    ("retr_transp", lambda m, x, u: m.retr_transp(x, u, u)),
    ("inner", lambda m, x, u: m.inner(x, u)),
]


@pytest.mark.parametrize("name,op", _MIXED, ids=[n for n, _ in _MIXED])
@pytest.mark.parametrize(
    "x_dtype,u_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float64, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_mixed_precision_follows_the_point(name, op, x_dtype, u_dtype):
    # Note [Mixed precision follows the point]: a float32 weight with a bfloat16
    # gradient gets a float32 result, as torch's promotion gives it in geoopt; the
    # reference is the same call in float64 on the very values given (u as rounded)
    man = Stiefel(12, 3)
    x = man.random(dtype=x_dtype, generator=_gen()).detach()
    x64 = x.double()
    u = 0.3 * man.proju(x64, torch.randn(12, 3, dtype=torch.float64, generator=_gen(1)))
    u = u.to(u_dtype)
    got = op(man, x, u)
    want = op(man, x64, u.double())
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    work = torch.float32 if x_dtype in (torch.float16, torch.bfloat16) else x_dtype
    tol = 10 * man.n * torch.finfo(x_dtype).eps + 10 * man.n * torch.finfo(work).eps
    for g, w in zip(got, want, strict=True):
        assert g.dtype == x_dtype, (name, g.dtype)
        assert float((g.double() - w).abs().max()) <= tol * (1 + float(w.abs().max()))


def test_mixed_precision_keeps_the_field_and_exact_dtype_checks():
    man = Stiefel(6, 2)
    x = man.random(dtype=torch.float64)
    # two wide dtypes that differ are still refused (no low-precision argument)
    with pytest.raises(TypeError, match="must match"):
        man.proju(x, x.float())
    # a real low-precision vector on a complex manifold names its own dtype
    un = Unitary(2)
    with pytest.raises(TypeError, match=r"u is real \(torch.bfloat16\)"):
        un.retr(un.random(), torch.zeros(2, 2, dtype=torch.bfloat16))

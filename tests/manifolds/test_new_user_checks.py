"""What a geoopt user meets first: batch broadcasting, the membership checks' tolerances
and their answers to tensors of the wrong dtype.

References are dense float64 formulas (the Cayley map by an explicit inverse, the
QR factor with a positive diagonal, the projection U − X sym(XᴴU)) evaluated one
batch element at a time.
"""

from __future__ import annotations

import math

import pytest
import torch

from stiefel.manifolds import Stiefel

D = torch.float64
SHAPES = [(7, 3), (4, 4), (20, 3)]  # tall with the Woodbury step, square, tall and thin


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sym(a: torch.Tensor) -> torch.Tensor:
    return (a + a.mH) / 2


def _cayley_ref(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(I − ½A)⁻¹(I + ½A)X with A = (Pu)Xᴴ − X(Pu)ᴴ, P = I − ½XXᴴ, by a dense inverse."""
    eye = torch.eye(x.shape[-2], dtype=x.dtype)
    pu = (eye - 0.5 * x @ x.mH) @ u
    a = pu @ x.mH - x @ pu.mH
    return torch.linalg.inv(eye - 0.5 * a) @ (eye + 0.5 * a) @ x


def _qr_ref(a: torch.Tensor) -> torch.Tensor:
    q, r = torch.linalg.qr(a)
    return q * torch.sgn(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def _case(n, m, seed=0):
    st = Stiefel(n, m)
    x1 = st.random(dtype=D, generator=_gen(seed)).as_subclass(torch.Tensor)
    xb = st.random(3, n, m, dtype=D, generator=_gen(seed + 1)).as_subclass(torch.Tensor)
    u1 = 0.3 * st.proju(x1, torch.randn(n, m, dtype=D, generator=_gen(seed + 2)))
    return st, x1, xb, u1


@pytest.mark.parametrize(("n", "m"), SHAPES)
def test_retr_one_point_many_steps_broadcasts(n, m):
    # a (3, n, m) batch of steps at one (n, m) point: geoopt broadcasts, the Woodbury
    # and QR kernels once raised a RuntimeError from a reshape
    st, x1, _, _ = _case(n, m)
    ub = 0.3 * st.proju(x1, torch.randn(3, n, m, dtype=D, generator=_gen(5)))
    tol = 10 * n * torch.finfo(D).eps
    for method, ref in (("cayley", _cayley_ref), ("qr", lambda x, u: _qr_ref(x + u))):
        y = st.retr(x1, ub, method=method)
        assert y.shape == (3, n, m)
        for k in range(3):
            torch.testing.assert_close(y[k], ref(x1, ub[k]), atol=tol, rtol=0)
        y2, v2 = st.retr_transp(x1, ub, ub[0], method=method)
        assert y2.shape == v2.shape == (3, n, m)
        torch.testing.assert_close(y2, y, atol=tol, rtol=0)
        assert float(torch.linalg.matrix_norm(_sym(y2.mH @ v2)).max()) < tol * (
            1 + float(v2.norm())
        )


@pytest.mark.parametrize(("n", "m"), SHAPES)
def test_retr_and_expmap_many_points_one_step_broadcast(n, m):
    st, _, xb, _ = _case(n, m)
    u1 = 0.3 * st.proju(xb[0], torch.randn(n, m, dtype=D, generator=_gen(6)))
    tol = 10 * n * torch.finfo(D).eps
    y = st.retr(xb, u1)
    for k in range(3):
        torch.testing.assert_close(y[k], _cayley_ref(xb[k], u1), atol=tol, rtol=0)
    for metric in ("euclidean", "canonical"):
        e = st.expmap(xb, u1, metric=metric)
        for k in range(3):
            torch.testing.assert_close(e[k], st.expmap(xb[k], u1, metric=metric), atol=tol, rtol=0)


@pytest.mark.parametrize("metric", ["euclidean", "canonical"])
def test_inner_has_the_broadcast_batch_shape_under_either_metric(metric):
    st, _, xb, u1 = _case(7, 3)
    got = st.inner(xb, u1, metric=metric)
    assert got.shape == (3,)
    eye = torch.eye(7, dtype=D)
    for k in range(3):
        w = eye if metric == "euclidean" else eye - 0.5 * xb[k] @ xb[k].mT
        ref = torch.trace(u1.mT @ w @ u1)
        torch.testing.assert_close(got[k], ref, atol=1e-13, rtol=1e-13)


def test_batches_that_do_not_broadcast_raise_value_error_naming_shapes():
    st, _, xb, _ = _case(7, 3)
    u = torch.zeros(2, 7, 3, dtype=D)
    for call in (
        lambda: st.retr(xb, u),
        lambda: st.retr(xb, u, method="qr"),
        lambda: st.expmap(xb, u),
        lambda: st.retr_transp(xb, torch.zeros_like(xb), u),
        lambda: st.proju(xb, u),
        lambda: st.transp(xb, xb, u),
        # the Euclidean inner product does not read x: it returned a (2,) result silently
        lambda: st.inner(xb, u),
    ):
        with pytest.raises(ValueError, match=r"\(3, 7, 3\).*\(2, 7, 3\).*broadcast"):
            call()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "m"), [(6, 2), (64, 64), (200, 8)])
def test_low_precision_check_refuses_points_off_the_manifold(dtype, n, m):
    # 100·n·eps(bfloat16) is 4.7 at n = 6: every matrix of the right shape passed
    st = Stiefel(n, m)
    x = st.random(dtype=D, generator=_gen(0))
    stored = x.to(dtype)
    assert st.check_point_on_manifold(stored)  # the rounding of a point: on it
    # rounding bound √m·eps (computed in float64), the DESIGN's contract for stored points
    assert float(st.orthogonality_error(stored.double())) <= math.sqrt(m) * torch.finfo(dtype).eps
    noisy = (x + 0.05 * torch.randn(n, m, dtype=D, generator=_gen(1))).to(dtype)
    err = float(st.orthogonality_error(noisy.double()))
    assert err > 0.04
    ok, reason = st.check_point_on_manifold(noisy, explain=True)
    assert not ok and "exceeds" in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tangent_check_accepts_a_rounded_point_and_vector(dtype):
    # geoopt's fixed atol=1e-5 judged the rounding of a valid bfloat16 point off the manifold
    st = Stiefel(64, 8)
    x = st.random(dtype=D, generator=_gen(2))
    u = st.proju(x, torch.randn(64, 8, dtype=D, generator=_gen(3)))
    assert st.check_vector_on_tangent(x.to(dtype), u.to(dtype))
    st.assert_check_vector_on_tangent(x.to(dtype), u.to(dtype))
    assert not st.check_vector_on_tangent(x.to(dtype), (u + x).to(dtype))


def test_float64_tangent_check_uses_the_dtype_tolerance():
    # with geoopt's fixed atol=1e-5 a vector 1e-7 off its tangent space passed in float64
    st = Stiefel(6, 2)
    x = st.random(dtype=D, generator=_gen(4))
    u = st.proju(x, torch.randn(6, 2, dtype=D, generator=_gen(5)))
    assert st.check_vector_on_tangent(x, u)
    ok, reason = st.check_vector_on_tangent(x, u + 1e-7 * x, explain=True)
    assert not ok and "sym(Xᴴu)" in reason
    assert st.check_vector_on_tangent(x, u + 1e-7 * x, atol=1e-5)  # an explicit atol wins
    assert st.check_vector_on_tangent(x, u + 1e-3 * x, atol=0.0, rtol=1e-2)  # rtol is read


def test_tangent_check_is_per_matrix_of_a_batch():
    # one long tangent vector beside a short one off its tangent space: the scale is per matrix
    st = Stiefel(6, 2)
    x = st.random(2, 6, 2, dtype=D, generator=_gen(6))
    u = st.proju(x, torch.randn(2, 6, 2, dtype=D, generator=_gen(7)))
    u = torch.stack((1e6 * u[0], u[1] + 1e-9 * x[1]))
    assert not st.check_vector_on_tangent(x, u)


@pytest.mark.parametrize(
    "u",
    [torch.zeros(6, 2, dtype=torch.complex128), torch.zeros(6, 2, dtype=torch.int64)],
    ids=["complex", "int"],
)
def test_tangent_check_of_a_wrong_dtype_says_so(u):
    # it raised torch's "expected m1 and m2 to have the same dtype" from a matmul
    st = Stiefel(6, 2)
    x = st.random(dtype=D, generator=_gen(8))
    ok, reason = st.check_vector_on_tangent(x, u, explain=True)
    assert not ok and str(u.dtype) in reason and "Stiefel" in reason


def test_point_check_of_an_integer_or_non_tensor_says_so():
    st = Stiefel(6, 2)
    ok, reason = st.check_point_on_manifold(torch.zeros(6, 2, dtype=torch.int64), explain=True)
    assert not ok and "torch.int64" in reason  # it raised torch.finfo's TypeError
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):  # was an AttributeError
        st.check_point_on_manifold([[1.0, 0.0]])


def test_dist_and_logmap_say_why_they_are_missing():
    # geoopt's bare NotImplementedError() had an empty message
    st = Stiefel(5, 2)
    x = st.random(dtype=D, generator=_gen(9))
    for call in (lambda: st.dist(x, x), lambda: st.logmap(x, x)):
        with pytest.raises(NotImplementedError, match="no geodesic distance"):
            call()


def test_a_tangent_check_of_mixed_precision_takes_the_coarser_tolerance():
    # a float64 point with its tangent vector rounded to float32 was judged off (4e-8 > 7e-13)
    st = Stiefel(8, 3)
    x = st.random(dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    t = st.proju(
        x, torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    )
    assert st.check_vector_on_tangent(x, t.float()) and st.check_vector_on_tangent(x.float(), t)


def test_sizes_from_numpy_are_taken_as_ints_and_bools_refused():
    # numpy's integers (a config's values, an array's shape) are sizes to torch too; they
    # were refused as "not an int". A bool is no size, numpy's or Python's.
    np = pytest.importorskip("numpy")
    from torch import nn

    import stiefel
    from stiefel.nn import OrthoConv2d
    from stiefel.nn.spectrum import lipschitz_bound

    st = Stiefel(np.int64(5), np.int32(3))
    assert (st.n, st.m) == (5, 3) and type(st.n) is int and type(st.m) is int
    x = st.random(np.int64(2), 5, 3, dtype=D)
    assert x.shape == (2, 5, 3) and st.check_point_on_manifold(x)
    conv = OrthoConv2d(np.int64(4), 4, np.int64(3), padding=np.int64(1), dtype=D)
    assert conv.kernel_size == 3 and type(conv.kernel_size) is int
    assert conv(torch.randn(1, 4, 6, 6, dtype=D)).shape == (1, 4, 6, 6)
    bound = lipschitz_bound(conv, (np.int64(4), 6, 6), iterations=np.int64(50))
    assert 0.99 < bound < 1.01  # orthogonal: every singular value 1
    assert "padding=1," in repr(conv)  # stored as Python's int
    from stiefel.nn import OrthogonalRNNCell

    assert type(OrthogonalRNNCell(np.int64(3), np.int64(4)).n) is int
    lin = nn.Linear(8, 8)
    lin.requires_grad_(False)
    stiefel.rotate(lin, method="cwy", reflections=np.int64(2), blocks=np.int64(2))
    assert type(lin.rotation.blocks) is int
    peft = pytest.importorskip("peft")
    from stiefel.integrations.peft import StiefelConfig

    config = StiefelConfig(target_modules=["q"], blocks=np.int64(2), butterfly=np.int64(0))
    assert type(config.blocks) is int and type(config.butterfly) is int  # JSON-writable
    assert peft is not None
    for bad in (True, np.bool_(True)):
        with pytest.raises(ValueError, match="n="):
            Stiefel(bad, 1)

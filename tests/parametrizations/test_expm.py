"""expm with the adjoint-Fréchet backward: gradcheck, equality with torch's autograd."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stiefel.parametrizations import _expm
from stiefel.parametrizations import kernels as K
from stiefel.parametrizations._expm import expm
from stiefel.parametrizations._spectral import one_norm, skew_spectral, spectral_needed


def _skew(shape, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, dtype=torch.float64, generator=gen)
    if dtype.is_complex:
        a = a + 1j * torch.randn(*shape, dtype=torch.float64, generator=gen)
    a = (scale * a).to(dtype)
    return 0.5 * (a - a.mH)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape", [(5, 5), (2, 4, 4)])
def test_gradcheck(dtype, shape):
    a = _skew(shape, dtype, 1.0, 0).requires_grad_()
    assert torch.autograd.gradcheck(expm, (a,))
    b = 0.3 * _skew(shape, dtype, 1.0, 1) + 0.2 * torch.eye(shape[-1], dtype=dtype)
    assert torch.autograd.gradcheck(expm, (b.requires_grad_(),))  # not skew: general A


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("scale", [0.01, 1.0, 20.0, 200.0])  # 0 to 7 squarings
def test_equals_torch_matrix_exp_and_its_autograd(dtype, scale):
    a = _skew((3, 12, 12), dtype, scale, 2).requires_grad_()
    y, ref = expm(a), torch.linalg.matrix_exp(a)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g = g.to(dtype)
    (ga,) = torch.autograd.grad(y, a, g)
    (gb,) = torch.autograd.grad(ref, a, g)
    assert (y - ref).abs().max() < 1e-10 * max(1.0, scale)
    assert (ga - gb).abs().max() < 1e-10 * gb.abs().max()


def _at_norm(a: torch.Tensor, norm1: float) -> torch.Tensor:
    return a * (norm1 / torch.linalg.matrix_norm(a, ord=1).max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("degree, theta", _expm._THETA["double"])
def test_each_double_degree_against_torch_and_gradcheck(dtype, degree, theta):
    # Note [Padé degree by the dtype's unit roundoff]: just under θ_m takes degree m
    # without squarings; just over the last θ, the last degree with one squaring
    for norm1, want in ((0.97 * theta, (degree, 0)), (1.03 * theta, None)):
        a = _at_norm(_skew((2, 10, 10), dtype, 1.0, degree), norm1).requires_grad_()
        got = _expm._plan(a)[:2]
        if want is not None:
            assert got == want
        elif degree == 13:
            assert got == (13, 1)
        else:  # the next degree
            table = _expm._THETA["double"]
            assert got == (table[[m for m, _ in table].index(degree) + 1][0], 0)
        y, ref = expm(a), torch.linalg.matrix_exp(a)
        g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        (ga,) = torch.autograd.grad(y, a, g.to(dtype))
        (gb,) = torch.autograd.grad(ref, a, g.to(dtype))
        assert (y - ref).abs().max() < 1e-13
        assert (ga - gb).abs().max() < 1e-12 * gb.abs().max()
    b = _at_norm(_skew((5, 5), dtype, 1.0, 3) + 0.1 * torch.eye(5, dtype=dtype), 0.9 * theta)
    assert _expm._plan(b)[:2] == (degree, 0)  # a general A, not skew, too
    assert torch.autograd.gradcheck(expm, (b.requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("norm1", [0.3, 1.5, 3.5, 30.0])  # degrees 3, 5, 7, 13 with 3 squarings
def test_each_single_degree_against_float64(dtype, norm1):
    n = 48
    wide = torch.complex128 if dtype.is_complex else torch.float64
    a64 = _at_norm(_skew((2, n, n), wide, 1.0, 12), norm1)
    a = a64.to(dtype).requires_grad_()
    m, s = _expm._plan(a)
    assert m == next((d for d, t in _expm._THETA["single"] if norm1 <= t), 13)
    assert s == (3 if norm1 == 30.0 else 0)
    y = expm(a)
    ref = torch.linalg.matrix_exp(a64)
    eps = torch.finfo(torch.float32).eps
    assert float((y.to(wide) - ref).abs().max()) < 10 * n * eps
    eye = torch.eye(n, dtype=wide)
    assert float(torch.linalg.matrix_norm(y.to(wide).mH @ y.to(wide) - eye).max()) < 10 * n * eps
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    (ga,) = torch.autograd.grad(y, a, g.to(dtype))
    a64 = a64.clone().requires_grad_()
    (gb,) = torch.autograd.grad(torch.linalg.matrix_exp(a64), a64, g.to(wide))
    assert float((ga.to(wide) - gb).abs().max()) < 10 * n * eps * float(gb.abs().max())


# ------------------------------- the plan, and the Cholesky route of a skew-Hermitian A


def test_plan_of_a_non_finite_or_vouched_norm(device):
    a = _skew((2, 9, 9), torch.float32, 1.0, 20).to(device)
    inf = a.clone()
    inf[1, 0, 3], inf[1, 3, 0] = float("inf"), -float("inf")  # not finite: no squarings
    assert _expm._plan(inf) == (13, 0)
    norm = float(torch.linalg.matrix_norm(a, ord=1).amax())
    assert _expm._plan(a, skew_norm=norm) == _expm._plan(a)  # the caller's read
    for bad in (float("nan"), float("inf")):
        assert _expm._plan(a, skew_norm=bad) == (13, 0)
    assert _expm._plan(torch.zeros(5, 5, device=device)) == (3, 0)


# The Cholesky route is the exp_map dispatcher's choice on CUDA only (tests/test_dispatch.py
# compares it with torch's matrix_exp there); here its numerics run on every device.


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize(  # every degree without squarings, then degree 13 with one
    "degree, theta, fraction",
    [(m, t, 0.97) for m, t in _expm._THETA["double"]] + [(13, 5.37, 1.03)],
)
def test_cholesky_route_at_each_double_degree_against_torch(device, dtype, fraction, degree, theta):
    a = _at_norm(_skew((2, 10, 10), dtype, 1.0, degree), fraction * theta).to(device)
    assert _expm._plan(a) == (degree, int(fraction > 1))
    a64 = a.cpu().requires_grad_()
    a = a.requires_grad_()
    y, ref = expm(a, cholesky=True), torch.linalg.matrix_exp(a64)
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(21))
    (ga,) = torch.autograd.grad(y, a, g.to(dtype).to(device))
    (gb,) = torch.autograd.grad(ref, a64, g.to(dtype))
    assert float((y.detach().cpu() - ref.detach()).abs().max()) < 1e-13
    assert float((ga.cpu() - gb).abs().max()) < 1e-12 * float(gb.abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("scale", [0.05, 1.0, 20.0])  # degrees 5 or 7, 13; 13 with squarings
def test_cholesky_route_gradcheck(device, dtype, scale):
    # the route is right for skew-Hermitian A only: gradcheck perturbs the raw upper
    # triangle, so every perturbed A stays skew
    raw = K.raw_from_skew(_skew((2, 5, 5), dtype, scale, 22)).to(device).requires_grad_()
    norm = one_norm(K.skew_from_raw(raw.detach()))
    fn = lambda r: expm(K.skew_from_raw(r), skew_norm=norm, cholesky=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (raw,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("norm1", [0.3, 1.5, 3.5, 30.0])
def test_cholesky_route_in_single_precision_against_float64(device, dtype, norm1):
    n = 48
    wide = torch.complex128 if dtype.is_complex else torch.float64
    a64 = _at_norm(_skew((2, n, n), wide, 1.0, 23), norm1)
    a = a64.to(dtype).to(device).requires_grad_()
    y = expm(a, cholesky=True)
    eps = torch.finfo(torch.float32).eps
    y64 = y.detach().cpu().to(wide)
    assert float((y64 - torch.linalg.matrix_exp(a64)).abs().max()) < 10 * n * eps
    eye = torch.eye(n, dtype=wide)
    assert float(torch.linalg.matrix_norm(y64.mH @ y64 - eye).max()) < 10 * n * eps
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(24))
    (ga,) = torch.autograd.grad(y, a, g.to(dtype).to(device))
    a64 = a64.clone().requires_grad_()
    (gb,) = torch.autograd.grad(torch.linalg.matrix_exp(a64), a64, g.to(wide))
    assert float((ga.cpu().to(wide) - gb).abs().max()) < 10 * n * eps * float(gb.abs().max())


class _HostReads(TorchDispatchMode):
    """Counts the values read back to the host (``float(t)``, ``.item()``, ``.tolist()``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.ops.aten._to_copy.default and args[0].device.type != "cpu"
        to_host = to_host and torch.device(kwargs.get("device", args[0].device)).type == "cpu"
        self.count += func is torch.ops.aten._local_scalar_dense.default or to_host
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_the_exp_map_reads_its_norm_once_and_hands_it_to_expm(monkeypatch, device, dtype):
    # one host read picks the path and expm's degree (and, on CUDA, its solve)
    plans, plan = [], _expm._plan
    monkeypatch.setattr(
        _expm, "_plan", lambda a, skew_norm=None: plans.append(skew_norm) or plan(a, skew_norm)
    )
    raw = torch.randn(3, 12, 12, dtype=dtype, generator=torch.Generator().manual_seed(25))
    raw = (3.0 * raw).to(device).requires_grad_()
    eye = torch.eye(12, dtype=dtype, device=device)
    reads = _HostReads()
    with reads:
        q = K.exp_map(K.skew_from_raw(raw), eye)
        (got,) = torch.autograd.grad(q.real.sum(), raw)
    assert reads.count == 1
    a = K.skew_from_raw(raw.detach())
    assert plans == [one_norm(a)]  # the map's read, handed on
    raw64 = raw.detach().cpu().requires_grad_()
    ref = torch.linalg.matrix_exp(K.skew_from_raw(raw64))
    (want,) = torch.autograd.grad(ref.real.sum(), raw64)
    assert float((q.detach().cpu() - ref.detach()).abs().max()) < 1e-12
    assert float((got.cpu() - want).abs().max()) < 1e-11 * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_forward_of_skew_is_orthogonal(dtype):
    n = 64
    q = expm(_skew((n, n), dtype, 3.0, 4))
    eye = torch.eye(n, dtype=dtype)
    err = torch.linalg.matrix_norm(q.mH @ q - eye)
    eps = torch.finfo(q.real.dtype).eps
    assert err < 10 * n * eps


def test_no_grad_path_and_errors():
    a = _skew((4, 4), torch.float64, 1.0, 5)
    assert torch.allclose(expm(a), torch.linalg.matrix_exp(a), atol=1e-14)
    with pytest.raises(ValueError, match="square"):
        expm(torch.zeros(3, 4))


# ------------------------------------------------- large ‖A‖: exp and Cayley through eigh


@pytest.mark.parametrize("kind", ["exp", "cayley"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape", [(5, 5), (2, 6, 6)])
def test_spectral_path_equals_pade_and_lu_and_their_gradients(kind, dtype, shape):
    a = _skew(shape, dtype, 2.0, 6).requires_grad_()
    eye = torch.eye(shape[-1], dtype=dtype)
    ref = expm(a) if kind == "exp" else torch.linalg.solve(eye + a, eye - a)
    y = skew_spectral(a, kind)
    g = _skew(shape, dtype, 1.0, 7) + 0.5 * _skew(shape, dtype, 1.0, 8).mH.tril()  # any G
    (ga,) = torch.autograd.grad(y, a, g)
    (gb,) = torch.autograd.grad(ref, a, g)
    assert (y - ref).abs().max() < 1e-12
    skew = 0.5 * (gb - gb.mH)  # the spectral form reads S(A) = (A − Aᴴ)/2 only
    assert (ga - skew).abs().max() < 1e-12 * max(1.0, float(skew.abs().max()))


@pytest.mark.parametrize("kind", ["exp", "cayley"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_spectral_path_gradcheck_at_large_norm(kind, dtype):
    # Through the kernels on free parameters, where the eigh path is the one taken:
    # real skew A has ±λ pairs (and a zero for odd n), the divided differences handle them.
    raw = _skew((5, 5), dtype, 40.0, 9).requires_grad_()
    assert spectral_needed(K.skew_from_raw(raw))
    base = torch.linalg.qr(torch.randn(5, 3, dtype=torch.float64).to(dtype)).Q
    if kind == "exp":
        f = lambda r: K.exp_map(K.skew_from_raw(r), torch.eye(5, dtype=dtype), 3)  # noqa: E731
    else:
        f = lambda r: K.cayley_map(K.skew_from_raw(r), base)  # noqa: E731
    assert torch.autograd.gradcheck(f, (raw,))
    d = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    g = lambda r: K.scaled_cayley_map(K.skew_from_raw(r), d)  # noqa: E731
    assert torch.autograd.gradcheck(g, (raw,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("scale", [1e3, 1e10, 1e30])
def test_large_skew_stays_orthogonal_in_float32(dtype, scale):
    n = 7
    a = _skew((3, n, n), dtype, scale, 10)
    eye = torch.eye(n, dtype=torch.complex128)
    for q in (skew_spectral(a, "exp"), skew_spectral(a, "cayley")):
        q = q.to(torch.complex128)
        assert bool(torch.isfinite(q).all())
        assert float(torch.linalg.matrix_norm(q.mH @ q - eye).max()) < 10 * n * 1.2e-7


def test_spectral_threshold_and_errors():
    n = 6
    assert not spectral_needed(_skew((n, n), torch.float32, 1.0, 11))
    assert spectral_needed(_skew((n, n), torch.float32, 1e3, 11))
    assert not spectral_needed(torch.full((n, n), float("nan")))  # NaN propagates
    with pytest.raises(ValueError, match="kind='log' is not supported; allowed: exp, cayley"):
        skew_spectral(torch.zeros(3, 3), "log")


def test_exp_of_zero_is_exactly_the_identity():
    # Note [Padé coefficients normalised to b₀ = 1]: a based map returns its base bit for bit.
    for dtype in (torch.float32, torch.float64, torch.complex64):
        assert torch.equal(expm(torch.zeros(7, 7, dtype=dtype)), torch.eye(7, dtype=dtype))

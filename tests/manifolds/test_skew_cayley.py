"""Q − I of the Cayley transform of a skew-Hermitian K, by Euler's product or a solve.

Note [Cayley of a small skew matrix by Euler's product]: both paths against the
dense float64 formula (I + K)⁻¹(I − K) − I, gradients, and the square Cayley step
that uses it against a dense reference (which path runs: tests/manifolds/test_euler.py).
"""

import pytest
import torch

from stiefel.manifolds import kernels
from stiefel.manifolds.kernels import skew_cayley
from stiefel.manifolds.kernels.skew_cayley import cayley_delta

LOW = [torch.float32, torch.complex64]
ALL = [torch.float32, torch.float64, torch.complex64, torch.complex128]


def _wide(dtype):
    return torch.complex128 if dtype.is_complex else torch.float64


def _skew(n, batch, r, dtype, gen):
    """Skew-Hermitian matrices with ‖K‖_F = r each, built in the wide dtype."""
    a = torch.randn(*batch, n, n, dtype=_wide(dtype), generator=gen)
    s = a - a.mH
    return (r * s / torch.linalg.matrix_norm(s, keepdim=True)).to(dtype)


def _reference(k):
    # −2(I + K)⁻¹K in the wide dtype: (I + K)⁻¹(I − K) − I would round relative to I,
    # an error of eps/‖D‖ relative to D, too coarse to judge a float64 result
    kw = k.to(_wide(k.dtype))
    eye = torch.eye(k.shape[-1], dtype=kw.dtype)
    return torch.linalg.solve(eye + kw, -2 * kw)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("n", [8, 64, 130])
@pytest.mark.parametrize("r", [1e-3, 0.05, 0.3])
def test_delta_equals_the_dense_formula(dtype, n, r, device):
    # relative to ‖D‖ ≈ 2r: both paths round relative to D, not to I
    gen = torch.Generator().manual_seed(n)
    k = _skew(n, (3,), r, dtype, gen)
    with torch.no_grad():
        d = cayley_delta(k.to(device), r).cpu()
    ref = _reference(k)
    eps = torch.finfo(dtype).eps
    err = torch.linalg.matrix_norm(d.to(ref.dtype) - ref) / torch.linalg.matrix_norm(ref)
    assert float(err.max()) < 10 * n * eps
    assert d.dtype == dtype and d.shape == k.shape


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("factors", [1, 2, 3, 4])
def test_each_number_of_factors_is_exact_within_its_radius(dtype, factors, device):
    # the largest r that j factors take in the dtype: r^(2^(j+1)) = u
    r = (torch.finfo(dtype).eps / 2) ** (1 / 2 ** (factors + 1))
    gen = torch.Generator().manual_seed(factors)
    k = _skew(48, (2,), r, dtype, gen)
    with torch.no_grad():
        d = skew_cayley.euler_delta(k.to(device), factors).cpu()
    ref = _reference(k)
    err = torch.linalg.matrix_norm(d.to(ref.dtype) - ref) / torch.linalg.matrix_norm(ref)
    assert float(err.max()) < 10 * 48 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", LOW)
def test_series_is_as_accurate_as_the_solve(dtype):
    gen = torch.Generator().manual_seed(1)
    k = _skew(64, (16,), 0.05, dtype, gen)
    ref = _reference(k)
    with torch.no_grad():
        series, solved = cayley_delta(k, 0.05), cayley_delta(k, None)

    def err(d):
        return float(
            (torch.linalg.matrix_norm(d.to(ref.dtype) - ref) / torch.linalg.matrix_norm(ref)).max()
        )

    assert err(series) <= 2 * err(solved)


@pytest.mark.parametrize("cplx", [False, True])
def test_series_gradient_by_gradcheck(cplx):
    dtype = torch.complex128 if cplx else torch.float64
    gen = torch.Generator().manual_seed(3)
    a = _skew(6, (2,), 1.0, dtype, gen)

    def f(t):
        k = 1e-3 * (t - t.mH)  # ‖K‖_F ≤ 2e-3·‖t‖_F: the series with its bound
        return cayley_delta(k, float(torch.linalg.matrix_norm(k.detach()).max()))

    assert torch.autograd.gradcheck(f, (a.clone().requires_grad_(),))


@pytest.mark.parametrize("dtype", LOW)
def test_square_cayley_step_through_the_series_equals_the_dense_step(dtype, device, monkeypatch):
    # a batch of O(64) points and short steps: the square kernel takes the series (no
    # solve); its result against the dense Cayley retraction of the same step in float64
    def no_solve(*args, **kwargs):
        raise AssertionError("the short square step solved instead of the series")

    gen = torch.Generator().manual_seed(4)
    n = 64
    wide = _wide(dtype)
    x = kernels.haar(n, n, 8, dtype=wide, generator=gen)
    u = kernels.proj_tangent(x, 1e-3 * torch.randn(8, n, n, dtype=wide, generator=gen))
    ref = kernels.cayley_dense(x, u)
    monkeypatch.setattr(skew_cayley.torch.linalg, "solve", no_solve)
    with torch.no_grad():
        y = kernels.cayley_retraction(x.to(device, dtype), u.to(device, dtype)).cpu()
    assert float((y.to(wide) - ref).abs().max()) < 10 * n * torch.finfo(dtype).eps

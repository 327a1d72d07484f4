"""(I + K)⁻¹R for small K by Euler's product of the Neumann series, or a solve.

Note [Inverse of I + K by Euler's product]: the product against the float64 solve
for general K and right-hand sides (within the radius each number of factors
promises), the choice of that number, the limits per device type, which path
runs, and gradients.
"""

import math

import pytest
import torch

from stiefel.manifolds.kernels import euler
from stiefel.manifolds.kernels.euler import euler_solve, series_factors, solve_near_identity

ALL = [torch.float32, torch.float64, torch.complex64, torch.complex128]


def _wide(dtype):
    return torch.complex128 if dtype.is_complex else torch.float64


def _near_identity(n, cols, batch, r, dtype, gen):
    """General K with ‖K‖₂ = r each (not skew, not normal) and a right-hand side R."""
    a = torch.randn(*batch, n, n, dtype=_wide(dtype), generator=gen)
    k = r * a / torch.linalg.matrix_norm(a, 2, keepdim=True)
    rhs = torch.randn(*batch, n, cols, dtype=_wide(dtype), generator=gen)
    return k.to(dtype), rhs.to(dtype)


def _reference(k, rhs):
    kw = k.to(_wide(k.dtype))
    return torch.linalg.solve(torch.eye(k.shape[-1], dtype=kw.dtype) + kw, rhs.to(kw.dtype))


def _rel_err(p, ref):
    num = torch.linalg.matrix_norm(p.to(ref.dtype) - ref)
    return float((num / torch.linalg.matrix_norm(ref)).max())


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("factors", [1, 2, 3, 4])
@pytest.mark.parametrize("cols", [3, 24])
def test_each_number_of_factors_is_exact_within_its_radius(dtype, factors, cols, device):
    # the largest r that j factors take in the dtype: r^(2^(j+1)) = u; K general, so
    # ‖(I + K)⁻¹‖₂ ≤ 1/(1 − r) bounds the rounding's growth
    r = (torch.finfo(dtype).eps / 2) ** (1 / 2 ** (factors + 1))
    gen = torch.Generator().manual_seed(factors)
    k, rhs = _near_identity(24, cols, (3,), r, dtype, gen)
    with torch.no_grad():
        p = euler_solve(k.to(device), rhs.to(device), factors).cpu()
    assert p.dtype == dtype and p.shape == rhs.shape
    assert _rel_err(p, _reference(k, rhs)) < 10 * 24 * torch.finfo(dtype).eps / (1 - r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_one_factor_too_few_misses_by_the_truncation(dtype):
    # the truncation error is r^(2^(j+1)): with K = r·U (U unitary, so ‖K⁴y‖ = r⁴‖y‖)
    # one factor at the radius of two misses by exactly r⁴, far above rounding
    r = (torch.finfo(dtype).eps / 2) ** (1 / 8)
    gen = torch.Generator().manual_seed(5)
    u = torch.linalg.qr(torch.randn(2, 16, 16, dtype=_wide(dtype), generator=gen))[0]
    k = (r * u).to(dtype)
    rhs = torch.randn(2, 16, 4, dtype=dtype, generator=gen)
    err = _rel_err(euler_solve(k, rhs, 1), _reference(k, rhs))
    assert abs(err / r**4 - 1) < 0.01
    assert _rel_err(euler_solve(k, rhs, 2), _reference(k, rhs)) < 10 * 16 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_square_right_hand_side_shares_the_first_product(dtype):
    # R = K: P₀ = K − K² from the square, the same numbers as a copy of K taken as R
    gen = torch.Generator().manual_seed(6)
    k, _ = _near_identity(12, 1, (3,), 0.05, dtype, gen)
    torch.testing.assert_close(euler_solve(k, k, 2), euler_solve(k, k.clone(), 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_series_factors_is_the_smallest_count_within_half_an_ulp(dtype, device_type, monkeypatch):
    # a device type's limits, checked on CPU tensors given that type's table entry
    limit = euler.SERIES_LIMITS[device_type]
    monkeypatch.setitem(euler.SERIES_LIMITS, "cpu", limit)
    unit = torch.finfo(dtype).eps / 2
    for n in (8, limit.max_order, limit.max_order + 1):
        k = torch.zeros(n, n, dtype=dtype)
        for r in (0.0, 1e-9, 1e-4, 0.01, 0.05, 0.1, 0.2, 0.34, 0.5, 0.58, 0.6, 0.99):
            j = series_factors(r, k)
            fits = [i for i in range(1, 30) if r ** (2 ** (i + 1)) <= unit]
            if fits and fits[0] <= limit.max_factors and n <= limit.max_order:
                assert j == fits[0]
            else:
                assert j is None


@pytest.mark.parametrize(("device_type", "factors", "root"), [("cpu", 2, 8), ("cuda", 4, 32)])
def test_the_series_limits_in_float32(device_type, factors, root, monkeypatch):
    # the CPU takes two factors up to u^(1/8) = 1/8, a GPU four up to u^(1/32)
    monkeypatch.setitem(euler.SERIES_LIMITS, "cpu", euler.SERIES_LIMITS[device_type])
    k = torch.zeros(8, 8)
    edge = (torch.finfo(torch.float32).eps / 2) ** (1 / root)
    assert series_factors(0.99 * edge, k) == factors
    assert series_factors(1.01 * edge, k) is None
    assert math.isclose((torch.finfo(torch.float32).eps / 2) ** (1 / 8), 1 / 8)  # u = 2⁻²⁴


def test_the_path_follows_the_bound_and_the_order(monkeypatch):
    calls = []
    solve = torch.linalg.solve

    def counting(*args, **kwargs):
        calls.append(args[0].shape[-1])
        return solve(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "solve", counting)
    gen = torch.Generator().manual_seed(2)
    small, rhs = _near_identity(64, 5, (2,), 0.01, torch.float32, gen)
    large, rhs_large = _near_identity(129, 5, (), 0.01, torch.float32, gen)
    with torch.no_grad():
        series = solve_near_identity(small, rhs, 0.01)
        assert calls == []
        solved = solve_near_identity(small, rhs, None)  # not read: solve
        solve_near_identity(small, rhs, 0.5)  # too long for two factors: solve
        solve_near_identity(large, rhs_large, 0.01)  # above the CPU's max_order: solve
    assert calls == [64, 64, 129]
    ref = _reference(small, rhs)
    assert _rel_err(series, ref) <= 2 * max(_rel_err(solved, ref), torch.finfo().eps)


@pytest.mark.parametrize("cplx", [False, True])
def test_series_gradient_by_gradcheck(cplx):
    dtype = torch.complex128 if cplx else torch.float64
    gen = torch.Generator().manual_seed(3)
    k0, rhs = _near_identity(5, 2, (2,), 1.0, dtype, gen)

    def f(a, b):
        k = 1e-3 * a  # ‖K‖₂ ≤ 1e-3: the series with its bound
        return solve_near_identity(k, b, float(torch.linalg.matrix_norm(k.detach()).max()))

    assert torch.autograd.gradcheck(f, (k0.clone().requires_grad_(), rhs.clone().requires_grad_()))

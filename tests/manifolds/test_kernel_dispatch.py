"""The kernel dispatchers of `stiefel.manifolds.kernels`: each other path against the reference.

One property test per dispatcher (Note [Inverse of I + K by Euler's product]): on
inputs where the policy picks the other path, its result equals the one forced
onto the reference path by ``policy(reference=True)``, and both equal the dense
float64 solve.
"""

from __future__ import annotations

import pytest
import torch

from stiefel.dispatch import policy
from stiefel.manifolds.kernels import euler
from stiefel.manifolds.kernels.reads import StepChecks


@pytest.mark.parametrize("n", [4, 16, 64])
@pytest.mark.parametrize("radius", [1e-3, 1e-2])  # within two factors in float64
def test_near_identity_series_equals_the_solve(n, radius):
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(3, n, n, dtype=torch.float64, generator=gen)
    k = radius * a / torch.linalg.matrix_norm(a, keepdim=True)  # ‖K‖₂ ≤ ‖K‖_F = radius
    rhs = torch.randn(3, n, 2, dtype=torch.float64, generator=gen)
    assert euler.series_path(k) == "series"
    fast = euler.solve_near_identity(k, rhs, radius)
    # the per-matrix bound of a step that reads nothing
    bound = torch.full((3, 1, 1), radius, dtype=torch.float64)
    plain: list = []  # no last step's bound: the solve, refusing nothing
    unread = euler.solve_near_identity(k, rhs, bound, plain, "site")
    sized = StepChecks({"site": radius / 2})  # the last step's bound sizes the product
    calls = []
    solve = torch.linalg.solve
    torch.linalg.solve = lambda *a, **kw: calls.append(1) or solve(*a, **kw)
    try:
        sized_out = euler.solve_near_identity(k, rhs, bound, sized, "site")
    finally:
        torch.linalg.solve = solve
    with policy(reference=True):
        assert euler.series_path(k) == "solve"
        ref = euler.solve_near_identity(k, rhs, radius)
    dense = torch.linalg.solve(torch.eye(n, dtype=torch.float64) + k, rhs)
    tol = 10 * n * torch.finfo(torch.float64).eps
    assert plain == []
    assert calls == [] and len(sized) == 1 and bool(sized[0])  # Euler's product, its test
    assert [(site, float(b)) for site, b in sized.measured] == [("site", radius)]
    for out in (fast, unread, sized_out, ref):
        assert float((out - dense).abs().max()) <= tol * float(dense.abs().max())


def test_a_bound_more_than_twice_the_last_fails_its_test():
    k = 1e-3 * torch.eye(6, dtype=torch.float64).expand(2, 6, 6)
    checks = StepChecks({"site": 1e-6})  # sized for 2e-6: one factor
    assert euler.series_factors(2e-6, k) == 1
    euler.solve_near_identity(k, k, torch.full((2, 1, 1), 1e-3), checks, "site")
    assert len(checks) == 1 and not bool(checks[0])  # the step is taken again, exactly
    nan = StepChecks({"site": float("nan")})  # a non-finite last bound: the solve
    euler.solve_near_identity(k, k, torch.full((2, 1, 1), 1e-3), nan, "site")
    assert nan == []


@pytest.mark.parametrize("shape", [(40, 5, 4), (300, 7)])
def test_wide_gram_by_chunks_equals_the_whole_copy(monkeypatch, shape):
    from stiefel.manifolds.kernels import reduce

    monkeypatch.setattr(reduce, "WIDE_CHUNK", 64)  # several chunks: batch and row blocks
    x = torch.randn(*shape, dtype=torch.float32)
    with torch.no_grad():
        assert reduce.wide_gram_path(x) == "chunks"
        fast = reduce.wide_gram(x)
        with policy(reference=True):
            assert reduce.wide_gram_path(x) == "whole"
            ref = reduce.wide_gram(x)
    exact = x.double().mT @ x.double()
    tol = 10 * shape[-2] * torch.finfo(torch.float64).eps
    assert fast.dtype == torch.float64 and torch.allclose(fast, ref, rtol=tol, atol=tol)
    assert torch.allclose(fast, exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("batch", [(), (2,)])
def test_minus_adjoint_by_a_transposed_copy_equals_the_plain_difference(batch):
    from stiefel.manifolds.kernels import frame

    a = torch.randn(*batch, 512, 512, dtype=torch.float64)
    with torch.no_grad():
        assert frame.minus_adjoint_path(a) == "transposed_copy"
        fast = frame.minus_adjoint(a)
        with policy(reference=True):
            assert frame.minus_adjoint_path(a) == "plain"
            ref = frame.minus_adjoint(a)
    assert torch.equal(fast, ref) and torch.equal(fast, a - a.mT)  # exact: one rounding each

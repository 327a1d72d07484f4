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


@pytest.mark.parametrize("n", [4, 16, 64])
@pytest.mark.parametrize("radius", [1e-3, 1e-2])  # within two factors in float64
def test_near_identity_series_equals_the_solve(n, radius):
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(3, n, n, dtype=torch.float64, generator=gen)
    k = radius * a / torch.linalg.matrix_norm(a, keepdim=True)  # ‖K‖₂ ≤ ‖K‖_F = radius
    rhs = torch.randn(3, n, 2, dtype=torch.float64, generator=gen)
    assert euler.series_path(k) == "series"
    fast = euler.solve_near_identity(k, rhs, radius)
    checks: list = []  # the per-matrix bound of a step that reads nothing
    unread = euler.solve_near_identity(k, rhs, torch.full((3, 1, 1), radius), checks)
    with policy(reference=True):
        assert euler.series_path(k) == "solve"
        ref = euler.solve_near_identity(k, rhs, radius)
    dense = torch.linalg.solve(torch.eye(n, dtype=torch.float64) + k, rhs)
    tol = 10 * n * torch.finfo(torch.float64).eps
    assert checks == []  # a tensor bound takes the solve, refusing nothing
    for out in (fast, unread, ref):
        assert float((out - dense).abs().max()) <= tol * float(dense.abs().max())

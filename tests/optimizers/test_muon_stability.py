"""manifold_muon under rounding: Riemannian gradients of rank below M (a least-squares loss).

Note [A dead zone for the dual descent] in `stiefel.manifolds.kernels.msign`: a polynomial
msign multiplies the null-space rounding of a rank-deficient B + XΛ by its slope at zero,
p'(0) ≈ 2.2e4 for Polar Express at 10 steps, and the dual descent compounded that every
inner step (4e-14 → 9e-11 → 3e-7 → 4e-4 on St(12, 6), float64). The bounds below are
C·eps·p'(0): the conditioning of the polynomial sign itself, paid once. The reference is
the same dual descent with the exact msign (one SVD per inner step).
"""

from __future__ import annotations

import math

import geoopt
import pytest
import torch

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.manifolds.kernels.msign import MSIGN_DEFAULT_STEPS, _coefficients, spectral_direction

_STEPS = MSIGN_DEFAULT_STEPS["polar_express"]
_COEFFICIENTS, _SAFETY = _coefficients("polar_express", _STEPS)
SLOPE = math.prod(a for a, _, _ in _COEFFICIENTS) / _SAFETY  # p'(0) of the default msign


def _regression(n: int, m: int, seed: int, dtype=torch.float64, batch=()):
    """X on St(n, m) and the gradient of mean((a Xᵀ − 1)²) over 8 samples a.

    XᴴG = c(XᴴX aᵀa − Xᴴ1 sᵀ) is symmetric up to rank one, so the Riemannian gradient
    has rank at most 3 < m: B + XΛ is rank-deficient from the first inner step.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.linalg.qr(torch.randn(*batch, n, m, dtype=dtype, generator=gen))[0]
    a = torch.randn(*batch, 8, m, dtype=dtype, generator=gen)
    return x, 2 * (x @ a.mT - 1) @ a.conj() / (8 * n)


def _max(a: torch.Tensor) -> float:
    return float(a.abs().max())


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((12, 6), torch.float64),
        ((16, 4), torch.float64),
        ((20, 5), torch.float64),
        ((8, 6), torch.float64),
        ((3, 12, 6), torch.float64),
        ((16, 4), torch.complex128),
        ((8, 6), torch.complex128),
    ],
)
def test_default_direction_equals_exact_msign_direction(shape, dtype, one_thread):
    *batch, n, m = shape
    eps = torch.finfo(torch.float64).eps
    for seed in range(3):
        x, g = _regression(n, m, seed, dtype, tuple(batch))
        phi = spectral_direction(x, g, 10, "polar_express", dual_step=1.0)
        nudged = spectral_direction(x, g * (1 + 4 * eps), 10, "polar_express", dual_step=1.0)
        exact = spectral_direction(x, g, 10, "svd", dual_step=1.0)
        # the step is scale-invariant in G: a relative nudge of 4 eps is rounding
        assert _max(phi - nudged) <= 100 * eps * SLOPE, (seed, _max(phi - nudged))
        assert _max(phi - exact) <= 100 * eps * SLOPE, (seed, _max(phi - exact))
        assert _max(x.mH @ phi + phi.mH @ x) <= 100 * n * eps
        assert float(torch.linalg.matrix_norm(phi, 2).max()) <= 1 + 100 * eps


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
@pytest.mark.parametrize("n", [5, 6])
def test_square_direction_is_insensitive_to_rounding(n, dtype, one_thread):
    # O(n), U(n): one msign of X skew(XᴴG), here of rank ≤ 2; its null-space rounding was
    # multiplied by p'(0) (1e-12 in float64, 7e-4 in float32)
    eps = torch.finfo(dtype).eps
    for seed in range(3):
        x, g = _regression(n, n, seed, dtype)
        phi = spectral_direction(x, g, 10, "polar_express")
        nudged = spectral_direction(x, g * (1 + 4 * eps), 10, "polar_express")
        assert _max(phi - nudged) <= 100 * n * eps, (seed, _max(phi - nudged))


@pytest.mark.parametrize(("n", "m"), [(12, 6), (16, 4)])
def test_manifold_muon_step_is_the_exact_msign_step(n, m, one_thread):
    # a rank-deficient least-squares gradient: St(12, 6), float64, one default step of lr 0.05
    st = Stiefel(n, m)
    x, g = _regression(n, m, 0)
    eps = torch.finfo(torch.float64).eps

    def step(grad, **kw):
        w = geoopt.ManifoldParameter(x.clone(), manifold=st)
        opt = optimizers.create("manifold_muon", [w], lr=0.05, **kw)
        w.grad = grad.clone()
        opt.step()
        return w.detach()

    default = step(g)
    assert _max(default - x) > 1e-3  # it moves
    tol = 0.05 * 100 * eps * SLOPE
    assert _max(default - step(g * (1 + 1e-15))) <= tol
    assert _max(default - step(g, msign="svd")) <= tol


@pytest.mark.parametrize("steps", [2, 3, 4])
def test_fewer_steps_than_the_default_take_no_dead_zone(steps):
    # Polar Express stopped early ends with singular values above √(5/3), where the
    # dead zone's polynomial turns negative and grows as s⁵: the descent would follow a
    # direction of up to 2e6 in spectral norm (aligned with G at 0.03–0.13 of the
    # exact one); without the dead zone it is the plain early-stopped sign's
    from stiefel.manifolds.kernels.msign import spectral_direction

    gen = torch.Generator().manual_seed(0)
    x = torch.linalg.qr(torch.randn(64, 16, dtype=torch.float64, generator=gen))[0]
    g = torch.randn(64, 16, dtype=torch.float64, generator=gen)
    exact = spectral_direction(x, g, 10, "svd", None, 1.0)
    phi = spectral_direction(x, g, 10, "polar_express", steps, 1.0)
    assert float((phi * g).sum() / (exact * g).sum()) > 0.25
    assert float(torch.linalg.matrix_norm(phi, 2)) <= 1 + 1e-12

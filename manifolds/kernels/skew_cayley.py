r"""D = Q − I for the Cayley transform Q = (I + K)⁻¹(I − K) of a skew-Hermitian K.

The square Cayley step (Note [Square Cayley step in the frame of X]) needs this
D for a batch of n×n matrices K = ½βŜ. ``cayley_delta`` forms it by Euler's
product when that is exact to rounding in a few matrix products, and by one
solve otherwise.

Note [Cayley of a small skew matrix by Euler's product]
D = (I + K)⁻¹(I − K) − I = −2(I + K)⁻¹K. For ‖K‖₂ ≤ r < 1 Euler's factorization of
the Neumann series, (I + K)⁻¹ = (I − K)(I + K²)(I + K⁴)···(I + K^{2^j})(I − K^{2^{j+1}})⁻¹,
gives

    P_j = (I − K)(I + K²)···(I + K^{2^j})·K = (I + K)⁻¹K − K^{2^{j+1}}(I + K)⁻¹K,

so D = −2P_j with a relative truncation error of at most r^{2^{j+1}} (all factors
are polynomials in K and commute). It costs 2j products: P₀ = K − K², then for
i = 1, …, j the square K^{2^i} (K² is already there) and P_i = P_{i−1} + P_{i−1}K^{2^i},
one fused multiply-add. Every term is a product of small matrices (‖K^p‖ ≤ r^p),
so its rounding is relative to D, not to I: the series is as accurate as the solve
with the small right-hand side −2K, and more accurate than forming 2(I + K)⁻¹ − 2I.
r is the Frobenius norm ‖K‖_F = |β|/2 ≥ ‖K‖₂, read on the host (one number for the
batch); j is the smallest with r^{2^{j+1}} below half an ulp of the dtype.

Why not always the solve: LAPACK factorizes the matrices of a batch one call at a
time, and for n up to a few hundred those calls run far below the rate of batched
products (docs/results.md, "Batched regime"); on a GPU the LU is a chain of small
kernels, slower than a few products up to n in the thousands. The series is used
while it costs at most 2·`SeriesLimit.max_factors` products and n ≤
`SeriesLimit.max_order`, the limits of the device type in `SERIES_LIMITS`: the
orders and lengths of step at which those products cost less than the solve there
(``benchmarks.skew_cayley``). On a CPU that is r ≤ u^{1/8} (1/8 in float32) and
n ≤ 128; on a GPU r ≤ u^{1/32} (0.59 in float32) and n ≤ 2048, the largest order
measured. A device type not in the table takes the CPU's limits. A longer step, a
larger n, or a traced call (no host read: Note [Traced steps compute both paths]
in .frame) takes the solve.

Example:
    ```python
    import torch
    from stiefel.manifolds.kernels.skew_cayley import cayley_delta

    a = torch.randn(16, 16, dtype=torch.float64)
    k = 0.01 * (a - a.mT) / torch.linalg.matrix_norm(a - a.mT)
    eye = torch.eye(16, dtype=torch.float64)
    ref = torch.linalg.solve(eye + k, eye - k) - eye
    assert torch.allclose(cayley_delta(k, 0.01), ref, rtol=0, atol=1e-15)
    ```
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .basic import eye_like, flat
from .frame import in_place

__all__ = [
    "SeriesLimit",
    "SERIES_LIMITS",
    "series_factors",
    "cayley_delta",
    "euler_delta",
]


class SeriesLimit(NamedTuple):
    """Where Euler's product runs on a device type: n ≤ max_order, j ≤ max_factors."""

    max_order: int
    max_factors: int


#: the limits of the series by device type (others take the CPU's): Note [Cayley of a
#: small skew matrix by Euler's product]
SERIES_LIMITS = {"cpu": SeriesLimit(128, 2), "cuda": SeriesLimit(2048, 4)}


def series_factors(r: float, k: torch.Tensor) -> int | None:
    """The number j of Euler factors after which r^(2^(j+1)) is below half an ulp.

    Args:
        r: a bound on ‖K‖₂ (e.g. ‖K‖_F).
        k: the matrices (..., n, n): their dtype (complex: that of the parts), order
            and device type select the limits in `SERIES_LIMITS`.

    Returns:
        j ≥ 1, or None when n or the j needed is above the device type's limits.
    """
    limit = SERIES_LIMITS.get(k.device.type, SERIES_LIMITS["cpu"])
    if k.shape[-1] > limit.max_order:
        return None
    unit = torch.finfo(k.dtype).eps / 2
    for j in range(1, limit.max_factors + 1):
        if r ** (2 ** (j + 1)) <= unit:
            return j
    return None


def cayley_delta(k: torch.Tensor, bound: float | None) -> torch.Tensor:
    r"""(I + K)⁻¹(I − K) − I = −2(I + K)⁻¹K for skew-Hermitian K (..., n, n).

    Args:
        k: skew-Hermitian matrices.
        bound: an upper bound on ‖K‖₂ over the batch read by the caller, or None
            when it was not read (then the solve runs).

    Returns:
        D, of ``k``'s shape; a fresh tensor.
    """
    j = None if bound is None else series_factors(bound, k)
    if j is None:  # Note [Cayley of a small skew matrix by Euler's product]
        return torch.linalg.solve(eye_like(k, k.shape[-1]) + k, -2 * k)
    return euler_delta(k, j)


def euler_delta(k: torch.Tensor, factors: int) -> torch.Tensor:
    r"""−2(I − K)(I + K²)···(I + K^{2^j})·K with j = ``factors``: 2j products.

    Equals (I + K)⁻¹(I − K) − I up to a relative error ‖K‖₂^{2^{j+1}} (Note [Cayley
    of a small skew matrix by Euler's product]); `cayley_delta` picks j.

    Args:
        k: matrices (..., n, n) with ‖K‖₂ < 1.
        factors: j ≥ 1.

    Returns:
        D, of ``k``'s shape; a fresh tensor.
    """
    power = k @ k
    p = k - power  # P₀ = (I − K)K
    for i in range(1, factors + 1):
        if i > 1:
            power = power @ power  # K^(2^i)
        p = torch.baddbmm(flat(p), flat(p), flat(power)).reshape(k.shape)  # P + P·K^(2^i)
    return p.mul_(-2) if in_place() else -2 * p

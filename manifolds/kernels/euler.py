r"""(I + K)⁻¹R for a batch of small K: Euler's product of the Neumann series, or a solve.

The Cayley steps solve near-identity systems with matrices of the order of the
step: the square step (I + K)⁻¹K for a skew K (`skew_cayley`), and the
Woodbury step's two M×M blocks (`woodbury`). ``solve_near_identity`` takes
Euler's product when a bound on ‖K‖₂ read by the caller makes it exact to
rounding in a few batched products, and one LU solve otherwise.

Note [Inverse of I + K by Euler's product]
For ‖K‖₂ ≤ r < 1 Euler's factorization of the Neumann series,
(I + K)⁻¹ = (I − K)(I + K²)(I + K⁴)···(I + K^{2^j})(I − K^{2^{j+1}})⁻¹, gives

    P_j = (I + K^{2^j})···(I + K²)(I − K)·R = (I + K)⁻¹R − K^{2^{j+1}}(I + K)⁻¹R,

a relative truncation error of at most r^{2^{j+1}} (all factors are polynomials
in K and commute). It costs 2j + 1 products: K², P₀ = R − K·R, then for
i = 1, …, j the fused multiply-add P_i = P_{i−1} + K^{2^i}·P_{i−1} and the next
square (R = K saves P₀'s product: P₀ = K − K²). Each term of P adds a product
of small matrices to R, so its rounding is relative to the result, as for the
solve. r is a norm at least ‖K‖₂ (e.g. ‖K‖_F), one number for the batch read on
the host by the caller; j is the smallest with r^{2^{j+1}} below half an ulp of
the dtype.

Why not always the solve: LAPACK factorizes the matrices of a batch one call at
a time, and for n up to a few hundred those calls run far below the rate of
batched products (docs/performance.md, "Woodbury system by block elimination" and
"Euler's product against the solve"); on a GPU the LU is a chain of small kernels, slower than a
few products up to n in the thousands. The series is used while it costs at most
2·`SeriesLimit.max_factors` products and n ≤ `SeriesLimit.max_order`, the limits
of the device type in `SERIES_LIMITS`: the orders and lengths of step at which
those products cost less than the solve there (``benchmarks.skew_cayley``). On a
CPU that is r ≤ u^{1/8} (1/8 in float32) and n ≤ 128; on a GPU r ≤ u^{1/32}
(0.59 in float32) and n ≤ 2048, the largest order measured. A device type not in
the table takes the CPU's limits. A longer step, a larger n, or a traced call (no
host read: Note [Traced steps compute both paths] in .frame) takes the solve.

Example:
    ```python
    import torch
    from stiefel.manifolds.kernels.euler import solve_near_identity

    k = 0.01 * torch.randn(4, 16, 16, dtype=torch.float64)
    r = float(torch.linalg.matrix_norm(k).max())  # ≥ ‖K‖₂ for each matrix
    rhs = torch.randn(4, 16, 3, dtype=torch.float64)
    eye = torch.eye(16, dtype=torch.float64)
    ref = torch.linalg.solve(eye + k, rhs)
    assert torch.allclose(solve_near_identity(k, rhs, r), ref, rtol=0, atol=1e-14)
    ```
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..._core.dispatch import dispatcher
from .basic import eye_like, product_on
from .reads import last_value

__all__ = [
    "SeriesLimit",
    "SERIES_LIMITS",
    "series_path",
    "reach",
    "series_factors",
    "euler_solve",
    "solve_near_identity",
]


class SeriesLimit(NamedTuple):
    """Where Euler's product runs on a device type: n ≤ max_order, j ≤ max_factors."""

    max_order: int
    max_factors: int


#: the limits of the series by device type (others take the CPU's): Note [Inverse of
#: I + K by Euler's product]
SERIES_LIMITS = {"cpu": SeriesLimit(128, 2), "cuda": SeriesLimit(2048, 4)}


@dispatcher(
    "near_identity_solve",
    paths=("solve", "series"),
    why="series: Euler's product, fewer batched products than LAPACK's per-matrix LU "
    "for n ≤ 128 on the CPU, n ≤ 2048 on a GPU (Euler's product against the solve)",
)
def series_path(k: torch.Tensor) -> str:
    """Whether (I + K)⁻¹R may take Euler's product: n within the device type's limit."""
    return "series" if k.shape[-1] <= _limit(k).max_order else "solve"


def _limit(k: torch.Tensor) -> SeriesLimit:
    return SERIES_LIMITS.get(k.device.type, SERIES_LIMITS["cpu"])


def reach(j: int, k: torch.Tensor) -> float:
    """The largest bound r with r^(2^(j+1)) at most half an ulp of ``k``'s dtype."""
    return (torch.finfo(k.dtype).eps / 2) ** (1 / 2 ** (j + 1))


def series_factors(r: float | None, k: torch.Tensor) -> int | None:
    """The number j of Euler factors after which r^(2^(j+1)) is below half an ulp.

    Args:
        r: a bound on ‖K‖₂ (e.g. ‖K‖_F); None: the most factors the device allows.
        k: the matrices (..., n, n): their dtype (complex: that of the parts), order
            and device type select the limits in `SERIES_LIMITS` (`series_path`).

    Returns:
        j ≥ 1, or None when the series is not taken or the j needed is above the limits.
    """
    if series_path(k) != "series":
        return None
    most = _limit(k).max_factors
    if r is None:
        return most
    if not r < 1:  # no power of it falls below an ulp (and a huge one overflows a float)
        return None
    unit = torch.finfo(k.dtype).eps / 2
    for j in range(1, most + 1):
        if r ** (2 ** (j + 1)) <= unit:
            return j
    return None


def euler_solve(k: torch.Tensor, rhs: torch.Tensor, factors: int) -> torch.Tensor:
    r"""(I + K^{2^j})···(I + K²)(I − K)·R with j = ``factors``: 2j + 1 products (2j for R = K).

    Equals (I + K)⁻¹R up to a relative error ‖K‖₂^{2^{j+1}} (Note [Inverse of I + K
    by Euler's product]); `solve_near_identity` picks j.

    Args:
        k: matrices (..., n, n) with ‖K‖₂ < 1.
        rhs: R, (..., n, c) with ``k``'s batch shape, or ``k`` itself.
        factors: j ≥ 1.

    Returns:
        P_j, of ``rhs``'s shape; a fresh tensor.
    """
    power = k @ k
    # P₀ = (I − K)R; for R = K (the square Cayley step) K·R is the square already
    p = k - power if rhs is k else rhs - k @ rhs
    for i in range(1, factors + 1):
        if i > 1:
            power = power @ power  # K^(2^i)
        p = product_on(p, power, p)  # P + K^(2^i)·P, in P's layout
    return p


def solve_near_identity(
    k: torch.Tensor,
    rhs: torch.Tensor,
    bound: float | torch.Tensor | None,
    checks: list | None = None,
    site: str | None = None,
) -> torch.Tensor:
    r"""(I + K)⁻¹R: Euler's product where ``bound`` allows it, one LU solve otherwise.

    Note [Euler's product sized by the last step]
    A step that reads nothing on its own (its tests join the optimizer's one read,
    ``checks``) cannot pick the number of factors from this step's bound. A fixed
    number refused the longer steps, each refusal a second step (a Cayley step on
    St(4096, 64) twice as long), and the solve for every such step made a batch of
    small matrices 1.4× slower than with the read (4096 × St(64, 16)). The bound of
    the same call site at the last step, read with that step's flags
    (`stiefel.manifolds.kernels.reads.StepChecks`), sizes the product instead: j is
    the number of factors that makes twice that bound exact, this step's bound
    within j's reach joins ``checks`` (a step more than twice as long as the last is
    taken again on the exact path), and this step's bound is measured for the next.
    Without a last bound (the first step, or ``checks`` a plain list), or when it
    is beyond the series' limits, the solve runs, exact, refusing nothing.

    Args:
        k: matrices (..., n, n).
        rhs: R, (..., n, c) with ``k``'s batch shape, or ``k`` itself.
        bound: an upper bound on ‖K‖₂ over the batch read by the caller (a float), per
            matrix as a tensor (with ``checks``), or None when it was not read (then the
            solve runs).
        checks: where a tensor bound appends its test (Note [Euler's product sized by
            the last step]).
        site: the caller's name for this solve (one per call site in a step), under
            which its bound is measured and looked up next step.

    Returns:
        (I + K)⁻¹R, of ``rhs``'s shape; a fresh tensor.
    """
    if isinstance(bound, torch.Tensor):  # Note [Euler's product sized by the last step]
        last = None if site is None else last_value(checks, site, bound)
        j = None if last is None else series_factors(2 * last, k)
        if j is None:
            return torch.linalg.solve(eye_like(k, k.shape[-1]) + k, rhs)
        checks.append((bound <= reach(j, k)).all())  # NaN: False, the exact path
        return euler_solve(k, rhs, j)
    j = None if bound is None else series_factors(bound, k)
    if j is None:  # Note [Inverse of I + K by Euler's product]
        return torch.linalg.solve(eye_like(k, k.shape[-1]) + k, rhs)
    return euler_solve(k, rhs, j)

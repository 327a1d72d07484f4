r"""D = Q − I for the Cayley transform Q = (I + K)⁻¹(I − K) of a skew-Hermitian K.

The square Cayley step (Note [Square Cayley step in the frame of X]) needs this
D for a batch of n×n matrices K = ½βŜ. ``cayley_delta`` forms it by Euler's
product when that is exact to rounding in a few matrix products, and by one
solve otherwise.

Note [Cayley of a small skew matrix by Euler's product]
D = (I + K)⁻¹(I − K) − I = −2(I + K)⁻¹K: a near-identity solve with the right-hand
side K, taken by Euler's product in 2j products while ‖K‖ is small (Note [Inverse
of I + K by Euler's product] in .euler). Every term of the product is a product of
small matrices (‖K^p‖ ≤ r^p), so its rounding is relative to D, not to I: the
series is as accurate as the solve with the small right-hand side −2K, and more
accurate than forming 2(I + K)⁻¹ − 2I. The bound is the Frobenius norm
‖K‖_F = |β|/2 ≥ ‖K‖₂, read on the host by the step (one number for the batch).

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

import torch

from .euler import euler_solve, solve_near_identity
from .frame import in_place

__all__ = ["cayley_delta", "euler_delta"]


def cayley_delta(
    k: torch.Tensor, bound: float | torch.Tensor | None, checks: list | None = None
) -> torch.Tensor:
    r"""(I + K)⁻¹(I − K) − I = −2(I + K)⁻¹K for skew-Hermitian K (..., n, n).

    Args:
        k: skew-Hermitian matrices.
        bound: an upper bound on ‖K‖₂ over the batch read by the caller, per matrix
            as a tensor (with ``checks``), or None when it was not read (then the
            solve runs).
        checks: `solve_near_identity`'s (Note [Euler's product sized by the last step]).

    Returns:
        D, of ``k``'s shape; a fresh tensor.
    """
    return _times_minus_two(solve_near_identity(k, k, bound, checks, "square Cayley"))


def euler_delta(k: torch.Tensor, factors: int) -> torch.Tensor:
    r"""−2(I + K^{2^j})···(I + K²)(I − K)·K with j = ``factors``: 2j products.

    Equals (I + K)⁻¹(I − K) − I up to a relative error ‖K‖₂^{2^{j+1}} (Note [Inverse
    of I + K by Euler's product] in .euler); `cayley_delta` picks j.

    Args:
        k: matrices (..., n, n) with ‖K‖₂ < 1.
        factors: j ≥ 1.

    Returns:
        D, of ``k``'s shape; a fresh tensor.
    """
    return _times_minus_two(euler_solve(k, k, factors))


def _times_minus_two(p: torch.Tensor) -> torch.Tensor:
    return p.mul_(-2) if in_place() else -2 * p  # exact: a power of two

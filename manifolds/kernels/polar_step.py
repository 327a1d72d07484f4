r"""The polar retraction: the polar factor of X − lr·d, Newton–Schulz corrected.

A descent kernel ``fn(x, d, lr, v=None, *, xx=None)`` like the Cayley and QR ones
(`stiefel.manifolds.kernels.cayley`, whose table `RETRACTIONS` lists them).
"""

from __future__ import annotations

import torch

from .basic import newton_schulz, polar, proj_tangent
from .scaling import scaled_step

__all__ = ["polar_descent", "polar_retraction"]

Lr = float | torch.Tensor


def polar_descent(
    x: torch.Tensor,
    d: torch.Tensor,
    lr: Lr,
    v=None,
    *,
    xx=None,
    checks=None,
    group=None,
    reads=True,
):
    """Polar step: polar factor of X − lr·d, Newton–Schulz corrected; v projected.

    ``checks`` and ``reads`` are accepted for the table's signature: the polar step
    refuses nothing.
    ``group``: the process group the rows are split over, or None (`polar`).
    """
    s, gamma = scaled_step(d, lr, group=group)
    # polar(X − lr·d) = polar(γX − σ·d/μ): a positive rescaling of the argument
    y = newton_schulz(polar(gamma * x - s, group), group=group)
    return y if v is None else (y, proj_tangent(y, v, group))


def polar_retraction(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Polar retraction: the polar factor of X + U (via the SVD)."""
    return polar_descent(x, u, -1.0)

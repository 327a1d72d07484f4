r"""Initial points: the nearest point of St(n, m) to a matrix, and geotorch's torus.

The nearest point of St(n, m) to a tall A = UΣVᴴ (n ≥ m) in the Frobenius norm is
its polar factor UVᴴ (`nearest_point`), computed by the SVD
(`stiefel.manifolds.kernels.polar`) after an exact power-of-two scaling (Note
[Nearest point of a scaled matrix]). For an ill-conditioned A the polar factor
is itself ill-conditioned (a relative perturbation ε of A moves it by up to
~κ·ε, κ = σ_max/σ_min). `torus` draws geotorch's ``sample("torus")`` points.
"""

from __future__ import annotations

import math

import torch

from ..manifolds.kernels import polar

__all__ = ["nearest_point", "torus"]


def _power_of_two_scaled(a: torch.Tensor) -> torch.Tensor:
    """A·2⁻ᵉ per matrix, with e such that its largest |entry| lands in [½, 1).

    Note [Nearest point of a scaled matrix]
    The polar factor is invariant under positive scaling, polar(cA) = polar(A). Each
    matrix is scaled first by a power of two, exactly (no rounding), into entries of
    magnitude below 1, so that the SVD never sees entries near the ends of the dtype's
    range (~1e38 or subnormal in float32), where intermediate norms overflow or
    underflow: LAPACK's SVD rescales such a matrix itself, and the scaling here keeps
    the result independent of whether a backend's SVD does. The factor 2⁻ᵉ is applied
    in two halves, each a normal number even where 2⁻ᵉ itself is not (a subnormal A).
    A zero or non-finite matrix is left as it is, for the SVD's own handling.
    """
    amax = a.detach().abs().amax(dim=(-2, -1), keepdim=True)
    usable = torch.isfinite(amax) & (amax > 0)
    _, e = torch.frexp(torch.where(usable, amax, torch.ones_like(amax)))
    half = torch.div(e, 2, rounding_mode="floor")
    real = amax.dtype
    return a * torch.exp2(-half.to(real)) * torch.exp2((half - e).to(real))


def nearest_point(a: torch.Tensor) -> torch.Tensor:
    """The polar factor of tall A (…, n, m), n ≥ m, by the SVD of A scaled by a power of two.

    Note [Nearest point of a scaled matrix]; float16 and bfloat16 go to
    `stiefel.manifolds.kernels.polar` as they are (it computes in float32).
    """
    if a.dtype not in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        return polar(a)
    return polar(_power_of_two_scaled(a))


def torus(
    n: int,
    m: int,
    *batch: int,
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""geotorch's ``sample("torus")`` point: a block diagonal of 2×2 rotations, first m columns.

    Angles θ_j ~ Uniform(−π, π), j < ⌊n/2⌋, drawn as geotorch's ``torus_init_``
    draws them (one ``uniform_`` of shape (*batch, ⌊n/2⌋), in ``dtype``'s real
    part, on the CPU); block j is expm([[0, −θ_j], [θ_j, 0]]) =
    [[cos θ_j, −sin θ_j], [sin θ_j, cos θ_j]] and an odd n ends with a 1. The
    closed form replaces geotorch's expm of the block-diagonal skew matrix
    (the same matrix). Used by expRNN's examples for recurrent kernels: the
    eigenvalues e^{±iθ_j} are spread uniformly on the unit circle.
    """
    real = torch.empty((), dtype=dtype).real.dtype
    theta = torch.empty(*batch, n // 2, dtype=real).uniform_(-math.pi, math.pi, generator=generator)
    c, s = theta.cos(), theta.sin()
    q = torch.zeros(*batch, n, n, dtype=real)
    idx = torch.arange(n // 2)
    q[..., 2 * idx, 2 * idx] = c
    q[..., 2 * idx + 1, 2 * idx + 1] = c
    q[..., 2 * idx, 2 * idx + 1] = -s
    q[..., 2 * idx + 1, 2 * idx] = s
    if n % 2:
        q[..., n - 1, n - 1] = 1
    return q[..., :m].to(dtype)

r"""Scaling of a step −lr·d so that no product of a retraction can overflow.

Shared by the Cayley kernels (`cayley`) and the factorization retractions
(`factor`): every descent kernel divides its direction by μ = max|d| and
writes the step with the finite weights γ, σ of Note [Overflow-safe step].
"""

from __future__ import annotations

import math

import torch

from .reads import taken_as_one
from .reduce import gram, rows_absmax

__all__ = [
    "normalize",
    "weights",
    "scaled_step",
    "scaled_gram",
    "free_scale",
]


def free_scale(d: torch.Tensor) -> float:
    """The largest max|d| for which no Gram of a step on ``d`` can overflow: √(max/64NM).

    Near the manifold ‖X‖₂ ≤ 2 and ‖P‖₂ ≤ 1, so every M×M product a step forms from
    d (XᴴD, PdᴴPd, their products) has entries at most 4NM·max|d|², here max/16.
    """
    n, m = d.shape[-2:]
    return math.sqrt(torch.finfo(d.dtype).max / (64 * max(n * m, 1)))


def normalize(
    d: torch.Tensor, absmax: torch.Tensor | None = None, group=None, checks=None
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """d / μ and μ per matrix (shape (..., 1, 1)): μ = max|d|, or exactly 1 where
    max|d| is below `free_scale` (Note [Step weights as tensors]); (d, 1.0) where the
    last step's μ was 1 (Note [Scales taken as one from the last step]).

    Args:
        d: directions (..., N, M).
        absmax: max|d| per matrix if the caller has it (Note [One pass over the
            gradient for its test and its scale] in `stiefel.manifolds.geometry`).
        group: the process group the rows are split over, or None.
        checks: the step's checks, or None.
    """
    mu = rows_absmax(d, group) if absmax is None else absmax
    mu = torch.where(mu <= free_scale(d), 1.0, mu.clamp_min(torch.finfo(mu.dtype).tiny))
    if taken_as_one(checks, "direction scale", mu):
        return d, 1.0
    return d / mu, mu


def weights(beta: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor] | tuple[float, float]:
    r"""γ = 1/max(1, |β|) and σ = β/max(1, |β|) (= clamp(β, −1, 1)), both finite.

    Note [Overflow-safe step]
    A step −lr·d with a huge but finite lr·d used to square it first (the
    Woodbury block PuᴴPu = lr²·PdᴴPd overflows float32 from lr·‖Pd‖ ≈ 1e19) and
    wrote NaN. The kernels now (i) divide d by μ = max|d| (lr·μ takes the
    scale), so no N-sized product of the step can overflow, and (ii) write the
    step as Pu = −β·P̂ with ‖P̂‖_F = 1 and β = lr·μ·‖Pd/μ‖_F, substitute
    V₁ = βZ₁ in the Woodbury system and divide its rows by ω = max(1, |β|):

        [[γI + ½σXᴴP̂, −½σXᴴX], [½σP̂ᴴP̂, γI − ½σP̂ᴴX]] [V₁; Z₂] = σ[XᴴX; P̂ᴴX],
        Y = X(I + Z₂) − P̂V₁.

    Every entry is bounded by the M×M Grams, whatever β (β = ±inf gives γ = 0,
    σ = ±1: the Cayley map's limit, the reflection I − 2Π on the range of A).
    The same γ, σ scale the dense system and the QR/polar arguments
    (qf and polar are invariant under a positive scale of their argument). A
    result that is still not finite (a singular limit) is refused by the
    optimizer's step, which keeps the old point and warns.
    """
    if isinstance(beta, float):  # a float lr (Note [Step weights as tensors]); NaN stays NaN
        return 1 / max(abs(beta), 1.0), max(min(beta, 1.0), -1.0)
    omega = beta.abs().clamp_min(1)
    return 1 / omega, beta.clamp(-1, 1)


# Note [Step weights as tensors]
# μ, γ and σ are one number per matrix, computed as tensors of shape (..., 1, 1)
# on the device: a number read on the host would be a synchronisation per step on
# a GPU and a graph break under torch.compile (Note [One host read per step] in
# `stiefel.optimizers.engine`). Where max|d| is below `free_scale` no product of
# the step can overflow, and μ is taken as exactly 1 (``torch.where``): the
# division d/μ then changes no bit, and the step's numbers are those of the
# unscaled formula.
def _step_scale(d: torch.Tensor, lr, factor: float, absmax=None, group=None):
    """(c·σ/μ, γ) per matrix, as tensors (Note [Step weights as tensors])."""
    mu = rows_absmax(d, group) if absmax is None else absmax
    mu = mu.clamp_min(torch.finfo(mu.dtype).tiny)
    gamma, sigma = weights(lr * mu)
    scale = sigma / mu
    return (scale if factor == 1 else scale * factor), gamma


def scaled_step(
    d: torch.Tensor, lr, absmax: torch.Tensor | None = None, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""(σ·d/μ, γ): the step written as γX − σ·d/μ = (X − lr·d)/max(1, |β|), β = lr·μ.

    One pass over d for μ = max|d| (none when ``absmax`` is given) and one for the
    scaled copy (σ/μ is formed per matrix first: |σ/μ| ≤ 1/tiny is finite and every
    entry of the result is at most |σ| ≤ 1, Note [Overflow-safe step]). For β ≤ 1,
    σ/μ = lr: the step is lr·d.

    Args:
        d: directions (..., N, M).
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).
        absmax: max|d| per matrix if the caller has it.
        group: the process group the rows are split over, or None.

    Returns:
        (σ·d/μ, γ), γ of shape (..., 1, 1).
    """
    scale, gamma = _step_scale(d, lr, 1.0, absmax, group)
    return d * scale, gamma


def scaled_gram(
    x: torch.Tensor,
    d: torch.Tensor,
    lr,
    factor: float = 1.0,
    absmax: torch.Tensor | None = None,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""(Xᴴ(c·σ·d/μ), γ): `gram` of X and `scaled_step`'s copy, and its γ.

    Args:
        x: points (..., N, M).
        d: directions, same shape.
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).
        factor: c, a power of two the caller wants in the product (exact: it
            saves the caller a pass over it).
        absmax: max|d| per matrix if the caller has it.
        group: the process group the rows are split over, or None.

    Returns:
        (c·σ·XᴴD/μ, γ), γ of shape (..., 1, 1).
    """
    scale, gamma = _step_scale(d, lr, factor, absmax, group)
    return gram(x, d * scale, group), gamma

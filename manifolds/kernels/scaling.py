r"""Scaling of a step −lr·d so that no product of a retraction can overflow.

Shared by the Cayley kernels (`cayley`) and the factorization retractions
(`factor`): every descent kernel divides its direction by μ = max|d| and
writes the step with the finite weights γ, σ of Note [Overflow-safe step].
"""

from __future__ import annotations

import torch

from .reduce import rows_absmax

__all__ = ["normalize", "weights", "scaled_step"]


def normalize(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d / μ and μ = max|d| per matrix (shape (..., 1, 1), never 0)."""
    mu = rows_absmax(d)
    mu = mu.clamp_min(torch.finfo(mu.dtype).tiny)
    return d / mu, mu


def weights(beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    omega = beta.abs().clamp_min(1)
    return 1 / omega, beta.clamp(-1, 1)


def scaled_step(d: torch.Tensor, lr) -> tuple[torch.Tensor, torch.Tensor]:
    r"""(σ·d/μ, γ): the step written as γX − σ·d/μ = (X − lr·d)/max(1, |β|), β = lr·μ.

    One pass over d for μ = max|d| and one for the scaled copy (σ/μ is formed per
    matrix first: |σ/μ| ≤ 1/tiny is finite and every entry of the result is at
    most |σ| ≤ 1, Note [Overflow-safe step]). For β ≤ 1, σ/μ = lr: the step is lr·d.

    Args:
        d: directions (..., N, M).
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).

    Returns:
        (σ·d/μ, γ), γ of shape (..., 1, 1).
    """
    mu = rows_absmax(d)
    mu = mu.clamp_min(torch.finfo(mu.dtype).tiny)
    gamma, sigma = weights(lr * mu)
    return d * (sigma / mu), gamma

r"""Scaling of a step −lr·d so that no product of a retraction can overflow.

Shared by the Cayley kernels (`cayley`) and the factorization retractions
(`factor`): every descent kernel divides its direction by μ = max|d| and
writes the step with the finite weights γ, σ of Note [Overflow-safe step].
"""

from __future__ import annotations

import math

import torch

from .reads import host_reads_allowed
from .reduce import gram, row_group, rows_absmax

__all__ = [
    "normalize",
    "weights",
    "scaled_step",
    "scaled_gram",
    "host_bound",
    "host_max",
    "host_scalars",
    "free_scale",
]


def free_scale(d: torch.Tensor) -> float:
    """The largest max|d| for which no Gram of a step on ``d`` can overflow: √(max/64NM).

    Near the manifold ‖X‖₂ ≤ 2 and ‖P‖₂ ≤ 1, so every M×M product a step forms from
    d (XᴴD, PdᴴPd, their products) has entries at most 4NM·max|d|², here max/16.
    """
    n, m = d.shape[-2:]
    return math.sqrt(torch.finfo(d.dtype).max / (64 * max(n * m, 1)))


def normalize(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
    """d / μ and μ = max|d| per matrix (shape (..., 1, 1), never 0); (d, 1.0) where the
    host reads the batch's largest μ below `free_scale` (Note [Step weights on the host])."""
    mu = rows_absmax(d)
    if host_bound(d) and host_max(mu) <= free_scale(d):  # NaN: False
        return d, 1.0
    mu = mu.clamp_min(torch.finfo(mu.dtype).tiny)
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
    if isinstance(beta, float):  # on the host (Note [Step weights on the host]); NaN stays NaN
        return 1 / max(abs(beta), 1.0), max(min(beta, 1.0), -1.0)
    omega = beta.abs().clamp_min(1)
    return 1 / omega, beta.clamp(-1, 1)


# Note [Step weights on the host]
# μ, γ and σ are one number per matrix, and each tensor operation on them costs
# a dispatch whatever its size: a dozen of them are a visible part of a small
# step. For one matrix on the CPU, outside autograd (the optimizers' steps),
# with a float lr and no row split, the numbers are read once and computed in
# Python floats (float64; the tensor path computes them in the working dtype,
# which differs by rounding in γ and σ only). The scale then also rides on the
# product XᴴD (`scaled_gram`) instead of a scaled copy of D, one pass over an
# N×M matrix fewer (timings: docs/performance.md), whenever XᴴD
# cannot overflow: |(XᴴD)_ij| ≤ N·μ·max|X| and |X| ≤ 2 near the manifold. A
# batch keeps its per-matrix numbers as tensors, but the same conditions let the
# host read one number for the whole batch, the largest μ: where it is below
# `free_scale` no product of the step can overflow, and the division d/μ (and the
# scaling back of a linear result), a pass over the N×M data each, is skipped. On
# a GPU a host number would be a synchronisation per step, so the tensor path is
# kept there.
def host_bound(t: torch.Tensor) -> bool:
    """Whether one number of a step on ``t`` (a bound over its batch) is read on the host.

    On the CPU, outside autograd and tracing, with no row split. Note [Step weights
    on the host].
    """
    return (
        t.device.type == "cpu"
        and not torch.is_grad_enabled()
        and row_group() is None
        and host_reads_allowed()
    )


def host_max(t: torch.Tensor) -> float:
    """The largest entry of ``t`` read on the host; −inf for an empty batch (max's identity)."""
    return float(t.amax()) if t.numel() else -math.inf


def host_scalars(t: torch.Tensor, lr: float | torch.Tensor = 1.0) -> bool:
    """Whether the per-matrix numbers of a step on ``t`` are computed on the host.

    One matrix (not a batch), a float ``lr`` and `host_bound`. Note [Step weights
    on the host].
    """
    return t.dim() == 2 and isinstance(lr, (int, float)) and host_bound(t)


def _step_scale(d: torch.Tensor, lr, factor: float):
    """(c·σ/μ, γ, μ): floats for the scale and μ on the host, tensors otherwise."""
    mu = rows_absmax(d)
    tiny = torch.finfo(mu.dtype).tiny
    if host_scalars(d, lr):  # Note [Step weights on the host]
        m = max(float(mu), tiny)  # max keeps a NaN in its first argument
        gamma, sigma = weights(lr * m)
        return factor * sigma / m, torch.full_like(mu, gamma), m
    mu = mu.clamp_min(tiny)
    gamma, sigma = weights(lr * mu)
    scale = sigma / mu
    return (scale if factor == 1 else scale * factor), gamma, mu


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
    scale, gamma, _ = _step_scale(d, lr, 1.0)
    return d * scale, gamma


def scaled_gram(
    x: torch.Tensor, d: torch.Tensor, lr, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""(Xᴴ(c·σ·d/μ), γ): `gram` of X and `scaled_step`'s copy, and its γ.

    The scale is applied to the M×M product instead of D where that cannot
    overflow (Note [Step weights on the host]).

    Args:
        x: points (..., N, M).
        d: directions, same shape.
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).
        factor: c, a power of two the caller wants in the product (exact: it
            saves the caller a pass over it).

    Returns:
        (c·σ·XᴴD/μ, γ), γ of shape (..., 1, 1).
    """
    scale, gamma, mu = _step_scale(d, lr, factor)
    if isinstance(scale, float) and 2 * mu * d.shape[-2] < torch.finfo(d.dtype).max:
        return gram(x, d).mul_(scale), gamma
    return gram(x, d * scale), gamma

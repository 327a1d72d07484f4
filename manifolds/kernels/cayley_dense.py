r"""The Cayley step through a dense solve: of N×N where 2M ≥ N, of 2M×2M for a long step.

Note [A long Cayley step in the basis of X and the step]
The 2M×2M Woodbury system of a step whose direction has a rank-deficient normal
part (a rank-1 gradient) has Jordan blocks on the shared directions of its two
factors (Note [Cayley through Sherman–Morrison–Woodbury with 2M columns] in
`stiefel.manifolds.kernels.woodbury`): its rounding grows as β² = (lr·‖Pd‖_F)²,
and a float32 step of β = 100 left the manifold by 1e-3, one of 1e4 by more than
1. The Cayley map itself is not ill-conditioned there: A = PuXᴴ − XPuᴴ lives on
span{X, d}. With the Householder QR [X, d] = B·R (B: N×2M orthonormal columns to
rounding whatever the rank; R: 2M×2M), X = B·R₁ and d = B·R₂ (R₁, R₂ the two
column blocks of R), so A = B·A_B·Bᴴ with A_B the step's A built from the
2M×M point R₁ and direction R₂, and

    Cayley(A)X = B·Cayley(A_B)R₁,   Cayley(A)v = v + B(Cayley(A_B) − I)Bᴴv

(Cayley(A) is the identity on the complement of span B). Cayley(A_B)R₁ is the
dense step of `dense_cayley_step` on 2M rows, a normal system whose rounding is
of order eps·β with its Newton–Schulz step on the result's own Gram, so Y is on
the manifold to rounding at any β; its limit as β → ∞ is the same reflection.
It costs a QR of N×2M and two N-sized products (one more for a transported
vector) against six N×M×M products of the Woodbury step: `smw_step` takes it
only where the host already learned that the step is long (its exact path).
"""

from __future__ import annotations

import torch

from .basic import eye_like, newton_schulz
from .scaling import weights

__all__ = ["dense_cayley_step", "long_cayley_step"]


def dense_cayley_step(x, dn, lr, v=None):
    """The scaled Cayley step Y = retr(X, −lr·dn) through a dense N×N solve (cheaper when 2M ≥ N).

    Returns Y, or (Y, Cayley(A)v) when ``v`` is given.
    """
    n, m = x.shape[-2:]
    pd = dn - 0.5 * (x @ (x.mH @ dn))
    t = torch.linalg.matrix_norm(pd, keepdim=True)
    gamma, sigma = weights(lr * t)
    ph = pd / t.clamp_min(torch.finfo(t.dtype).tiny)
    a = ph @ x.mH
    a = a - a.mH  # P̂Xᴴ − XP̂ᴴ; A = −β(P̂Xᴴ − XP̂ᴴ)
    omega = x if v is None else torch.cat((x, v), -1)
    # Cayley(A) = 2(I − ½A)⁻¹ − I and (I − ½A)⁻¹ = γ(γI + ½σ·(P̂Xᴴ − XP̂ᴴ))⁻¹: on
    # the null space of A (where the solve meets the pivot γ) the answer is Ω itself.
    # γ is kept above √eps, so that the rounding of that pivot (eps/γ) stays below
    # √eps: a longer step is taken as one of length 1/√eps, a change of O(√eps) in Y
    # towards the same limit, and the Newton–Schulz step on Y's own Gram (N ≤ 2M
    # here, so it is cheap beside the N×N solve) takes the error to O(eps).
    gamma = gamma.clamp_min(torch.finfo(gamma.dtype).eps ** 0.5)
    lhs = gamma * eye_like(x, n) + (0.5 * sigma) * a
    out = (2 * gamma) * torch.linalg.solve(lhs, omega) - omega
    y = newton_schulz(out[..., :m])
    return y if v is None else (y, out[..., m:])


def long_cayley_step(x, d, lr, v=None):
    """The Cayley step of `dense_cayley_step` in the basis of span{X, d} (Note [A long ...]).

    Args:
        x: points (..., N, M), N ≥ 2M.
        d: the step direction, same shape.
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).
        v: a vector to transport, or None.

    Returns:
        Y, or (Y, Cayley(A)v) when ``v`` is given.
    """
    m = x.shape[-1]
    b, r = torch.linalg.qr(torch.cat((x, d), -1))
    if v is None:
        return b @ dense_cayley_step(r[..., :m], r[..., m:], lr)
    bv = b.mH @ v
    y, moved = dense_cayley_step(r[..., :m], r[..., m:], lr, bv)
    return b @ y, v + b @ (moved - bv)

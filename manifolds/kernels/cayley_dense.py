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

(Cayley(A) is the identity on the complement of span B). A_B is skew-Hermitian
of order 2M, so Cayley(A_B) = V diag(f(ν)) Vᴴ from the eigendecomposition of the
Hermitian iÂ (A_B = −βÂ, ‖Â‖ bounded), with f(ν) = (1 + iβν/2)/(1 − iβν/2)
written in the weights γ, σ of Note [Overflow-safe step]: each f is unimodular
to rounding whatever β, a null direction of A_B (a rank-deficient step) keeps
f = 1, and β → ∞ gives the Cayley map's reflection. A solve with I − ½A_B
instead has a pivot of order 1/β there (`dense_cayley_step` keeps it above
√eps, which in float32 shortens a step beyond β ≈ 3e3). Y is on the manifold
to rounding at any β, and the Cayley step to rounding along a full-rank
direction; along a rank-deficient one the rounding of the data (eps·β in A, on
directions where A is 0) moves it by about that much. It costs a QR of N×2M, an
eigendecomposition of 2M×2M and two N-sized products (one more for a
transported vector), more than the five N×M×M products of the Woodbury step:
`smw_step` takes it only where the host already learned that the step is long
(its exact path).
"""

from __future__ import annotations

import torch

from .basic import eye_like, newton_schulz
from .scaling import weights

__all__ = ["dense_cayley_step", "long_cayley_step"]


def _generator(x, dn, lr):
    """(Â, γ, σ): A = −βÂ with Â = P̂Xᴴ − XP̂ᴴ, P̂ = Pd/‖Pd‖_F, and the weights of β."""
    pd = dn - 0.5 * (x @ (x.mH @ dn))
    t = torch.linalg.matrix_norm(pd, keepdim=True)
    gamma, sigma = weights(lr * t)
    a = (pd / t.clamp_min(torch.finfo(t.dtype).tiny)) @ x.mH
    return a - a.mH, gamma, sigma


def dense_cayley_step(x, dn, lr, v=None):
    """The scaled Cayley step Y = retr(X, −lr·dn) through a dense N×N solve (cheaper when 2M ≥ N).

    Returns Y, or (Y, Cayley(A)v) when ``v`` is given.
    """
    n, m = x.shape[-2:]
    a, gamma, sigma = _generator(x, dn, lr)
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
    """The Cayley step in the basis of span{X, d}, exact at any length (Note [A long ...]).

    Args:
        x: points (..., N, M), N ≥ 2M.
        d: the step direction, same shape.
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).
        v: a vector to transport, or None.

    Returns:
        Y, or (Y, Cayley(A)v) when ``v`` is given.
    """
    m = x.shape[-1]
    basis = torch.cat((x, d), -1)
    # a matrix that is not finite gives NaN, as the other paths do (the optimizer's
    # step then keeps its point), not a LAPACK error for the whole batch
    # (a NaN lr gives NaN weights, and so NaN through f)
    bad = ~torch.isfinite(basis).all(-1).all(-1)[..., None, None]
    b, r = torch.linalg.qr(torch.where(bad, 0.0, basis))
    xb = r[..., :m]  # X = B·R₁, d = B·R₂
    a, gamma, sigma = _generator(xb, r[..., m:], lr)  # A = −βÂ, and iÂ is Hermitian
    wide = torch.promote_types(a.dtype, torch.complex64)
    nu, vec = torch.linalg.eigh(a.to(wide) * 1j)  # Â = −i·V diag(ν) Vᴴ
    # Cayley(A) = V diag(f) Vᴴ, f = (1 + iβν/2)/(1 − iβν/2) = (γ + iσν/2)/(γ − iσν/2):
    # unimodular at any β (σ = βγ); 0/0 only on the null space at β = ±inf, where f = 1
    # eigenvalues at Â's rounding are its null space: f = 1 there exactly (a phase on
    # a cluster of complex eigenvectors would not be real, and its real part not unitary)
    tol = 4 * nu.shape[-1] * torch.finfo(nu.dtype).eps * nu.abs().amax(-1, keepdim=True)
    nu = torch.where(nu.abs() <= tol, torch.zeros_like(nu), nu)
    g, h = gamma[..., 0].to(nu.dtype), 0.5 * sigma[..., 0].to(nu.dtype) * nu
    num, den = torch.complex(g, h), torch.complex(g, -h)
    f = torch.where(den == 0, torch.ones_like(num), num / den)
    c = (vec * f.unsqueeze(-2)) @ vec.mH
    c = c if c.dtype == x.dtype else c.real.to(x.dtype)  # a real Cayley(A) for a real Â
    y = (b @ newton_schulz(c @ xb)).masked_fill(bad, torch.nan)  # NS: X's drift corrected
    if v is None:
        return y
    bv = b.mH @ v
    return y, v + b @ (c @ bv - bv)

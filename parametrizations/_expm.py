r"""The matrix exponential with a cheap backward: the adjoint Fréchet derivative.

``expm(a)`` equals ``torch.linalg.matrix_exp(a)`` for any batch of square real or
complex matrices (the ``"exp"`` map feeds it skew-symmetric / skew-Hermitian
ones). Its backward returns L(Aᴴ, G), the adjoint of the Fréchet derivative
L(A, ·) under Re tr(XᴴY), computed from the forward's own intermediates:
about 13 matrix products, one solve with the forward's LU factors and two
products per squaring, against the 2n×2n block exponential torch's autograd
evaluates (≈ 8× a forward of size n).

Note [Scaling and squaring with its Fréchet derivative]
Forward (Higham 2005, degree-13 Padé): X = A/2^s with s = ⌈log₂(‖A‖₁/θ₁₃)⌉⁺,
θ₁₃ = 5.37; X₂ = X², X₄ = X₂², X₆ = X₂X₄;
U = X(X₆W₁ + W₂), V = X₆Z₁ + Z₂ with W₁, W₂, Z₁, Z₂ the even polynomials of
the degree-13 Padé coefficients b; R₀ = (V − U)⁻¹(V + U); R_{k+1} = R_k², and
expm(A) = R_s. The Fréchet derivative (Al-Mohy & Higham 2009, Algorithm 6.4)
differentiates every line: with E = G/2^s, M₂ = XE + EX, M₄ = X₂M₂ + M₂X₂,
M₆ = X₄M₂ + M₄X₂, L_U = X(X₆L_{W1} + M₆W₁ + L_{W2}) + E·W, L_V = X₆L_{Z1} + M₆Z₁ + L_{Z2},
L₀ = (V − U)⁻¹(L_U + L_V + (L_U − L_V)R₀), L_{k+1} = R_kL_k + L_kR_k.
The backward needs L at Aᴴ: since the polynomials have real coefficients,
p(Aᴴ) = p(A)ᴴ, so every matrix above at Aᴴ is the conjugate transpose of the one
the forward saved, and (V − U)ᴴ is solved with the forward's LU factors
(``adjoint=True``). Nothing of the forward is recomputed.

Example:
```python
import torch
from stiefel.parametrizations._expm import expm

a = torch.randn(5, 5, dtype=torch.float64)
a = (a - a.mT).requires_grad_()
q = expm(a)
assert torch.allclose(q, torch.linalg.matrix_exp(a), atol=1e-13)
assert torch.autograd.gradcheck(expm, (a,))
```
"""

from __future__ import annotations

import math

import torch

__all__ = ["expm"]

# Note [Padé coefficients normalised to b₀ = 1]
# R = (V − U)⁻¹(V + U) does not change when every bₖ is divided by b₀, and with
# b₀ = 1 the forward at A = 0 is V = I, R = I exactly (an LU solve against
# b₀·I may multiply by a rounded 1/b₀): the based maps then return their base
# bit for bit at A = 0, so a stored float32 point stays a float32 point.
_B0 = 64764752532480000.0
_B_RAW = (
    _B0,
    32382376266240000.0,
    7771770303897600.0,
    1187353796428800.0,
    129060195264000.0,
    10559470521600.0,
    670442572800.0,
    33522128640.0,
    1323241920.0,
    40840800.0,
    960960.0,
    16380.0,
    182.0,
    1.0,
)
_B = tuple(c / _B0 for c in _B_RAW)
_THETA13 = 5.371920351148152


def _squarings(a: torch.Tensor) -> int:
    if a.numel() == 0 or a.device.type == "meta":  # meta: shapes only, no values
        return 0
    norm = float(torch.linalg.matrix_norm(a.detach(), ord=1).max())
    if not math.isfinite(norm):
        return 0
    return max(0, math.ceil(math.log2(norm / _THETA13))) if norm > _THETA13 else 0


def _forward(a: torch.Tensor):
    b = _B
    s = _squarings(a)
    x = a / 2**s if s else a
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    x2 = x @ x
    x4 = x2 @ x2
    x6 = x2 @ x4
    w1 = b[13] * x6 + b[11] * x4 + b[9] * x2
    w2 = b[7] * x6 + b[5] * x4 + b[3] * x2 + b[1] * eye
    z1 = b[12] * x6 + b[10] * x4 + b[8] * x2
    z2 = b[6] * x6 + b[4] * x4 + b[2] * x2 + b[0] * eye
    w = x6 @ w1 + w2
    u = x @ w
    v = x6 @ z1 + z2
    lu, piv = torch.linalg.lu_factor(v - u)
    r = torch.linalg.lu_solve(lu, piv, v + u)
    powers = [r]
    for _ in range(s):
        r = r @ r
        powers.append(r)
    return r, (s, x, x2, x4, x6, w1, z1, w, lu, piv, powers)


def _adjoint_frechet(g: torch.Tensor, saved) -> torch.Tensor:
    # L(Aᴴ, G) from the forward's intermediates at A (Note [Scaling and squaring ...]).
    b = _B
    s, x, x2, x4, x6, w1, z1, w, lu, piv, powers = saved
    y, y2, y4, y6 = x.mH, x2.mH, x4.mH, x6.mH
    e = g / 2**s if s else g
    m2 = y @ e + e @ y
    m4 = y2 @ m2 + m2 @ y2
    m6 = y4 @ m2 + m4 @ y2
    lw1 = b[13] * m6 + b[11] * m4 + b[9] * m2
    lw2 = b[7] * m6 + b[5] * m4 + b[3] * m2
    lz1 = b[12] * m6 + b[10] * m4 + b[8] * m2
    lz2 = b[6] * m6 + b[4] * m4 + b[2] * m2
    lw = y6 @ lw1 + m6 @ w1.mH + lw2
    lu_ = y @ lw + e @ w.mH
    lv = y6 @ lz1 + m6 @ z1.mH + lz2
    rhs = lu_ + lv + (lu_ - lv) @ powers[0].mH
    ell = torch.linalg.lu_solve(lu, piv, rhs, adjoint=True)
    for r in powers[:-1]:
        rh = r.mH
        ell = rh @ ell + ell @ rh
    return ell


class _Expm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, saved = _forward(a)
        ctx.saved = saved
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _adjoint_frechet(g, ctx.saved)


def expm(a: torch.Tensor) -> torch.Tensor:
    r"""exp(A) for a batch of square matrices, with the adjoint-Fréchet backward.

    Args:
        a: real or complex tensor (..., n, n) (float32/64, complex64/128).

    Returns:
        exp(A), same shape and dtype. Its gradient is L(Aᴴ, G) (first order only:
        double backward is not supported).

    Raises:
        ValueError: ``a`` is not a batch of square matrices.
    """
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"expm needs square matrices (..., n, n), got shape {tuple(a.shape)}")
    if not a.requires_grad or not torch.is_grad_enabled():
        return _forward(a)[0]
    return _Expm.apply(a)

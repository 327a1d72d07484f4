r"""The matrix exponential with a cheap backward: the adjoint Fréchet derivative.

``expm(a)`` equals ``torch.linalg.matrix_exp(a)`` for any batch of square real or
complex matrices (the ``"exp"`` map feeds it skew-symmetric / skew-Hermitian
ones). Its backward returns L(Aᴴ, G), the adjoint of the Fréchet derivative
L(A, ·) under Re tr(XᴴY), computed from the forward's own intermediates:
at most 13 matrix products (5 to 11 below degree 13; one more on the Cholesky
route), one solve with the forward's factors of V − U and two products per
squaring, against the 2n×2n block exponential torch's autograd evaluates (≈ 8× a
forward of size n).

Note [Scaling and squaring with its Fréchet derivative]
Forward (Higham 2005), written here for degree 13, the largest (Note [Padé
degree by the dtype's unit roundoff] for the others, sums of the even powers in
place of the Horner form): X = A/2^s with s = ⌈log₂(‖A‖₁/θ₁₃)⌉⁺,
θ₁₃ = 5.37; X₂ = X², X₄ = X₂², X₆ = X₂X₄;
U = X(X₆W₁ + W₂), V = X₆Z₁ + Z₂ with W₁, W₂, Z₁, Z₂ the even polynomials of
the degree-13 Padé coefficients b; R₀ = (V − U)⁻¹(V + U); R_{k+1} = R_k², and
expm(A) = R_s. The Fréchet derivative (Al-Mohy & Higham 2009, Algorithm 6.4)
differentiates every line: with E = G/2^s, M₂ = XE + EX, M₄ = X₂M₂ + M₂X₂,
M₆ = X₄M₂ + M₄X₂, L_U = X(X₆L_{W1} + M₆W₁ + L_{W2}) + E·W, L_V = X₆L_{Z1} + M₆Z₁ + L_{Z2},
L₀ = (V − U)⁻¹(L_U + L_V + (L_U − L_V)R₀), L_{k+1} = R_kL_k + L_kR_k.
The backward needs L at Aᴴ: since the polynomials have real coefficients,
p(Aᴴ) = p(A)ᴴ, so every matrix above at Aᴴ is the conjugate transpose of the one
the forward saved, and (V − U)ᴴ is solved with the forward's factors (its LU,
``adjoint=True``; Note [The Padé solve of a skew-Hermitian A by device type] for
the Cholesky route). Nothing of the forward is recomputed.

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
from fractions import Fraction

import torch

from .._core.autocast import backward_autocast_off
from .._core.first_order import first_order

__all__ = ["expm"]


# Note [Padé coefficients normalised to b₀ = 1]
# R = (V − U)⁻¹(V + U) does not change when every bₖ is divided by b₀, and with
# b₀ = 1 the forward at A = 0 is V = I, R = I exactly (an LU solve against
# b₀·I may multiply by a rounded 1/b₀): the based maps then return their base
# bit for bit at A = 0, so a stored float32 point stays a float32 point.
def _coefficients(m: int) -> tuple[float, ...]:
    """b_k/b_0 of the [m/m] Padé approximant of exp, k = 0..m (b_0 = 1 exactly)."""
    f = math.factorial
    return tuple(
        float(Fraction(f(2 * m - k) * f(m), f(2 * m) * f(k) * f(m - k))) for k in range(m + 1)
    )


_B = {m: _coefficients(m) for m in (3, 5, 7, 9, 13)}


# Note [Padé degree by the dtype's unit roundoff]
# The [m/m] approximant r_m(X) equals exp(X + ΔX) with ‖ΔX‖ ≤ u‖X‖ while
# ‖X‖₁ ≤ θ_m (Higham 2005, the bounds MATLAB's expm uses): for u = 2⁻⁵³ the
# degrees 3, 5, 7, 9, 13 below, for u = 2⁻²⁴ (float32, complex64 and narrower)
# 3, 5, 7. Where ‖A‖₁ is within a degree's θ_m the forward takes the cheapest such
# degree, without squarings. Degree m costs (m + 1)/2 products below 13, and 6 at
# 13 (Horner form in X⁶): a float32 exponent with ‖A‖₁ ≤ 0.43 takes 2 products,
# not 6. Beyond the table, degree 13 with s = ⌈log₂(‖A‖₁/θ₁₃)⌉ squarings in every
# dtype: there the squarings' rounding, not the approximant's truncation, sets
# the error (each squaring about doubles it), and degree 7 would need one squaring
# more as often as not (float32 at n = 1024, ‖A‖₁ = 36: 5.3e-6 against 2.4e-6 from
# float64, one-off script). The Fréchet derivative differentiates the same
# polynomials (Al-Mohy & Higham 2009, Algorithm 6.4), so the backward shrinks with
# the forward. Algorithm 6.4 switches degree at its own bounds ℓ_m, a little below
# θ_m (its derivative's error bound); here the derivative takes the forward's
# degree, as the degree-13 code did at θ₁₃, and at 0.999·θ_m of every degree the
# gradients agree with torch's autograd in float64 to rounding (the tests).
_THETA = {
    "double": ((3, 1.495585217958292e-2), (5, 2.539398330063230e-1), (7, 9.504178996162932e-1),
               (9, 2.097847961257068), (13, 5.371920351148152)),
    "single": ((3, 4.258730016922831e-1), (5, 1.880152677804762), (7, 3.925724783138660)),
}  # fmt: skip
_THETA13 = _THETA["double"][-1][1]


# Note [The Padé solve of a skew-Hermitian A by device type]
# For skew-Hermitian A (the "exp" map's input, exactly: W − Wᴴ rounds to a
# skew-Hermitian matrix) the even powers of X are Hermitian and the odd ones
# skew-Hermitian, so V is Hermitian, U skew-Hermitian and the denominator is
# Q = V − U = Pᴴ with P = V + U: R₀ = P⁻ᴴP. P is normal (a polynomial in the
# normal X) with eigenvalues p(iσ), |σ| ≤ ‖X‖₂ ≤ ‖X‖₁ ≤ θ_m (‖X‖∞ = ‖X‖₁ for a
# skew-Hermitian X), and |p(iy)|² is a polynomial in y² with nonnegative
# coefficients, so κ₂(P) ≤ |p(iθ_m)| ≤ 1.163 for every degree of the table (the
# largest at single θ₇; 1.157 at θ₁₃). Then G = PᴴP is Hermitian positive definite
# with κ₂(G) ≤ 1.351, and with G = LLᴴ:
#   Q⁻¹Y = P G⁻¹ Y,   Q⁻ᴴY = P⁻¹Y = G⁻¹PᴴY,
# each one Cholesky solve and one product, so the forward is R₀ = P·G⁻¹·P and the
# backward's adjoint solve reuses L. This costs two products more than the pivoted
# LU of Q in the forward (PᴴP, and the one after the solve) and one more in the
# backward (Pᴴ times the right-hand side). Where LAPACK's LU runs near the product
# rate (the CPU) the LU is the better buy; where the LU factorisation runs far below
# it (CUDA) the Cholesky route, its products included, takes less time. The choice is
# the ``exp_map`` dispatcher's (`stiefel.parametrizations.kernels`), which vouches
# for the skewness: its A is X₊ − X₊ᴴ. The unpivoted LU has no such stability
# argument here: V, the Hermitian part of Q, is indefinite near θ₁₃ and single θ₇.
# An A skew only up to δ = ‖A + Aᴴ‖ gets an error of order δ from the route.


def _plan(a: torch.Tensor, skew_norm: float | None = None) -> tuple[int, int]:
    """(m, s): the Padé degree and the squarings (Note [Padé degree by ...]).
    ``skew_norm``: `expm`'s argument, else ‖A‖₁ is read here."""
    if a.numel() == 0 or a.device.type == "meta":  # meta: shapes only, no values
        return 13, 0
    if skew_norm is not None:
        norm = skew_norm
    else:
        norm = float(torch.linalg.matrix_norm(a.detach(), ord=1).amax())
    if not math.isfinite(norm):
        return 13, 0
    for m, theta in _THETA["double" if torch.finfo(a.dtype).eps < 2.0**-40 else "single"]:
        if norm <= theta:
            return m, 0
    return 13, max(0, math.ceil(math.log2(norm / _THETA13)))


class _LU:
    """Solves with Q = V − U and Qᴴ by Q's pivoted LU factors."""

    def __init__(self, v: torch.Tensor, u: torch.Tensor):
        self.lu, self.piv = torch.linalg.lu_factor(v - u)

    @classmethod
    def from_factors(cls, lu: torch.Tensor, piv: torch.Tensor) -> _LU:
        solver = cls.__new__(cls)
        solver.lu, solver.piv = lu, piv
        return solver

    def solve(self, y: torch.Tensor) -> torch.Tensor:
        return torch.linalg.lu_solve(self.lu, self.piv, y)

    def solve_adjoint(self, y: torch.Tensor) -> torch.Tensor:
        return torch.linalg.lu_solve(self.lu, self.piv, y, adjoint=True)


class _SkewCholesky:
    """Solves with Q = Pᴴ and Qᴴ = P, P = V + U, by the Cholesky factor of G = PᴴP
    (Note [The Padé solve of a skew-Hermitian A by device type])."""

    def __init__(self, v: torch.Tensor, u: torch.Tensor):
        self.p = v + u
        # G is positive definite with κ₂ ≤ 1.351: no host read of the factor's info
        self.l = torch.linalg.cholesky_ex(self.p.mH @ self.p)[0]

    @classmethod
    def from_factors(cls, p: torch.Tensor, l: torch.Tensor) -> _SkewCholesky:  # noqa: E741
        solver = cls.__new__(cls)
        solver.p, solver.l = p, l
        return solver

    def solve(self, y: torch.Tensor) -> torch.Tensor:
        return self.p @ torch.cholesky_solve(y, self.l)

    def solve_adjoint(self, y: torch.Tensor) -> torch.Tensor:
        return torch.cholesky_solve(self.p.mH @ y, self.l)


#: X⁴ = X²X², X⁶ = X⁴X², X⁸ = X⁴X⁴: the factors (i, j) of each even power after X²,
#: as indices into [X², X⁴, ...]; the derivative follows the same products
_EVEN_PRODUCTS = ((0, 0), (1, 0), (1, 1))


def _evens(x: torch.Tensor, count: int) -> list[torch.Tensor]:
    """[X², X⁴, X⁶, X⁸][:count], each by one product."""
    out = [x @ x]
    for i, j in _EVEN_PRODUCTS[: count - 1]:
        out.append(out[i] @ out[j])
    return out


def _series(c: tuple[float, ...], terms: list[torch.Tensor]) -> torch.Tensor:
    """Σ_j c[j]·terms[j]."""
    out = c[0] * terms[0]
    for cj, t in zip(c[1:], terms[1:], strict=True):
        out = out.add(t, alpha=cj)
    return out


def _forward(a: torch.Tensor, m: int, s: int, cholesky: bool):
    b = _B[m]
    x = a / 2**s if s else a
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    if m == 13:  # Horner form in X⁶: six products
        x2, x4, x6 = evens = _evens(x, 3)
        w1 = b[13] * x6 + b[11] * x4 + b[9] * x2
        w2 = b[7] * x6 + b[5] * x4 + b[3] * x2 + b[1] * eye
        z1 = b[12] * x6 + b[10] * x4 + b[8] * x2
        z2 = b[6] * x6 + b[4] * x4 + b[2] * x2 + b[0] * eye
        w = x6 @ w1 + w2
        v = x6 @ z1 + z2
        horner = (w1, z1)
    else:  # W = Σ b_{2j+1}X^{2j}, V = Σ b_{2j}X^{2j}: (m + 1)/2 products with U
        evens = _evens(x, (m - 1) // 2)
        w = _series(b[1::2], [eye, *evens])
        v = _series(b[0::2], [eye, *evens])
        horner = ()
    u = x @ w
    if cholesky:
        solver = _SkewCholesky(v, u)
        r = solver.solve(solver.p)
    else:
        solver = _LU(v, u)
        r = solver.solve(v + u)
    powers = [r]
    for _ in range(s):
        r = r @ r
        powers.append(r)
    return r, (m, s, x, evens, w, horner, solver, powers)


def _adjoint_frechet(g: torch.Tensor, saved) -> torch.Tensor:
    # L(Aᴴ, G) from the forward's intermediates at A (Note [Scaling and squaring ...]):
    # every matrix at Aᴴ is the conjugate transpose of the one at A
    m, s, x, evens, w, horner, solver, powers = saved
    b = _B[m]
    y, ys = x.mH, [t.mH for t in evens]
    e = g / 2**s if s else g
    ms = [y @ e + e @ y]  # M_{2j} = d(Y^{2j})[E], by the product rule on each product
    for i, j in _EVEN_PRODUCTS[: len(ys) - 1]:
        ms.append(ys[i] @ ms[j] + ms[i] @ ys[j])
    if m == 13:
        w1, z1 = horner
        m2, m4, m6 = ms
        y6 = ys[2]
        lw1 = b[13] * m6 + b[11] * m4 + b[9] * m2
        lw2 = b[7] * m6 + b[5] * m4 + b[3] * m2
        lz1 = b[12] * m6 + b[10] * m4 + b[8] * m2
        lz2 = b[6] * m6 + b[4] * m4 + b[2] * m2
        lw = y6 @ lw1 + m6 @ w1.mH + lw2
        lv = y6 @ lz1 + m6 @ z1.mH + lz2
    else:
        lw = _series(b[3::2], ms)
        lv = _series(b[2::2], ms)
    lu_ = y @ lw + e @ w.mH
    rhs = lu_ + lv + (lu_ - lv) @ powers[0].mH
    ell = solver.solve_adjoint(rhs)
    for r in powers[:-1]:
        rh = r.mH
        ell = rh @ ell + ell @ rh
    return ell


class _Expm(torch.autograd.Function):
    """exp(A) with the adjoint-Fréchet backward, in torch.func's form.

    Note [Saved intermediates as outputs]
    torch.func (grad, vjp, jacrev, vmap) runs an autograd.Function whose forward
    takes no ctx, with a ``setup_context`` that saves tensors only through
    ``save_for_backward``; a tensor kept as a ctx attribute would belong to
    another transform level. So the plan (degree, squarings, solver; a host read)
    is made before the Function, as non-tensor inputs, the forward returns every
    intermediate the backward reads as outputs marked non-differentiable, and
    ``setup_context`` saves them and rebuilds the backward's structure from the
    plan. Forward and backward are batched tensor code, so vmap's rule is
    generated.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(a: torch.Tensor, m: int, s: int, cholesky: bool):  # type: ignore[override]
        out, (_, _, _, evens, w, horner, solver, powers) = _forward(a, m, s, cholesky)
        held = (solver.p, solver.l) if cholesky else (solver.lu, solver.piv)
        # X = A/2ˢ is A itself when s = 0 and the last power is the output: neither is
        # returned again (an output must be a new tensor, and only once)
        return (out, *evens, w, *horner, *held, *powers[:-1])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        a, m, s, cholesky = inputs
        ctx.plan = (m, s, cholesky)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(a, *output)

    @staticmethod
    @first_order("the exp map (its adjoint Fréchet backward)")
    @backward_autocast_off  # Note [Autocast off for the maps' own products]
    def backward(ctx, g: torch.Tensor | None, *_):  # type: ignore[override]
        if g is None:
            return None, None, None, None
        m, s, cholesky = ctx.plan
        a, out, *rest = ctx.saved_tensors
        count = 3 if m == 13 else (m - 1) // 2
        evens, rest = rest[:count], rest[count:]
        w, rest = rest[0], rest[1:]
        horner, rest = (tuple(rest[:2]), rest[2:]) if m == 13 else ((), rest)
        held, powers = rest[:2], [*rest[2:], out]
        solver = (_SkewCholesky if cholesky else _LU).from_factors(*held)
        x = a / 2**s if s else a  # as `_forward` scales it
        saved = (m, s, x, evens, w, horner, solver, powers)
        return _adjoint_frechet(g, saved), None, None, None


def expm(
    a: torch.Tensor, *, skew_norm: float | None = None, cholesky: bool = False
) -> torch.Tensor:
    r"""exp(A) for a batch of square matrices, with the adjoint-Fréchet backward.

    Args:
        a: real or complex tensor (..., n, n) (float32/64, complex64/128).
        skew_norm: the largest ‖A‖₁ over the batch, from a caller that has read it
            (no host read here). None: read from ``a``.
        cholesky: solve through the Cholesky factor of PᴴP (Note [The Padé solve of a
            skew-Hermitian A by device type]): right for a skew-Hermitian A only, which
            the caller vouches for; False: the pivoted LU of V − U, right for any A.

    Returns:
        exp(A), same shape and dtype. Its gradient is L(Aᴴ, G) (first order only:
        double backward is not supported).

    Raises:
        ValueError: ``a`` is not a batch of square matrices.
    """
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"expm needs square matrices (..., n, n), got shape {tuple(a.shape)}")
    m, s = _plan(a, skew_norm)
    if not a.requires_grad or not torch.is_grad_enabled():
        return _forward(a, m, s, cholesky)[0]
    return _Expm.apply(a, m, s, cholesky)[0]

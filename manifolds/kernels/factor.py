r"""The QR retraction of X − lr·d, through the Grams (the polar one: `polar_step`).

Descent kernels ``fn(x, d, lr, v=None, *, xx=None)`` like the Cayley ones
(`stiefel.manifolds.kernels.cayley`, whose table `RETRACTIONS` lists them):
Y = retr(X, −lr·d), and with ``v`` also v transported to Y (by projection).
The QR step also has a fused gradient form, `qr_gradient_step`.

Example:
    ```python
    import torch
    from stiefel.manifolds import kernels

    x = kernels.haar(300, 6, dtype=torch.float64)
    g = torch.randn(300, 6, dtype=torch.float64)
    y = kernels.qr_gradient_step(x, g, 0.1)
    d = kernels.egrad2rgrad_euclidean(x, g)
    assert float((y - kernels.qr_unique(x - 0.1 * d)).abs().max()) < 1e-12
    ```
"""

from __future__ import annotations

import torch

from .basic import (
    add_product_,
    eye_like,
    flat_over,
    newton_schulz,
    product_like,
    product_on,
    proj_tangent,
    qr_unique,
    sym,
)
from .frame import (
    UNCORRECTED,
    frame_update,
    in_frame,
    in_place,
    minus_adjoint,
    replace_refused,
    shifted_gram,
    tall_gram,
    wide_gram,
)
from .reduce import abs_square, by_columns, gram
from .scaling import scaled_gram, scaled_step

__all__ = [
    "qr_descent",
    "qr_gradient_step",
    "qr_retraction",
    "right_solve_by_inverse",
    "right_solve_flops",
    "times_inverse",
]

Lr = float | torch.Tensor

# Note [QR retraction through the Gram of X − lr·d]
# The thin QR of A = X − lr·d with a positive diagonal of R is A = QR with
# RᴴR = AᴴA (Cholesky), so Q = A·R⁻¹. A step writes A = X·C − S (S = σ·d/μ,
# C = γI, or C = γI + W for the fused gradient step d = G − XW, Note
# [Overflow-safe step]), and AᴴA = CᴴXᴴXC − CᴴH − HᴴC + SᴴS with H = XᴴS comes
# from M×M matrices and three N×M×M products (XᴴX, which the optimizer's
# off-manifold test forms anyway, H and SᴴS); Q = (X·C − S)·R⁻¹ is one more
# product, accumulated over S (the step's own copy), and A·R⁻¹ (Note [Right
# triangular solves]).
# Householder QR (LAPACK geqrf + orgqr, about five products' time at N = 4096,
# M = 64 on a CPU) and the Newton–Schulz step after it (two products) are
# replaced by O(M³) work.
#
# On O(n) and U(n) (N = M) the M×M work is as large as the products, so the
# square step is taken in the frame of X (Note [Square steps in the frame of
# X]): with XXᴴ = I, S = X·H and A = X·B with B = C − H = γI + P, so
# qf(A) = X·qf(B). For the gradient step P = W − H is −skew(H) (Euclidean) or
# −2·skew(H) (canonical), formed exactly skew; BᴴB = γ²I + PᴴP in the delta
# form of Note [Delta form of a shifted Gram] (the plain product loses 7 eps
# per diagonal entry at n = 512, which was the 1.0e-5 drift of a first square
# Cholesky-QR), and qf(B) − I = (P − (R − γI))R⁻¹ by one triangular solve, so
# a step costs XᴴS, PᴴP, a Cholesky factorization, the solve and the update
# X + X(D − ½E): two products fewer than Householder QR of X·C − S followed by
# Newton–Schulz. Off the manifold (XᴴX = I + E) the square step is the QR
# retraction at the corrected point X̃ = X(I − ½E): X̃·qf(B), which is
# qf(X̃·B) up to O(‖E‖²) and differs from qf(X − lr·d) by O(‖E‖) (qf of a
# point off the manifold is not its polar correction); matrices refused by
# the tests below take NS(qf(X̃·B)) by Householder QR, the same point up to
# O(‖E‖²). On the manifold all of these are qf(X − lr·d).
#
# Drift: AᴴA uses the computed XᴴX of the current point, so Q is orthonormal
# up to this step's own rounding, whatever the point's error (the same
# correction as Note [Newton–Schulz drift correction], with no extra product).
# Accuracy: Cholesky-QR loses orthogonality as κ(A)²·eps, and forming AᴴA from
# its four terms loses digits when they cancel. So the Gram path is used for a
# matrix only when (i) ρ = ‖AᴴA/s − I‖_F ≤ ½ with s = tr(AᴴA)/M (then
# κ(A)² ≤ 3), and (ii) (‖XC‖_F + ‖S‖_F)² ≤ 4‖A‖_F² (the terms cancel by at
# most two bits; ‖XC‖²_F and ‖S‖²_F are traces of M×M matrices already
# formed). Other matrices (long or rank-deficient steps) take Householder QR
# with the sign fix of `qr_unique` and the Newton–Schulz step; on St(N, M),
# N > M, both paths compute the unique thin QR factor, and every test of the
# result holds for either.
_RHO_MAX = 0.5
_CANCEL_MAX = 4.0


def _trace(a: torch.Tensor) -> torch.Tensor:
    return a.diagonal(dim1=-2, dim2=-1).real.sum(-1)[..., None, None]


def _cholesky(aa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R of AᴴA = RᴴR (upper, positive diagonal) and whether κ(A)² ≤ 3 (per matrix).

    ρ² = ‖AᴴA/s − I‖²_F = M²‖AᴴA‖²_F/tr(AᴴA)² − M for s = tr(AᴴA)/M: one
    reduction, no identity matrix (its rounding, ~M·eps, is far below ρ² ≤ ¼).
    """
    r, info = torch.linalg.cholesky_ex(aa, upper=True)
    return r, _conditioned(aa, info)


def _upper_cholesky(aa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R of AᴴA = RᴴR (upper, positive diagonal) stored by rows, and LAPACK's ``info``.

    Note [The square step's Cholesky factor stored by rows]
    LAPACK writes every factor by columns, so ``cholesky_ex(upper=True)`` returns R
    by columns, while the square QR step's P (a product's result) is stored by
    rows: B − R = P − (R − γI) then sums two layouts, 2.5–5× the time of a sum in
    one layout, and the solve by R reads it transposed. The lower factor L of the same
    Hermitian matrix is Rᴴ (the factor is unique), and its adjoint view is R stored
    by rows at no cost (a complex one is copied once, resolving the conjugation).
    LAPACK's lower and upper sweeps round differently, each to the backward
    stability of Cholesky. The tall step keeps LAPACK's upper factor: its R enters
    only the solve, and the lower factorization of a small M×M batch is the slower
    of the two (timings: docs/performance.md, "Right triangular solves").
    """
    low, info = torch.linalg.cholesky_ex(aa)
    return low.mH.resolve_conj(), info  # a conjugate view would reach view_as_real


def _conditioned(aa: torch.Tensor, info: torch.Tensor) -> torch.Tensor:
    """Whether the Cholesky factorization of AᴴA succeeded and ρ ≤ ½ (κ(A)² ≤ 3), per matrix."""
    m = aa.shape[-1]
    tr = _trace(aa).clamp_min(torch.finfo(aa.real.dtype).tiny)
    fro = torch.linalg.matrix_norm(aa, keepdim=True)
    rho2 = (m * fro / tr) ** 2 - m
    # a non-finite AᴴA gives a NaN ρ (refused): R is finite whenever this passes
    return (info[..., None, None] == 0) & (rho2 <= _RHO_MAX**2)


def _plus_diagonal(a: torch.Tensor | None, gamma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """γI + A (A None: γI) for γ of shape (..., 1, 1), without forming I."""
    m = like.shape[-1]
    out = like.new_zeros((*gamma.shape[:-2], m, m)) if a is None else a.clone()
    out.diagonal(dim1=-2, dim2=-1).add_(gamma[..., 0])
    return out


def _congruence(xx: torch.Tensor, f: torch.Tensor | None, gamma: torch.Tensor) -> torch.Tensor:
    r"""(γI + F)ᴴ XᴴX (γI + F) = γ²XᴴX + γ(P + Pᴴ) + FᴴP with P = XᴴX·F.

    Written so that the products act on the small F (O(lr) for a short step) and
    XᴴX enters once, unmultiplied: their rounding is of order eps·‖F‖, not
    eps·‖XᴴX‖, which halves the point's error after a step in float32.
    """
    head = (gamma * gamma) * xx
    if f is None:
        return head
    p = xx @ f
    return head + gamma * (p + p.mH) + f.mH @ p


# Note [Right triangular solves]
# Q = A·R⁻¹ with A N×M and R M×M upper triangular is a triangular solve of NM²
# flops, or the M×M inverse R⁻¹ (M³/3 flops, one LAPACK call per matrix) and a
# product of 2NM². The product is the faster one once the matrix is tall: the
# solve with N right-hand sides runs far below the GEMM rate on the CPU
# (docs/performance.md, "Right triangular solves"), and it returns a column-major
# result, which the commit then copies across into a row-major parameter. The
# explicit inverse is as accurate here: the Gram path is taken only for
# κ(R)² = κ(A)² ≤ 3 (Note [QR retraction through the Gram of X − lr·d]), and
# A·R⁻¹ formed either way has an error of order κ(R)·eps·‖A‖. A batch of short
# matrices (N < `_INVERSE_ROWS`·M, square ones included) keeps the solve, in
# place over a column-major A where autograd is off: there the call per matrix of
# the inverse costs more than the solve saves. LAPACK solves in a column-major
# buffer, so torch's ``out=`` into a row-major A solves in a scratch copy and
# copies back across, slower than returning the scratch itself (the step stores
# its result anyway): a row-major A gets a new result. Between the two, a single
# small matrix (N·M² below about 10⁶) takes either in a few µs, inside a step's
# fixed cost.
_INVERSE_ROWS = 8


def right_solve_by_inverse(n: int, m: int) -> bool:
    """Whether A·R⁻¹ for A N×M is the M×M inverse and a product (Note [Right triangular solves])."""
    return n >= _INVERSE_ROWS * m


def right_solve_flops(n: int, m: int) -> float:
    """FLOPs of the QR step's A·R⁻¹ for A N×M (Note [Right triangular solves]).

    Args:
        n: rows N of A.
        m: columns M of A (R is M×M).

    Returns:
        NM² (the triangular solve, N < 8M), or 2NM² + M³/3 (R⁻¹ and a product).
    """
    return 2 * n * m * m + m**3 / 3 if right_solve_by_inverse(n, m) else n * m * m


def times_inverse(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A·R⁻¹ as R⁻¹ (a solve against I) and a product, in A's layout."""
    return product_like(a, torch.linalg.solve_triangular(r, eye_like(r, r.shape[-1]), upper=True))


def _right_solve(a: torch.Tensor, r: torch.Tensor, over_a: bool = False) -> torch.Tensor:
    """A·R⁻¹ for an upper-triangular R (Note [Right triangular solves]); over A if allowed."""
    if right_solve_by_inverse(*a.shape[-2:]):
        return times_inverse(a, r)
    out = a if over_a and by_columns(a) else None  # in place in LAPACK's own layout only
    return torch.linalg.solve_triangular(r, a, upper=True, left=False, out=out)


def _householder(a: torch.Tensor, group=None) -> torch.Tensor:
    """The explicit path: Householder QR (positive diagonal), Newton–Schulz corrected.

    Cholesky-QR2 when the rows are split over ``group`` (`qr_unique`).
    """
    return newton_schulz(qr_unique(a, group), group=group)


def _argument(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, over_s: bool = False):
    """X·C − S, one product over the flattened batch; written over S with ``over_s``."""
    if over_s:
        return add_product_(s, x, flat_over(c, x), beta=-1)
    return product_on(s, x, c, beta=-1)


def _qr_tall(x, s, h, w, gamma, xx, checks=None, group=None, reads=True) -> torch.Tensor:
    r"""qf(X(γI + W) − S), H = XᴴS (Note [QR retraction through the Gram of X − lr·d])."""
    c = _plus_diagonal(w, gamma, x)
    ss = gram(s, s, group)
    head = _congruence(xx, w, gamma)  # Cᴴ(XᴴX)C
    ch = c.mH @ h
    aa = head - ch - ch.mH + ss
    r, ok = _cholesky(aa)
    terms = (_trace(head).clamp_min(0).sqrt() + _trace(ss).clamp_min(0).sqrt()) ** 2
    ok = ok & (terms <= _CANCEL_MAX * _trace(aa))
    fast = in_place()
    a = _argument(x, c, s, over_s=fast)  # X·C − S
    if checks is not None:  # a refused step is taken again (Note [Refused matrices ...])
        return replace_refused(_right_solve(a, r, over_a=fast), ok, None, checks)

    def exact(sel):
        return _householder(sel(a), group)

    return replace_refused(_right_solve(a, r), ok, exact, reads=reads)


def _unit_columns(d: torch.Tensor) -> torch.Tensor:
    r"""D of I + D with unit columns: column j of I + D scaled by 1/‖q_j‖, to O(δ_j·‖d_j‖²).

    Note [Unit columns of the square QR factor]
    Q = B·R⁻¹ has unit columns in exact arithmetic, but R_jj ≈ γ is rounded
    to a float near 1 (absolute error up to eps/2), and since ‖G‖, hence γ,
    barely changes from one step to the next, the rounding goes the same way
    at every step: the column norms of X drift linearly (measured ‖XᴴX − I‖_F
    4.8e-4 after 1000 uncorrected float32 steps on O(512), 97 % of it on the
    diagonal). δ_j = ‖q_j‖² − 1 = 2 Re D_jj + ‖d_j‖² is formed from the small
    D, so to the precision of D, and q_j is scaled by 1 + s_j, s_j = −½δ_j
    (exact to O(δ²), δ being rounding). Only the diagonal entry takes the
    scale: the off-diagonal ones would change by s_j·d_ij, below their own
    rounding, and leaving them moves ‖q_j‖² by 2s_j·Σ_{i≠j}|d_ij|², far below
    eps for any step the frame path takes. What remains is the random walk of
    the off-diagonal rounding (Note [The drift correction every
    k-th step]). One pass over D.
    """
    diag = d.diagonal(dim1=-2, dim2=-1)
    # ‖d_j‖² as a sum of squares, faster than torch's vector_norm along rows (docs/performance.md)
    sq = abs_square(d).sum(-2)
    s = sq.add_(diag.real, alpha=2).mul_(-0.5)
    if in_place():
        diag.addcmul_(s, 1 + diag)
        return d
    return d.diagonal_scatter(diag + s * (1 + diag), dim1=-2, dim2=-1)


def _qr_square(x, p, skew, gamma, xx, p_again, checks=None, reads=True) -> torch.Tensor:
    r"""X̃·qf(B), B = γI + P, X̃ = X(I − ½E) (Note [Square steps in the frame of X]).

    ``p_again()`` forms P again for the matrices that take the explicit path,
    NS(qf(X̃·B)), which equals the frame path's X̃·qf(B) up to O(‖E‖²). With
    ``xx=UNCORRECTED``, X̃ = X.
    """
    if xx is None:
        xx = wide_gram(x)
    bb = shifted_gram(p, gamma, skew)
    r, info = _upper_cholesky(bb)  # BᴴB = RᴴR
    if skew:
        # B = γI + P with P skew is normal, σ_k(B)² = γ² + λ_k², so κ(B)² ≤ 1 + ‖P‖₂²/γ²,
        # and ‖P‖₂ ≤ √2·γ gives κ² ≤ 3, the bound of the ρ-test. ‖P‖₂ ≤ ‖P‖_F/√2 for a
        # real skew P (its eigenvalues ±iθ come in pairs), ‖P‖₂ ≤ ‖P‖_F for a complex
        # one (torch's ‖P‖₁ took ten times a Frobenius norm, and admits fewer random
        # P); the ρ-test decides the others
        # ‖P‖²_F = tr(BᴴB) − nγ², to n·eps·γ² (far below the bound): no pass over P.
        # The test also stands for info == 0: a finite γ²I + PᴴP has its pivots at
        # least γ²(1 − O(n·eps)) > 0, and a NaN or inf in column j of P reaches
        # (PᴴP)_jj, hence the trace; strict, so that γ = 0 fails
        bound = x.shape[-1] + (2.0 if p.is_complex() else 4.0)  # ‖P‖²_F ≤ (bound − n)·γ²
        ok = (_trace(bb) < bound * gamma**2) | _conditioned(bb, info)
    else:
        ok = _conditioned(bb, info)
        # B = γI + P may cancel: test (ii) of the Note, with ‖B‖²_F = tr(BᴴB)
        pn = torch.linalg.matrix_norm(p, keepdim=True)
        ok = ok & ((gamma * x.shape[-1] ** 0.5 + pn) ** 2 <= _CANCEL_MAX * _trace(bb))
        diag = p.diagonal(dim1=-2, dim2=-1) - (r.diagonal(dim1=-2, dim2=-1) - gamma[..., 0])
    # B − R = P − (R − γI), the diagonal from small terms: P's own minus R_jj − γ, or
    # for a skew P (zero real part on the diagonal) γ − R_jj in one subtraction
    # (exact while R_jj ≤ 2γ); written over P when autograd is off
    fast = in_place()
    num = p.sub_(r) if fast else p - r
    if skew:
        num.diagonal(dim1=-2, dim2=-1).add_(gamma[..., 0])
    else:
        num.diagonal(dim1=-2, dim2=-1).copy_(diag)
    # qf(B) − I = B·R⁻¹ − I = (B − R)·R⁻¹, every operand small
    d = _right_solve(num, r, over_a=fast)

    def explicit(sel):  # qf(X̃·B), X̃ = X(3I − XᴴX)/2 from the Gram already formed
        b = _plus_diagonal(sel(p_again()), sel(gamma), x)
        xt = sel(x) if xx is UNCORRECTED else newton_schulz(sel(x), sel(xx).to(x.dtype))
        return _householder(xt @ b)

    return replace_refused(frame_update(x, _unit_columns(d), xx), ok, explicit, checks, reads)


def qr_descent(
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
    r"""QR step qf(X − lr·d) (R's diagonal positive); v projected onto the new tangent space.

    Computed through the Gram of X − lr·d (Note [QR retraction through the Gram
    of X − lr·d]), with Householder QR and a Newton–Schulz step for long steps;
    on O(n) and U(n) as X̃·qf(B) in the frame of X (Note [Square steps in the
    frame of X]).

    Args:
        x: points (..., N, M).
        d: step direction, same shape.
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).
        v: a vector to transport (by projection) to the new point.
        xx: XᴴX if already formed.
        checks: for a caller that reads its flags once per step (Note [Refused
            matrices in a step that reads nothing] in .frame); None: read here.
        reads: as for `stiefel.manifolds.kernels.cayley_descent`.
        group: the process group the rows of X are split over (Note [Row-sharded
            kernels] in .reduce), or None.

    Returns:
        Y, or (Y, v projected onto T_Y) when ``v`` is given.
    """
    s, gamma = scaled_step(d, lr, group=group)
    if in_frame(x, group):  # B = γI − H
        h = gram(x, s)
        y = _qr_square(x, -h, False, gamma, xx, lambda: -h, checks, reads)
    else:
        xx = tall_gram(x, xx, group)
        y = _qr_tall(x, s, gram(x, s, group), None, gamma, xx, checks, group, reads)
    return y if v is None else (y, proj_tangent(y, v, group))


def qr_gradient_step(
    x: torch.Tensor,
    g: torch.Tensor,
    lr: Lr,
    metric: str = "euclidean",
    *,
    xx: torch.Tensor | None = None,
    checks: list | None = None,
    absmax: torch.Tensor | None = None,
    group=None,
    reads: bool = True,
) -> torch.Tensor:
    r"""One RGD step `qr_descent`(x, rgrad(G), lr), fused.

    With d = G − XW (W = sym(XᴴG) for the Euclidean metric, GᴴX for the canonical
    one), X − lr·d = X(I + lr·W) − lr·G: d is never formed, and H = XᴴG serves both W
    and the Gram of the QR (Note [QR retraction through the Gram of X − lr·d]).
    G is scaled as in Note [Overflow-safe step].

    Args:
        x: points (..., N, M).
        g: Euclidean gradient, same shape.
        lr: step size (float or tensor broadcastable to (..., 1, 1)).
        metric: ``"euclidean"`` or ``"canonical"``.
        xx: XᴴX if already formed.
        checks: as for `qr_descent`.
        reads: as for `qr_descent`.
        absmax: max|G| per matrix (..., 1, 1) if the caller has it.
        group: as for `qr_descent`.

    Returns:
        The new points.

    Raises:
        ValueError: an unknown ``metric``.
    """
    if metric not in ("euclidean", "canonical"):
        raise ValueError(f"metric={metric!r} is not supported; allowed: euclidean, canonical")
    if not in_frame(x, group):  # σ·W of the scaled gradient S = σG/μ: sym(H) or Hᴴ
        s, gamma = scaled_step(g, lr, absmax, group)
        xx = tall_gram(x, xx, group)
        h = gram(x, s, group)
        w = sym(h) if metric == "euclidean" else h.mH
        return _qr_tall(x, s, h, w, gamma, xx, checks, group, reads)
    # B = γI + W − H = γI + P, P = −skew(H) = ½(Hᴴ − H) (Euclidean) or Hᴴ − H
    # (canonical): with S scaled by c = −½ or −1 (exact), P = cH − (cH)ᴴ
    h, gamma = scaled_gram(x, g, lr, -0.5 if metric == "euclidean" else -1.0, absmax)
    p_again = lambda: minus_adjoint(h)  # noqa: E731
    return _qr_square(x, minus_adjoint(h), True, gamma, xx, p_again, checks, reads)


qr_descent.gradient_step = qr_gradient_step  # type: ignore[attr-defined]


def qr_retraction(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """QR retraction qf(X + U) with the sign/phase fix (continuous in U)."""
    return qr_descent(x, u, -1.0)

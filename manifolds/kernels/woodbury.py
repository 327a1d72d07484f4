r"""The Woodbury Cayley step of St(N, M), 2M < N: `smw_step`, its 2M×2M system and the solve.

The Cayley step of St(N, M) with 2M < N (Note [Cayley through
Sherman–Morrison–Woodbury with 2M columns], `smw_step`) reduces to one linear
system per matrix, in the scaled form of Note [Overflow-safe step]:

    [[γI + hE, −hG], [hF, γI − hEᴴ]] [V₁; Z₂] = σ[[G, Xᴴv], [Eᴴ, P̂ᴴv]],   h = ½σ,

with E = XᴴP̂, G = XᴴX and F = P̂ᴴP̂ (all M×M, ‖P̂‖_F = 1) and γ, σ the weights
of β = lr·‖Pd‖_F; then Y = X(I + Z₂) − P̂V₁. `solve_step_system` solves it by
block elimination where that is stable and by one 2M×2M LU otherwise.

Note [Woodbury system by block elimination]
Eliminating the first block column with the pivot block T = γI + hE leaves the
Schur complement S = γI − hEᴴ + h²FQ₁ (Q = T⁻¹[G, Xᴴv], Q₁ its first M
columns) and

    Z₂ = σS⁻¹([Eᴴ, P̂ᴴv] − hFQ),   V₁ = σQ + hQ₁Z₂:

two M×M solves and two M×M products instead of one 2M×2M solve, a quarter of
its flops. The gain is LAPACK's: it factorizes the matrices of a batch one call
at a time, and on small matrices the cost of a call grows faster than its flops,
so on a batch of St(64, 16) the two 16×16 solves cost less than half the 32×32
one (docs/performance.md, "Woodbury system by block elimination").
Block elimination without pivoting is as accurate as the LU when the pivot
block and the growth of the elimination are bounded. With σ/γ = β,
T = γ(I + K), ‖K‖₂ ≤ ½|β|‖E‖_F, so |β|‖E‖_F ≤ 1 gives ‖K‖₂ ≤ ½,
‖T⁻¹‖₂ ≤ 2/γ and cond(T) ≤ 3; |β| ≤ 4 (γ ≥ ¼) bounds the growth,
‖hF·T⁻¹·hG‖₂ ≤ ½|σβ|‖G‖₂ ≤ 2‖G‖₂ (‖F‖₂ ≤ tr F = 1), so no entry of S is
more than a few times the data. S is invertible because the whole matrix is
(det = det T·det S, Note [Cayley through Sherman–Morrison–Woodbury with 2M
columns]). Training steps satisfy both bounds (‖E‖_F ≤ 1 near the manifold,
so |β| ≤ 1 always does); a batch in which some matrix does not, or a traced
call (the test is a host read, Note [Traced steps compute both paths] in
.frame), takes the 2M×2M LU with partial pivoting. The test is one host read
per step, a synchronisation on a GPU; there too the batched LU is slower than the
two M×M solves, by more than the read costs (docs/performance.md, "Woodbury and
right solves on the GPU").
Within the bounds no term can overflow, so the weights are not needed: divided
by γ (σ/γ = β, h/γ = ½β) and with V₁ in the units of Pd (V₁/t, t = ‖Pd‖_F),
the elimination reads, with a = ½lr,

    T = I + a·XᴴPd,   Q = T⁻¹[G, Xᴴv],   W = a²·PdᴴPd·Q − a[PdᴴX, Pdᴴv],
    S = I + W₁,   Z₂ = −2S⁻¹W,   V₁/t = 2a(Q − Q₁S⁻¹W),

with no division by t (t = 0, a zero step, needs no special case).

Note [Near-identity blocks of the elimination]
Both M×M systems are near the identity: T = I + K_T with ‖K_T‖₂ ≤ r_T =
|a|·‖XᴴPd‖_F, and S = I + W₁ with ‖W₁‖₂ ≤ r_S = r_T + (a·t)²‖G‖_F/(1 − r_T)
(‖PdᴴPd‖₂ ≤ t² and ‖Q₁‖₂ ≤ ‖T⁻¹‖₂‖G‖₂; Frobenius norms, since torch's
1-norm of a batch of small matrices costs as much as the solve it would save). A
training step has both of the order of the step (r ≈ 10⁻³–10⁻¹), so each system
takes Euler's product where its bound allows (Note [Inverse of I + K by Euler's
product] in .euler): a few batched M×M products instead of a batched LU, which
LAPACK runs one matrix at a time. The bounds are maxima over the batch, read on
the host in the same read as the test of elimination.

Example:
    ```python
    import torch
    from stiefel.manifolds.kernels.woodbury import solve_step_system

    x = torch.linalg.qr(torch.randn(9, 3, dtype=torch.float64))[0]
    pd = 0.1 * torch.randn(9, 3, dtype=torch.float64)
    z1, z2 = solve_step_system(x.mT @ pd, x.mT @ x, pd.mT @ pd, 0.5)  # elimination
    # the unscaled system (|β| ≤ 1: γ = 1, σ = β), with V₁ = t·(V₁/t)
    t, eye = torch.linalg.matrix_norm(pd), torch.eye(3, dtype=torch.float64)
    e, f, h = x.mT @ pd / t, pd.mT @ pd / t**2, 0.25 * t
    lhs = torch.cat((torch.cat((eye + h * e, -h * eye), 1), torch.cat((h * f, eye - h * e.mT), 1)))
    z = torch.linalg.solve(lhs, 0.5 * t * torch.cat((eye, e.mT)))
    assert torch.allclose(torch.cat((t * z1, z2)), z, rtol=0, atol=1e-13)
    ```
"""

from __future__ import annotations

import torch

from .basic import eye_like, flat, product_on, sub_product, three_products, two_products
from .cayley_dense import long_cayley_step
from .euler import solve_near_identity
from .reads import host_reads_allowed
from .reduce import gram
from .scaling import weights

__all__ = ["smw_step", "block_matrix", "norm_from_gram", "elimination_bounds", "solve_step_system"]


def block_matrix(*rows) -> torch.Tensor:
    """The block matrix [[c·A + g·I, ...], ...] of ``rows`` of (A, c, g) (g None: no I).

    Each block is written once into the result (no concatenation copies).
    """
    first = rows[0][0][0]
    heights = [row[0][0].shape[-2] for row in rows]
    widths = [a.shape[-1] for a, _, _ in rows[0]]
    batch = torch.broadcast_shapes(*(a.shape[:-2] for row in rows for a, _, _ in row))
    out = first.new_empty(*batch, sum(heights), sum(widths))
    i = 0
    for row, h in zip(rows, heights, strict=True):
        j = 0
        for (a, c, g), w in zip(row, widths, strict=True):
            block = out[..., i : i + h, j : j + w]
            block.copy_(a).mul_(c)  # (a view as ``out=`` would break a traced graph)
            if g is not None:
                diag = block.diagonal(dim1=-2, dim2=-1)
                diag.add_(g[..., 0] if isinstance(g, torch.Tensor) else g)
            j += w
        i += h
    return out


def norm_from_gram(pdpd: torch.Tensor) -> torch.Tensor:
    """t = ‖Pd‖_F from the Gram PdᴴPd (the square root of its trace), shape (..., 1, 1)."""
    return pdpd.diagonal(dim1=-2, dim2=-1).real.sum(-1)[..., None, None].clamp_min(0).sqrt()


def elimination_bounds(
    xpd: torch.Tensor,
    g: torch.Tensor,
    t: torch.Tensor,
    lr,
    checks: list | None = None,
    reads: bool = True,
) -> tuple[float, float] | tuple[torch.Tensor, torch.Tensor] | None:
    """Bounds (r_T, r_S) on the blocks' ‖K‖₂ if every matrix may be eliminated, else None.

    Elimination needs |β| ≤ 4 and |β|·‖E‖_F ≤ 1 for every matrix of the batch: with
    β = lr·t and E = XᴴPd/t that is |lr|·max(t/4, ‖XᴴPd‖_F) ≤ 1 (for the step
    u = −lr·d, ‖Pu‖_F ≤ 4 and ‖XᴴPu‖_F ≤ 1; Note [Woodbury system by block
    elimination]). r_T and r_S bound ‖T − I‖₂ and ‖S − I‖₂ (Note [Near-identity
    blocks of the elimination]): over the batch, read on the host (one read); or,
    with ``checks`` (a step that reads nothing), per matrix as tensors, the test
    "every matrix fits" appended to ``checks`` (Note [Euler's product without a
    host read] in .euler). None under tracing.

    Args:
        xpd: XᴴPd, (..., M, M).
        g: G = XᴴX, (..., M, M).
        t: ‖Pd‖_F, (..., 1, 1).
        lr: the step size, a float or a tensor broadcastable to (..., 1, 1).
        checks: where the test is appended instead of read, or None.

    Returns:
        (r_T, r_S), or None where some matrix is out of bounds (NaN included).
    """
    if checks is None and not host_reads_allowed(reads):
        return None
    if xpd.numel() == 0:  # an empty batch: nothing to bound
        return 0.0, 0.0
    size = torch.linalg.matrix_norm(xpd, keepdim=True)
    rate = abs(lr)
    r_t = 0.5 * rate * size
    at = 0.5 * rate * t
    r_s = r_t + at * at * torch.linalg.matrix_norm(g, keepdim=True) / (1 - r_t)
    test = torch.maximum(size, 0.25 * t) * rate
    if checks is not None:
        checks.append((test <= 1).all())  # NaN: False, and the step is taken again
        return r_t, r_s
    worst = torch.stack(torch.broadcast_tensors(test, r_t, r_s)).flatten(1).amax(1)
    fit, r_t, r_s = worst.tolist()
    return (r_t, r_s) if fit <= 1 else None  # NaN: None, and the LU refuses it alike


def solve_step_system(
    xpd: torch.Tensor,
    g: torch.Tensor,
    pdpd: torch.Tensor,
    lr: float | torch.Tensor,
    xv: torch.Tensor | None = None,
    pdv: torch.Tensor | None = None,
    *,
    lu: bool = False,
    checks: list | None = None,
    reads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""(V₁/t, Z₂) of the Woodbury Cayley system (module docstring), for a batch.

    The data are given in the units of Pd (t = ‖Pd‖_F, E = XᴴPd/t, F = PdᴴPd/t²)
    and V₁ is returned in them, so that Y = X(I + Z₂) − Pd·(V₁/t).

    Args:
        xpd: XᴴPd, (..., M, M).
        g: G = XᴴX, (..., M, M).
        pdpd: PdᴴPd, (..., M, M).
        lr: the step size, a float or a tensor broadcastable to (..., 1, 1).
        xv: Xᴴv for a transported vector v, (..., M, K), or None.
        pdv: Pdᴴv, with ``xv``.
        lu: take the 2M×2M LU whatever the test says (to measure or check it).
        checks: a step that reads nothing: its tests are appended here (`elimination_bounds`).

    Returns:
        V₁/t and Z₂, each (..., M, M) or, with ``xv``, (..., M, M + K).
    """
    t = norm_from_gram(pdpd)
    bounds = None if lu else elimination_bounds(xpd, g, t, lr, checks, reads)
    return _solve(xpd, g, pdpd, t, lr, xv, pdv, bounds, checks)


def _solve(xpd, g, pdpd, t, lr, xv, pdv, bounds, checks):
    # `solve_step_system` with the elimination's bounds given (None: the scaled LU)
    m = xpd.shape[-1]
    if bounds is not None:  # Note [Woodbury system by block elimination]
        # unscaled (|β| ≤ 4): T = I + aXᴴPd, a = ½lr; S = I + W₁ with
        # W = a²PdᴴPd·Q − a[PdᴴX, Pdᴴv]; Z₂ = −2S⁻¹W and V₁/t = 2a(Q − Q₁S⁻¹W),
        # each block by Euler's product where its bound allows (Note [Near-identity
        # blocks of the elimination])
        r_t, r_s = bounds
        half = 0.5 * lr
        ea = xpd * half
        q = solve_near_identity(
            ea, g if xv is None else torch.cat((g, xv), -1), r_t, checks, "woodbury T"
        )
        right = ea.mH if pdv is None else torch.cat((ea.mH, pdv * half), -1)
        w = (pdpd * (half * half)) @ q - right
        sw = solve_near_identity(w[..., :m], w, r_s, checks, "woodbury S")
        v1 = product_on(q, q[..., :m], sw, alpha=-1)  # in Q's layout
        return v1 * (2 * half), -2 * sw
    tc = t.clamp_min(torch.finfo(t.dtype).tiny)
    gamma, sigma = weights(lr * t)
    h = 0.5 * sigma
    e, eh, f = xpd / tc, xpd.mH / tc, pdpd.div(tc).div_(tc)
    top = ((g, sigma, None),) if xv is None else ((g, sigma, None), (xv, sigma, None))
    bottom = ((eh, sigma, None),) if pdv is None else ((eh, sigma, None), (pdv / tc, sigma, None))
    lhs = block_matrix(((e, h, gamma), (g, -h, None)), ((f, h, None), (eh, -h, gamma)))
    z = torch.linalg.solve(lhs, block_matrix(top, bottom))
    return z[..., :m, :] / tc, z[..., m:, :]


def smw_step(
    x,
    pd_or_d,
    xhd,
    xx,
    lr,
    v=None,
    v_is_d=False,
    mu=1.0,
    implicit=False,
    checks=None,
    group=None,
    reads=True,
):
    r"""Y = Cayley(A)X(3I − XᴴX)/2 for Pu = −lr·Pd through a 2M×2M system.

    ``pd_or_d`` is Pd, or with ``implicit`` the direction d itself (Note [Pd through d]).

    Note [Cayley through Sherman–Morrison–Woodbury with 2M columns]
    A = (Pu)Xᴴ − X(Pu)ᴴ, P = I − ½XXᴴ, is skew-Hermitian with AX = u for a
    tangent u. Writing A = BCᴴ with B = [Pu, X] and C = [X, −Pu] (both N×2M), the
    Woodbury identity gives (CWY paper, appendix B, Lemma 1, applied to −A)

        (I − ½BCᴴ)⁻¹(I + ½BCᴴ) Ω = Ω + B (I − ½CᴴB)⁻¹ CᴴΩ,

    so only a 2M×2M matrix is factorized, in O(NM² + M³), and no N×N matrix is
    formed. For u the Euclidean Riemannian gradient this A equals the paper's
    Euclidean-metric A written with 3M columns; for u the canonical gradient it
    equals Wen–Yin's GXᴴ − XGᴴ. I − ½CᴴB is invertible because its determinant
    equals det(I − ½A) ≠ 0 (Sylvester), A having an imaginary spectrum. B and C
    are never concatenated: CᴴB = [[XᴴPu, XᴴX], [−PuᴴPu, −PuᴴX]], so the N-sized
    work is XᴴX, Xᴴd, PdᴴPd and the final two updates (and Pd itself in the fused
    gradient step; Note [Pd through d]). XᴴX is the true Gram
    (formed, or the optimizer's float64 one every k-th step), for which the
    identity holds exactly, or I between two corrections (Note [Tall steps
    correct every k-th step]), for a point whose Gram is I + E with E at
    rounding level: the result then differs from Cayley(A)X by O(‖E‖·lr‖Pd‖).

    The Newton–Schulz factor K = (3I − XᴴX)/2 is folded into the M×M
    coefficients of the update at no N-sized cost (Cayley(A) is unitary, so Y
    has the Gram of X, which K corrects). Y is accumulated on a copy of X,
    Y = X + X·C − Pd·V with C = (I + Z₂)K − I = Z₂K − ½(XᴴX − I): both products
    have coefficients of the size of the step, so their rounding is relative to
    the step, and each entry of Y is rounded once more, when it is added to X
    (as in Note [Square steps in the frame of X]). Forming X·(I + Z₂)K instead
    rounds a sum of M products of O(1) terms per entry at every step, a drift
    that is not corrected (docs/performance.md, "Measurements behind code
    choices"). Where the normal part of Pd is rank-deficient
    (a rank-1 gradient), B and C share directions and the 2M×2M system has
    Jordan blocks [[γ, −½], [0, γ]] on them (Note [Overflow-safe step]): its
    rounding grows as β² = (lr·‖Pd‖)², and Y left the manifold by about eps·β²
    (float32 St(256, 16), rank 1: 1e-3 at β = 100, 0.1 at 1e3). So a step the
    elimination refuses (|β| > 4 or |β|·‖XᴴPd‖ > 1), where the host knows it,
    is taken in the basis of span{X, d} instead (Note [A long Cayley step in the
    basis of X and the step] in `stiefel.manifolds.kernels.cayley_dense`); a
    step that reads nothing (traced, capturable) or on row-sharded points keeps
    the system, and the test of the next step brings its point back.
    The system is written in the scaled form of Note [Overflow-safe step] and
    solved by `woodbury.solve_step_system` (block elimination where it is
    stable, Note [Woodbury system by block elimination]). A
    transported vector Ω = v costs two more N-sized products (Xᴴv, Pdᴴv) and M
    more columns in the system; the step direction d itself costs neither
    (Note [Image of the step direction]).

    Note [Image of the step direction]
    With Â = PdXᴴ − XPdᴴ, A = −lr·Â, so Q = Cayley(A) commutes with Â, and
    ÂX = Pd·XᴴX − X·(XᴴPd)ᴴ. Writing d = Pd + ½X·Xᴴd = ÂX + R with
    R = Pd(I − XᴴX) + X·W, W = ½Xᴴd + (XᴴPd)ᴴ,

        Q d = Â·QX + Q R = Pd·XᴴY₀ − X·PdᴴY₀ + Y₀W + Q·Pd(I − XᴴX),

    Y₀ = QX = X(I + Z₂) − Pd·V₁ (the system's solution for X). XᴴY₀ and PdᴴY₀
    are M×M (from XᴴX, XᴴPd, PdᴴPd), so Q d is two N×M·M×M products of X and
    Pd with no columns for d in the system and without reading d. The last
    term is taken as Pd(I − XᴴX), an error ‖(Q − I)Pd‖·‖XᴴX − I‖ (the step's
    length times the point's drift, ~10⁻⁷ relative to d in training), and on
    the manifold the formula is exact.

    Note [Pd through d]
    Pd = d − ½X·E (E = Xᴴd) need not be formed, which saves an N-sized product
    and its copy: every use of it is a Gram or a product by an M×M matrix,

        PdᴴPd = dᴴd − ½(E + XᴴPd)ᴴE,   Pdᴴv = dᴴv − ½Eᴴ·Xᴴv,
        A·X + Pd·B = (A − ½E·B)·X + d·B,

    exact identities for any X (XᴴX enters through XᴴPd = E − ½XᴴX·E). On the
    manifold d = XE + X⊥F gives dᴴd = EᴴE + FᴴF and PdᴴPd = ¼EᴴE + FᴴF ⪰ ¼dᴴd,
    whatever d: the subtraction cancels by at most two bits, and the rounding of
    the Gram is eps·‖d‖², as that of the formed Pd (whose entries are rounded
    relative to d's). The coefficient A − ½E·B is step-sized where A is (B is
    the step's), so the products keep the rounding of Note [Cayley through
    Sherman–Morrison–Woodbury with 2M columns]. The fused gradient step forms Pd
    from G instead: there d = G − XW is not formed, and GᴴG would cancel by as
    much as the gradient's normal part exceeds its tangent part.

    Args:
        x: points (..., N, M), 2M < N.
        pd_or_d: Pd = d − ½X·Xᴴd, or d itself with ``implicit``.
        xhd: Xᴴd, (..., M, M).
        xx: XᴴX (the formed Gram, or I between two corrections).
        lr: the step size, a float or a tensor broadcastable to (..., 1, 1).
        v: a vector to transport, or None.
        v_is_d: whether ``v`` is the step direction d (Note [Image of the step
            direction]; ``pd_or_d`` is then of d/μ).
        mu: the scale μ of d = μ·(d/μ), with ``v_is_d``.
        implicit: ``pd_or_d`` is d (Note [Pd through d]).
        checks: a step that reads nothing: its tests are appended here (`elimination_bounds`).
        group: the process group the rows are split over (Note [Row-sharded kernels]
            in .reduce), or None.

    Returns:
        Y, or (Y, Cayley(A)v) when ``v`` is given.
    """
    m = x.shape[-1]
    eye = eye_like(x, m)
    half = 0.5 * xhd
    xpd = sub_product(xhd, xx, half)  # XᴴPd = Xᴴd − ½XᴴX·Xᴴd
    if implicit:  # Note [Pd through d]
        pdpd = product_on(gram(pd_or_d, pd_or_d, group), (xhd + xpd).mH, half, alpha=-1)
    else:
        pdpd = gram(pd_or_d, pd_or_d, group)
    # V₁/t and Z₂, t = ‖Pd‖_F: Note [Woodbury system by block elimination]
    t = norm_from_gram(pdpd)
    bounds = elimination_bounds(xpd, xx, t, lr, checks, reads)
    if bounds is None and checks is None and group is None and host_reads_allowed(reads):
        # a long step, known on the host (Note [A long Cayley step in the basis of X
        # and the step]): the Woodbury system's rounding would grow as β²
        d = pd_or_d if implicit else product_on(pd_or_d, x, half)  # d = Pd + ½X·Xᴴd
        return long_cayley_step(x, d, lr, v)
    other = v is not None and not v_is_d
    xv = gram(x, v, group) if other else None
    pdv = None
    if other:
        pdv = gram(pd_or_d, v, group)
        pdv = product_on(pdv, half.mH, xv, alpha=-1) if implicit else pdv

    def on_x(a, b):  # A of A·X + Pd·B written as (A − ½E·B)·X + d·B
        return product_on(a, half, b, alpha=-1) if implicit else a

    z1, z2 = _solve(xpd, xx, pdpd, t, lr, xv, pdv, bounds, checks)
    z, vt = z2[..., :m], z1[..., :m]
    k = 1.5 * eye - 0.5 * xx
    # Y = X + X((I + Z₂)K − I) − Pd(V₁/t)K, (I + Z₂)K − I = Z₂K − ½(XᴴX − I): two
    # products with coefficients of the step's size, accumulated on X's copy
    c = (z @ k).add_(eye - xx, alpha=0.5)
    b = (vt @ k).neg_()
    y = three_products(x, x, on_x(c, b), pd_or_d, b)
    if v is None:
        return y
    if other:  # Cayley(A)v = v + XZ₂' − P̂V₁'
        b = -z1[..., m:]
        return y, three_products(v, x, on_x(z2[..., m:], b), pd_or_d, b)
    # Note [Image of the step direction], for d = μ·dn (xhd, Pd of dn); each M×M
    # coefficient is accumulated in place on one new row-major matrix (baddbmm's
    # output), and only W sums two layouts (XᴴPd's transpose, read by strides)
    xpdh, z, vt, hf = flat(xpd).mH, flat(z), flat(vt), flat(half)
    w = hf + xpdh  # W = ½Xᴴd + (XᴴPd)ᴴ
    # (I + Z₂)W − PdᴴY₀ with PdᴴY₀ = (XᴴPd)ᴴ(I + Z₂) − PdᴴPd·V₁: W − (XᴴPd)ᴴ = ½Xᴴd
    # is taken exactly, not as the difference of two O(1) terms
    cx = torch.baddbmm(hf, z, w).baddbmm_(xpdh, z, alpha=-1).baddbmm_(flat(pdpd), vt)
    cp = torch.baddbmm(eye, flat(xx), z).baddbmm_(xpdh.mH, vt, alpha=-1)
    cp = cp.baddbmm_(vt, w, alpha=-1)  # XᴴY₀ − V₁W + I − XᴴX
    cx, cp = cx.reshape(xpd.shape).mul_(mu), cp.reshape(xpd.shape).mul_(mu)
    return y, two_products(x, on_x(cx, cp), pd_or_d, cp, y.shape)

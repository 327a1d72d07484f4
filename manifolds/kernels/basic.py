r"""Elementary kernels of St(N, M): tangent space, metrics, factorizations, geodesics.

Plain functions on tensors of shape (..., N, M), real or complex, without
argument checks (the manifold classes check once, in front of them). A kernel
that sums over the rows takes ``group``: the process group the rows are split
over (Note [Row-sharded kernels] in `stiefel.manifolds.kernels.reduce`), None
for plain tensors.
"""

from __future__ import annotations

import torch

from .reduce import by_columns, columns_defect, flat, gram, rows_sum, rows_sum_squares

__all__ = [
    "sym",
    "skew",
    "gram_minus_identity",
    "orthogonality_error",
    "proj_tangent",
    "egrad2rgrad_euclidean",
    "egrad2rgrad_canonical",
    "inner_euclidean",
    "inner_canonical",
    "qr_unique",
    "polar",
    "cholesky_qr2",
    "gram_polar",
    "haar",
    "newton_schulz",
    "expmap_euclidean",
    "expmap_canonical",
]


def sym(a: torch.Tensor) -> torch.Tensor:
    """Hermitian part ½(A + Aᴴ) of a batch of square matrices (halved in place: one new tensor)."""
    return (a + a.mH).mul_(0.5)


def skew(a: torch.Tensor) -> torch.Tensor:
    """Skew-Hermitian part ½(A − Aᴴ) of a batch of square matrices (one new tensor)."""
    return (a - a.mH).mul_(0.5)


def eye_like(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k×k identity in x's dtype and device."""
    return torch.eye(k, dtype=x.dtype, device=x.device)


def flat_over(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``flat`` of B broadcast over A's batch (a factor shared by the batch is not copied)."""
    if b.shape[:-2] == a.shape[:-2]:
        return flat(b)
    return flat(b.expand(*a.shape[:-2], *b.shape[-2:]))


def add_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha=1, beta=1):
    """out ← β·out + α·A·B in place over the flattened batch, in ``out``'s own layout.

    Note [Accumulating into a column-major batch]
    torch's in-place ``baddbmm_`` on the CPU runs one ``addmm_`` per matrix when its
    accumulator is column-major per matrix (a batch from LAPACK, e.g. QR's Q, and every
    gradient or copy that keeps its layout): a Python-level loop over the batch. The
    transpose of such a batch is row-major, and (AB)ᵀ = BᵀAᵀ, so the product is
    accumulated into outᵀ instead: the same numbers, one batched call. The
    out-of-place form (`product_on`) has the same reason: ``baddbmm`` first copies
    its accumulator into a new row-major tensor, a transposing copy of a
    column-major one, where the copy of Uᵀ is a plain one and the result keeps
    U's layout.

    Args:
        out: (..., n, m), written over (through ``flat``: a batch whose dimensions
            cannot be merged into one is copied first, and only the result holds it).
        a: (..., n, k) with the batch of ``out``.
        b: (..., k, m) with the batch of ``out``.
        alpha: scale of the product.
        beta: scale of ``out``.

    Returns:
        The result, of ``out``'s shape.
    """
    of = flat(out)
    if by_columns(of):
        of.mT.baddbmm_(flat(b).mT, flat(a).mT, alpha=alpha, beta=beta)
    else:
        of.baddbmm_(flat(a), flat(b), alpha=alpha, beta=beta)
    return of.reshape(out.shape)


def product_on(u: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha=1, beta=1):
    """β·U + α·A·B as a new tensor in U's layout, over the flattened batch.

    A column-major U is accumulated as its transpose (Note [Accumulating into a
    column-major batch]); ``b`` may broadcast over ``a``'s batch.
    """
    uf, bf = flat(u), flat_over(b, a)
    if by_columns(uf):
        out = torch.baddbmm(uf.mT, bf.mT, flat(a).mT, alpha=alpha, beta=beta).mT
    else:
        out = torch.baddbmm(uf, flat(a), bf, alpha=alpha, beta=beta)
    return out.reshape(u.shape)


def sub_product(u: torch.Tensor, x: torch.Tensor, k: torch.Tensor, over_u: bool = False):
    """U − X·K: one product accumulated on U over the flattened batch, one new N×M matrix
    (none with ``over_u``: written over U, which the caller owns)."""
    if u.shape != x.shape or k.shape[:-2] != x.shape[:-2]:  # broadcasting: the plain form
        return u.sub_(x @ k) if over_u else u - x @ k
    if over_u:
        return add_product_(u, x, k, alpha=-1)
    return product_on(u, x, k, alpha=-1)


def product_like(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A·B as a new tensor in A's layout, over A's flattened batch (``b`` may broadcast).

    A column-major A gives (BᵀAᵀ)ᵀ: the same numbers, stored by columns, so that a
    sum with A or a tensor of its layout reads both in the same order (Note
    [Accumulating into a column-major batch]).
    """
    af, bf = flat(a), flat_over(b, a)
    ab = torch.bmm(bf.mT, af.mT).mT if by_columns(af) else torch.bmm(af, bf)
    return ab.reshape(*a.shape[:-1], b.shape[-1])


def two_products(a, b, c, e, out_shape) -> torch.Tensor:
    """A B + C E over a flattened batch (one matmul and one fused multiply-add), in A's layout."""
    ab = flat(product_like(a, b))
    return add_product_(ab, flat(c), flat_over(e, c)).reshape(out_shape)


def three_products(v, a, b, c, e) -> torch.Tensor:
    """V + A B + C E over a flattened batch: two multiply-adds on V's copy, no separate sum."""
    return add_product_(product_on(v, a, b), c, flat_over(e, c))


def gram_minus_identity(
    x: torch.Tensor, xx: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    """XᴴX − I, shape (..., M, M), its diagonal from the columns' squares.

    The off-diagonal entries are those of ``xx`` (XᴴX, formed here when None); the
    diagonal is `columns_defect` (Note [The Gram's diagonal from offset squares]),
    exact to the rounding of X's squares where the product's is ten times that.
    """
    xx = gram(x, x, group) if xx is None else xx
    defect = columns_defect(x, xx.diagonal(dim1=-2, dim2=-1), group)
    return torch.diagonal_scatter(xx, defect.to(xx.dtype), dim1=-2, dim2=-1)


def orthogonality_error(x: torch.Tensor, group=None) -> torch.Tensor:
    """‖XᴴX − I‖_F for each matrix of the batch (a real tensor of shape x.shape[:-2])."""
    return torch.linalg.matrix_norm(gram_minus_identity(x, group=group))


# --------------------------------------------------------------------------- tangent space
def proj_tangent(x: torch.Tensor, u: torch.Tensor, group=None) -> torch.Tensor:
    r"""Euclidean-orthogonal projection onto T_X St: ξ = U − X sym(XᴴU).

    Note [Projection does not depend on the metric]
    The tangent space {ξ : Xᴴξ + ξᴴX = 0} is the same set for the Euclidean
    and the canonical metric, and the nearest tangent vector in the ambient
    Frobenius norm is U − X sym(XᴴU) for both. This map is idempotent: applied
    to a tangent ξ, sym(Xᴴξ) = 0 and ξ is returned unchanged. (geoopt's
    canonical ``proju`` returns U − XUᴴX, which is the canonical Riemannian
    gradient, not a projection: applied twice it changes its input.)
    """
    return sub_product(u, x, sym(gram(x, u, group)))


# Under the Euclidean metric the Riemannian gradient is the projection of G.
egrad2rgrad_euclidean = proj_tangent


def egrad2rgrad_canonical(x: torch.Tensor, g: torch.Tensor, group=None) -> torch.Tensor:
    r"""Riemannian gradient under the canonical metric: G − X GᴴX.

    With ⟨ξ, η⟩_X = Re tr(ξᴴ(I − ½XXᴴ)η) the gradient is the unique tangent
    vector whose inner product with every tangent η equals Re tr(Gᴴη).
    """
    return sub_product(g, x, gram(g, x, group))


def _real_trace_product(
    u: torch.Tensor, v: torch.Tensor, keepdim: bool, rows: bool = True, group=None
) -> torch.Tensor:
    # Re tr(uᴴ v) = Σ Re(conj(u) v), summed over the two matrix dimensions (over all
    # ranks' rows when ``rows`` and the rows are split, Note [Row-sharded kernels]).
    if u is v and rows:  # ‖u‖²_F in one pass, no temporary (Note [Sum of squares by row norms])
        out = rows_sum_squares(u, group)
        return out if keepdim else out[..., 0, 0]
    prod = u.conj() * v if u.is_complex() else u * v
    out = rows_sum(prod, group) if rows else prod.sum(dim=(-2, -1), keepdim=True)
    out = out.real if out.is_complex() else out
    return out if keepdim else out[..., 0, 0]


def inner_euclidean(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, keepdim: bool = False, group=None
) -> torch.Tensor:
    """Euclidean metric Re tr(uᴴv) (x is unused, kept for a uniform signature)."""
    return _real_trace_product(u, v, keepdim, group=group)


def inner_canonical(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, keepdim: bool = False, group=None
) -> torch.Tensor:
    """Canonical metric Re tr(uᴴ(I − ½XXᴴ)v) = Re tr(uᴴv) − ½ Re tr((Xᴴu)ᴴ(Xᴴv))."""
    xu = gram(x, u, group)
    xv = xu if v is u else gram(x, v, group)  # ⟨u, u⟩_X (radam's second moment): one product
    inner = _real_trace_product(u, v, keepdim, group=group)
    return inner - 0.5 * _real_trace_product(xu, xv, keepdim, rows=False)


# --------------------------------------------------------------------------- factorizations
def qr_unique(a: torch.Tensor, group=None) -> torch.Tensor:
    r"""Q factor of A = QR with diag(R) real positive (the unique thin QR).

    Note [Sign fix of the QR retraction]
    LAPACK returns some Q with R's diagonal of arbitrary sign (phase). Rescaling
    column j of Q by the phase of R_jj makes the factorization unique, which
    makes the QR retraction a continuous function of the step and makes
    QR of a Gaussian Haar distributed (Mezzadri 2007). A zero diagonal entry
    (rank-deficient A) keeps phase 1.
    """
    if group is not None:  # the rows are split: through the Gram
        return cholesky_qr2(a, group)
    q, r = torch.linalg.qr(a)
    d = torch.diagonal(r, dim1=-2, dim2=-1)
    phase = torch.sgn(d)
    phase = torch.where(phase == 0, torch.ones_like(phase), phase)
    return q * phase.unsqueeze(-2)


def polar(a: torch.Tensor, group=None) -> torch.Tensor:
    """Polar factor U Vᴴ of A = U Σ Vᴴ: the point of St nearest to A in Frobenius norm."""
    if group is not None:  # the rows are split: through the Gram
        return gram_polar(a, group)
    u, _, vh = torch.linalg.svd(a, full_matrices=False)
    return u @ vh


def cholesky_qr2(a: torch.Tensor, group=None) -> torch.Tensor:
    r"""The Q of `qr_unique` through the Gram: Cholesky-QR, twice.

    Args:
        a: matrices (..., N, M) of full column rank.
        group: the process group the rows are split over, or None.

    Returns:
        Q with orthonormal columns and A = QR, diag(R) > 0.

    Note [Cholesky-QR2 for row-sharded matrices]
    With AᴴA = RᴴR (Cholesky, R upper with a positive diagonal), Q₁ = AR⁻¹ has
    orthonormal columns up to a rounding of order κ(A)²·eps; a second pass on
    Q₁ (whose Gram is I + O(κ²eps)) brings it to O(eps) (Yamamoto et al. 2015).
    Both R factors have positive diagonals, so Q = A(R₂R₁)⁻¹ is the unique thin
    QR of `qr_unique`. Only the M×M Grams need all the rows: for a row-sharded A
    they are all-reduced and the triangular solves stay local. Used when the
    rows are split (a retraction argument X − lr·d near the manifold is well
    conditioned); `qr_unique` (Householder) otherwise.
    """
    q = a
    for _ in range(2):
        r = torch.linalg.cholesky(gram(q, q, group), upper=True)
        q = torch.linalg.solve_triangular(r, q, upper=True, left=False)
    return q


def gram_polar(a: torch.Tensor, group=None) -> torch.Tensor:
    r"""The polar factor A(AᴴA)^{-1/2} through the eigendecomposition of the M×M Gram.

    Args:
        a: matrices (..., N, M) of full column rank.
        group: the process group the rows are split over, or None.

    Returns:
        The polar factor, equal to `polar`'s UVᴴ (A = UΣVᴴ: A·VΣ⁻¹Vᴴ = UVᴴ).

    Used when the rows of A are split over ranks (Note [Row-sharded kernels]);
    the SVD of `polar` otherwise.
    """
    w, v = torch.linalg.eigh(gram(a, a, group))
    inv_sqrt = w.clamp_min(torch.finfo(w.dtype).tiny).rsqrt().to(v.dtype)
    return a @ ((v * inv_sqrt.unsqueeze(-2)) @ v.mH)


def haar(
    n: int,
    m: int,
    *batch: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Haar-distributed points of St(n, m), shape (*batch, n, m).

    QR of a standard (complex, for a complex dtype) Gaussian with the
    sign/phase fix of `qr_unique`.
    """
    dtype = dtype or torch.get_default_dtype()
    g = torch.randn(*batch, n, m, dtype=dtype, device=device, generator=generator)
    return qr_unique(g)


def newton_schulz(y: torch.Tensor, yy: torch.Tensor | None = None, group=None) -> torch.Tensor:
    r"""One Newton–Schulz step towards the polar factor: Y(3I − YᴴY)/2.

    Args:
        y: points (..., N, M).
        yy: YᴴY when the caller has it already (saves an N×M×M product).
        group: the process group the rows are split over, or None.

    Returns:
        Y(3I − YᴴY)/2.

    Note [Newton–Schulz drift correction]
    With YᴴY = I + E the corrected point has Gram (I − ½E)(I + E)(I − ½E)
    = I − ¾E² + ¼E³: the error goes from ‖E‖ to O(‖E‖²). Rounding of the
    previous steps therefore never accumulates; each step leaves only its own
    rounding. On the manifold (E = 0) the map is the identity, which is why the
    retractions of `Stiefel.retr` and the optimizers' steps both apply it: they
    are then one map, equal to the textbook retraction on the manifold and
    drift-correcting off it (the QR step on St(N, M), N > M, gets the same
    property from the Gram it normalizes by, Note [QR retraction through the
    Gram of X − lr·d]). It contracts while ‖E‖₂ < 1 (the new error
    ¾e² + ¼e³ < e), which sets the threshold above which a step projects first
    (Note [Off-manifold points at a step]).
    """
    return polar_step(y, 0.5, gram_minus_identity(y, yy, group))


def polar_step(
    y: torch.Tensor, lam: float | torch.Tensor = 0.5, e: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    r"""Y + λ(Y − Y(YᴴY)) = Y((1 + λ)I − λYᴴY): a polar-like correction towards St.

    With YᴴY = I + E the corrected Gram matrix is I + (1 − 2λ)E + O(E²): λ = ½ is
    the Newton–Schulz step (`newton_schulz`), other λ POGO's correction.

    Args:
        y: points (..., N, M).
        lam: λ, a float or a tensor broadcastable to (..., 1, 1).
        e: YᴴY − I (`gram_minus_identity`) when the caller has it already.
        group: the process group the rows are split over, or None.

    Returns:
        The corrected points.
    """
    if e is None:
        e = gram_minus_identity(y, group=group)
    # Y − Y·(λ(YᴴY − I)): Y is added to the small product, not multiplied by
    # (1 + λ)I − λYᴴY, whose product would round Y itself over its M terms (the
    # drift that the correction exists to remove)
    return sub_product(y, y, e * lam)


# --------------------------------------------------------------------------- geodesics
def expmap_euclidean(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""Geodesic of the embedded (Euclidean) metric, through exponentials of skew matrices.

    With A = XᴴU and QR = (I − XXᴴ)U: Y = [X, Q] expm([[2A, −Rᴴ], [R, 0]]) [I; 0] expm(−A)
    (R. Zimmermann & K. Hüper 2022, the family of metrics at α = 0), Edelman, Arias &
    Smith's [X, U] expm([[A, −S], [I, A]]) [I; 0] expm(−A), S = UᴴU, in other factors.

    Note [The Euclidean geodesic by skew exponentials]
    Edelman's block [[A, −S], [I, A]] is not skew: its exponential grows with ‖U‖
    and the product's rounding with it (float32 St(7, 3): ‖YᴴY − I‖ = 4.8e-4 at
    ‖U‖_F = 100, 0.019 at 1000; float64 1.44 at 1e8). Here every factor is unitary
    up to the rounding of a skew exponential, about eps·‖U‖ (1.9e-5 and 2.6e-4 at
    those float32 steps), and [X, Q] has orthonormal columns (those of a
    rank-deficient R enter with weight 0).
    """
    m = x.shape[-1]
    a = x.mH @ u
    q, r = torch.linalg.qr(u - x @ a)
    top = torch.cat((2 * a, -r.mH), dim=-1)
    bottom = torch.cat((r, torch.zeros_like(r)), dim=-1)
    e = torch.linalg.matrix_exp(torch.cat((top, bottom), dim=-2))[..., :m]
    return torch.cat((x, q), dim=-1) @ e @ torch.linalg.matrix_exp(-a)


def expmap_canonical(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""Geodesic of the canonical metric (Edelman, Arias & Smith 1998, §2.4.2).

    With A = XᴴU and QR = (I − XXᴴ)U: Y = [X, Q] expm([[A, −Rᴴ], [R, 0]]) [I; 0].
    """
    m = x.shape[-1]
    a = x.mH @ u
    q, r = torch.linalg.qr(u - x @ a)
    top = torch.cat((a, -r.mH), dim=-1)
    bottom = torch.cat((r, torch.zeros_like(r)), dim=-1)
    e = torch.linalg.matrix_exp(torch.cat((top, bottom), dim=-2))[..., :m]
    return torch.cat((x, q), dim=-1) @ e

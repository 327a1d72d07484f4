r"""Pure tensor kernels for the Stiefel manifold St(N, M) = {X : XᴴX = I}.

Every function here takes and returns plain tensors of shape (..., N, M),
real or complex, with any leading batch dimensions. They do no argument
checking (the manifold classes do that once, in front of them), so they can
be used in hot loops, benchmarked alone and traced by ``torch.compile``.

Example::

    >>> import torch
    >>> from stiefel.manifolds import kernels
    >>> x = kernels.haar(100, 5, dtype=torch.float64)
    >>> u = kernels.proj_tangent(x, torch.randn(100, 5, dtype=torch.float64))
    >>> y = kernels.cayley_retraction(x, 0.1 * u)
    >>> bool(kernels.orthogonality_error(y) < 1e-12)
    True
"""

from __future__ import annotations

import torch

from .msign import MSIGN_METHODS, msign, msign_flops  # noqa: F401  (re-export; helper muon)

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
    "haar",
    "cayley_smw",
    "cayley_dense",
    "cayley_retraction",
    "cayley_retraction_transport",
    "rgd_cayley_step",
    "qr_retraction",
    "polar_retraction",
    "expmap_euclidean",
    "expmap_canonical",
    "use_smw",
]


def sym(a: torch.Tensor) -> torch.Tensor:
    """Hermitian part ½(A + Aᴴ) of a batch of square matrices."""
    return 0.5 * (a + a.mH)


def skew(a: torch.Tensor) -> torch.Tensor:
    """Skew-Hermitian part ½(A − Aᴴ) of a batch of square matrices."""
    return 0.5 * (a - a.mH)


def _eye_like(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.eye(k, dtype=x.dtype, device=x.device)


def gram_minus_identity(x: torch.Tensor) -> torch.Tensor:
    """XᴴX − I, shape (..., M, M)."""
    return x.mH @ x - _eye_like(x, x.shape[-1])


def orthogonality_error(x: torch.Tensor) -> torch.Tensor:
    """‖XᴴX − I‖_F for each matrix of the batch (a real tensor of shape x.shape[:-2])."""
    return torch.linalg.matrix_norm(gram_minus_identity(x))


# --------------------------------------------------------------------------- tangent space
def proj_tangent(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""Euclidean-orthogonal projection onto T_X St: ξ = U − X sym(XᴴU).

    Note [Projection does not depend on the metric]
    The tangent space {ξ : Xᴴξ + ξᴴX = 0} is the same set for the Euclidean
    and the canonical metric, and the nearest tangent vector in the ambient
    Frobenius norm is U − X sym(XᴴU) for both. This map is idempotent: applied
    to a tangent ξ, sym(Xᴴξ) = 0 and ξ is returned unchanged. (geoopt's
    canonical ``proju`` returns U − XUᴴX, which is the canonical Riemannian
    gradient, not a projection: applied twice it changes its input.)
    """
    return u - x @ sym(x.mH @ u)


# Under the Euclidean metric the Riemannian gradient is the projection of G.
egrad2rgrad_euclidean = proj_tangent


def egrad2rgrad_canonical(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    r"""Riemannian gradient under the canonical metric: G − X GᴴX.

    With ⟨ξ, η⟩_X = Re tr(ξᴴ(I − ½XXᴴ)η) the gradient is the unique tangent
    vector whose inner product with every tangent η equals Re tr(Gᴴη).
    """
    return g - x @ (g.mH @ x)


def _real_trace_product(u: torch.Tensor, v: torch.Tensor, keepdim: bool) -> torch.Tensor:
    # Re tr(uᴴ v) = Σ Re(conj(u) v), summed over the two matrix dimensions.
    prod = u.conj() * v if u.is_complex() else u * v
    out = prod.sum(dim=(-2, -1), keepdim=keepdim)
    return out.real if out.is_complex() else out


def inner_euclidean(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, keepdim: bool = False
) -> torch.Tensor:
    """Euclidean metric Re tr(uᴴv) (x is unused, kept for a uniform signature)."""
    return _real_trace_product(u, v, keepdim)


def inner_canonical(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, keepdim: bool = False
) -> torch.Tensor:
    """Canonical metric Re tr(uᴴ(I − ½XXᴴ)v) = Re tr(uᴴv) − ½ Re tr((Xᴴu)ᴴ(Xᴴv))."""
    xu, xv = x.mH @ u, x.mH @ v
    return _real_trace_product(u, v, keepdim) - 0.5 * _real_trace_product(xu, xv, keepdim)


# --------------------------------------------------------------------------- factorizations
def qr_unique(a: torch.Tensor) -> torch.Tensor:
    r"""Q factor of A = QR with diag(R) real positive (the unique thin QR).

    Note [Sign fix of the QR retraction]
    LAPACK returns some Q with R's diagonal of arbitrary sign (phase). Rescaling
    column j of Q by the phase of R_jj makes the factorization unique, which
    makes the QR retraction a continuous function of the step and makes
    QR of a Gaussian Haar distributed (Mezzadri 2007). A zero diagonal entry
    (rank-deficient A) keeps phase 1.
    """
    q, r = torch.linalg.qr(a)
    d = torch.diagonal(r, dim1=-2, dim2=-1)
    phase = torch.sgn(d)
    phase = torch.where(phase == 0, torch.ones_like(phase), phase)
    return q * phase.unsqueeze(-2)


def polar(a: torch.Tensor) -> torch.Tensor:
    """Polar factor U Vᴴ of A = U Σ Vᴴ: the point of St nearest to A in Frobenius norm."""
    u, _, vh = torch.linalg.svd(a, full_matrices=False)
    return u @ vh


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
    sign/phase fix of :func:`qr_unique`.
    """
    dtype = dtype or torch.get_default_dtype()
    g = torch.randn(*batch, n, m, dtype=dtype, device=device, generator=generator)
    return qr_unique(g)


# --------------------------------------------------------------------------- Cayley
def use_smw(n: int, m: int) -> bool:
    """Whether the Sherman–Morrison–Woodbury form (a 2M×2M solve) is cheaper than N×N.

    The SMW form costs about 8NM² + (2M)³ flops against about N³ + 2N²M for the
    dense solve; it wins (and never forms an N×N matrix) whenever 2M < N.
    """
    return 2 * m < n


def _pu(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # P u = u − ½X(Xᴴu), and Xᴴu (reused by the caller)
    xhu = x.mH @ u
    return u - 0.5 * (x @ xhu), xhu


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:])


def cayley_smw(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Cayley retraction (I − ½A)⁻¹(I + ½A)X through a 2M×2M system.

    A = (Pu)Xᴴ − X(Pu)ᴴ, P = I − ½XXᴴ, is skew-Hermitian with AX = u for a
    tangent u, so retr(x, t·u) = x + t·u + O(t²).

    Note [Cayley through Sherman–Morrison–Woodbury with 2M columns]
    Writing A = BCᴴ with B = [Pu, X] and C = [X, −Pu] (both N×2M), the
    Woodbury identity gives (CWY paper, appendix B, Lemma 1, applied to −A)

        (I − ½BCᴴ)⁻¹(I + ½BCᴴ) Ω = Ω + B (I − ½CᴴB)⁻¹ CᴴΩ,

    so only the 2M×2M matrix I − ½CᴴB is factorized, in O(NM² + M³), and no
    N×N matrix is ever formed. For u the Euclidean Riemannian gradient this A
    equals the paper's Euclidean-metric A written with 3M columns; for u the
    canonical gradient it equals Wen–Yin's GXᴴ − XGᴴ. I − ½CᴴB is invertible
    because its determinant equals det(I − ½A) ≠ 0 (Sylvester), A having an
    imaginary spectrum.

    Note [Blocks of CᴴB]
    B and C are never concatenated: CᴴB = [[XᴴPu, XᴴX], [−PuᴴPu, −PuᴴX]] with
    XᴴPu = Xᴴu − ½(XᴴX)(Xᴴu) and PuᴴX = (XᴴPu)ᴴ, so the N-sized work is four
    N×M×M products (Xᴴu, X(Xᴴu), XᴴX, PuᴴPu) and the final Y = X(I + Z₂) + Pu Z₁.
    XᴴX is computed, not assumed to be I: A stays exactly skew-Hermitian, so the
    map stays an isometry and the step adds no drift of its own.

    If ``v`` is given, it is transported by the same orthogonal map, Cayley(A)v
    (an isometric vector transport: Yᴴ(Cayley(A)v) = Xᴴv stays skew-Hermitian),
    in the same solve, and the pair (Y, transported v) is returned.
    """
    pu, xhu = _pu(x, u)
    xx = x.mH @ x
    return _cayley_woodbury(x, pu, xhu - 0.5 * (xx @ xhu), xx, v)


def _cayley_woodbury(
    x: torch.Tensor,
    pu: torch.Tensor,
    xpu: torch.Tensor,
    xx: torch.Tensor,
    v: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # Y = X + B(I − ½CᴴB)⁻¹CᴴX from Pu, XᴴPu and XᴴX (Note [Blocks of CᴴB]).
    m = x.shape[-1]
    lhs = torch.cat((torch.cat((xpu, xx), -1), torch.cat((-(pu.mH @ pu), -xpu.mH), -1)), -2).mul_(
        -0.5
    )
    lhs.diagonal(dim1=-2, dim2=-1).add_(1)
    rhs = torch.cat((xx, -xpu.mH), -2)  # CᴴX
    if v is not None:
        rhs = torch.cat((rhs, torch.cat((x.mH @ v, -(pu.mH @ v)), -2)), -1)
    z = torch.linalg.solve(lhs, rhs)
    z1, z2 = z[..., :m, :], z[..., m:, :]
    # Y = X + Pu Z₁ + X Z₂, as two fused multiply-adds over the flattened batch
    xf, pf = _flat(x), _flat(pu)
    y = torch.baddbmm(xf, xf, _flat(z2[..., :m])).baddbmm_(pf, _flat(z1[..., :m]))
    y = y.reshape(x.shape)
    if v is None:
        return y
    tv = torch.baddbmm(_flat(v), xf, _flat(z2[..., m:])).baddbmm_(pf, _flat(z1[..., m:]))
    return y, tv.reshape(v.shape)


def rgd_cayley_step(
    x: torch.Tensor, g: torch.Tensor, lr: float, metric: str = "euclidean"
) -> torch.Tensor:
    r"""One Riemannian gradient step retr(X, −lr·rgrad(G)) with the SMW Cayley retraction.

    Equal to ``cayley_smw(x, -lr * egrad2rgrad_<metric>(x, g))`` but fused.

    Note [Fused RGD step]
    With H = XᴴG, the step's P u (P = I − ½XXᴴ) is −lr·G + X T for an M×M matrix T:
    Euclidean, rgrad = G − X sym(H): T = lr(sym(H) + ½(H − XᴴX sym(H)));
    canonical, rgrad = G − XHᴴ:      T = lr(Hᴴ + ½(H − XᴴX Hᴴ));
    and XᴴPu = −lr·H + XᴴX T. The Riemannian gradient itself is never formed, so the
    step costs six N×M×M products (XᴴG, XᴴX, XT, PuᴴPu and the two of the update).
    """
    if metric not in ("euclidean", "canonical"):
        raise ValueError(f"metric={metric!r} is not supported; allowed: euclidean, canonical")
    if not use_smw(x.shape[-2], x.shape[-1]):
        rgrad = egrad2rgrad_euclidean if metric == "euclidean" else egrad2rgrad_canonical
        return cayley_dense(x, -lr * rgrad(x, g))  # type: ignore[return-value]
    h = x.mH @ g
    xx = x.mH @ x
    w = sym(h) if metric == "euclidean" else h.mH
    t = lr * (w + 0.5 * (h - xx @ w))
    pu = torch.baddbmm(_flat(g), _flat(x), _flat(t), beta=-lr).reshape(x.shape)
    return _cayley_woodbury(x, pu, xx @ t - lr * h, xx)  # type: ignore[return-value]


def cayley_dense(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The same Cayley retraction (and transport) through a dense N×N solve.

    Cheaper than :func:`cayley_smw` when 2M ≥ N (square or nearly square points).
    """
    pu, _ = _pu(x, u)
    a = pu @ x.mH
    a = a - a.mH  # (Pu)Xᴴ − X(Pu)ᴴ
    lhs = _eye_like(x, x.shape[-2]) - 0.5 * a
    omega = x if v is None else torch.cat((x, v), dim=-1)
    out = torch.linalg.solve(lhs, omega + 0.5 * (a @ omega))
    if v is None:
        return out
    m = x.shape[-1]
    return out[..., :m], out[..., m:]


def cayley_retraction(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Cayley retraction, SMW (2M×2M) when 2M < N, dense N×N otherwise."""
    fn = cayley_smw if use_smw(x.shape[-2], x.shape[-1]) else cayley_dense
    return fn(x, u)  # type: ignore[return-value]


def cayley_retraction_transport(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Cayley retraction of ``u`` and transport of ``v`` by the same map."""
    fn = cayley_smw if use_smw(x.shape[-2], x.shape[-1]) else cayley_dense
    return fn(x, u, v)  # type: ignore[return-value]


def qr_retraction(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """QR retraction qf(X + U) with the sign/phase fix (continuous in U)."""
    return qr_unique(x + u)


def polar_retraction(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Polar retraction: the polar factor of X + U (via the SVD)."""
    return polar(x + u)


# --------------------------------------------------------------------------- geodesics
def expmap_euclidean(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    r"""Geodesic of the embedded (Euclidean) metric (Edelman, Arias & Smith 1998, §2.2.2).

    Y = [X, U] expm([[A, −S], [I, A]]) [I; 0] expm(−A) with A = XᴴU, S = UᴴU.
    """
    m = x.shape[-1]
    a = x.mH @ u
    s = u.mH @ u
    eye = _eye_like(x, m).expand_as(a)
    top = torch.cat((a, -s), dim=-1)
    bottom = torch.cat((eye, a), dim=-1)
    e = torch.linalg.matrix_exp(torch.cat((top, bottom), dim=-2))[..., :m]
    return torch.cat((x, u), dim=-1) @ e @ torch.linalg.matrix_exp(-a)


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

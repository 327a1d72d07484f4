r"""Pure tensor kernels of the optimizers' steps on St(N, M) = {X : XᴴX = I}.

Plain functions on tensors of shape (..., N, M), real or complex, without
argument checks, so they can be tested against dense references, benchmarked
alone and traced by ``torch.compile``. ``lr`` may be a float or a tensor
broadcastable to (..., 1, 1) (one step size per matrix of a batch).

Example::

    >>> import torch
    >>> from stiefel.manifolds import kernels as mk
    >>> from stiefel.optimizers import kernels
    >>> x = mk.haar(200, 8, dtype=torch.float64)
    >>> g = torch.randn(200, 8, dtype=torch.float64)
    >>> y = kernels.cayley_gradient_step(x, g, 0.1)
    >>> ref = mk.cayley_retraction(x, -0.1 * mk.egrad2rgrad_euclidean(x, g))
    >>> bool((y - ref).abs().max() < 1e-12)
    True
"""

from __future__ import annotations

import torch

from ..manifolds.kernels import cayley_dense, sym, use_smw
from ..manifolds.kernels.reduce import gram, row_group, rows_sum

__all__ = [
    "newton_schulz",
    "cayley_descent",
    "cayley_gradient_step",
    "landing_direction",
    "landing_safe_step",
]

Lr = float | torch.Tensor


def _eye(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.eye(k, dtype=x.dtype, device=x.device)


def _abs2(t: torch.Tensor) -> torch.Tensor:
    return (t.conj() * t).real if t.is_complex() else t * t


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:])


def _two_products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, e: torch.Tensor, out_shape):
    """A B + C E over a flattened batch (one matmul and one fused multiply-add)."""
    af, cf = _flat(a), _flat(c)
    bf = _flat(b.expand(*a.shape[:-2], *b.shape[-2:]))
    ef = _flat(e.expand(*c.shape[:-2], *e.shape[-2:]))
    return torch.bmm(af, bf).baddbmm_(cf, ef).reshape(out_shape)


def newton_schulz(y: torch.Tensor) -> torch.Tensor:
    r"""One Newton–Schulz step towards the polar factor: Y(3I − YᴴY)/2.

    Note [Newton–Schulz drift correction]
    With YᴴY = I + E the corrected point has Gram (I − ½E)(I + E)(I − ½E)
    = I − ¾E² + ¼E³: the error goes from ‖E‖ to O(‖E‖²). Rounding of the
    previous steps therefore never accumulates; each step leaves only its own
    rounding. On the manifold (E = 0) the map is the identity.
    """
    m = y.shape[-1]
    k = 1.5 * _eye(y, m) - 0.5 * gram(y, y)
    return y @ k


def _woodbury(
    x: torch.Tensor,
    pd: torch.Tensor,
    xhd: torch.Tensor,
    xx: torch.Tensor,
    lr: Lr,
    d: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Cayley(A)·X·(3I − XᴴX)/2 and optionally Cayley(A)·d, for the step u = −lr·d.

    Inputs: Pd = d − ½X(Xᴴd), Xᴴd and XᴴX. With Pu = −lr·Pd the skew-Hermitian
    A = (Pu)Xᴴ − X(Pu)ᴴ = BCᴴ, B = [Pu, X], C = [X, −Pu] (DESIGN, Clarifications).

    Note [Cayley step by Woodbury in the step direction]
    Cayley(A)Ω = Ω + B(I − ½CᴴB)⁻¹CᴴΩ (CWY paper, appendix B, Lemma 1 for −A), with
    CᴴB = [[XᴴPu, XᴴX], [−PuᴴPu, −PuᴴX]], XᴴPu = −lr(Xᴴd − ½XᴴX Xᴴd),
    PuᴴPu = lr²PdᴴPd. For the transported vector Ω = d itself the right-hand side
    Cᴴd = [Xᴴd; lr·Pdᴴd] needs no new N-sized product, because
    Pdᴴd = PdᴴPd + ½(XᴴPd)ᴴXᴴd. The N-sized work is XᴴX, Xᴴd, Pd, PdᴴPd and the
    final two updates (four more with the transport): O(NM² + M³), no N×N matrix.
    The Newton–Schulz factor K = (3I − XᴴX)/2 (Note [Newton–Schulz drift
    correction]) is folded into the M×M coefficients, so it costs no N-sized work.
    """
    m = x.shape[-1]
    eye = _eye(x, m)
    xpd = xhd - 0.5 * (xx @ xhd)  # XᴴPd
    pdpd = gram(pd, pd)
    top = torch.cat((lr * xpd, -xx), -1)
    bottom = torch.cat(((lr * lr) * pdpd, -lr * xpd.mH), -1)
    lhs = 0.5 * torch.cat((top, bottom), -2)
    lhs = lhs + torch.eye(2 * m, dtype=x.dtype, device=x.device)  # I − ½CᴴB
    rhs = torch.cat((xx, lr * xpd.mH), -2)  # CᴴX
    if d is not None:
        pdd = pdpd + 0.5 * (xpd.mH @ xhd)
        rhs = torch.cat((rhs, torch.cat((xhd, lr * pdd), -2)), -1)
    z = torch.linalg.solve(lhs, rhs)
    z1, z2 = z[..., :m, :m], z[..., m:, :m]
    k = 1.5 * eye - 0.5 * xx
    # Y = (X + Pu Z₁ + X Z₂) K = X (I + Z₂)K + Pd (−lr Z₁ K)
    y = _two_products(x, (eye + z2) @ k, pd, (-lr) * (z1 @ k), x.shape)
    if d is None:
        return y
    w1, w2 = z[..., :m, m:], z[..., m:, m:]
    # Cayley(A)d = d + X Z₂' + Pu Z₁'
    td = _two_products(x, w2, pd, (-lr) * w1, d.shape) + d
    return y, td


def cayley_descent(
    x: torch.Tensor, d: torch.Tensor, lr: Lr, transport: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Cayley retraction of the step −lr·d, drift-corrected; optionally d transported.

    Returns Y = Cayley(A)X(3I − XᴴX)/2 with A = (Pu)Xᴴ − X(Pu)ᴴ, u = −lr·d,
    P = I − ½XXᴴ (for X on the manifold Y = ``retr(x, -lr * d, "cayley")``), and
    with ``transport=True`` also Cayley(A)d, the isometric transport of d to Y.
    A 2M×2M solve when 2M < N (Note [Cayley step by Woodbury in the step
    direction]), a dense N×N solve followed by :func:`newton_schulz` otherwise.
    """
    n, m = x.shape[-2:]
    if not use_smw(n, m) and row_group() is None:
        if transport:
            y, td = cayley_dense(x, -lr * d, d)
            return newton_schulz(y), td
        return newton_schulz(cayley_dense(x, -lr * d))  # type: ignore[arg-type]
    xhd = gram(x, d)
    pd = torch.baddbmm(_flat(d), _flat(x), _flat(xhd), alpha=-0.5).reshape(d.shape)
    return _woodbury(x, pd, xhd, gram(x, x), lr, d if transport else None)


def cayley_gradient_step(
    x: torch.Tensor, g: torch.Tensor, lr: Lr, metric: str = "euclidean"
) -> torch.Tensor:
    r"""One drift-corrected RGD step retr(X, −lr·rgrad(G)) with the Cayley retraction.

    Note [Fused gradient step]
    Both Riemannian gradients have the form d = G − XW with W = sym(XᴴG)
    (Euclidean metric) or W = GᴴX (canonical). With H = XᴴG: Xᴴd = H − XᴴX W and
    Pd = G − X(W + ½Xᴴd), one N-sized product; d itself is never formed. The step
    costs six N×M×M products: XᴴG, XᴴX, Pd, PdᴴPd and the two of the update.
    """
    n, m = x.shape[-2:]
    h = gram(x, g)
    w = sym(h) if metric == "euclidean" else h.mH
    if not use_smw(n, m) and row_group() is None:
        return cayley_descent(x, g - x @ w, lr)  # type: ignore[return-value]
    xx = gram(x, x)
    xhd = h - xx @ w
    pd = torch.baddbmm(_flat(g), _flat(x), _flat(w + 0.5 * xhd), alpha=-1).reshape(g.shape)
    return _woodbury(x, pd, xhd, xx, lr, None)  # type: ignore[return-value]


def landing_direction(
    x: torch.Tensor, g: torch.Tensor, attraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Landing field Λ = skew(GXᴴ)X + λX(XᴴX − I), d = ‖XᴴX − I‖_F and ‖skew(GXᴴ)X‖²_F.

    Note [Landing field in O(NM²)]
    skew(GXᴴ)X = ½(GXᴴX − XGᴴX), so with S = XᴴX and H = GᴴX (M×M)
    Λ = ½GS + X(λE − ½H), E = S − I: four N×M×M products and no N×N matrix. The
    first term is the relative gradient ψX (Ablin & Peyré 2022); the second is the
    gradient of N(X) = ¼‖XᴴX − I‖², pulling X to the manifold. The norm of ψX
    comes from M×M matrices only: XᴴΛ = ½HᴴS + S(λE − ½H), so
    ‖ψX‖² = ‖Λ‖² − 2λ Re tr((XᴴΛ)ᴴE) + λ² tr(ESE).
    Returns Λ (shape of x), d and ‖ψX‖² (shapes (..., 1, 1)).
    """
    m = x.shape[-1]
    s = gram(x, x)
    e = s - _eye(x, m)
    h = gram(g, x)
    c = attraction * e - 0.5 * h
    field = _two_products(g, 0.5 * s, x, c, x.shape)
    dist = torch.linalg.matrix_norm(e, keepdim=True)
    a2 = rows_sum(_abs2(field))
    xf = 0.5 * (h.mH @ s) + s @ c
    cross = (xf.conj() * e).sum((-2, -1), keepdim=True).real
    ese = (e.conj() * (s @ e)).sum((-2, -1), keepdim=True).real
    psi2 = (a2 - 2 * attraction * cross + attraction**2 * ese).clamp_min(0)
    return field, dist, psi2


def landing_safe_step(
    field: torch.Tensor,
    dist: torch.Tensor,
    psi2: torch.Tensor,
    lr: float,
    attraction: float,
    eps: float,
) -> torch.Tensor:
    r"""Step size min(lr, η*) that keeps ‖XᴴX − I‖_F ≤ ε (shape (..., 1, 1)).

    Note [Safe step of the landing method]
    With a = ‖Λ‖_F and d = ‖XᴴX − I‖_F ≤ ε < 1, the step X − ηΛ stays within ε
    for every η ≤ η* = (λd(1−d) + √(λ²d²(1−d)² + a²(ε − d)))/a² (Ablin & Peyré
    2022, Lemma 4; Ablin, Vary, Gao & Absil 2024). Outside the ε-region (d > ε,
    e.g. a start off the manifold) the square root may be of a negative number:
    there we take η ≤ 1/(2λ(1 + d)), for which the attraction X(I − ηλE) moves
    every eigenvalue e of E = XᴴX − I to (1 + e)(1 − ηλe)² − 1, between e and 0
    (toward the manifold, never across it), and η ≤ λd/‖ψX‖², so that the
    O(η²‖ψX‖²) growth caused by the relative gradient stays below the O(ηλd)
    decrease. No NaN or inf is produced (a = 0 gives η = lr).
    """
    a2 = rows_sum(_abs2(field)).to(dist.dtype)
    tiny = torch.finfo(dist.dtype).tiny
    b = attraction * dist * (1 - dist)
    disc = (b * b + a2 * (eps - dist)).clamp_min(0)
    inside = (b + disc.sqrt()) / a2.clamp_min(tiny)
    outside = torch.minimum(
        1 / (2 * attraction * (1 + dist)), attraction * dist / psi2.to(dist.dtype).clamp_min(tiny)
    )
    eta = torch.where(dist <= eps, inside, outside)
    eta = torch.where(a2 > 0, eta, torch.full_like(eta, lr))
    return eta.clamp(max=lr)

r"""Retractions of St(N, M) as descent kernels: the Cayley step (SMW or dense), and the table.

Every retraction is written once, as a *descent kernel*
``fn(x, d, lr, v=None, *, xx=None)`` computing Y = retr(X, −lr·d) followed by
the Newton–Schulz correction (Note [Newton–Schulz drift correction]); with a
vector ``v`` it also returns v transported to Y (``v`` may be ``d`` itself).
``lr`` is a float or a tensor broadcastable to (..., 1, 1) (one step size per
matrix of a batch); ``xx`` is XᴴX when the caller has formed it already.
The QR and polar steps live in `stiefel.manifolds.kernels.factor`;
`RETRACTIONS` is the one table of them all: `Stiefel.retr` (with lr = −1) and the
optimizers' steps both read it.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from .basic import newton_schulz, sub_product, sym
from .cayley_dense import dense_cayley_step
from .factor import qr_descent
from .frame import (
    frame_update,
    in_frame,
    in_place,
    minus_adjoint,
    replace_refused,
    tall_gram,
    wide_gram,
)
from .polar_step import polar_descent
from .reads import host_max, host_reads_allowed
from .reduce import gram
from .scaling import normalize, weights
from .skew_cayley import cayley_delta
from .woodbury import smw_step

__all__ = [
    "use_smw",
    "cayley_descent",
    "cayley_gradient_step",
    "cayley_frame_descent",
    "cayley_smw",
    "cayley_dense",
    "cayley_retraction",
    "cayley_retraction_transport",
    "RETRACTIONS",
]

Lr = float | torch.Tensor


def use_smw(n: int, m: int) -> bool:
    """Whether the Sherman–Morrison–Woodbury form (a 2M×2M solve) is cheaper than N×N.

    The SMW form costs about 8NM² + (2M)³ flops against about N³ + 2N²M for the
    dense solve; it wins (and never forms an N×N matrix) whenever 2M < N.
    """
    return 2 * m < n


def _woodbury_for(x: torch.Tensor, group) -> bool:
    # split rows: always the 2M×2M form, the one whose N-sized work is row-local
    # (Note [Row-sharded kernels]); the dense form needs all N rows at once
    return group is not None or use_smw(*x.shape[-2:])


# --------------------------------------------------------------------------- Cayley
def _square(x, w, lr, v=None, v_is_d=False, mu=1.0, xx=None, checks=None, reads=True):
    r"""The Cayley step of a square X in X's own frame: one n×n solve, no n×n A.

    Note [Square Cayley step in the frame of X]
    For a square X with XᴴX = I every A satisfies A = XSXᴴ with S = XᴴAX, and
    A = (Pu)Xᴴ − X(Pu)ᴴ gives S = XᴴPu − (Pu)ᴴX = skew(Xᴴu) (XᴴP = ½Xᴴ), so

        Cayley(A)X = X·Cayley(S),   Cayley(A)v = X·Cayley(S)·Xᴴv = Y·(Xᴴv).

    Only W = Xᴴd (an n×n product the fused step has anyway) is needed: Pu, A
    and XXᴴ are never formed. With S = −β·Ŝ, Ŝ = skew(W)/‖skew(W)‖_F, the
    scaled form of Note [Overflow-safe step] reads
    Cayley(S) = 2γ(γI + ½σŜ)⁻¹ − I, so D = Cayley(S) − I = −σ(γI + ½σŜ)⁻¹Ŝ
    = −2(I + K)⁻¹K with K = ½βŜ: Euler's product or one n×n solve (Note
    [Cayley of a small skew matrix by Euler's product]) whose data and result
    are small (O(lr)), and
    Y = X + X(D − ½E − ½E·D) in the frame of X (Note [Square steps in the
    frame of X]), the drift correction taken from the optimizer's float64 XᴴX
    every k-th step (`correction_period`). A step costs XᴴG, the solve and one product,
    about 3.3n³ multiply-adds (plus a float64 n³ every k-th step, and one
    product more when that step has ‖D‖_F > ½), against 7.7n³ for geoopt's
    canonical step (Pu, A, (I + ½A)X and a solve). That holds for
    β ≤ 4 (γ ≥ ¼): the eigenvalues of γI + ½σŜ are γ + ½iσθ with |θ| ≤ 1, so
    its condition number is at most (γ + ½)/γ ≤ 3 and D is as accurate as its
    data. β is measured in the Frobenius norm, so a step of spectral size 0.06
    on O(1024) already has β ≈ 1.5 (canonical metric, unit-normal G,
    lr = 1e-3); with the old bound β ≤ 1 it took the explicit path and its
    float32 Newton–Schulz step (drift 8.4e-6 after 1000 steps, against 2.4e-6
    in the frame). A longer step (β > 4) takes the explicit path, Y = 2γ·X(γI + ½σŜ)⁻¹ − X
    (the solve from the right with X as its right-hand side) followed by the
    Newton–Schulz step on Y's own Gram: the rounding of the pivot γ (≥ √eps,
    as in the dense path) of a very long step, amplified by 1/γ, is then
    corrected in Y (measured: ~1e-4 in float32 after lr = 1e20 when it was
    left in Y).
    """
    ph = minus_adjoint(w).mul_(0.5)  # skew(Xᴴd), then normalized in place
    t = torch.linalg.matrix_norm(ph, keepdim=True)
    gamma, sigma = weights(lr * t)
    gamma = gamma.clamp_min(torch.finfo(gamma.dtype).eps ** 0.5)
    tc = t.clamp_min(torch.finfo(t.dtype).tiny)
    ph = ph.div_(tc) if in_place() else ph / tc
    half_beta = sigma / (2 * gamma)  # K = ½βŜ (‖K‖_F = |β|/2), and γI + ½σŜ = γ(I + K)

    def explicit(sel):
        xs, g = sel(x), sel(gamma)
        lhs = sel(ph) * sel(0.5 * sigma)
        lhs.diagonal(dim1=-2, dim2=-1).add_(g[..., 0])  # γI + ½σŜ
        return newton_schulz((2 * g) * torch.linalg.solve(lhs, xs, left=False) - xs)

    short = gamma >= 0.25
    bound = None  # Note [Traced steps compute both paths] in .frame: traced, no read
    if checks is not None:  # per matrix, unread (Note [Euler's product sized by ...] in .euler)
        bound = torch.where(short, half_beta.abs(), 0.0)
    elif host_reads_allowed(reads):  # max ‖K‖_F over the short steps, −1: none
        bound = host_max(torch.where(short, half_beta.abs(), -1.0))
    if isinstance(bound, float) and bound < 0:
        y = explicit(lambda t: t)
    else:
        if xx is None:
            xx = wide_gram(x)
        y = frame_update(x, cayley_delta(ph * half_beta, bound, checks), xx)  # Cayley(S) − I
        y = replace_refused(y, short, explicit, checks, reads)
    if v is None:
        return y
    if not v_is_d:
        return y, y @ (x.mH @ v)
    # Cayley(A)·d = Y·Xᴴd = Y·(μW): μ scales the product in place, not a copy of W
    return y, (y @ w).mul_(mu)


def _cayley(x, d, lr, v, xx, smw, checks=None, group=None, reads=True):
    """The Cayley step; ``smw``: True/False forces SMW/the generic dense solve, None picks."""
    dn, mu = normalize(d, group=group, checks=checks)
    lr = lr * mu
    if smw is None and in_frame(x, group):
        return _square(x, x.mH @ dn, lr, v, v is d, mu, xx, checks, reads)
    xx = tall_gram(x, xx, group)
    if not (_woodbury_for(x, group) if smw is None else smw):
        return dense_cayley_step(x, dn, lr, v)
    # Pd = d − ½X·Xᴴd, never formed (Note [Pd through d])
    mu_v = mu if v is d else 1.0
    xhd = gram(x, dn, group)
    return smw_step(
        x, dn, xhd, xx, lr, v, v is d, mu_v, implicit=True, checks=checks, group=group, reads=reads
    )


def cayley_descent(
    x: torch.Tensor,
    d: torch.Tensor,
    lr: Lr,
    v: torch.Tensor | None = None,
    *,
    xx: torch.Tensor | None = None,
    checks: list | None = None,
    group=None,
    reads: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    r"""Cayley step Y = Cayley(A)X(3I − XᴴX)/2 of u = −lr·d; optionally v transported.

    A = (Pu)Xᴴ − X(Pu)ᴴ with P = I − ½XXᴴ, so AX = u and Y = X + u + O(‖u‖²) on
    the manifold, and Cayley(A) = (I − ½A)⁻¹(I + ½A). A 2M×2M solve when
    2M < N (Note [Cayley through Sherman–Morrison–Woodbury with 2M columns]),
    a dense N×N solve otherwise; overflow-safe (Note [Overflow-safe step]).

    Args:
        x: points (..., N, M).
        d: step direction, same shape.
        lr: step size, a float or a tensor broadcastable to (..., 1, 1).
        v: a vector to transport by the same unitary map Cayley(A) (isometric).
        xx: XᴴX if already formed.
        checks: for a caller that reads its flags once per step: the tests of the
            short paths are appended here unread (Note [Refused matrices in a step
            that reads nothing] in .frame); None: read here.
        group: the process group the rows of X are split over (Note [Row-sharded
            kernels] in .reduce), or None.
        reads: False for a step that must read nothing on the host (an optimizer's
            ``capturable`` step): the short and the exact paths are both computed
            and chosen by ``torch.where``, as in a traced step.

    Returns:
        Y, or (Y, Cayley(A)v) when ``v`` is given.

    Example:
        ```python
        import torch
        from stiefel.manifolds import kernels

        x = kernels.haar(200, 8, dtype=torch.float64)
        d = kernels.proj_tangent(x, torch.randn(200, 8, dtype=torch.float64))
        y, td = kernels.cayley_descent(x, d, 0.1, d)
        assert float(kernels.orthogonality_error(y)) < 1e-12
        assert abs(float(td.norm() - d.norm())) < 1e-12  # an isometry
        ```
    """
    return _cayley(x, d, lr, v, xx, None, checks, group, reads)


def cayley_gradient_step(
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
    r"""One RGD step `cayley_descent`(x, rgrad(G), lr), fused.

    Note [Fused gradient step]
    Both Riemannian gradients have the form d = G − XW with W = sym(XᴴG)
    (Euclidean metric) or W = GᴴX (canonical). With H = XᴴG: Xᴴd = H − XᴴX W and
    Pd = G − X(W + ½Xᴴd), one N-sized product; d itself is never formed. The step
    costs six N×M×M products: XᴴG, XᴴX, Pd, PdᴴPd and the two of the update
    (G is first divided by max|G|, Note [Overflow-safe step]).

    Args:
        x: points (..., N, M).
        g: Euclidean gradient, same shape.
        lr: step size (float or tensor broadcastable to (..., 1, 1)).
        metric: ``"euclidean"`` or ``"canonical"``.
        xx: XᴴX if already formed.
        checks: as for `cayley_descent`.
        absmax: max|G| per matrix (..., 1, 1) if the caller has it (`scaling.normalize`).
        group: as for `cayley_descent`.
        reads: as for `cayley_descent`.

    Returns:
        The new points.

    Example:
        ```python
        import torch
        from stiefel.manifolds import kernels

        x = kernels.haar(200, 8, dtype=torch.float64)
        g = torch.randn(200, 8, dtype=torch.float64)
        y = kernels.cayley_gradient_step(x, g, 0.1)
        ref = kernels.cayley_retraction(x, -0.1 * kernels.egrad2rgrad_euclidean(x, g))
        assert float((y - ref).abs().max()) < 1e-12
        ```
    """
    if metric not in ("euclidean", "canonical"):
        raise ValueError(f"metric={metric!r} is not supported; allowed: euclidean, canonical")
    gn, mu = normalize(g, absmax, group, checks)
    lr = lr * mu
    if in_frame(x, group):  # Xᴴd = H − XᴴX·W with XᴴX = I: skew(H) or 2·skew(H)
        h = gram(x, gn)
        return _square(
            x, h if metric == "euclidean" else 2 * h, lr, xx=xx, checks=checks, reads=reads
        )
    xx = tall_gram(x, xx, group)
    h = gram(x, gn, group)
    w = sym(h) if metric == "euclidean" else h.mH
    if not _woodbury_for(x, group):
        return dense_cayley_step(x, gn - x @ w, lr)
    xhd = h - xx @ w
    # Pd = G − X(W + ½Xᴴd), over G/μ (never over the caller's G)
    pd = sub_product(gn, x, w + 0.5 * xhd, over_u=in_place() and gn is not g)
    return smw_step(x, pd, xhd, xx, lr, None, False, mu, checks=checks, group=group, reads=reads)


cayley_descent.gradient_step = cayley_gradient_step  # type: ignore[attr-defined]


def cayley_frame_descent(
    x: torch.Tensor,
    omega: torch.Tensor,
    lr: Lr,
    *,
    xx=None,
    checks: list | None = None,
    reads: bool = True,
) -> torch.Tensor:
    """Cayley step Y = retr(X, −lr·XΩ) of square points X, from the skew-Hermitian Ω.

    The step of Note [Square Cayley step in the frame of X] with Xᴴd = Ω given:
    the vector XΩ is carried to Y·Ω by the same map (Note [Moments in the frame of
    X] in `stiefel.manifolds.geometry`). ``xx``, ``checks`` and ``reads`` as for
    `cayley_descent`.
    """
    wn, mu = normalize(omega, checks=checks)
    return _square(x, wn, lr * mu, xx=xx, checks=checks, reads=reads)


cayley_descent.frame_step = cayley_frame_descent  # type: ignore[attr-defined]


def cayley_smw(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None):
    """Cayley retraction of ``u`` (and transport of ``v``) forced through the 2M×2M system."""
    return _cayley(x, u, -1.0, v, None, True)


def cayley_dense(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None):
    """Cayley retraction of ``u`` (and transport of ``v``) forced through a dense N×N solve."""
    return _cayley(x, u, -1.0, v, None, False)


def cayley_retraction(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Cayley retraction of the tangent step ``u``: `cayley_descent`(x, u, −1)."""
    return cayley_descent(x, u, -1.0)  # type: ignore[return-value]


def cayley_retraction_transport(
    x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Cayley retraction of ``u`` and transport of ``v`` by the same map."""
    return cayley_descent(x, u, -1.0, v)  # type: ignore[return-value]


RETRACTIONS = MappingProxyType({"cayley": cayley_descent, "qr": qr_descent, "polar": polar_descent})
"""The retraction table: name → descent kernel ``fn(x, d, lr, v=None, *, xx=None)``.

A kernel with the attribute ``takes_uncorrected = True`` accepts
``xx=UNCORRECTED`` (`frame.UNCORRECTED`) and a float64 ``xx``: the optimizers
then form the float64 Gram of a point every `frame.correction_period`(M) steps
only (Notes [The drift correction every k-th step], [Tall steps correct every
k-th step]); others get a Gram in the point's dtype at every step. One with
``takes_checks = True`` (and its ``gradient_step`` / ``frame_step``) accepts
``checks=``, a list where its tests are appended unread (Note [Refused matrices
in a step that reads nothing] in .frame), and ``reads=False`` for a step that
reads nothing at all; others are called without them. A
kernel (and its ``gradient_step``) is handed ``group=``, the process group the
rows of a row-sharded point are split over, for such points only (Note
[Row-sharded geometries] in `stiefel.manifolds.geometry`); the table's kernels
take it.
"""
for _kernel in RETRACTIONS.values():  # polar ignores xx: its polar factor corrects X
    _kernel.takes_uncorrected = True  # type: ignore[attr-defined]
    _kernel.takes_checks = True  # type: ignore[attr-defined]

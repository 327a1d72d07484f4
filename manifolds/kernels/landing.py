r"""Kernels of the retraction-free landing method (Ablin & Peyré 2022; Ablin et al. 2024)."""

from __future__ import annotations

import torch

from .basic import eye_like, sub_product, two_products
from .frame import in_place
from .reduce import gram, rows_sum_squares

__all__ = ["landing_direction", "landing_safe_step", "landing_update"]


def landing_direction(
    x: torch.Tensor, g: torch.Tensor, attraction: float, group=None, *, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Landing field Λ = skew(GXᴴ)X + λX(XᴴX − I), d = ‖XᴴX − I‖_F, ‖Λ‖²_F, ‖skew(GXᴴ)X‖²_F.

    Args:
        x: points (..., N, M), possibly off the manifold.
        g: Euclidean gradient, same shape.
        attraction: λ > 0.
        group: the process group the rows are split over (Note [Row-sharded
            kernels] in .reduce), or None.
        rows: N, the points' row count (None: x's); pass it when ``x`` holds the
            local rows of row-sharded points, so that every rank takes the same
            path and issues the same all-reduces.

    Returns:
        Λ (shape of x), then d, ‖Λ‖² and ‖ψX‖² (shapes (..., 1, 1)).

    Note [Landing field in O(NM²)]
    skew(GXᴴ)X = ½(GXᴴX − XGᴴX), so with S = XᴴX and H = GᴴX (M×M)
    Λ = ½GS + X(λE − ½H), E = S − I: four N×M×M products and no N×N matrix. The
    first term is the relative gradient ψX (Ablin & Peyré 2022); the second is the
    gradient of N(X) = ¼‖XᴴX − I‖², pulling X to the manifold. The norm of ψX
    comes from M×M matrices only: XᴴΛ = ½HᴴS + S(λE − ½H), so
    ‖ψX‖² = ‖Λ‖² − 2λ Re tr((XᴴΛ)ᴴE) + λ² tr(ESE): three M×M×M products (6M³)
    instead of a fifth N×M×M one (2NM²) for ψX itself. That is the cheaper way
    for N > 3M only; on squarish points (O(n), and N ≤ 3M) ψX is formed first,
    its norm taken in one pass, and Λ = ψX + X(λE) accumulated on it.
    """
    m = x.shape[-1]
    s = gram(x, x, group)
    e = s - eye_like(x, m)
    h = gram(g, x, group)
    dist = torch.linalg.matrix_norm(e, keepdim=True)
    if (x.shape[-2] if rows is None else rows) <= 3 * m:
        psi = two_products(g, 0.5 * s, x, -0.5 * h, x.shape)  # ψX
        psi2 = rows_sum_squares(psi, group)
        field = sub_product(psi, x, -attraction * e, over_u=in_place())  # ψX + λXE
        return field, dist, rows_sum_squares(field, group), psi2
    c = attraction * e - 0.5 * h
    field = two_products(g, 0.5 * s, x, c, x.shape)
    a2 = rows_sum_squares(field, group)
    xf = 0.5 * (h.mH @ s) + s @ c
    cross = (xf.conj() * e).sum((-2, -1), keepdim=True).real
    ese = (e.conj() * (s @ e)).sum((-2, -1), keepdim=True).real
    psi2 = (a2 - 2 * attraction * cross + attraction**2 * ese).clamp_min(0)
    return field, dist, a2, psi2


def landing_safe_step(
    a2: torch.Tensor,
    dist: torch.Tensor,
    psi2: torch.Tensor,
    lr: float,
    attraction: float,
    eps: float,
) -> torch.Tensor:
    r"""Step size min(lr, η*) that keeps ‖XᴴX − I‖_F ≤ ε (shape (..., 1, 1)).

    Args:
        a2: ‖Λ‖²_F from `landing_direction`.
        dist: ‖XᴴX − I‖_F from `landing_direction`.
        psi2: ‖ψX‖² from `landing_direction`.
        lr: the largest step.
        attraction: λ > 0.
        eps: ε in (0, 1), the radius of the safe region.

    Returns:
        η per matrix, shape (..., 1, 1).

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
    a2 = a2.to(dist.dtype)
    tiny = torch.finfo(dist.dtype).tiny
    b = attraction * dist * (1 - dist)
    disc = (b * b + a2 * (eps - dist)).clamp_min(0)
    inside = (b + disc.sqrt()) / a2.clamp_min(tiny)
    outside = torch.minimum(
        1 / (2 * attraction * (1 + dist)), attraction * dist / psi2.to(dist.dtype).clamp_min(tiny)
    )
    eta = torch.where(dist <= eps, inside, outside)
    # lr made a tensor by arithmetic: a tensor lr is not read on the host, and a traced
    # step does not specialise on a float lr (a scalar operand of where or clamp, or
    # as_tensor's, is a constant of the graph; a sum keeps it an input)
    lr = eta.new_zeros(()) + lr
    return torch.minimum(torch.where(a2 > 0, eta, lr), lr)


def landing_update(x: torch.Tensor, field: torch.Tensor, eta) -> torch.Tensor:
    """X − η·Λ, written over Λ when autograd is off (Λ is the step's own temporary).

    One fused pass and no new N×M buffer; η is a float or a tensor (..., 1, 1).
    """
    if not in_place():
        return x - eta * field
    if not isinstance(eta, torch.Tensor):
        return torch.sub(x, field, alpha=eta, out=field)
    return torch.addcmul(x, field, eta.to(field.dtype), value=-1, out=field)

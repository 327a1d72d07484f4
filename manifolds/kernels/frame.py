r"""Steps of square points (O(n), U(n)) in the frame of X: Y = X + X(D − ½E).

For a square X every retraction used here is Y = X·Q with an n×n unitary Q
built from small n×n data (Cayley: Q = Cayley(S), Note [Square Cayley step in
the frame of X]; QR: Q = qf(B), Note [QR retraction through the Gram of
X − lr·d]). This module holds what the two share: the update of X by
D = Q − I with the drift correction folded in, the delta form of a shifted Gram,
and the replacement of the matrices whose frame path is refused.

Example:
    ```python
    import torch
    from stiefel.manifolds import kernels
    from stiefel.manifolds.kernels import frame

    x = kernels.haar(40, 40, dtype=torch.float64)
    q = kernels.haar(40, 40, dtype=torch.float64)  # any unitary Q
    y = frame.frame_update(x, q - torch.eye(40, dtype=torch.float64), x.mT @ x)
    assert float((y - x @ q).abs().max()) < 1e-12
    ```
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .basic import flat

__all__ = ["frame_update", "shifted_gram", "replace_refused", "D_MAX"]

# Note [Square steps in the frame of X]
# On O(n) and U(n) a step is Y = X·Q, Q = I + D unitary and computed from
# n×n matrices. With XᴴX = I + E, Y is formed as X + X·F with
# F = (I − ½E)(I + D) − I = D − ½E − ½E·D:
# - drift: (I − ½E) is the Newton–Schulz step of X (Note [Newton–Schulz drift
#   correction]), so Y's Gram is Qᴴ(I − ¾E² + ¼E³)Q: the error of X is not
#   carried over, only this step's rounding is added. E comes from the Gram XᴴX
#   that the optimizer's off-manifold test forms anyway; the Newton–Schulz
#   step after the retraction, which it replaces, costs two products;
# - the product E·D: without it Y's Gram is QᴴQ + ½(DᴴE + ED) + DᴴED + O(E²),
#   so the error of X is multiplied by at most ‖D‖₂ + ‖D‖₂², at most ¾ when
#   ‖D‖_F ≤ ½. Short steps (‖D‖_F ≤ ½, the usual ones) skip it; a batch with
#   a longer step pays one more product;
# - rounding: the one product acts on the small F (O(lr) for a short step),
#   so its rounding is O(eps·‖F‖), below that of storing Y; I + D and X·Q are
#   never formed (forming I + D in float32 already rounds its diagonal by
#   eps, which is the whole drift budget at n = 512).
# Measured on O(512), float32, lr = 1e-3, random gradients: ‖YᴴY − I‖_F
# stays at 6.0e-6 (QR) against 6.4e-6 for Householder QR + Newton–Schulz and
# 1.4e-5 for geoopt's Householder QR; rounding X to float32 alone gives 8e-7.
D_MAX = 0.5


@torch.compiler.disable
def frame_update(x: torch.Tensor, d: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
    """Y = X + X·((I − ½E)(I + D) − I), E = XᴴX − I (Note [Square steps in the frame of X]).

    The term −½E·D is formed only when some ‖D‖_F exceeds `D_MAX` (one host
    synchronisation).

    Args:
        x: square points (..., n, n).
        d: Q − I for the unitary Q of the step, (..., n, n) (broadcastable); it is
            overwritten.
        xx: XᴴX, (..., n, n).

    Returns:
        Y, shape of ``x``.
    """
    long = bool((torch.linalg.matrix_norm(d) > D_MAX).any())
    ed = xx @ d - d if long else None  # E·D
    # XᴴX is Hermitian: its transposed view has the layout of a LAPACK result (column
    # major), so the sum reads both operands in one order (a mixed-layout sum costs 5×)
    if d.stride(-2) == 1:
        xx = xx.mH if xx.is_complex() else xx.mT
    f = d.add_(xx, alpha=-0.5)  # written over D (the caller's temporary)
    f.diagonal(dim1=-2, dim2=-1).add_(0.5)  # D − ½E
    if ed is not None:
        f.sub_(ed, alpha=0.5)  # − ½E·D
    if x.dim() == 2:
        return torch.addmm(x, x, f)
    return torch.baddbmm(flat(x), flat(x), flat(f.expand_as(x))).reshape(x.shape)


def shifted_gram(p: torch.Tensor, gamma: torch.Tensor, skew: bool = False) -> torch.Tensor:
    r"""(γI + P)ᴴ(γI + P) = γ²I + γ(P + Pᴴ) + PᴴP, in the form that keeps its digits.

    Note [Delta form of a shifted Gram]
    A product (γI + P)ᴴ(γI + P) with a small P adds, on the diagonal, the n small
    terms |P_kj|² to γ², each addition rounded relative to γ²: measured 9.5e-6
    Frobenius error at n = 512 in float32 (7 eps per entry), which becomes the
    orthogonality error of the Q built from it. The product PᴴP of small
    entries and one addition of γ² per diagonal entry leave about 8e-7.

    Args:
        p: the small part, (..., n, n).
        gamma: the shift, shape (..., 1, 1).
        skew: P is skew-Hermitian (then P + Pᴴ = 0 is not formed).

    Returns:
        The Gram, (..., n, n).
    """
    out = p.mH @ p
    if not skew:
        out = out + gamma * (p + p.mH)
    out.diagonal(dim1=-2, dim2=-1).add_((gamma * gamma)[..., 0])
    return out


@torch.compiler.disable
def replace_refused(
    y: torch.Tensor, ok: torch.Tensor, exact: Callable[[Callable], torch.Tensor]
) -> torch.Tensor:
    """Y with the matrices where ``ok`` is False replaced by the kernel's explicit path.

    ``exact(select)`` computes the explicit path for the matrices that ``select``
    picks: ``select(t)`` maps a (..., a, b) tensor (broadcastable to the batch)
    to the refused matrices, stacked; the identity when all are refused.

    Args:
        y: the short path's results (..., N, M).
        ok: bool per matrix, broadcastable to (..., 1, 1).
        exact: computes the explicit results for the selected matrices.

    Returns:
        The results, every matrix from one path or the other.
    """
    if bool(ok.all()):
        return y
    batch = y.shape[:-2]
    if ok.numel() == 1:
        return exact(lambda t: t)
    bad = (~ok.expand(*batch, 1, 1)).reshape(-1).nonzero().squeeze(-1)

    def select(t: torch.Tensor) -> torch.Tensor:
        return t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:])[bad]

    out = y.reshape(-1, *y.shape[-2:]).clone()
    out[bad] = exact(select).to(out.dtype)
    return out.reshape(y.shape)

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
from .reduce import row_group

__all__ = ["in_frame", "frame_update", "shifted_gram", "replace_refused", "in_place", "D_MAX"]

# Note [Square steps in the frame of X]
# On O(n) and U(n) a step is Y = X·Q, Q = I + D unitary and computed from
# n×n matrices. With XᴴX = I + E, Y is formed as X + X·F with
# F = (I − ½E)(I + D) − I = D − ½E − ½E·D, i.e. Y = X̃·Q with
# X̃ = X(I − ½E) the Newton–Schulz step of X (Note [Newton–Schulz drift
# correction]): the retraction is taken at the corrected point X̃.
# - drift: Y's Gram is Qᴴ(I − ¾E² + ¼E³)Q, so the error of X is not carried
#   over, only this step's rounding is added. E comes from the Gram XᴴX that
#   the optimizer's off-manifold test forms anyway; the Newton–Schulz step
#   after the retraction, which it replaces, costs two products.
# - the product E·D is formed only for the matrices with ‖D‖_F > ½ (a batch
#   holding one pays one batched product). Without it Y's Gram is
#   QᴴQ + ½(DᴴE + ED) + DᴴED + O(E²): the error of X is multiplied by at most
#   ‖D‖₂ + ‖D‖₂² ≤ ¾ per step instead of being squared, and Y differs from
#   X̃·Q by ½X·E·D. In float32, E is rounding (~1e-6 at n = 512) and both are
#   below the step's own rounding; a point further off keeps a fraction ‖D‖ of
#   its error for one step, and the next steps take it to rounding.
# - rounding: the one product acts on the small F (O(lr) for a short step),
#   so its rounding is O(eps·‖F‖), below that of storing Y; X·Q is never
#   formed, and F's diagonal D_jj − ½(XᴴX_jj − 1) is formed from the exact
#   difference XᴴX_jj − 1 (Sterbenz). D itself carries the rounding of the
#   factorization it comes from.
# Measured on O(512), float32, lr = 1e-3, random gradients: ‖YᴴY − I‖_F
# stays at 6.0e-6 (QR) against 6.4e-6 for Householder QR + Newton–Schulz and
# 1.4e-5 for geoopt's Householder QR; rounding X to float32 alone gives 8e-7.
# The kernels write their temporaries in place (a 512×512 float32 temporary is
# a fresh 1 MiB allocation, about a tenth of a product's time) unless autograd
# records the call (`torch.is_grad_enabled()`): then every operation is out of
# place and the step is differentiable, as the tall steps are.
D_MAX = 0.5


def in_frame(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the square steps: O(n)/U(n) with every row on this rank.

    A row-sharded point (`row_group`) is not square locally; it takes the Gram
    (QR) or Woodbury (Cayley) path, whose products reduce over the ranks.
    """
    return x.shape[-2] == x.shape[-1] and row_group() is None


def in_place() -> bool:
    """Whether the kernels may write their temporaries in place (autograd is off)."""
    return not torch.is_grad_enabled()


@torch.compiler.disable
def frame_update(x: torch.Tensor, d: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:
    """Y = X + X·((I − ½E)(I + D) − I), E = XᴴX − I (Note [Square steps in the frame of X]).

    The term −½E·D is formed for the matrices with ‖D‖_F > `D_MAX` only (one
    host synchronisation to know whether any has it).

    Args:
        x: square points (..., n, n).
        d: Q − I for the unitary Q of the step, (..., n, n); a temporary of the
            caller, overwritten unless autograd is on.
        xx: XᴴX, (..., n, n).

    Returns:
        Y, of the broadcast batch shape of ``x`` and ``d``.
    """
    n = x.shape[-1]
    long = torch.linalg.matrix_norm(d, keepdim=True) > D_MAX
    ed = (xx @ d - d) * long if bool(long.any()) else None  # E·D where ‖D‖_F > ½
    d_diag = d.diagonal(dim1=-2, dim2=-1).clone()
    e_diag = xx.diagonal(dim1=-2, dim2=-1) - 1  # exact: XᴴX_jj is within 2× of 1
    # XᴴX is Hermitian: its transposed view has the layout of a LAPACK result (column
    # major), so the sum reads both operands in one order (a mixed-layout sum costs 5×)
    xx_t = xx.mH if xx.is_complex() else xx.mT
    xx_l = xx_t if d.stride(-2) == 1 and xx_t.stride(-1) == 1 else xx
    f = d.add_(xx_l, alpha=-0.5) if in_place() else torch.add(d, xx_l, alpha=-0.5)
    f.diagonal(dim1=-2, dim2=-1).copy_(d_diag - 0.5 * e_diag)  # D − ½E
    if ed is not None:
        f = f.sub_(ed, alpha=0.5) if in_place() else f - 0.5 * ed  # − ½E·D
    batch = torch.broadcast_shapes(x.shape[:-2], f.shape[:-2])
    xb = x.expand(*batch, n, n)
    if xb.dim() == 2:
        return torch.addmm(xb, xb, f)
    fb = f.expand(*batch, n, n)
    return torch.baddbmm(flat(xb), flat(xb), flat(fb)).reshape(*batch, n, n)


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

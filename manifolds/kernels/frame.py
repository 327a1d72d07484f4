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

import math
from collections.abc import Callable

import torch

from ..._core.dispatch import dispatcher
from .basic import eye_like, product_like
from .reads import host_reads_allowed
from .reduce import by_columns, flat, gram, wide_gram

__all__ = [
    "outside",
    "positive_definite",
    "in_frame",
    "frame_update",
    "wide_gram",
    "shifted_gram",
    "minus_adjoint",
    "replace_refused",
    "tall_gram",
    "in_place",
    "D_MAX",
    "E_MAX",
    "MAX_PERIOD",
    "correction_period",
    "correction_flops",
    "UNCORRECTED",
]

# Note [Square steps in the frame of X]
# On O(n) and U(n) a step is Y = X·Q, Q = I + D unitary and computed from
# n×n matrices. With XᴴX = I + E, Y is formed as X + X·F with
# F = (I − ½E)(I + D) − I = D − ½E − ½E·D, i.e. Y = X̃·Q with
# X̃ = X(I − ½E) the Newton–Schulz step of X (Note [Newton–Schulz drift
# correction]): the retraction is taken at the corrected point X̃.
# - drift: Y's Gram is Qᴴ(I − ¾E² + ¼E³)Q, so the error of X is not carried
#   over, only this step's rounding is added. The correction needs E to better
#   than X's own rounding: a float32 Gram XᴴX is off by ~eps per entry, far more
#   than E itself (~eps/√n per entry for a point rounded to float32), and
#   "corrects" X to 6.0e-6 at n = 512 (Frobenius), where storing X in float32
#   alone gives 8e-7. So E comes from the Gram formed in float64 (`wide_gram`).
# - the product E·D is formed only for the matrices with ‖D‖_F > ½ (a batch
#   holding one pays one batched product). Without it Y's Gram is
#   QᴴQ + ½(DᴴE + ED) + DᴴED + O(E²): the error of X is multiplied by at most
#   ‖D‖₂ + ‖D‖₂² ≤ ¾ per step instead of being squared, and Y differs from
#   X̃·Q by ½X·E·D. In float32, E is rounding (~1e-6 at n = 512) and both are
#   below the step's own rounding; a point further off keeps a fraction ‖D‖ of
#   its error for one step, and the next steps take it to rounding.
# - rounding: the one product acts on the small F (O(lr) for a short step),
#   so its rounding is O(eps·‖F‖), below that of storing Y; X·Q is never
#   formed. D itself carries the rounding of the factorization it comes from.
# The kernels write their temporaries in place (each n×n temporary would be a
# fresh allocation, 1 MiB at n = 512 in float32, per step) unless autograd
# records the call (`torch.is_grad_enabled()`): then every operation is out of
# place and the step is differentiable, as the tall steps are.
#
# Note [The drift correction every k-th step]
# Between two corrections, Y = X + X·D keeps the error of X (Gram Qᴴ(I + E)Q)
# and adds the rounding of storing Y: a random walk, measured 8.6e-7·√k after
# k steps on O(512) in float32, with no systematic part once the QR step's
# columns are normalized (Note [Unit columns of the square QR factor]). A
# wide Gram is n³ multiply-adds in float64, whose GEMM rate is below float32's,
# more than the rest of a short step's extra work.
# So the optimizer forms it, tests the point (Note [Off-manifold points at a
# step]) and corrects it every k-th step only (k = `correction_period`(n)), and
# after any change it did not make (the parameter's version counter); the steps
# in between pass `xx=UNCORRECTED` and cost XᴴG, the n×n factorization and X·F.
# Measured, ‖XᴴX − I‖_F after 1000 float32 steps (lr = 1e-3, unit-normal
# gradients), correcting every k-th step with a float64 Gram:
#   n = 512:  k = 1: 8.3e-7, k = 4: 1.7e-6, k = 8: 2.3e-6 (a float32 Gram at
#             every step: 5.6e-6; none: 4.8e-4, the QR columns' bias);
#   n = 1024: k = 1: 1.2e-6, k = 4: 2.4e-6, k = 8: 3.4e-6.
# Note [The correction period grows with n]
# The drift only grows while the point moves (a step that rounds Y back to X
# adds nothing), so the measure is the matrices still moving: the worst of a
# batch, or any point trained on noisy gradients. A step that corrects every
# time with a float32 Gram (as pogo-torch's POGO step does) stays at that Gram's
# rounding instead, which grows with n (pogo-torch measured, 1000 steps,
# lr = 1e-2, loss ‖X − T‖²: 1.2e-6 at n = 64, 2.2e-6 at 128, 4.2e-6 at 256,
# 6.3e-6 at 512). Ours against it, the worst matrix of a batch of 64 (1024
# for O(64) gave the same), float64 Gram every k-th step:
#   O(64):  k = 1: 0.27×, 2: 0.37×, 4: 0.72×, 8: 1.57×;
#   O(128): k = 1: 0.20×, 2: 0.26×, 4: 0.48×, 8: 1.07×.
# So the ratio about doubles with k (on a smooth trajectory consecutive steps
# round alike, and the growth between corrections is faster than the √k of a
# random walk, which noisy gradients show) and falls by a third when n doubles:
# the same margin needs k ∝ n^0.6. The period is √n/2 as a power of two between 1 and `MAX_PERIOD`:
# 4 at n = 64 and 128, 8 from n = 256 (0.72× predicted there, and below for a
# larger n); single points, which have stopped moving at step 1000, stay 2.5–5×
# below pogo-torch at k = 8 for n = 64 … 512. From n = 256 on, k = 8 forms the
# Gram half as often as k = 4 (what that saves in time, measured:
# docs/performance.md, "Measurements behind code choices").
# A correcting step also tests the point (its Gram gives ‖XᴴX − I‖ for M×M
# work), read with the step's flags: a point changed behind the optimizer's
# back in place (through `.data`, which has a version counter of its own) is
# projected at the next correcting step, at most k − 1 steps later, and stepped
# until then as X·Q, which keeps its distance ‖E‖ up to the step's own error
# (Note [A correction only inside its basin]).
#
# Note [Tall steps correct every k-th step]
# A tall step (St(N, M), N > M, or a row-sharded point) needs XᴴX in its M×M
# algebra (the Cholesky factor of the QR step, the Woodbury system and the
# Newton–Schulz factor (3I − XᴴX)/2 folded into the Cayley update), and that
# Gram is also its drift correction. Formed in float32 at every step, as
# pogo-torch forms its own, it corrects X only to the Gram's rounding, which is
# above X's: each entry of the product sums N terms near X's columns' norms.
# So a tall step takes the same schedule as a square one: the float64 Gram of
# `wide_gram` every k-th step (k = `correction_period`(M), the same on every
# rank of a row-sharded point), rounded to X's dtype (its off-diagonal entries
# keep their digits, its diagonal is 1 + e to float32's half ulp), and XᴴX = I
# on the steps in between (`UNCORRECTED`), whose error is the random walk of
# storing Y, as above. A step between corrections forms no Gram of X: one
# N×M×M product fewer. A step that does not know its count (a traced step:
# reading the count is a graph break) forms the Gram in X's dtype at every
# step, the correction tall steps had before this schedule.
# Measured, the worst ‖XᴴX − I‖_F of 512 × St(64, 16) after 1000 float32 steps
# (lr = 1e-2, loss ‖X − T‖² towards points T of St), against pogo-torch's SGD on
# the same points, two seeds: a float32 Gram at every step: QR 1.11–1.40×; the
# float64 Gram every k-th step, k = 2: QR 0.74–0.84×, Cayley 0.29–0.31×,
# `radam` 0.37–0.38× (against pogo-torch's VectorAdam); k = 4: QR 0.76–0.82×,
# Cayley 0.29–0.36×. QR applying the correction exactly instead (X(I − ½E)
# formed by one more product, then XᴴX = I) reached 0.31–0.34×, at one more
# N×M×M product and N×M matrix per correction. Points that move fast (a target
# off the manifold, steps of ‖lr·G‖_F ≈ 0.6) random-walk further between
# corrections: 1.05–1.55× the float32 Gram at every step, both near 2√M·eps.
D_MAX = 0.5
E_MAX = 1.0
MAX_PERIOD = 8  # the longest correction_period (Note [The correction period grows with n])


def correction_period(n: int) -> int:
    """Steps between two drift corrections of a point with n columns (O(n), or St(N, n)
    by Note [Tall steps correct every k-th step]): √n/2 as a power of two in
    [1, `MAX_PERIOD`] (Note [The correction period grows with n])."""
    k = 1
    while 2 * k <= MAX_PERIOD and 16 * k * k <= n:  # 2k ≤ √n/2
        k *= 2
    return k


def correction_flops(n: int, m: int) -> float:
    """FLOPs per step of the float64 XᴴX of an N×M point formed every k-th step, 2NM²/k
    (k = `correction_period`(M)), counted at the float32 rate like every product."""
    return 2.0 * n * m * m / correction_period(m)


# Note [Traced steps compute both paths]
# A kernel that picks a path per matrix from a tensor test (the short frame
# path or the explicit one, the E·D term or not) reads the test on the host
# once and computes only what is needed. Under torch.compile a host read is a
# graph break (and a synchronisation on a GPU), so a traced kernel computes
# both and selects per matrix with torch.where: the numbers are the eager
# ones (each matrix takes the same path; a term multiplied by its zero mask
# adds exactly zero), at the cost of the path not taken.


class _Uncorrected:
    """The type of `UNCORRECTED` (one instance, a readable repr)."""

    def __repr__(self) -> str:
        return "UNCORRECTED"


UNCORRECTED = _Uncorrected()
"""``xx=UNCORRECTED``: X is on the manifold to rounding; skip the drift correction.

Note [The drift correction every k-th step]; the square steps then take
Y = X + X·D, the tall steps XᴴX = I (Note [Tall steps correct every k-th step]).
"""


def tall_gram(x: torch.Tensor, xx, group=None) -> torch.Tensor:
    """XᴴX in X's dtype for the step of a tall kernel, from the caller's ``xx``.

    ``xx`` None: formed here (in X's dtype); `UNCORRECTED`: I; a wider Gram
    (`wide_gram`): rounded to X's dtype; a Gram in X's dtype: ``xx`` itself
    (Note [Tall steps correct every k-th step]).

    Args:
        x: points (..., N, M).
        xx: None, `UNCORRECTED` or a Gram (..., M, M).
        group: the process group the rows are split over, or None.

    Returns:
        XᴴX, (..., M, M), in X's dtype.
    """
    if xx is None:
        return gram(x, x, group)
    if xx is UNCORRECTED:
        m = x.shape[-1]
        return eye_like(x, m).expand(*x.shape[:-2], m, m)
    return xx.to(x.dtype)


def in_frame(x: torch.Tensor, group=None) -> bool:
    """Whether ``x`` takes the square steps: O(n)/U(n) with every row on this rank.

    A row-sharded point (its rows split over ``group``, not None) is not square
    locally; it takes the Gram (QR) or Woodbury (Cayley) path, whose products
    reduce over the ranks.
    """
    return x.shape[-2] == x.shape[-1] and group is None


def in_place() -> bool:
    """Whether the kernels may write their temporaries in place (autograd off, not traced).

    Note [No hand-made buffer reuse in a traced step]
    Writing a step's result over its own temporary (``out=``, ``addcmul_``) saves an
    N×M buffer in eager mode. A compiler plans its buffers itself, and Dynamo does
    not trace ``out=`` into a non-contiguous tensor (a column-major gradient gives
    one): the graph breaks there, and a step compiled across that break can write one
    weight's new value into the others of its bucket. Traced kernels write new tensors.
    """
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def frame_update(x: torch.Tensor, d: torch.Tensor, xx) -> torch.Tensor:
    """Y = X + X·((I − ½E)(I + D) − I), E = XᴴX − I (Note [Square steps in the frame of X]).

    The term −½E·D counts for the matrices with ‖D‖_F > `D_MAX` only: it is
    formed for every matrix and zeroed where not needed, the same numbers without
    a host read (Note [Traced steps compute both paths]); it is one n×n product of
    a correcting step only (every k-th). With ``xx=UNCORRECTED``
    E is taken as 0: Y = X + X·D.

    Args:
        x: square points (..., n, n).
        d: Q − I for the unitary Q of the step, (..., n, n); a temporary of the
            caller, overwritten unless autograd is on.
        xx: XᴴX, (..., n, n), in x's dtype or a wider one (`wide_gram`), or
            `UNCORRECTED`.

    Returns:
        Y, of the broadcast batch shape of ``x`` and ``d``.
    """
    if xx is UNCORRECTED:
        f = d
    else:
        # E = XᴴX − I in the Gram's precision, then rounded to d's dtype: its entries
        # are small, so rounding them keeps their relative digits. E is Hermitian, so
        # of XᴴX and its adjoint view the one stored like D is copied (D − ½E reads
        # both operands in one order: a sum of two layouts costs 2.5–5×)
        xx_l = (xx.mH if xx.is_complex() else xx.mT) if by_columns(d) != by_columns(xx) else xx
        e = xx_l.to(d.dtype, copy=True)  # a fresh tensor either way: E is written below
        e.diagonal(dim1=-2, dim2=-1).copy_(xx.diagonal(dim1=-2, dim2=-1) - 1)
        # Note [A correction only inside its basin]
        # X(I − ½E) maps E to −¾E² + ¼E³: a correction while ‖E‖₂ < 1, a divergence
        # beyond (a weight scaled by 3 gives a factor −3I). The optimizer projects
        # a point that far off before stepping it (its test is read at every
        # correcting step; a step that reads nothing projects by torch.where
        # first), but this kernel is public and may be handed one directly. So E
        # is applied where ‖E‖_F < `E_MAX` = 1 (then ‖E‖₂ < 1, where
        # every eigenvalue e of E maps to e²(¼e − ¾), smaller in modulus) and taken
        # as 0 elsewhere: such a point is stepped as X·Q, which keeps its distance.
        inside = torch.linalg.matrix_norm(e, keepdim=True) < E_MAX
        e = e.mul_(inside) if in_place() else e * inside
        long = torch.linalg.matrix_norm(d, keepdim=True) > D_MAX
        ed = (e @ d) * long  # E·D where ‖D‖_F > ½ (Note [Traced steps compute both paths])
        f = d.sub_(e, alpha=0.5) if in_place() else torch.sub(d, e, alpha=0.5)  # D − ½E
        f = f.sub_(ed, alpha=0.5) if in_place() else f - 0.5 * ed  # − ½E·D
    # X·F, then one addition: a fused X + X·F (addmm) adds each k-block's partial
    # product into the stored X, rounding its large entries once per block
    # (measured 1.4e-6 against 0.9e-6 of drift per uncorrected step on O(512)).
    # X·F is formed in X's layout, so that the sum reads both in one order; a batch
    # of F broader than X's takes the plain product, of the broadcast batch shape
    xf = product_like(x, f) if f.shape[:-2] == x.shape[:-2] else x @ f
    return xf.add_(x) if in_place() else x + xf


@dispatcher(
    "minus_adjoint",
    paths=("plain", "transposed_copy"),
    why="transposed_copy: Aᵀ copied by torch's blocked transpose, 2x (n = 512) to 4.5x "
    "(n = 1024) the strided plain difference on the CPU (one thread)",
)
def minus_adjoint_path(a: torch.Tensor) -> str:
    """The path of `minus_adjoint`: the blocked copy for real n ≥ 512 outside autograd."""
    if a.shape[-1] < 512 or a.is_complex() or not in_place():
        return "plain"
    return "transposed_copy"


def minus_adjoint(a: torch.Tensor) -> torch.Tensor:
    """A − Aᴴ, exactly skew-Hermitian, in a fresh tensor.

    torch's elementwise kernels read a transposed operand with a stride of n,
    a cache miss per entry once A outgrows the cache; from n = 512 (real,
    outside autograd) Aᵀ is first copied by torch's blocked transpose and
    subtracted from contiguously. Below that both operands fit in cache and the
    plain form is kept (timings: docs/performance.md, "Measurements behind code
    choices").
    """
    if minus_adjoint_path(a) == "plain":
        return a - a.mH
    t = a.mT.contiguous()
    return torch.sub(a, t, out=t)


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


def replace_refused(
    y: torch.Tensor,
    ok: torch.Tensor | bool,
    exact: Callable[[Callable], torch.Tensor],
    checks: list | None = None,
    reads: bool = True,
) -> torch.Tensor:
    """Y with the matrices where ``ok`` is False replaced by the kernel's explicit path.

    ``exact(select)`` computes the explicit path for the matrices that ``select``
    picks: ``select(t)`` maps a (..., a, b) tensor (broadcastable to the batch)
    to the refused matrices, stacked; the identity when all are refused.

    Note [Refused matrices in a step that reads nothing]
    Which matrices to replace is a host read (the explicit path runs on the refused
    ones only). A caller that reads its flags once for the whole step (the
    optimizer, Note [One host read per step] in `stiefel.optimizers.engine`) passes
    ``checks``: ``ok.all()`` is appended there, unread, and Y is returned as the
    short path left it; where the flag turns out False the caller takes the step
    again without ``checks``, which replaces the refused matrices here. A traced
    step (no read at all) computes both paths and selects by ``torch.where``.

    Args:
        y: the short path's results (..., N, M).
        ok: bool per matrix, broadcastable to (..., 1, 1); ``True``: every matrix
            (the caller has tested it already).
        exact: computes the explicit results for the selected matrices.
        checks: where ``ok.all()`` is appended instead of read, or None.
        reads: False for a step that must read nothing (an optimizer's ``capturable``
            step): both paths, chosen by ``torch.where``, as when traced.

    Returns:
        The results, every matrix from one path or the other.
    """
    if ok is True:
        return y
    if checks is not None:  # Note [Refused matrices in a step that reads nothing]
        checks.append(ok.all())
        return y
    if not host_reads_allowed(reads):  # Note [Traced steps compute both paths]
        return torch.where(ok, y, exact(lambda t: t).to(y.dtype))
    if bool(ok.all()):
        return y
    batch = y.shape[:-2]
    if ok.numel() == 1:
        return exact(lambda t: t)
    bad = (~ok.expand(*batch, 1, 1)).reshape(-1).nonzero().squeeze(-1)

    def select(t: torch.Tensor) -> torch.Tensor:
        return flat(t.expand(*batch, *t.shape[-2:]))[bad]

    out = flat(y).clone()
    out[bad] = exact(select).to(out.dtype)
    return out.reshape(y.shape)


def outside(xx: torch.Tensor, bound: float) -> torch.Tensor:
    """Whether the points of Grams XᴴX (..., M, M) are beyond ``bound``, a flag per matrix.

    Note [Off-manifold points at a step] in `stiefel.manifolds.geometry`: below 1,
    ‖E‖_F > bound with E = XᴴX − I; from 1 on (a wide basin), rank-deficient or
    ‖E‖₂ ≥ bound (∞: the rank alone): XᴴX or (1 + bound)I − XᴴX not positive
    definite, by the infos of Cholesky factorizations (E > −1 from the first is E > −b).
    """
    if bound < 1:
        # ‖XᴴX − I‖²_F = ‖XᴴX‖²_F − 2 tr(XᴴX) + M: no identity matrix; the rounding of
        # the difference (~M·eps) is far below bound² (only the test uses it)
        tr = xx.diagonal(dim1=-2, dim2=-1).real.sum(-1)
        return torch.linalg.matrix_norm(xx) ** 2 - 2 * tr + xx.shape[-1] > bound**2
    if bound == math.inf:
        return ~positive_definite(xx)
    eye = torch.eye(xx.shape[-1], dtype=xx.dtype, device=xx.device)
    return ~positive_definite(xx, (1 + bound) * eye - xx)


def positive_definite(*hermitian: torch.Tensor) -> torch.Tensor:
    """Whether every one of the Hermitian (..., M, M) matrices is positive definite, per batch
    entry: the infos of one batched Cholesky factorization (on the device, no host read)."""
    return (torch.linalg.cholesky_ex(torch.stack(hermitian)).info == 0).all(0)

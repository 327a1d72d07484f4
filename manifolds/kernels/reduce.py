r"""The one place where a kernel sums over the rows of St(N, M): Gram products and norms.

Every kernel of this package writes a product contracted over the N rows
(XᴴX, XᴴG, PdᴴPd, ...) as `gram`, and a sum or maximum of an N×M matrix as
`rows_sum` / `rows_amax`. With ``group=None`` they are the plain operations.
Given the process group the rows are split over (``group=``, the ``Shard(0)``
layout of FSDP2, handed down by `stiefel.manifolds.sharded.ShardedGeometry`
through every kernel that reaches them), they run on the local rows: each
computes the local M×M (or (..., 1, 1)) result and all-reduces it over
``group``, while every
N-sized update (X·K, Pd·Z, ...) stays local. So one formula per kernel serves
both, and a sharded step communicates M×M-sized reductions only, never the
N×M matrix.

Note [Row-sharded kernels]
A product contracted over the rows splits over the ranks' row blocks,
XᴴG = Σ_r X_rᴴG_r, and so do Frobenius sums and maxima; everything else a
kernel does is either row-local (X_r·K, elementwise maps) or M×M (solves,
Cholesky, eigh, computed redundantly and identically on every rank from the
same all-reduced inputs). The factorizations of an N×M matrix are rewritten
through its Gram: QR as Cholesky-QR2 and the polar factor as X(XᴴX)^{-1/2}.

Example:
    ```python
    import torch
    from stiefel.manifolds.kernels import reduce

    x = torch.randn(50, 4, dtype=torch.float64)
    assert torch.allclose(reduce.gram(x, x), x.T @ x)  # no group: the plain product
    ```
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..._core.dispatch import dispatcher

__all__ = [
    "abs_square",
    "wide_gram",
    "gram",
    "product",
    "rows_sum",
    "rows_sum_squares",
    "columns_defect",
    "rows_amax",
    "rows_absmax",
    "memory_order",
    "by_columns",
]


def flat(t: torch.Tensor) -> torch.Tensor:
    """View a (..., a, b) tensor as (batch, a, b) for ``bmm``/``baddbmm`` (itself if it is).

    The batch is counted, not inferred: a shard of zero rows (a rank of a row-sharded
    point that holds none) has no elements, from which -1 could not be inferred.
    """
    return t if t.dim() == 3 else t.reshape(math.prod(t.shape[:-2]), *t.shape[-2:])


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        t = t.contiguous()
        dist.all_reduce(t, op=op, group=group)
    return t


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·b: one ``bmm`` (``mm``) when both are 3-D with one batch (2-D), else ``a @ b``.

    ``torch.matmul`` broadcasts every batched operand (an expand and a view each, and
    a view of the result) before its ``bmm``; the kernels' products of equal batches
    skip those ops, which a step over many parameters pays in host time.
    """
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]:
        return torch.bmm(a, b)
    if a.dim() == 2 and b.dim() == 2:
        return torch.mm(a, b)
    return a @ b


def gram(a: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
    """aᴴb, the product contracted over the rows: shape (..., a.shape[-1], b.shape[-1]).

    Args:
        a: matrices (..., N, K), the local rows when ``group`` is given.
        b: matrices (..., N, L), the same rows.
        group: the process group the rows are split over, or None (plain tensors).
    """
    return _all_reduce(product(a.mH, b), dist.ReduceOp.SUM, group)


#: entries of X widened to float64 at a time by `wide_gram` (2 MiB in float64)
WIDE_CHUNK = 1 << 18


@dispatcher(
    "wide_gram",
    paths=("whole", "chunks"),
    why="chunks: the float64 copy widened by cache-sized pieces, about 2x the whole copy's "
    "product on the CPU at 4096 × St(64, 16) and St(65536, 64) (one thread)",
)
def wide_gram_path(x: torch.Tensor) -> str:
    """Whether `wide_gram` widens X by chunks (Note [The wide Gram by chunks])."""
    wide = torch.promote_types(x.dtype, torch.float64)
    whole = wide == x.dtype or x.numel() <= WIDE_CHUNK or x.device.type != "cpu"
    whole = whole or torch.compiler.is_compiling()
    return "whole" if whole or (torch.is_grad_enabled() and x.requires_grad) else "chunks"


def wide_gram(x: torch.Tensor, group=None) -> torch.Tensor:
    """XᴴX in float64 (complex128) for a lower-precision X, in X's dtype otherwise.

    The Gram of the drift correction (Note [Square steps in the frame of X] in
    `stiefel.manifolds.kernels.frame`), summed over all rows like `gram`.

    Note [The wide Gram by chunks]
    A float64 copy of the whole of X (32 MiB for a batch of 4096 × St(64, 16) or
    one St(65536, 64)) is a fresh buffer, written once, whose pages the system
    maps at the first write, and which the float64 product then reads back from
    memory. Widened and multiplied by chunks of `WIDE_CHUNK` entries (whole
    matrices of a batch, or row blocks of one tall matrix, whose Grams add up),
    each copy is still in cache when its product reads it. The same products
    summed in float64: the same Gram to float64 rounding. Outside autograd and
    tracing only (the in-place sums record no graph; a traced loop is unrolled),
    and on the CPU only: a GPU's caching allocator hands back memory already
    mapped, and a chunk there is two kernel launches for a copy the whole-X form
    makes in one (as for `skew_from_raw`, Note [Skew part by copies]).
    """
    wide = torch.promote_types(x.dtype, torch.float64)
    n, m = x.shape[-2:]
    if wide_gram_path(x) == "whole":
        xw = x.to(wide)
        return gram(xw, xw, group)
    xf = flat(x)
    mats, rows = max(1, WIDE_CHUNK // (n * m)), min(n, max(1, WIDE_CHUNK // m))
    out = torch.zeros((xf.shape[0], m, m), dtype=wide, device=x.device)
    for i in range(0, xf.shape[0], mats):
        for j in range(0, n, rows):
            xw = xf[i : i + mats, j : j + rows].to(wide)
            out[i : i + mats].baddbmm_(xw.mH, xw)
    return _all_reduce(out.reshape(*x.shape[:-2], m, m), dist.ReduceOp.SUM, group)


def abs_square(t: torch.Tensor) -> torch.Tensor:
    """|t_ij|² entrywise, real: re² + im² of a complex t, t² of a real one.

    Note [|v|² as a sum of squares]
    ``t.abs().square()`` has the same values, but |z| has no derivative at z = 0 and
    autograd's second derivative of |z|² taken through it is wrong there, where
    re² + im² is a polynomial: a Hessian-vector product through complex CWY
    coordinates holding exact zeros (as `orthogonalize` writes them) would be off.
    """
    if not t.is_complex():
        return t.square()
    return torch.view_as_real(t.resolve_conj()).square().sum(-1)  # one pass, a conj view too


def rows_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Σ over the last two dimensions of an N×M tensor, shape (..., 1, 1), over ``group``."""
    return _all_reduce(t.sum(dim=(-2, -1), keepdim=True), dist.ReduceOp.SUM, group)


def rows_sum_squares(t: torch.Tensor, group=None) -> torch.Tensor:
    """‖t‖²_F over the last two dimensions (shape (..., 1, 1)), real.

    Note [Sum of squares by row norms]
    ``(t * t).sum()`` writes an N×M temporary and reads it back. A
    ``vector_norm`` over both dimensions reduces without it, but accumulates
    each lane sequentially in the input's precision: a relative error that grows
    with N·M (1e-4 in float32 at 4·10⁶ entries). The norm of each row (M terms)
    is exact to M·eps, and the N squared row norms are summed by torch's
    pairwise sum: one pass over t, an N-sized temporary, the accuracy of the
    plain sum. Matrices stored by columns are reduced by columns instead (a norm
    along a strided dimension reads memory out of order, several times slower);
    a column's norm (N terms) is torch's vectorized reduction, exact to about
    2·10⁻⁶ at N = 10⁶ in float32.
    """
    if by_columns(t):
        t = t.mT  # the same entries in memory order
    rows = torch.linalg.vector_norm(t, dim=-1).square()
    return rows_sum(rows.unsqueeze(-1), group)


def columns_defect(t: torch.Tensor, near: torch.Tensor, group=None) -> torch.Tensor:
    r"""‖t_j‖² − 1 for every column j, shape (..., M), real, summed over all rows.

    Args:
        t: matrices (..., N, M) (the local rows when ``group`` is given).
        near: ‖t_j‖² to any accuracy, shape (..., M) (the diagonal of a float32 tᴴt).
        group: the process group the rows are split over, or None.

    Note [The Gram's diagonal from offset squares]
    The diagonal of a Gram XᴴX in float32 carries the rounding of the product's
    running sums, which near a point of St are close to 1: about 1e-7 per entry
    (measured on 64×16 and 64×64 blocks, stored either way), ten times the
    drift E = XᴴX − I of a point rounded to float32 (about 1e-8 per diagonal
    entry). A correction M(I − λE) built on it moves the point by that rounding
    at every step. Summed as Σ_k (x_kj² − c_j) + n·c_j over the n local rows, with
    c_j = ``near``/N near the column's mean square (N taken as n times the ranks
    the rows are split over; the rounding of c_j cancels exactly, since n·c_j is
    formed in float64, so any c_j near it will do), every term is small and the
    float32 sum keeps E's digits: about 1e-8 per entry on the same blocks, the
    rounding of the squares themselves. The off-diagonal entries of a float32
    product are sums of terms of both signs whose running sums stay small:
    about 1e-8 per entry already. One fused pass writes the N×M terms, one sums them.
    """
    n = t.shape[-2]
    rows = n * (dist.get_world_size(group) if group is not None else 1)  # N, or about it
    near = near.real if near.is_complex() else near
    # squares past the dtype's range make ``near`` inf, or NaN where a complex product
    # forms inf − inf (cuBLAS does): offset by 0 there, and the plain sum of squares
    # says inf as an off-manifold test must see it (NaN only where t holds NaN)
    c = torch.nan_to_num(near, nan=0.0, posinf=0.0, neginf=0.0).div(max(rows, 1)).unsqueeze(-2)
    if t.is_complex():
        terms = torch.addcmul(-c, t.real, t.real).addcmul_(t.imag, t.imag)
    else:
        terms = torch.addcmul(-c, t, t)
    local = terms.sum(dim=-2).double() + n * c.squeeze(-2).double()
    return (_all_reduce(local, dist.ReduceOp.SUM, group) - 1).to(c.dtype)


def absmax_from(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max |t| from min t and max t: max(−lo, hi), NaN where either is NaN."""
    return torch.maximum(lo.neg(), hi)


def rows_amax(t: torch.Tensor, group=None) -> torch.Tensor:
    """max over the last two dimensions of a non-negative N×M tensor, shape (..., 1, 1).

    A rank may hold no rows (uneven sharding): its maximum is 0.
    """
    if t.shape[-2] * t.shape[-1] == 0:
        local = t.new_zeros((*t.shape[:-2], 1, 1))
    else:
        local = t.amax(dim=(-2, -1), keepdim=True)
    return _all_reduce(local, dist.ReduceOp.MAX, group)


def by_columns(t: torch.Tensor) -> bool:
    """Whether each matrix of ``t`` is stored by columns (and not also by rows).

    Such a batch (QR's Q, and every gradient, state or copy that keeps its layout)
    is read in memory order as ``t.mT``.
    """
    return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1


def memory_order(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its dimensions permuted into memory order: contiguous whenever t is dense.

    Note [Reductions over all entries in memory order]
    A reduction over every entry (``aminmax(t)``) makes a contiguous copy of a
    tensor that is not contiguous, even when its entries fill one block of memory
    in another order: a batch of matrices stored by columns (points from
    ``torch.linalg.qr``, and every gradient and state ``*_like`` them) paid a copy
    of its size per finiteness test. The permutation that sorts the strides is
    contiguous exactly for such a tensor, and the value of the reduction does not
    depend on the order of the entries.
    """
    if t.is_contiguous() or torch.compiler.is_compiling():  # a traced step: any order
        return t
    if t.dim() >= 2 and t.mT.is_contiguous():  # matrices by columns: the common case
        return t.mT
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]), reverse=True)
    dense = t.permute(order)
    return dense if dense.is_contiguous() else t


def rows_absmax(t: torch.Tensor, group=None) -> torch.Tensor:
    """max |t| over the last two dimensions (shape (..., 1, 1)), like ``rows_amax(t.abs())``.

    A real tensor is reduced by ``amax`` and ``amin`` with no |t| copy (one
    pass fewer than ``abs().amax()``; torch's ``aminmax`` along dimensions is
    slower than the two), a single matrix by one ``aminmax`` of all its entries
    (one pass for both); a complex one takes its moduli. Timings:
    docs/performance.md, "Measurements behind code choices".
    """
    if t.is_complex() or t.shape[-2] * t.shape[-1] == 0:
        return rows_amax(t.abs(), group)
    if t.dim() == 2:  # one pass for both (along dimensions aminmax is the slower form)
        lo, hi = torch.aminmax(memory_order(t))  # no copy of a column-major matrix
        return _all_reduce(absmax_from(lo, hi).reshape(1, 1), dist.ReduceOp.MAX, group)
    if by_columns(t):  # the same entries in memory order (Note [Reductions over all
        t = t.mT  # entries in memory order])
    hi = t.amax(dim=(-2, -1), keepdim=True)
    lo = t.amin(dim=(-2, -1), keepdim=True)
    return _all_reduce(absmax_from(lo, hi), dist.ReduceOp.MAX, group)

r"""The Cayley transform's solve, 2(I + A)⁻¹B − B, by elimination without pivoting.

``cayley_solve(a, b, path)`` returns Q·B = (I + A)⁻¹(I − A)·B for skew-Hermitian A (Note
[Cayley transform by one solve]) by one of three eliminations of M = I + A, named by
the ``cayley_map`` dispatcher (`stiefel.parametrizations.kernels`): ``"solve"``,
``torch.linalg.solve`` (partial pivoting, the reference), or, while ‖A‖₁ is known to be
small (`unpivoted`, Note [Elimination without pivoting for I + A]), elimination without
pivoting: ``"unpivoted_blocks"`` by blocks of matrix products, ``"unpivoted_lu"`` by
torch's own unpivoted LU (Note [Unpivoted LU by device type]). The unpivoted ones have
their own backward: one solve with Mᴴ from the forward's factors and one product.

Note [Elimination without pivoting for I + A]
M = I + A has Hermitian part ½(M + Mᴴ) = I: M is positive real. Every Schur
complement that block elimination meets is, by the quotient property, the Schur
complement of a leading block M₁₁ = I + A₁₁ of M; with M₁₂ = A₁₂, M₂₁ = −A₁₂ᴴ,

    S = M₂₂ − M₂₁M₁₁⁻¹M₁₂ = I + A₂₂ + A₁₂ᴴ M₁₁⁻¹ A₁₂,

and the Hermitian part of M₁₁⁻¹ is M₁₁⁻¹(½(M₁₁ + M₁₁ᴴ))M₁₁⁻ᴴ = M₁₁⁻¹M₁₁⁻ᴴ, positive
definite, so S has Hermitian part ⪰ I, and so has every principal block of S.
Hence (i) elimination without pivoting never meets a singular pivot block, and
(ii) every pivot block D satisfies ‖D⁻¹‖₂ ≤ 1 (xᴴDx has real part ≥ ‖x‖², so
‖Dx‖ ≥ ‖x‖): its inverse, formed explicitly by LAPACK (partial pivoting inside the
block), is as well conditioned as D itself. This is Gaussian elimination on a matrix
with positive definite Hermitian part H and skew part K, stable without pivoting in the
sense of Golub & Van Loan (1979; Higham, *Accuracy and Stability*, §10.4): ‖|L||U|‖ is
bounded by a multiple of n‖H + KᴴH⁻¹K‖₂, here n(1 + ‖A‖₂²). The growth is bounded, but
by ‖A‖₂² where partial pivoting has ‖A‖₂, and the errors of Q grow like ‖A‖₂²·eps
instead of ‖A‖₂·eps (measured at n = 256 and 1024 on random, rank-two and graded skew A:
both within a few tens of eps up to ‖A‖₂ = 10, the unpivoted one up to ~0.3‖A‖₂²·eps
beyond). So the unpivoted elimination is used only while ‖A‖₁ ≤ `UNPIVOTED_PER_ROOT`·√n
(‖A‖₂ ≤ ‖A‖₁ for skew-Hermitian A), where 0.3‖A‖₂² ≤ 5n: within the 10·n·eps every map
is held to, and no more than the pivoted solve's own error at the top of its range
(‖A‖₁ = 4n, Note [Where the eigh path starts]). ‖A‖₁ is the value that choice already reads
(one host synchronisation); where it is not read (``vmap``, meta, a caller's
``spectral=False``) or is above the limit, and for n ≤ `BLOCK`, the pivoted solve runs.

Why not the other forms: ``torch.linalg.lu_factor(pivot=False)`` exists on CUDA only
(and is used there: Note [Unpivoted LU by device type]);
a Cholesky factorisation of MᴴM = I + AᴴA squares the condition number; the pivoted
solve spends its time in LAPACK's panel factorisation and triangular solves, where
this elimination is matrix products of n×`BLOCK` panels (flops: n³·2/3 for the
factors, 2n²m for the solve with m columns, as for LU with partial pivoting).

Layout of the factors: one n×n tensor F (per batch entry) holds the block unit lower
factor L below the diagonal blocks, the block upper factor U above them, and on the
diagonal the inverses D⁻¹ of U's diagonal blocks (the pivot blocks), of size `BLOCK`.

Note [Unpivoted LU by device type]
On CUDA the same elimination is torch's own: ``lu_factor_ex(pivot=False)`` (it exists
there alone) and ``lu_solve``, with the backward written out as for the blocks (one
adjoint solve from the forward's factors and one product). The stability argument above
is that of any elimination without pivoting of a matrix with Hermitian part I, so the
range `UNPIVOTED_PER_ROOT`·√n holds for it too. The block elimination is a loop of
n/`BLOCK` small inversions and products, each a separate launch on a GPU, where
torch's unpivoted LU is a few large kernels; which one runs where is the
``cayley_map`` dispatcher's policy (`benchmarks.cayley_solve` measures either against
the pivoted solve).

Example:
    ```python
    import torch
    from stiefel.parametrizations._cayley import cayley_solve, unpivoted

    x = torch.randn(300, 300, dtype=torch.float64) / 300
    a = x - x.mT
    b = torch.randn(300, 4, dtype=torch.float64)
    eye = torch.eye(300, dtype=torch.float64)
    ref = torch.linalg.solve(eye + a, (eye - a) @ b)
    assert unpivoted(300, float(torch.linalg.matrix_norm(a, ord=1)))
    assert torch.allclose(cayley_solve(a, b, "unpivoted_blocks"), ref, atol=1e-12)
    assert torch.allclose(cayley_solve(a, b), ref, atol=1e-12)
    ```
"""

from __future__ import annotations

import math

import torch

from .._core import checks as _checks
from .._core.autocast import backward_autocast_off
from .._core.first_order import first_order

__all__ = ["BLOCK", "UNPIVOTED_PER_ROOT", "PATHS", "unpivoted", "cayley_solve"]

#: the size of the pivot blocks; orders n ≤ BLOCK take the pivoted solve
BLOCK = 128
#: ‖A‖₁ ≤ UNPIVOTED_PER_ROOT·√n takes the unpivoted elimination
UNPIVOTED_PER_ROOT = 4.0
#: the eliminations `cayley_solve` takes by name, the pivoted one first
PATHS = ("solve", "unpivoted_blocks", "unpivoted_lu")


def unpivoted(n: int, norm: float | None) -> bool:
    """Whether (I + A)X = B is solved without pivoting, from n and ‖A‖₁ (None: unknown)."""
    return n > BLOCK and norm is not None and norm <= UNPIVOTED_PER_ROOT * math.sqrt(n)


def _blocks(n: int) -> list[tuple[int, int]]:
    return [(j, min(j + BLOCK, n)) for j in range(0, n, BLOCK)]


def _factors(m: torch.Tensor, torch_lu: bool) -> tuple[torch.Tensor, ...]:
    """Factors of M = I + A (b, n, n) without pivoting; M may be overwritten."""
    if torch_lu:
        lu, pivots, _ = torch.linalg.lu_factor_ex(m, pivot=False)
        return lu, pivots
    return (_factor(m),)


def _solve_with(
    factors: tuple[torch.Tensor, ...], x: torch.Tensor, adjoint: bool = False
) -> torch.Tensor:
    """M⁻¹X (or M⁻ᴴX) from `_factors`, on a (b, n, m) tensor that it may overwrite."""
    if len(factors) == 2:  # torch's LU and its pivots
        return torch.linalg.lu_solve(*factors, x, adjoint=adjoint)
    return _solve(factors[0], x, adjoint)


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a @ b into the scratch ``out``; a new tensor under torch.func, whose batching
    rules take no ``out=`` (vmap of the backward: jacrev)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if wrapped(a) or wrapped(b):
        return torch.bmm(a, b)
    return torch.bmm(a, b, out=out)


def _factor(f: torch.Tensor) -> torch.Tensor:
    """Block LU of a (b, n, n) tensor in place (layout in the module's Note)."""
    n = f.shape[-1]
    work = f.new_empty(f.shape[0] * n * BLOCK)  # products land here, then in their place
    for j0, j1 in _blocks(n):
        d = f[:, j0:j1, j0:j1]
        d.copy_(torch.linalg.inv_ex(d).inverse)
        if j1 < n:
            col = f[:, j1:, j0:j1]
            scaled = work[: col.numel()].view(col.shape)
            col.copy_(_bmm(col, d, scaled))  # L's block column S₂₁D⁻¹
            f[:, j1:, j1:].baddbmm_(col, f[:, j0:j1, j1:], alpha=-1)  # the Schur complement
    return f


def _solve(f: torch.Tensor, x: torch.Tensor, adjoint: bool = False) -> torch.Tensor:
    """M⁻¹X (or M⁻ᴴX) in place on a (b, n, m) tensor, from the factors F = (L, D⁻¹, U)."""
    blocks = _blocks(f.shape[-1])
    work = x.new_empty(x.shape[0] * BLOCK * x.shape[-1])

    def inverse_times(j0: int, j1: int) -> torch.Tensor:  # x_j ← D_j⁻¹x_j (or D_j⁻ᴴx_j)
        xj, dinv = x[:, j0:j1], f[:, j0:j1, j0:j1]
        out = work[: xj.numel()].view(xj.shape)
        return xj.copy_(_bmm(dinv.mH if adjoint else dinv, xj, out))

    if not adjoint:  # M⁻¹ = U⁻¹L⁻¹, each block column applied once (right-looking)
        for j0, j1 in blocks:
            if j1 < x.shape[-2]:
                x[:, j1:].baddbmm_(f[:, j1:, j0:j1], x[:, j0:j1], alpha=-1)
        for j0, j1 in reversed(blocks):
            xj = inverse_times(j0, j1)
            if j0:
                x[:, :j0].baddbmm_(f[:, :j0, j0:j1], xj, alpha=-1)
        return x
    for j0, j1 in blocks:  # M⁻ᴴ = L⁻ᴴU⁻ᴴ: Uᴴ is block lower with diagonal blocks D⁻ᴴ
        xj = inverse_times(j0, j1)
        if j1 < x.shape[-2]:
            x[:, j1:].baddbmm_(f[:, j0:j1, j1:].mH, xj, alpha=-1)
    for j0, j1 in reversed(blocks):  # Lᴴ: unit block upper
        if j0:
            x[:, :j0].baddbmm_(f[:, j0:j1, :j0].mH, x[:, j0:j1], alpha=-1)
    return x


class _UnpivotedCayleySolve(torch.autograd.Function):
    r"""Q·B = 2X − B with X = (I + A)⁻¹B; backward Ā = −2WXᴴ, B̄ = 2W − G, W = (I + A)⁻ᴴG.

    From dX = −M⁻¹(dA)X: ⟨G, dQ⟩ = ⟨G, −2M⁻¹(dA)X⟩ = ⟨−2M⁻ᴴGXᴴ, dA⟩, and
    ⟨G, 2M⁻¹dB − dB⟩ = ⟨2M⁻ᴴG − G, dB⟩ (Re tr(XᴴY) throughout). The forward solves
    with 2B (2X = Q + B, no pass of its own) and writes Q over it; the backward forms
    2X = Q + B again.
    """

    # torch.func's form (Note [Saved intermediates as outputs]): the factors are
    # outputs marked non-differentiable, saved in setup_context. Under vmap the
    # mapped dimension joins the batch the elimination already runs over; the
    # backward, under vmap in jacrev, updates only its own (batched) right-hand side.

    @staticmethod
    def vmap(info, in_dims, a: torch.Tensor, b: torch.Tensor, torch_lu: bool):  # type: ignore[override]
        def front(t: torch.Tensor, dim: int | None) -> torch.Tensor:
            return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)

        q, *factors = _UnpivotedCayleySolve.apply(
            front(a, in_dims[0]), front(b, in_dims[1]), torch_lu
        )
        # each factor is per matrix of the joined batch: (B·k, …) read as (B, k, …)
        factors = [f.view(info.batch_size, -1, *f.shape[1:]) for f in factors]
        return (q, *factors), (0,) * (1 + len(factors))

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor, torch_lu: bool):  # type: ignore[override]
        n, m = b.shape[-2:]
        f = a.reshape(-1, n, n).clone(memory_format=torch.contiguous_format)
        f.diagonal(dim1=-2, dim2=-1).add_(1)
        factors = _factors(f, torch_lu)
        flat = b.reshape(-1, n, m)
        q = _solve_with(factors, torch.mul(flat, 2)).sub_(flat)
        return (q.view(b.shape), *factors)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        _, b, _ = inputs
        q, *factors = output
        ctx.mark_non_differentiable(*factors)
        ctx.set_materialize_grads(False)
        n, m = b.shape[-2:]
        ctx.save_for_backward(q.reshape(-1, n, m), b.reshape(-1, n, m), *factors)

    @staticmethod
    @first_order("the unpivoted Cayley solve of the cayley maps")
    @backward_autocast_off  # Note [Autocast off for the maps' own products]
    def backward(ctx, g: torch.Tensor | None, *_):  # type: ignore[override]
        if g is None:
            return None, None, None
        q, b, *factors = ctx.saved_tensors
        w = _solve_with(
            tuple(factors), g.reshape(q.shape).clone(memory_format=torch.contiguous_format), True
        )
        ga = gb = None
        if ctx.needs_input_grad[0]:
            n = q.shape[-2]
            ga = torch.bmm(w, (q + b).mH).neg_().view(*g.shape[:-2], n, n)
        if ctx.needs_input_grad[1]:
            gb = (2 * w).sub_(g.reshape(q.shape)).view(g.shape)
        return ga, gb, None


def cayley_solve(a: torch.Tensor, b: torch.Tensor, path: str = "solve") -> torch.Tensor:
    r"""2(I + A)⁻¹B − B = (I + A)⁻¹(I − A)B for skew-Hermitian A (…, n, n) and B (…, n, m).

    Args:
        a: skew-Hermitian, real or complex; broadcast with ``b``'s batch.
        b: the right-hand side, same dtype.
        path: the elimination, one of `PATHS`: ``"solve"`` for any A; the unpivoted
            ones only where `unpivoted` holds for ‖A‖₁ (Note [Elimination without
            pivoting for I + A]), ``"unpivoted_lu"`` on CUDA only.

    Returns:
        Q·B, of the broadcast batch and ``b``'s last two sizes.

    Raises:
        ValueError: ``path`` is not one of `PATHS`.
    """
    _checks.choice("path", path, PATHS)
    n = a.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    rhs = b.expand(*batch, *b.shape[-2:])  # a 2-D B must not read as a batch of vectors
    if path != "solve" and rhs.numel():
        torch_lu = path == "unpivoted_lu"
        return _UnpivotedCayleySolve.apply(a.expand(*batch, n, n), rhs, torch_lu)[0]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    # I + A is never singular: the _ex form skips the error check (a host synchronisation)
    return 2 * torch.linalg.solve_ex(eye + a, rhs).result - rhs

r"""Pure tensor kernels of the maps onto O(n), U(n) and St(N, M).

Plain functions of plain tensors (leading batch dimensions allowed, real or
complex), with no argument checking, separate from the ``nn.Module`` classes
that use them, so they can be tested, benchmarked and compiled alone.

Notation: the reflection H(v) = I − 2vvᴴ/‖v‖²; V = [v₁ … v_L] of shape
(…, n, L); U = V with normalised columns; d a vector of m signs (real) or
phases (complex) and E_d = [diag(d); 0] of shape (n, m). Every reflection map
here is Q = H(v₁)⋯H(v_L)·E_d, which lies on St(n, m) (O(n) or U(n) if m = n).

Example:
    ```python
    import torch
    from stiefel.parametrizations import kernels

    v = torch.randn(6, 6, dtype=torch.float64)
    q = kernels.cwy_matrix(v)
    assert torch.allclose(q, kernels.householder_matrix(v))
    assert torch.allclose(q.mT @ q, torch.eye(6, dtype=torch.float64))
    ```
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._core.dispatch import dispatcher
from ._cayley import cayley_solve, unpivoted
from ._expm import expm
from ._householder import householder_apply, wy_triangle
from ._spectral import LazyNorm, skew_spectral, spectral_for
from ._traced import skew_map

__all__ = [
    "normalize_columns",
    "cwy_triangle",
    "wy_triangle",
    "embed_diagonal",
    "cwy_matrix",
    "tcwy_matrix",
    "cwy_linear",
    "householder_apply",
    "cwy_factors",
    "cwy_linear_factored",
    "cwy_operator",
    "householder_matrix",
    "householder_linear",
    "skew_from_raw",
    "raw_from_skew",
    "exp_map",
    "cayley_map",
    "scaled_cayley_map",
    "skew_from_raw_path",
    "exp_path",
    "cayley_path",
]


def normalize_columns(v: torch.Tensor) -> torch.Tensor:
    """U = V with every column divided by its Euclidean norm.

    The norms are the column sums of |v|²: a sum over the rows of a row-major
    matrix adds whole contiguous rows at a time, where ``vector_norm`` along
    dimension −2 walks each column with a stride (the same values to rounding).
    """
    sq = v.abs().square() if v.is_complex() else v.square()
    return v / sq.sum(-2, keepdim=True).sqrt()


def cwy_triangle(u: torch.Tensor) -> torch.Tensor:
    r"""S = ½I + striu(UᴴU) for unit columns U (CWY paper, Theorem 2)."""
    eye = torch.eye(u.shape[-1], dtype=u.dtype, device=u.device)
    return torch.triu(u.mH @ u, 1) + 0.5 * eye


def embed_diagonal(d: torch.Tensor | None, n: int, m: int, like: torch.Tensor) -> torch.Tensor:
    """E_d = [diag(d); 0] of shape (…, n, m); [I; 0] when ``d`` is None."""
    if d is None:
        return torch.eye(n, m, dtype=like.dtype, device=like.device)
    e = torch.diag_embed(d.to(like.dtype))  # one pass over the m×m zeros, not eye times d
    return e if n == m else torch.nn.functional.pad(e, (0, 0, 0, n - m))


def cwy_matrix(
    v: torch.Tensor, d: torch.Tensor | None = None, m: int | None = None
) -> torch.Tensor:
    r"""Q = (I − U S⁻¹ Uᴴ) E_d through a triangular solve, shape (…, n, m).

    Note [Truncated CWY never forms n×n]
    (I − US⁻¹Uᴴ)E_d = E_d − U S⁻¹ (U₁ᴴ diag(d)) with U₁ the first m rows of U
    (CWY paper, Theorem 3; the diagonal d generalises its [I; 0]). The cost is
    O(nL² + L²m + nLm); no n×n matrix appears when m < n. S is upper
    triangular with diagonal ½, so the solve is a back substitution and never
    fails. With m = n this is the compact WY form of the square map.
    """
    n = v.shape[-2]
    m = n if m is None else m
    u = normalize_columns(v)
    # −U₁ᴴ diag(d): the sign rides on the small right-hand side, so that Q is the
    # product U·W with d added to its diagonal (no n×m E_d and no subtraction pass)
    rhs = u[..., :m, :].mH
    rhs = -rhs if d is None else rhs * d.neg().unsqueeze(-2).to(rhs.dtype)
    w = torch.linalg.solve_triangular(cwy_triangle(u), rhs, upper=True)
    q = u @ w
    diag = q.diagonal(dim1=-2, dim2=-1)
    diag.add_(1 if d is None else d.to(q.dtype))
    return q


def tcwy_matrix(v: torch.Tensor, m: int, d: torch.Tensor | None = None) -> torch.Tensor:
    r"""T-CWY γ(V) = [I; 0] − U S⁻¹ U₁ᴴ on St(n, m) (with phases: E_d − U S⁻¹ U₁ᴴ diag(d)).

    Example:
        ```python
        import torch
        from stiefel.parametrizations.kernels import tcwy_matrix

        q = tcwy_matrix(torch.randn(100, 4, dtype=torch.float64), 4)
        assert q.shape == (100, 4)
        assert torch.allclose(q.mT @ q, torch.eye(4, dtype=torch.float64))
        ```
    """
    return cwy_matrix(v, d, m)


def cwy_factors(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""(U, S): the column-normalised reflection vectors and S = ½I + striu(UᴴU).

    These are all the per-weight work of the operator form; computing them once
    per rollout and calling `cwy_linear_factored` at every step costs
    O(nL) per vector instead of O(nL²) (Note [Factors once per rollout]).
    """
    u = normalize_columns(v)
    return u, cwy_triangle(u)


def cwy_linear_factored(
    u: torch.Tensor,
    s: torch.Tensor,
    x: torch.Tensor,
    d: torch.Tensor | None = None,
    transposed: bool = False,
) -> torch.Tensor:
    r"""``F.linear(x, W)`` for W = (I − US⁻¹Uᴴ)E_d (or Wᵀ), given ``(U, S) = cwy_factors(V)``.

    Note [Operator form in row layout]
    ``F.linear`` computes x Wᵀ for rows x. For W = Q (n×m), x ∈ (…, m):
    x Qᵀ = [x·d, 0] − ((x·d) Ū₁) S⁻ᵀ Uᵀ, with (x·d)Ū₁ = x (U₁ᴴ diag d)ᵀ.
    For W = Qᵀ (m×n), x ∈ (…, n): x Q = (x − (x U) S⁻¹ Uᴴ) E_d, of which
    only the first m columns are needed. Both are O(nL) per row plus one L×L
    triangular solve shared by all rows (CWY paper §3.1: u = Uᴴh, S⁻¹u, h − U·).
    """
    n = u.shape[-2]
    if not transposed:
        m = x.shape[-1]
        xd = x if d is None else x * d.unsqueeze(-2).to(x.dtype)
        c = xd @ u[..., :m, :].conj()
        w = torch.linalg.solve_triangular(s.mT, c, upper=False, left=False)
        pad = torch.nn.functional.pad(xd, (0, n - m))
        return pad - w @ u.mT
    m = n if d is None else d.shape[-1]
    w = torch.linalg.solve_triangular(s, x @ u, upper=True, left=False)
    y = x[..., :m] - w @ u[..., :m, :].mH
    return y if d is None else y * d.unsqueeze(-2).to(y.dtype)


def cwy_operator(
    u: torch.Tensor,
    s: torch.Tensor,
    d: torch.Tensor | None = None,
    transposed: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""x ↦ ``cwy_linear_factored(u, s, x, d, transposed)`` with S⁻¹ folded in once.

    Note [Operator with S⁻¹ folded in]
    Applied to many vectors (a rollout), the triangular solve is moved off the
    per-step path: A = diag(d) Ū₁ S⁻ᵀ (m×L) or B = U S⁻¹ (n×L) is formed once,
    O(nL²), by the same backward-stable triangular solve, and each step is
    then x ↦ x·d − (x A) Uᵀ (or x₁·d − (x B) U₁ᴴ diag d): two thin products, no
    per-step solve, slice or pad. With batch 1 the per-step cost is dominated
    by the number of autograd nodes, which this keeps to three.
    """
    n = u.shape[-2]
    m = n if d is None else d.shape[-1]
    dd = None if d is None else d.to(u.dtype)
    drow = None if dd is None else dd.unsqueeze(-2)  # formed once, not per step
    if not transposed:
        lhs = u[..., :m, :].conj()
        if dd is not None:
            lhs = lhs * dd.unsqueeze(-1)
        a = torch.linalg.solve_triangular(s.mT, lhs, upper=False, left=False)
        ut = u.mT

        def apply(x: torch.Tensor) -> torch.Tensor:
            xd = x if drow is None else x * drow
            if m < n:
                xd = torch.nn.functional.pad(xd, (0, n - m))
            return xd - (x @ a) @ ut

        return apply
    b = torch.linalg.solve_triangular(s, u, upper=True, left=False)
    uh = u[..., :m, :].mH
    if drow is not None:
        uh = uh * drow

    def apply_t(x: torch.Tensor) -> torch.Tensor:
        x1 = x[..., :m] if m < n else x
        x1 = x1 if drow is None else x1 * drow
        return x1 - (x @ b) @ uh

    return apply_t


def cwy_linear(
    v: torch.Tensor, x: torch.Tensor, d: torch.Tensor | None = None, transposed: bool = False
) -> torch.Tensor:
    r"""``F.linear(x, W)`` for W = (I − US⁻¹Uᴴ)E_d (or Wᵀ if ``transposed``), W never formed.

    One call: the factors of `cwy_factors` are recomputed (O(nL²)); a
    rollout should compute them once and call `cwy_linear_factored`.
    """
    u, s = cwy_factors(v)
    return cwy_linear_factored(u, s, x, d, transposed)


def householder_matrix(
    v: torch.Tensor, d: torch.Tensor | None = None, m: int | None = None, block: int | None = None
) -> torch.Tensor:
    r"""Q = H(v₁)⋯H(v_L) E_d by reflections applied one block after another (custom backward)."""
    n = v.shape[-2]
    m = n if m is None else m
    return householder_apply(v, embed_diagonal(d, n, m, v), block)


def householder_linear(
    v: torch.Tensor,
    x: torch.Tensor,
    d: torch.Tensor | None = None,
    transposed: bool = False,
    block: int | None = None,
) -> torch.Tensor:
    r"""``F.linear(x, W)`` for W = H(v₁)⋯H(v_L)E_d (or its transpose), W never formed.

    Note [Transpose of a product of reflections]
    H(v)ᵀ = H(v̄), so (H(v₁)⋯H(v_L))ᵀ = H(v̄_L)⋯H(v̄₁): the transposed operator
    is the same kernel on the conjugated vectors in reverse order.
    """
    n = v.shape[-2]
    if not transposed:
        m = x.shape[-1]
        xd = x if d is None else x * d.unsqueeze(-2).to(x.dtype)
        pad = torch.nn.functional.pad(xd, (0, n - m))
        return householder_apply(v, pad.mT, block).mT
    m = n if d is None else d.shape[-1]
    y = householder_apply(v.conj().flip(-1), x.mT, block).mT[..., :m]
    return y if d is None else y * d.unsqueeze(-2).to(y.dtype)


# --------------------------------------------------------------------------- skew matrices
_PANEL = 128  # columns of the lower triangle written at a time by `_skew`
#: the order from which `skew_from_raw` writes by panels on the CPU
PANELS_FROM = 1024


@dispatcher(
    "skew_from_raw",
    paths=("formula", "panels"),
    why="panels: the CPU from n = PANELS_FROM, where the formula's transposed read "
    "walks across cache lines (Note [Skew part by copies])",
)
def skew_from_raw_path(x: torch.Tensor) -> str:
    """``"panels"`` (`_SkewFromRaw`) on the CPU for n ≥ `PANELS_FROM`, else ``"formula"``.

    Traced by ``torch.compile``, the formula (Inductor writes its own loops, and
    Dynamo does not trace a Function with a ``jvp``); off the CPU too: the panels are
    a CPU cache's matter, and on a GPU the loop is four kernel launches per panel
    where the formula takes two in all.
    """
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return "formula"
    return "panels" if x.shape[-1] >= PANELS_FROM else "formula"


def _skew(x: torch.Tensor) -> torch.Tensor:
    """X ↦ X₊ − X₊ᴴ (+ i·Im diag X), transposed by panels (Note [Skew part by copies])."""
    a = torch.triu(x, 1)
    n = a.shape[-1]
    for j0 in range(0, n, _PANEL):
        j1 = min(j0 + _PANEL, n)
        a[..., j1:, j0:j1].copy_(a[..., j0:j1, j1:].mH).neg_()
        block = a[..., j0:j1, j0:j1]
        block.sub_(block.mH.contiguous())
    if x.is_complex():
        a.diagonal(dim1=-2, dim2=-1).copy_(1j * x.diagonal(dim1=-2, dim2=-1).imag)
    return a


def _skew_adjoint(g: torch.Tensor) -> torch.Tensor:
    """G ↦ triu(G − Gᴴ, 1) (+ i·Im diag G): the adjoint of `_skew` under Re tr(XᴴY)."""
    x = torch.triu(g.sub(g.mH.contiguous()), 1)
    if g.is_complex():
        x.diagonal(dim1=-2, dim2=-1).copy_(1j * g.diagonal(dim1=-2, dim2=-1).imag)
    return x


class _SkewFromRaw(torch.autograd.Function):
    r"""`skew_from_raw` with its adjoint written out (Note [Skew part by copies]).

    Note [Skew part by copies]
    X₊ − X₊ᴴ read as an elementwise op on a transposed view walks one operand
    across rows, a cache line per element, once the matrix no longer fits in the
    cache. The forward writes the lower triangle one panel of `_PANEL` columns at a
    time, from the transpose of a row panel that fits in cache; the backward makes
    one blocked copy of Gᴴ (``.contiguous()``), after which every pass runs along
    memory. Autograd would form the gradient the strided way (G + (−G)ᴴ accumulated
    into one tensor), so the backward is the adjoint written the same way:
    ⟨G, X₊ − X₊ᴴ⟩ = ⟨G − Gᴴ, X₊⟩ gives triu(G − Gᴴ, 1), and the diagonal i·Im xⱼⱼ
    (complex) has adjoint i·Im gⱼⱼ. The map is linear, so its tangent (forward mode)
    is the map itself. Below `PANELS_FROM` the matrix is cache-sized and the panels'
    extra passes cost more than they save, so the formula stays there.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _skew(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _skew_adjoint(g)

    @staticmethod
    def jvp(ctx, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _skew(t)


def skew_from_raw(x: torch.Tensor) -> torch.Tensor:
    r"""The skew-Hermitian A = X₊ − X₊ᴴ (+ i·Im diag X if complex), X₊ the strict upper triangle.

    Only the strict upper triangle (and, for complex X, the imaginary part of
    the diagonal) is read, so A has exactly dim 𝔬(n) or 𝔲(n) free parameters.
    The path is `skew_from_raw_path`'s: the formula, or by panels (Note [Skew part
    by copies]); the same values.
    """
    if skew_from_raw_path(x) == "panels":
        return _SkewFromRaw.apply(x)
    a = torch.triu(x, 1)
    a = a - a.mH
    if x.is_complex():
        a = a + torch.diag_embed(1j * torch.diagonal(x, dim1=-2, dim2=-1).imag)
    return a


def raw_from_skew(a: torch.Tensor) -> torch.Tensor:
    """Right inverse of `skew_from_raw`: the upper triangle of A, imaginary diagonal."""
    x = torch.triu(a, 1)
    if a.is_complex():
        x = x + torch.diag_embed(1j * torch.diagonal(a, dim1=-2, dim2=-1).imag)
    return x


def _eye(a: torch.Tensor) -> torch.Tensor:
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)


# --------------------------------------------------------------------------- exp and Cayley
@dispatcher(
    "exp_map",
    paths=("matrix_exp", "traced", "eigh", "pade", "pade_cholesky"),
    why="traced: under torch.compile, no graph break at the read of ‖A‖₁; eigh: large "
    "‖A‖₁, where the squarings lose orthogonality; pade: the adjoint-Fréchet backward "
    "(forward+backward on the CPU); pade_cholesky: the same on CUDA, where LU runs "
    "below the product rate (docs/performance.md, The exponential on the GPU)",
)
def exp_path(a: torch.Tensor, norm: LazyNorm) -> str:
    r"""The path of exp(A) for a skew-Hermitian A (`exp_map`); ``norm``: `LazyNorm` (A).

    - ``"traced"`` under ``torch.compile``: one custom operator (Note [Skew maps
      under torch.compile]); ‖A‖₁ is not read here.
    - ``"matrix_exp"`` where ‖A‖₁ has no value to read (``torch.func.vmap``, meta,
      empty): torch's own kernel, the reference.
    - ``"eigh"`` for large ‖A‖₁ (Note [Large skew-Hermitian matrices go through eigh]).
    - ``"pade_cholesky"`` on CUDA, ``"pade"`` elsewhere: `_expm.expm`, its degree by
      ‖A‖₁ and the solve of Note [The Padé solve of a skew-Hermitian A by device type].
    """
    if torch.compiler.is_compiling():
        return "traced"
    value = norm()
    if value is None:
        return "matrix_exp"
    if spectral_for(a.shape[-1], value):
        return "eigh"
    return "pade_cholesky" if a.device.type == "cuda" else "pade"


def _exp(a: torch.Tensor, path: str, norm: LazyNorm) -> torch.Tensor:
    """exp(A) by ``path`` (`exp_path`)."""
    if path == "traced":
        return skew_map(a, "exp")
    if path == "matrix_exp":
        return torch.linalg.matrix_exp(a)
    if path == "eigh":
        return skew_spectral(a, "exp")
    return expm(a, skew_norm=norm(), cholesky=path == "pade_cholesky")


def eager_exp(a: torch.Tensor) -> torch.Tensor:
    """exp(A) of a skew-Hermitian A by the dispatcher's eager choice (`_traced` runs it)."""
    norm = LazyNorm(a)
    return _exp(a, exp_path(a, norm), norm)


#: the orders from which the Cayley solve eliminates without pivoting, on the CPU (by
#: blocks) and on CUDA (torch's LU): below them the pivoted solve is as fast or faster
UNPIVOTED_BLOCKS_FROM = 256
UNPIVOTED_LU_FROM = 1024


@dispatcher(
    "cayley_map",
    paths=("solve", "traced", "eigh", "unpivoted_blocks", "unpivoted_lu"),
    why="traced: under torch.compile, no graph break at the read of ‖A‖₁; eigh: large "
    "‖A‖₁, where cond(I + A) costs orthogonality; unpivoted_blocks: the CPU from "
    "n = UNPIVOTED_BLOCKS_FROM; unpivoted_lu: CUDA from n = UNPIVOTED_LU_FROM "
    "(docs/performance.md, The Cayley map's solve on the GPU)",
)
def cayley_path(a: torch.Tensor, norm: LazyNorm, spectral: bool | None = None) -> str:
    r"""The path of (I + A)⁻¹(I − A)·B for a skew-Hermitian A (`cayley_map`, `scaled_cayley_map`).

    ``norm``: `LazyNorm` (A); ``spectral``: the caller's choice of the ``eigh`` path
    (True, False) without a read of ‖A‖₁, or None.

    - ``"traced"`` under ``torch.compile`` when ``spectral`` is None (Note [Skew maps
      under torch.compile]).
    - ``"eigh"`` when ``spectral`` is True or ‖A‖₁ is large (Note [Large
      skew-Hermitian matrices go through eigh]).
    - Elimination without pivoting where ‖A‖₁ was read and is small (`_cayley.unpivoted`,
      Note [Elimination without pivoting for I + A]): ``"unpivoted_blocks"`` on the
      CPU from n = `UNPIVOTED_BLOCKS_FROM`, ``"unpivoted_lu"`` on CUDA from n =
      `UNPIVOTED_LU_FROM` (Note [Unpivoted LU by device type]).
    - ``"solve"`` otherwise (``spectral=False``, ``vmap``, other devices), the reference.
    """
    if spectral is not None:
        return "eigh" if spectral else "solve"
    if torch.compiler.is_compiling():
        return "traced"
    n, value = a.shape[-1], norm()
    if spectral_for(n, value):
        return "eigh"
    if unpivoted(n, value):
        if a.device.type == "cpu" and n >= UNPIVOTED_BLOCKS_FROM:
            return "unpivoted_blocks"
        if a.device.type == "cuda" and n >= UNPIVOTED_LU_FROM:
            return "unpivoted_lu"
    return "solve"


def _cayley_full(a: torch.Tensor, spectral: bool | None) -> tuple[torch.Tensor | None, str]:
    """(Q, path) where the path forms the n×n Q (traced, eigh), else (None, path): a solve."""
    path = cayley_path(a, LazyNorm(a), spectral)
    if path == "traced":
        return skew_map(a, "cayley"), path
    if path == "eigh":
        return skew_spectral(a, "cayley"), path
    return None, path


def eager_cayley(a: torch.Tensor) -> torch.Tensor:
    """(I + A)⁻¹(I − A) by the dispatcher's eager choice (`_traced` runs it)."""
    q, path = _cayley_full(a, None)
    return q if q is not None else cayley_solve(a, _eye(a), path)


def exp_map(a: torch.Tensor, base: torch.Tensor, m: int | None = None) -> torch.Tensor:
    r"""Q = (B·expm(A))[:, :m] for skew-Hermitian A (O(n³)); B carries the determinant.

    A must be skew-Hermitian (exactly, as `skew_from_raw` makes it, or to rounding):
    every path reads it as such (Note [The Padé solve of a skew-Hermitian A by device
    type]; the ``eigh`` path reads its skew part only). The path is `exp_path`'s: Padé
    of degree 3 to 13 by ‖A‖₁ and the dtype, scaling and squaring beyond, and the
    adjoint-Fréchet backward (`_expm.expm`); ``eigh`` when ‖A‖₁ is large, where the
    squarings would lose orthogonality (Note [Large skew-Hermitian matrices go through
    eigh]); ``torch.linalg.matrix_exp`` where ‖A‖₁ cannot be read (``torch.func.vmap``)
    and under ``stiefel.kernels.policy(reference=True)``.
    """
    m = a.shape[-1] if m is None else m
    norm = LazyNorm(a)  # the one host read: the path, then expm's degree
    return base @ _exp(a, exp_path(a, norm), norm)[..., :m]


def cayley_map(
    a: torch.Tensor, base: torch.Tensor | None = None, *, spectral: bool | None = None
) -> torch.Tensor:
    r"""Q = (I + A)⁻¹(I − A)·B for skew-Hermitian A and B of shape (…, n, m), by one solve.

    Without ``base``, Q = (I + A)⁻¹(I − A) itself (no product by an identity).
    With it, the operator form: B is any block of vectors and Q is never formed.

    Note [Cayley transform by one solve]
    (I + A)⁻¹(I − A) = (I + A)⁻¹(2I − (I + A)) = 2(I + A)⁻¹ − I, so
    Q·B = 2(I + A)⁻¹B − B: one solve with the m columns of B, neither I − A
    nor a product formed. The solve's error is cond(I + A)·eps relative to
    ‖(I + A)⁻¹B‖ ≤ ‖B‖ (the eigenvalues of I + A are 1 + iλ), as for the
    textbook form. The elimination is `cayley_path`'s: without pivoting where
    ‖A‖₁ is small, LU with partial pivoting otherwise (`_cayley.cayley_solve`, Note
    [Elimination without pivoting for I + A]).

    I + A is invertible for skew-Hermitian A (its eigenvalues are 1 + iλ). When
    ‖A‖₁ is large, cond(I + A) ≈ ‖A‖₂ would cost orthogonality, and the transform
    goes through ``eigh`` (Note [Large skew-Hermitian matrices go through eigh]).
    ``spectral`` says which path to take when the caller knows it (e.g. from a
    bound on ‖A‖₁ computed once per parameter version), so that no host
    synchronisation reads ‖A‖₁ (``spectral=False`` then solves with pivoting);
    None reads ‖A‖₁ here.
    """
    q, path = _cayley_full(a, spectral)
    if q is not None:
        return q if base is None else q @ base
    return cayley_solve(a, _eye(a) if base is None else base, path)


def scaled_cayley_map(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    r"""W = ((I + A)⁻¹(I − A) D)[:, :m] with D = diag(d), d of length m ≤ n (scoRNN / scuRNN).

    W = 2(I + A)⁻¹E_d − E_d with E_d = [diag(d); 0] (Note [Cayley transform by one
    solve]); the path as in `cayley_map`.
    """
    n, m = a.shape[-1], d.shape[-1]
    q, path = _cayley_full(a, None)
    if q is not None:
        return q[..., :m] * d.unsqueeze(-2).to(a.dtype)
    return cayley_solve(a, embed_diagonal(d, n, m, a), path)

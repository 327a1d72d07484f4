r"""Products of Householder reflections in compact WY form: the reflection maps' kernels.

Notation: the reflection H(v) = I − 2vvᴴ/‖v‖²; V = [v₁ … v_L] of shape
(…, n, L); U = V with normalised columns; d a vector of m signs (real) or
phases (complex) and E_d = [diag(d); 0] of shape (n, m). Every map here is
Q = H(v₁)⋯H(v_L)·E_d, which lies on St(n, m) (O(n) or U(n) if m = n): formed
(`cwy_matrix`, `tcwy_matrix`, `householder_matrix`) or applied to a block of
vectors without forming it (`cwy_linear`, `cwy_operator`, `householder_linear`).
Plain functions of plain tensors, no argument checking; the public face is
`stiefel.parametrizations.kernels`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..manifolds.kernels.reduce import abs_square
from ._householder import householder_apply

__all__ = [
    "normalize_columns",
    "cwy_triangle",
    "embed_diagonal",
    "cwy_matrix",
    "unit_cwy_matrix",
    "tcwy_matrix",
    "cwy_factors",
    "cwy_linear_factored",
    "cwy_operator",
    "cwy_linear",
    "householder_matrix",
    "householder_linear",
]


def normalize_columns(v: torch.Tensor) -> torch.Tensor:
    """U = V with every column divided by its Euclidean norm.

    The norms are the column sums of |v|²: a sum over the rows of a row-major
    matrix adds whole contiguous rows at a time, where ``vector_norm`` along
    dimension −2 walks each column with a stride (the same values to rounding).
    """
    # Note [|v|² as a sum of squares]
    return v / abs_square(v).sum(-2, keepdim=True).sqrt()


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
    return unit_cwy_matrix(normalize_columns(v), d, m)


def unit_cwy_matrix(
    u: torch.Tensor, d: torch.Tensor | None = None, m: int | None = None
) -> torch.Tensor:
    r"""`cwy_matrix` of columns U normalised already (unit, or zero: no reflection)."""
    n = u.shape[-2]
    m = n if m is None else m
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

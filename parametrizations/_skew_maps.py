r"""exp(A) and the Cayley transform (I + A)⁻¹(I − A) of a skew-Hermitian A, with their dispatchers.

`exp_path` and `cayley_path` choose each map's named path (Padé, ``eigh``, a solve
with or without pivoting, the traced operator under ``torch.compile``, torch's
reference); `exp_map`, `cayley_map` and `scaled_cayley_map` run it. Plain
functions of plain tensors; the public face is `stiefel.parametrizations.kernels`.
"""

from __future__ import annotations

import torch

from .._core.dispatch import dispatcher
from ._cayley import cayley_solve, unpivoted
from ._cwy import embed_diagonal
from ._expm import expm
from ._spectral import LazyNorm, skew_spectral, spectral_for
from ._traced import skew_map

__all__ = [
    "UNPIVOTED_BLOCKS_FROM",
    "UNPIVOTED_LU_FROM",
    "exp_path",
    "cayley_path",
    "eager_exp",
    "eager_cayley",
    "exp_map",
    "cayley_map",
    "scaled_cayley_map",
]


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

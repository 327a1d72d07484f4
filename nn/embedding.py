r"""The real embedding of U(n) in O(2n) and its inverse (Householder paper, §3)."""

from __future__ import annotations

import torch

__all__ = ["real_embedding", "complex_from_real"]


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"dtype {x.dtype}, shape {tuple(x.shape)}"
    return type(x).__name__


def real_embedding(u: torch.Tensor) -> torch.Tensor:
    r"""Û = [[Re U, −Im U], [Im U, Re U]]: U(n) → O(2n) (St(n, m) → St(2n, 2m)).

    A complex linear map z ↦ Uz acts on [Re z; Im z] as Û, and ÛᵀÛ =
    real_embedding(UᴴU), so a unitary U gives an orthogonal Û
    (Mhammedi et al. 2017, §3). A unitary RNN is therefore an orthogonal RNN
    of twice the width with this block structure.

    Args:
        u: complex tensor (…, n, m).

    Returns:
        Real tensor (…, 2n, 2m) of the matching real dtype.

    Raises:
        TypeError: if ``u`` is not a complex tensor.

    Example:
        ```python
        import torch
        from stiefel.nn import real_embedding

        u = torch.linalg.qr(torch.randn(3, 3, dtype=torch.complex128))[0]
        q = real_embedding(u)
        assert torch.allclose(q.T @ q, torch.eye(6, dtype=torch.float64))
        ```
    """
    if not isinstance(u, torch.Tensor) or not u.is_complex() or u.dim() < 2:
        what = _describe(u)
        raise TypeError(f"u must be a complex tensor (…, n, m); got {what}")
    re, im = u.real, u.imag
    return torch.cat((torch.cat((re, -im), -1), torch.cat((im, re), -1)), -2)


def complex_from_real(q: torch.Tensor, atol: float | None = None) -> torch.Tensor:
    r"""U = Q₁₁ + i·Q₂₁ from Q = [[Q₁₁, Q₁₂], [Q₂₁, Q₂₂]] = ``real_embedding(U)``.

    Args:
        q: real tensor (…, 2n, 2m) with the block structure Q₂₂ = Q₁₁,
            Q₁₂ = −Q₂₁.
        atol: tolerance of that structure (default 100·eps(dtype)·max(1, max|Q|)).

    Returns:
        Complex tensor (…, n, m).

    Raises:
        TypeError: if ``q`` is not a real floating tensor.
        ValueError: odd trailing dimensions, or a ``q`` without the structure
            (it is not the embedding of a complex matrix).

    Example:
        ```python
        import torch
        from stiefel.nn import complex_from_real, real_embedding

        u = torch.randn(2, 4, 3, dtype=torch.complex64)
        assert torch.equal(complex_from_real(real_embedding(u)), u)
        ```
    """
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dim() < 2:
        what = _describe(q)
        raise TypeError(f"q must be a real floating tensor (…, 2n, 2m); got {what}")
    rows, cols = q.shape[-2:]
    if rows % 2 or cols % 2:
        raise ValueError(f"q must have even trailing dimensions (…, 2n, 2m), got {tuple(q.shape)}")
    n, m = rows // 2, cols // 2
    a, b = q[..., :n, :m], q[..., n:, :m]
    if atol is None:
        atol = 100 * torch.finfo(q.dtype).eps * max(1.0, float(q.abs().max()) if q.numel() else 1)
    gap = max(
        float((q[..., n:, m:] - a).abs().max()) if q.numel() else 0.0,
        float((q[..., :n, m:] + b).abs().max()) if q.numel() else 0.0,
    )
    if not gap <= atol:
        raise ValueError(
            f"q is not the real embedding of a complex matrix: its blocks differ from "
            f"[[A, −B], [B, A]] by {gap:.3e} > atol={atol:.3e}"
        )
    return torch.complex(a, b)

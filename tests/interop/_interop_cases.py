"""Shared cases of the interop ports: every manifold kind and every registered map.

The lists come from the package itself (``stiefel.parametrizations.available()``),
never from a hand-kept list of names; reference values are computed here with dense
float64/complex128 formulas (SVD, QR) independent of the package.
"""

from __future__ import annotations

import torch

from stiefel import parametrizations
from stiefel.manifolds import Orthogonal, Stiefel, Unitary

# name: (manifold factory, weight shape (tall), dtype of the float64 case)
MANIFOLDS = {
    "stiefel_real": (lambda metric="euclidean": Stiefel(5, 3, metric=metric), (5, 3), False),
    "stiefel_complex": (
        lambda metric="euclidean": Stiefel(5, 3, complex=True, metric=metric),
        (5, 3),
        True,
    ),
    "orthogonal": (lambda metric="euclidean": Orthogonal(4, metric=metric), (4, 4), False),
    "unitary": (lambda metric="euclidean": Unitary(4, metric=metric), (4, 4), True),
}
METRICS = ("euclidean", "canonical")


def maps() -> list[str]:
    """Every registered parametrization: ``parametrizations.maps()``."""
    return list(parametrizations.maps())


def manifold(case: str, metric: str = "euclidean"):
    return MANIFOLDS[case][0](metric)


def shape_of(case: str) -> tuple[int, int]:
    return MANIFOLDS[case][1]


def dtype_of(case: str, precision: str = "high") -> torch.dtype:
    cplx = MANIFOLDS[case][2]
    if precision == "high":
        return torch.complex128 if cplx else torch.float64
    return torch.complex64 if cplx else torch.float32


def high(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.complex128 if x.is_complex() else torch.float64)


def polar(x: torch.Tensor) -> torch.Tensor:
    """Nearest point with orthonormal columns, U Vᴴ from the SVD (float64 reference)."""
    u, _, vh = torch.linalg.svd(high(x), full_matrices=False)
    return (u @ vh).to(x.dtype)


def qr_q(x: torch.Tensor) -> torch.Tensor:
    """torch's/geotorch's convention: Q of the QR factorisation with R's diagonal positive."""
    wide = x.shape[-2] < x.shape[-1]
    a = high(x.mT if wide else x)
    q, r = torch.linalg.qr(a)
    q = q * r.diagonal(dim1=-2, dim2=-1).sgn().unsqueeze(-2)
    q = q.to(x.dtype)
    return q.mT if wide else q


def tall(w: torch.Tensor) -> torch.Tensor:
    return w.mT if w.shape[-2] < w.shape[-1] else w


def orth_err(w: torch.Tensor) -> float:
    """max over the batch of ‖WᴴW − I‖_F (rows for a wide W), computed in float64."""
    w = high(tall(w.detach()))
    eye = torch.eye(w.shape[-1], dtype=w.dtype)
    return float(torch.linalg.matrix_norm(w.mH @ w - eye).max())


def eps_tol(dtype: torch.dtype, n: int, factor: float = 10.0) -> float:
    """factor·n·eps(dtype): torch's bound for a freshly computed orthogonal matrix."""
    return factor * n * torch.finfo(dtype).eps


def randn(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def random_point(case: str, seed: int, *batch: int, dtype: torch.dtype | None = None):
    """A point of the case's manifold from an independent formula: the polar factor of a
    Gaussian matrix (Haar-distributed), as geoopt's tests build theirs."""
    dtype = dtype or dtype_of(case)
    return polar(randn((*batch, *shape_of(case)), dtype, seed))


def same_component(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x moved into target's connected component (O(n): the sign of det); else x."""
    if x.shape[-1] == x.shape[-2] and not x.is_complex():
        if float(torch.linalg.det(x) * torch.linalg.det(target)) < 0:
            x = x.clone()
            x[..., 0] = -x[..., 0]
    return x

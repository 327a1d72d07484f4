"""A third-party map for the entry-point test: Q = polar(A), the orthonormal factor of A."""

import torch

from stiefel.parametrizations import OrthogonalMap


class PolarMap(OrthogonalMap):
    """Q = U Vᴴ for A = U Σ Vᴴ (A tall, full column rank); its right inverse is Q itself."""

    formula = "n m² (thin SVD)"
    domain = "St(n, m)"

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        u, _, vh = torch.linalg.svd(original, full_matrices=False)
        return u @ vh

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        return q.clone()

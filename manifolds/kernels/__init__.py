r"""Pure tensor kernels for the Stiefel manifold St(N, M) = {X : XᴴX = I}.

Every Stiefel kernel of the package lives here once: the tangent space and
metrics (`basic`), the retractions as descent kernels with the SMW Cayley step
and its fused transport and gradient step (`cayley`, with the one retraction
table `RETRACTIONS`), the QR (through the Gram of its argument) and polar
steps (`factor`), the overflow-safe scaling they share (`scaling`), and the
landing field (`landing`). Every function takes
and returns plain tensors of shape (..., N, M), real or complex, with any
leading batch dimensions. They do no argument checking (the manifold classes
do that once, in front of them), so they can be used in hot loops, benchmarked
alone and traced by ``torch.compile``.

Example:
    ```python
    import torch
    from stiefel.manifolds import kernels

    x = kernels.haar(100, 5, dtype=torch.float64)
    u = kernels.proj_tangent(x, torch.randn(100, 5, dtype=torch.float64))
    y = kernels.cayley_retraction(x, 0.1 * u)
    assert float(kernels.orthogonality_error(y)) < 1e-12
    ```
"""

from __future__ import annotations

from .basic import (
    cholesky_qr2,
    egrad2rgrad_canonical,
    egrad2rgrad_euclidean,
    expmap_canonical,
    expmap_euclidean,
    gram_minus_identity,
    gram_polar,
    haar,
    inner_canonical,
    inner_euclidean,
    newton_schulz,
    orthogonality_error,
    polar,
    proj_tangent,
    qr_unique,
    skew,
    sym,
)
from .cayley import (
    RETRACTIONS,
    cayley_dense,
    cayley_descent,
    cayley_gradient_step,
    cayley_retraction,
    cayley_retraction_transport,
    cayley_smw,
    use_smw,
)
from .factor import polar_descent, polar_retraction, qr_descent, qr_gradient_step, qr_retraction
from .landing import landing_direction, landing_safe_step
from .msign import MSIGN_METHODS, msign, msign_flops  # noqa: F401  (re-export; helper muon)

__all__ = [
    "sym",
    "skew",
    "gram_minus_identity",
    "orthogonality_error",
    "proj_tangent",
    "egrad2rgrad_euclidean",
    "egrad2rgrad_canonical",
    "inner_euclidean",
    "inner_canonical",
    "qr_unique",
    "cholesky_qr2",
    "gram_polar",
    "polar",
    "haar",
    "newton_schulz",
    "use_smw",
    "cayley_descent",
    "cayley_gradient_step",
    "cayley_smw",
    "cayley_dense",
    "cayley_retraction",
    "cayley_retraction_transport",
    "qr_descent",
    "qr_gradient_step",
    "polar_descent",
    "qr_retraction",
    "polar_retraction",
    "RETRACTIONS",
    "landing_direction",
    "landing_safe_step",
    "expmap_euclidean",
    "expmap_canonical",
]

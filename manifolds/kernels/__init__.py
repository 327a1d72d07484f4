r"""Pure tensor kernels for the Stiefel manifold St(N, M) = {X : XᴴX = I}.

Every Stiefel kernel of the package lives here once: the tangent space and
metrics (`basic`), the retractions as descent kernels with the SMW Cayley step
and its fused transport and gradient step (`cayley`, with the one retraction
table `RETRACTIONS`), the QR step through the Gram of its argument (`factor`),
the polar step (`polar_step`), the overflow-safe scaling they share (`scaling`), the update
of square points in their own frame that the square QR and Cayley steps share
(`frame`), and the landing field (`landing`). Every function takes
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

from . import basic as _basic
from . import cayley as _cayley
from . import factor as _factor
from . import landing as _landing
from . import polar_step as _polar_step
from .basic import *  # noqa: F403
from .cayley import *  # noqa: F403
from .factor import *  # noqa: F403
from .landing import *  # noqa: F403
from .msign import MSIGN_METHODS, msign, msign_flops  # noqa: F401  (re-export; not in __all__)
from .polar_step import *  # noqa: F403

# one list: each submodule's own __all__
__all__ = [
    *_basic.__all__,
    *_cayley.__all__,
    *_factor.__all__,
    *_polar_step.__all__,
    *_landing.__all__,
]

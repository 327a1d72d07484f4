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

from ._cwy import (
    cwy_factors,
    cwy_linear,
    cwy_linear_factored,
    cwy_matrix,
    cwy_operator,
    cwy_triangle,
    embed_diagonal,
    householder_linear,
    householder_matrix,
    normalize_columns,
    tcwy_matrix,
    unit_cwy_matrix,
)
from ._householder import householder_apply, wy_triangle
from ._skew import PANELS_FROM as PANELS_FROM
from ._skew import _SkewFromRaw as _SkewFromRaw
from ._skew import raw_from_skew, skew_from_raw, skew_from_raw_path
from ._skew_maps import UNPIVOTED_BLOCKS_FROM as UNPIVOTED_BLOCKS_FROM
from ._skew_maps import UNPIVOTED_LU_FROM as UNPIVOTED_LU_FROM
from ._skew_maps import (
    cayley_map,
    cayley_path,
    exp_map,
    exp_path,
    scaled_cayley_map,
)
from ._skew_maps import eager_cayley as eager_cayley
from ._skew_maps import eager_exp as eager_exp

__all__ = [
    "normalize_columns",
    "cwy_triangle",
    "wy_triangle",
    "embed_diagonal",
    "cwy_matrix",
    "unit_cwy_matrix",
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

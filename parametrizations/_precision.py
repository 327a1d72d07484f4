r"""The dtypes a map accepts and the precisions it computes in.

A constrained weight may be float32, float64, complex64, complex128, float16
or bfloat16 (`DTYPES`). A map computes in float32 or wider (`work_dtype`:
Note [Maps compute in float32 or wider] in `OrthogonalMap.forward`), and a
right inverse in float64 or complex128 (`high`: Note [Tolerance of right
inverses]).
"""

from __future__ import annotations

import torch

from .._core import checks as _checks

__all__ = ["DTYPES", "work_dtype", "real_work_dtype", "high"]

DTYPES = (
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float16,
    torch.bfloat16,
)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a map computes in: float32 for float16/bfloat16, else the dtype itself."""
    return torch.float32 if dtype in _checks.LOW_PRECISION else dtype


def real_work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype of `work_dtype`: float32 for complex64, float64 for complex128.

    (A table, not ``dtype.to_real()``, which Dynamo does not trace.)
    """
    work = work_dtype(dtype)
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(work, work)


def high(x: torch.Tensor) -> torch.Tensor:
    """x in float64 / complex128 (the working precision of right inverses)."""
    return x.to(torch.complex128 if x.is_complex() else torch.float64)

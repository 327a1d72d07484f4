"""The precisions a run may name: a dtype of the weights, or bfloat16 autocast.

Note [Autocast precisions]
A run's ``dtype`` names its precision: a dtype the weights are stored in, or
``"bfloat16-autocast"``: float32 weights, the loss computed under
``torch.autocast(device_type, dtype=torch.bfloat16)`` (the layers' matmuls in
bfloat16, the maps in float32: Note [Maps compute in float32 or wider]),
backward and optimizer steps outside it, evaluation in float32. bfloat16 has
float32's exponent range, so no gradient scaling is needed (float16 autocast
would need a GradScaler and is not offered).
"""

from __future__ import annotations

import torch

__all__ = ["PRECISIONS", "precision", "rounding"]

PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "float32": (torch.float32, None),
    "float64": (torch.float64, None),
    "complex64": (torch.complex64, None),
    "complex128": (torch.complex128, None),
    "bfloat16-autocast": (torch.float32, torch.bfloat16),
}


def precision(name: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(weight dtype, autocast dtype or None) of a precision name (Note [Autocast precisions]).

    Example:
        ```python
        import torch
        from stiefel.comparisons.precision import precision

        assert precision("bfloat16-autocast") == (torch.float32, torch.bfloat16)
        ```
    """
    if name not in PRECISIONS:
        raise ValueError(f"dtype={name!r} is not supported; allowed: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def rounding(name: str, scale: float, task: object = None) -> float:
    """10·n·eps·max(1, |scale|), the rounding of a loss of size ``scale`` in precision ``name``
    on a task of size n (its ``n``, else 1): a gap to the optimum within it is 0.

    Example:
        ```python
        import torch
        from stiefel.comparisons.precision import rounding

        assert rounding("float64", 3.0) == 30 * torch.finfo(torch.float64).eps
        ```
    """
    eps = torch.finfo(precision(name)[0]).eps
    return 10 * getattr(task, "n", 1) * eps * max(1.0, abs(scale))

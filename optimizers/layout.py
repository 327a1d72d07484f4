r"""The layout a step works in: a batch of tall matrices stored by columns is stepped by rows.

Note [Batches stepped by rows]
A batch of points stored by columns (QR's Q, as `torch.linalg.qr` returns it,
every gradient and copy that keeps that layout, and a wide batch stepped as its
transpose) reaches the products of a step as the transposes of row-major
matrices, so each N×M·M×M product runs as an M×M·M×N one and each Gram with
its operands swapped. On the CPU, MKL's batched products of these small shapes
are slower in that form (docs/performance.md, "Batched regime (many small
matrices)"). A step makes five to eight such products, and two copies cost less than
they lose. So a batch (three or more dimensions) of tall matrices (N > M) on
the CPU, stored by columns, is stepped on a row-major copy of its point and
gradient (points with orthonormal columns only: an elementwise rule on a plain
tensor reads either layout alike); the new point is written back into the
parameter, in the parameter's own layout, by the same ``copy_`` as before. The
moments a rule creates follow the copy and stay row-major. Left as they are: a
square batch (both forms are the same product shape), a single matrix (a few
large products per step, at one rate in either layout), a batch on a GPU
(cuBLAS's strided batched products read either layout; not measured, so no
copy is added there), and a tensor subclass such as a DTensor, whose local
shards and layout belong to its own dispatch.

Example:
    ```python
    import torch
    from stiefel.optimizers.layout import by_rows

    q = torch.linalg.qr(torch.randn(4, 8, 3))[0]  # stored by columns
    assert q.stride(-2) == 1 and by_rows(q).is_contiguous()
    assert torch.equal(by_rows(q), q)
    r = q.contiguous()  # stored by rows: stepped as it is
    assert by_rows(r) is r
    ```
"""

from __future__ import annotations

import torch

from ..manifolds.kernels.reduce import by_columns

__all__ = ["by_rows"]


def by_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a step works on it (Note [Batches stepped by rows]).

    Args:
        t: a point or gradient, (..., N, M).

    Returns:
        A row-major copy of a CPU batch of tall matrices stored by columns; ``t``
        itself otherwise.
    """
    if (
        type(t) is torch.Tensor
        and t.dim() > 2
        and t.device.type == "cpu"
        and t.shape[-2] > t.shape[-1]
        and by_columns(t)
    ):
        return t.contiguous()
    return t

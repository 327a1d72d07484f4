r"""Parameters that share memory: refused when they are added to an optimizer.

Note [Parameters that overlap in memory]
A step computes every parameter's new value from the values before the step and
then writes them (`stiefel.optimizers.buckets.write`). Two parameters that share
elements (``b = nn.Parameter(a[:2])`` beside ``a``) would each be written from
their own update, and the later write would drop the other's: torch's
per-parameter loops apply both, one on top of the other. No rule here defines a
step of such a pair, so it is refused when the second one is added. Views that
share a storage without sharing an element (the slices of a flat buffer, the
columns of one matrix) are stepped as usual: elements are compared exactly where
the two ranges of memory meet.
"""

from __future__ import annotations

import torch

__all__ = ["refuse_overlap"]


def _span(p: torch.Tensor) -> tuple[int, int] | None:
    """(storage address, first and one-past-last element offsets), or None (no storage)."""
    if p.device.type == "meta" or p.numel() == 0 or type(p).__torch_dispatch__ is not _PLAIN:
        return None
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(p.shape, p.stride(), strict=True))
    return p.untyped_storage().data_ptr(), p.storage_offset(), p.storage_offset() + extent


_PLAIN = torch.Tensor.__torch_dispatch__


def _share(a: torch.Tensor, b: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether the views ``a`` and ``b`` of one storage hold a common element."""
    if a.element_size() != b.element_size():
        return True  # views of one storage in two dtypes: taken as overlapping
    mark = torch.zeros(hi - lo, dtype=torch.bool, device=a.device)
    mark.as_strided(a.shape, a.stride(), a.storage_offset() - lo).fill_(True)
    return bool(mark.as_strided(b.shape, b.stride(), b.storage_offset() - lo).any())


def refuse_overlap(new: list[torch.Tensor], held: list[torch.Tensor]) -> None:
    """Refuse a parameter of ``new`` that shares an element with another one or with ``held``.

    Raises:
        ValueError: naming both parameters (Note [Parameters that overlap in memory]).
    """
    seen: dict[int, list[tuple[str, torch.Tensor, int, int]]] = {}
    named = [(f"a parameter already added (shape {tuple(p.shape)})", p) for p in held]
    named += [(f"parameter {i} of the new param group (shape {tuple(p.shape)})", p)
              for i, p in enumerate(new)]  # fmt: skip
    for name, p in named:
        span = _span(p)
        if span is None:
            continue
        address, lo, hi = span
        for other, q, qlo, qhi in seen.get(address, []):
            if q is not p and lo < qhi and qlo < hi and _share(q, p, min(lo, qlo), max(hi, qhi)):
                raise ValueError(
                    f"{name} shares memory with {other} (one is a view of the other): "
                    "each would be written from its own update and one would overwrite the "
                    "other (Note [Parameters that overlap in memory]); allowed: parameters "
                    "that share no element"
                )
        seen.setdefault(address, []).append((name, p, lo, hi))

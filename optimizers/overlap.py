r"""Parameters that share memory: refused when they are added to an optimizer.

Note [Parameters that overlap in memory]
A step computes every parameter's new value from the values before the step and
then writes them (`stiefel.optimizers.buckets.write`). Two parameters that share
elements (``b = nn.Parameter(a[:2])`` beside ``a``) would each be written from
their own update, and the later write would drop the other's: torch's
per-parameter loops apply both, one on top of the other. No rule here defines a
step of such a pair, so it is refused when the second one is added. Views that
share a storage without sharing an element (the slices of a flat buffer, the
columns of one matrix) are stepped as usual: byte ranges are compared, and where
two of one element size meet, their elements. The optimizer keeps an index of
the ranges by storage, so that adding groups one by one costs what the new
parameters cost.
"""

from __future__ import annotations

import torch

from .buckets import PLAIN

__all__ = ["refuse_overlap"]

#: the optimizer's attribute: (how many parameters it indexes, {storage: [(p, lo, hi)]})
_INDEX = "_stiefel_overlap_index"


def _extent(p: torch.Tensor) -> int:
    """Elements from the first one ``p`` reads to one past its last, in its storage."""
    return 1 + sum((s - 1) * abs(st) for s, st in zip(p.shape, p.stride(), strict=True))


def _span(p: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, one past the last byte), or None (no storage)."""
    if p.device.type == "meta" or p.numel() == 0 or type(p).__torch_dispatch__ is not PLAIN:
        return None
    start, size = p.storage_offset(), p.element_size()
    return p.untyped_storage().data_ptr(), start * size, (start + _extent(p)) * size


def _share(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether views ``a`` and ``b`` of one storage, whose byte ranges meet, share an element."""
    if a.element_size() != b.element_size():
        return True  # two dtypes over the same bytes: taken as sharing
    lo = min(a.storage_offset(), b.storage_offset())
    hi = max(t.storage_offset() + _extent(t) for t in (a, b))
    mark = torch.zeros(hi - lo, dtype=torch.bool, device=a.device)
    mark.as_strided(a.shape, a.stride(), a.storage_offset() - lo).fill_(True)
    return bool(mark.as_strided(b.shape, b.stride(), b.storage_offset() - lo).any())


def refuse_overlap(opt: torch.optim.Optimizer, new: list[torch.Tensor]) -> None:
    """Refuse a parameter of ``new`` sharing an element with another one or with ``opt``'s.

    The optimizer's index of byte ranges is extended only when every one is accepted.

    Raises:
        ValueError: naming both parameters (Note [Parameters that overlap in memory]).
    """
    held = [p for g in opt.param_groups for p in g["params"]]
    count, index = opt.__dict__.get(_INDEX, (-1, {}))
    if count != len(held):  # a copy, or groups changed by hand: indexed again
        index = {}
        for p in held:
            if (span := _span(p)) is not None:
                index.setdefault(span[0], []).append((p, *span[1:]))
    mine: dict[int, list[tuple[torch.Tensor, int, int, int]]] = {}
    for i, p in enumerate(new):
        if (span := _span(p)) is None:
            continue
        address, lo, hi = span
        before = [(q, a, b, None) for q, a, b in index.get(address, [])]
        for q, qlo, qhi, j in before + mine.get(address, []):
            if q is not p and lo < qhi and qlo < hi and _share(q, p):
                other = "a parameter already added" if j is None else f"parameter {j}"
                raise ValueError(
                    f"parameter {i} of the new param group (shape {tuple(p.shape)}) shares "
                    f"memory with {other} (shape {tuple(q.shape)}; one is a view of the "
                    "other): each would be written from its own update and one would "
                    "overwrite the other (Note [Parameters that overlap in memory]); "
                    "allowed: parameters that share no element"
                )
        mine.setdefault(address, []).append((p, lo, hi, i))
    for address, spans in mine.items():
        index.setdefault(address, []).extend((p, lo, hi) for p, lo, hi, _ in spans)
    opt.__dict__[_INDEX] = (len(held) + len(new), index)  # once torch adds them too

r"""The safe step: a step either completes for every parameter, or leaves everything as it was.

Note [Safe step]
The kernels are overflow-safe (Note [Overflow-safe step]), but a rule's own
arithmetic (e.g. a momentum that overflowed) or a singular limit can still
produce inf/NaN (or make LAPACK refuse its input): such a parameter's step is
skipped, its old point kept, never overwritten. And a rule that raises (a
corrupted state, a bad shape) must not leave the parameters before it moved and
those after it not: `step()` computes the new value of every parameter first
(`Transaction.add`) and writes them only when all rules returned
(`Transaction.commit`); an exception restores every state touched
(`Transaction.rollback`) and writes nothing.

Note [A skipped step leaves the state as it was]
A step whose result is not finite is skipped, and skipped entirely: its
momentum, moments and step count must not be advanced either, or the next
steps would use a momentum holding the rejected gradient (or an infinite
moment) and a wrong bias correction. The point is known to be acceptable
only after the rule ran, so the state before the step is kept aside. A rule
that only replaces its state tensors (``state[key] = new tensor``, never
``state[key].mul_(...)``), as every built-in rule does and declares with
``writes_state_in_place = False``, needs a copy of the dict only (no tensor
copied); a rule that writes into them (the default for a plugin) gets its
state tensors cloned before each step. The promise is checked by the
tensors' version counters after every step (RuntimeError if broken).

Note [The step's flags are read once, after the step]
Whether a step is accepted (its gradient and its result finite) is a tensor;
reading it on the host is a synchronisation with the device and, under
``torch.compile``, a graph break. It was read twice per parameter (gradient,
then result). Now every rule runs, even on a non-finite gradient (a NaN in,
a NaN out: nothing is written from it), and the flags of every parameter of
every group are stacked and read in one host read at the end of ``step()``
(`Transaction.commit`): accepted steps are written, the others restore their
state (new keys removed) and warn at once. A traced step reads nothing: each
point is written as ``torch.where(ok, new, old)`` and each state tensor
chosen the same way (`Transaction.select`), so a non-finite step still writes
nothing non-finite and keeps its point and state; a key the rule added on a
skipped first step holds zeros, which every built-in rule reads as its
absence (zero moments; a zero momentum buffer) except the first heavy-ball
buffer, which becomes (1 − δ)g instead of g after such a step. The skips are
counted per parameter on the device and warned about when read: by the next
eager ``step()`` or by ``report_skipped()``. The off-manifold test (Note
[Off-manifold points at a step]) projects under ``torch.cond`` in a traced
step; an eager step reads it only where it can be true: the first step, after
a change the optimizer did not make (its version counter), and every
`CHECK_EVERY`-th step (a change through ``.data``).

Example:
    ```python
    import torch
    from stiefel.optimizers.transaction import finite, finite_rows

    t = torch.ones(3, 2, 2)
    t[1, 0, 0] = float("nan")
    assert not bool(finite(t))
    assert finite_rows(t).tolist() == [True, False, True]
    ```
"""

from __future__ import annotations

import math

import torch

from ..manifolds.kernels.reduce import absmax_from, memory_order, rows_absmax
from ..manifolds.sharded import any_rank, is_dtensor

__all__ = ["finite", "finite_rows", "finite_gradient"]


def finite(t: torch.Tensor) -> torch.Tensor:
    """A bool 0-dim tensor: every entry of ``t`` is finite (a DTensor: on every rank).

    No host read (Note [The step's flags are read once, after the step]).

    Note [Finiteness in one pass]
    ``torch.isfinite(t).all()`` is composite on the CPU: ``t == t``,
    ``|t|``, ``|t| != inf``, their conjunction and ``all``, four or five
    passes over ``t`` and three temporaries of its size, the largest single
    cost of a step on a tall point. The extremes decide the same question in
    one reduction and no temporary: ``min`` and ``max`` propagate NaN, and an
    entry ±inf is the minimum or the maximum, so both are finite exactly when
    every entry is. A complex tensor is read as its real pairs. ``torch.isfinite``
    of the two is composite too (four operations each); max(−lo, hi) < ∞ is false
    for NaN and for either infinity, in three.
    """
    if is_dtensor(t):  # every rank must take the same decision
        bad = _finite(t.to_local()).logical_not().reshape(1)
        return any_rank(bad, mesh=t.device_mesh).logical_not().reshape(())
    return _finite(t)


def _finite(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return torch.ones((), dtype=torch.bool, device=t.device)
    t = memory_order(t)  # Note [Reductions over all entries in memory order]
    lo, hi = torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)
    return absmax_from(lo, hi) < math.inf


def finite_rows(t: torch.Tensor) -> torch.Tensor:
    """`finite` of each row ``t[i]`` (one parameter of a bucket): a bool vector, no host read.

    The extremes of each row, as in Note [Finiteness in one pass].
    """
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
    flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(t.shape[0], -1)
    lo, hi = torch.aminmax(flat, dim=1)
    return absmax_from(lo, hi) < math.inf


def finite_gradient(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`finite` of a gradient, and max |G| where the same pass gives it (else None).

    The maximum is handed to the rule's kernels (Note [One pass over the gradient for
    its test and its scale]): a single real matrix, not a DTensor, not traced.
    """
    if (
        is_dtensor(grad)
        or grad.dim() != 2
        or not grad.is_floating_point()
        or grad.numel() == 0
        or torch.compiler.is_compiling()
    ):
        return finite(grad), None
    absmax = rows_absmax(grad)  # one aminmax; NaN propagates to it, ±inf is it
    return (absmax < math.inf).reshape(()), absmax  # false for NaN and inf alike

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
    from stiefel.optimizers.transaction import Snapshot

    state = {"step": torch.tensor(1.0), "buf": torch.ones(2)}
    snap = Snapshot(state, in_place=False)
    state["buf"] = state["buf"] * 2  # replaced, not written: the promise holds
    snap.check("MyRule")
    snap.restore()
    assert torch.equal(state["buf"], torch.ones(2))
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..manifolds.kernels.reduce import absmax_from, memory_order, rows_absmax
from ..manifolds.sharded import any_rank

__all__ = ["Snapshot", "Pending", "Transaction", "finite", "finite_gradient"]


class Snapshot:
    """A parameter's state before a step, to restore if the step is skipped or rolled back.

    Args:
        state: the state dict (restored in place by `restore`).
        in_place: whether the rule may write into the state's tensors (they are
            cloned then; the master is written only after acceptance, never cloned).
    """

    def __init__(self, state: dict, in_place: bool):
        self.state = state
        if in_place:
            self.before = {
                key: value.clone() if isinstance(value, torch.Tensor) and key != "master" else value
                for key, value in state.items()
            }
            self.versions: dict = {}
        else:
            self.before = dict(state)
            self.versions = {
                key: value._version
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            }

    def restore(self) -> None:
        """Put the state back as it was."""
        self.state.clear()
        self.state.update(self.before)

    def select(self, ok: torch.Tensor) -> None:
        """Keep the rule's state where ``ok``, the state before elsewhere, by `torch.where`.

        A key the rule added gets its new value where ``ok`` and zeros elsewhere (the
        state a skipped first step leaves, Note [The step's flags are read once, after
        the step]); a key that is not a tensor keeps the rule's value.
        """
        for key, value in list(self.state.items()):
            if not isinstance(value, torch.Tensor) or key == "master":
                continue
            old = self.before.get(key)
            if not isinstance(old, torch.Tensor) or old.shape != value.shape:
                old = torch.zeros_like(value)
            self.state[key] = torch.where(ok.to(value.device), value, old.to(value.dtype))

    def check(self, owner: str) -> None:
        """A rule declaring ``writes_state_in_place = False`` kept it (else: RuntimeError)."""
        for key, version in self.versions.items():
            if self.before[key]._version != version:
                raise RuntimeError(
                    f"{owner}.update wrote into state[{key!r}] in place but the "
                    "class declares writes_state_in_place = False; replace the tensor "
                    "(state[key] = new) or set writes_state_in_place = True, so that a "
                    "skipped step can restore the state"
                )


@dataclass
class Pending:
    """One parameter's computed step, not yet written.

    Attributes:
        param: the parameter.
        state: its state dict (as the rule left it).
        snapshot: its state before the step.
        new: the rule's result in the parameter's orientation (None: LAPACK refused).
        start: the point the rule started from (the projected point when ``x`` was
            off its manifold), written instead of ``new`` when the step is skipped.
        projected: whether ``start`` differs from the parameter (it must be written).
        grad_ok: the gradient is finite (a bool tensor, or a bool).
        ok: the gradient and ``new`` are finite (a bool tensor, or a bool).
        where: the parameter, named for a warning.
    """

    param: torch.Tensor
    state: dict
    snapshot: Snapshot
    new: torch.Tensor | None
    start: torch.Tensor
    projected: bool
    grad_ok: torch.Tensor | bool
    ok: torch.Tensor | bool
    where: str


def _flag(value: torch.Tensor | bool, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, device=like.device).reshape(())


class Transaction:
    """The steps of one ``step()`` call: computed first, written together (Note [Safe step])."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def add(self, pending: Pending) -> None:
        self.pending.append(pending)

    def rollback(self) -> None:
        """Restore every state touched (latest first); nothing was written."""
        for pend in reversed(self.pending):
            pend.snapshot.restore()
        self.pending.clear()

    def flags(self) -> torch.Tensor:
        """(gradient finite, step finite) of every pending step, stacked: shape (k, 2)."""
        if not self.pending:
            return torch.zeros(0, 2, dtype=torch.bool)
        like = self.pending[0].start
        rows = [torch.stack([_flag(p.grad_ok, like), _flag(p.ok, like)]) for p in self.pending]
        return torch.stack(rows)

    def commit(self, write: Callable[[torch.Tensor, dict, torch.Tensor], None]) -> list[tuple]:
        """Write every step: the result where it is finite, else the state and point before.

        One host read for the whole step (Note [The step's flags are read once, after
        the step]). Returns ``(pending, grad_ok, ok)`` of every skipped step.
        """
        skipped = []
        for pend, (grad_ok, ok) in zip(self.pending, self.flags().tolist(), strict=True):
            if ok and pend.new is not None:
                write(pend.param, pend.state, pend.new)
                continue
            pend.snapshot.restore()
            if pend.projected:
                write(pend.param, pend.state, pend.start)
            skipped.append((pend, grad_ok, False))
        return skipped

    def select(self, write: Callable[[torch.Tensor, dict, torch.Tensor], None]) -> None:
        """`commit` without a host read: each point and state tensor chosen by `torch.where`.

        For a traced step (Note [The step's flags are read once, after the step]).
        """
        for pend in self.pending:
            ok = pend.ok if isinstance(pend.ok, torch.Tensor) else torch.tensor(pend.ok)
            pend.snapshot.select(ok)
            write(pend.param, pend.state, torch.where(ok, pend.new, pend.start))


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
    if isinstance(t, DTensor):  # every rank must take the same decision
        bad = _finite(t.to_local()).logical_not().reshape(1)
        return any_rank(bad, mesh=t.device_mesh).logical_not().reshape(())
    return _finite(t)


def _finite(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return torch.ones((), dtype=torch.bool, device=t.device)
    t = memory_order(t)  # Note [Reductions over all entries in memory order]
    lo, hi = torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)
    return absmax_from(lo, hi) < math.inf


def finite_gradient(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`finite` of a gradient, and max |G| where the same pass gives it (else None).

    The maximum is handed to the rule's kernels (Note [One pass over the gradient for
    its test and its scale]): a single real matrix, not a DTensor, not traced.
    """
    if (
        isinstance(grad, DTensor)
        or grad.dim() != 2
        or not grad.is_floating_point()
        or grad.numel() == 0
        or torch.compiler.is_compiling()
    ):
        return finite(grad), None
    absmax = rows_absmax(grad)  # one aminmax; NaN propagates to it, ±inf is it
    return (absmax < math.inf).reshape(()), absmax  # false for NaN and inf alike

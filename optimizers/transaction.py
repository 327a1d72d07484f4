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

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..manifolds.sharded import any_rank

__all__ = ["Snapshot", "Pending", "Transaction", "nonfinite", "finite", "gradient_flags"]


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
        state: its state dict.
        snapshot: its state before the step (None when nothing was changed).
        new: the point to write in the parameter's orientation (None: nothing to write).
        stepped: whether the rule's step was accepted (counts for ``repair_every``).
    """

    param: torch.Tensor
    state: dict
    snapshot: Snapshot | None
    new: torch.Tensor | None
    stepped: bool


class Transaction:
    """The steps of one ``step()`` call: computed first, written together (Note [Safe step])."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def add(self, pending: Pending) -> None:
        self.pending.append(pending)

    def rollback(self) -> None:
        """Restore every state touched (latest first); nothing was written."""
        for pend in reversed(self.pending):
            if pend.snapshot is not None:
                pend.snapshot.restore()
        self.pending.clear()

    def commit(self, write: Callable[[Pending], None]) -> None:
        """Write every computed point, in order."""
        for pend in self.pending:
            if pend.new is not None:
                write(pend)


@torch.compiler.disable
def nonfinite(grad: torch.Tensor, off: torch.Tensor | None = None, agree=None) -> tuple[bool, bool]:
    """(grad has a non-finite entry, ``off`` is True), with one host synchronisation.

    Note [One reduction for the finiteness test]: the sum of finite entries is
    finite unless it overflows, so one reduction decides the common case. The
    answer steers Python control flow: it runs eagerly (a graph break under
    torch.compile) and costs one host synchronisation per parameter, shared
    with the off-manifold test (Note [Off-manifold points at a step]). For a
    sharded parameter ``grad`` is the local shard and ``agree`` ORs the flags
    over the ranks, so that every rank takes the same branch.
    """
    total = grad.sum()
    if off is None and agree is None:  # one scalar: its test on the host (6 ops fewer)
        bad = not math.isfinite(abs(total.item()))
        if bad:
            bad = not bool(torch.isfinite(grad).all())
        return bad, False
    flags = torch.isfinite(total).logical_not().reshape(1)
    if off is not None:
        flags = torch.cat((flags, off.reshape(1).to(flags.device)))
    if agree is not None:
        flags = agree(flags)
    bad, *rest = flags.tolist()
    if bad:
        exact = torch.isfinite(grad).all().logical_not().reshape(1)
        bad = bool((exact if agree is None else agree(exact)).item())
    return bool(bad), bool(rest and rest[0])


@torch.compiler.disable
def finite(new: torch.Tensor) -> bool:
    """Whether every entry of a step's result is finite (Note [One reduction ...])."""
    if isinstance(new, DTensor):  # every rank must take the same decision
        agree = functools.partial(any_rank, mesh=new.device_mesh)
        return not nonfinite(new.to_local(), agree=agree)[0]
    return not nonfinite(new)[0]


def gradient_flags(grad: torch.Tensor, off: torch.Tensor | None) -> tuple[bool, bool]:
    """`nonfinite` of a gradient (a DTensor: on its local shard, agreed over the ranks)."""
    if isinstance(grad, DTensor):  # local tests, one agreement (Note [Row-sharded kernels])
        agree = functools.partial(any_rank, mesh=grad.device_mesh)
        return nonfinite(grad.to_local(), off, agree)
    return nonfinite(grad, off)

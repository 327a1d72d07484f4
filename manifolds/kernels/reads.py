r"""When a kernel may read a tensor's value on the host: the one test every kernel asks.

Note [Kernels read nothing while traced or captured]
A few kernels read a number on the host to take a shorter path (a batch whose
matrices all passed a test skips the fallback, a step size known small skips
a pass). Such a read is a graph break under ``torch.compile`` and is refused
while a CUDA stream is captured into a graph (``torch.cuda.graphs``, an
optimizer's ``capturable`` step): there the kernels take their path without a
read (both paths chosen by ``torch.where``, Note [Traced steps compute both
paths]). Both conditions are states of torch itself, asked here at the call,
so that no flag has to be carried from the optimizer into the kernels. The
third is an optimizer's ``capturable`` step run eagerly (before its capture):
it must read nothing either, and says so by an argument, ``reads=False``,
handed to the step's kernels with its geometry (`Geometry.for_step`).

Example:
    ```python
    from stiefel.manifolds.kernels.reads import host_reads_allowed

    assert host_reads_allowed()  # eager, no graph being captured
    ```
"""

from __future__ import annotations

import math

import torch

__all__ = ["host_reads_allowed", "host_max", "StepChecks", "last_value", "taken_as_one"]


def host_reads_allowed(reads: bool = True) -> bool:
    """False while ``torch.compile`` traces or a CUDA graph is being captured, or when the
    caller's step says ``reads=False`` (an optimizer's eager ``capturable`` step)."""
    if not reads or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def host_max(t: torch.Tensor) -> float:
    """The largest entry of ``t`` read on the host; −inf for an empty batch (max's identity)."""
    return float(t.detach().amax()) if t.numel() else -math.inf


class StepChecks(list):
    """The unread tests of one step's kernels, and the bounds they measured for the next.

    A list (kernels append their bool tests, Note [Refused matrices in a step that
    reads nothing] in `stiefel.manifolds.kernels.frame`) that also carries, per
    call site of a short path, the bound the same site measured at the last step
    (``last``, host floats) and collects this step's (``measured``, unread 0-dim
    tensors): the optimizer reads them with the step's flags, in its one read, and
    hands them to the next step (Note [Euler's product sized by the last step] in
    `stiefel.manifolds.kernels.euler`).

    Args:
        last: ``{site: bound}`` read after the last step (empty: none yet).
    """

    def __init__(self, last: dict[str, float] | None = None) -> None:
        super().__init__()
        self.last = {} if last is None else last
        self.measured: list[tuple[str, torch.Tensor]] = []

    def measure(self, site: str, bound: torch.Tensor) -> None:
        """Record the largest of ``bound`` (per matrix) at ``site``, to be read with the flags."""
        if bound.numel():  # an empty batch measures nothing
            self.measured.append((site, bound.detach().amax()))


def last_value(checks: list | None, site: str, value: torch.Tensor) -> float | None:
    """What ``site`` measured at the last step (None: unknown); this step's ``value``
    (per matrix) is measured for the next. Without a `StepChecks`, None."""
    if not isinstance(checks, StepChecks):
        return None
    checks.measure(site, value)
    return checks.last.get(site)


def taken_as_one(checks: list | None, site: str, scale: torch.Tensor) -> bool:
    """Whether a per-matrix ``scale`` may be taken as exactly 1 without reading it.

    Note [Scales taken as one from the last step]
    The overflow-safe scales of a step (the gradient's μ = max|G| of a Riemannian
    gradient, `geometry.linear_in_g`; the direction's μ = max|d| above
    `scaling.free_scale`; radam's μ for ⟨ξ, ξ⟩) are exactly 1 for ordinary data,
    and dividing by 1 changes no bit but costs a pass over the N×M data. A step
    that reads nothing of its own cannot skip the pass on this step's values; it
    skips it when the same ``site`` measured 1 for every matrix at the last step
    (`StepChecks`), and the test "1 now" joins its checks: a step where it is not
    (a gradient grown past the free scale) is taken again on the exact path. The
    largest value is measured for the next step either way. Without a
    `StepChecks` (a traced or captured step, the exact path, a direct call) the
    answer is no: the division runs.

    Args:
        checks: the step's checks (`StepChecks`), a plain list or None.
        site: the caller's name for this scale.
        scale: one value per matrix, 1 for ordinary data.
    """
    if last_value(checks, site, scale) != 1.0:
        return False
    checks.append((scale == 1).all())
    return True

r"""The step of a bucket: the rule's call (`compute`) and the write of its result (`commit`).

Note [The rule works on a copy of the state]
A rule steps a bucket with a state of its own (the parameters' state tensors stacked, or
a shallow copy of one parameter's state; cloned for a rule that writes into its
tensors): the parameters' states are not touched before `commit`. So a rule that raises
leaves every parameter and every state as they were (nothing to roll back), and a step
skipped for a non-finite gradient or result keeps its parameter's state exactly (Note [A
skipped step leaves the state as it was] in `stiefel.optimizers.engine`).

Note [One host read per step]
What the host must learn from a step is whether each parameter's gradient and result are
finite, and whether a point tested this step is off its manifold (Note [Off-manifold
points at a step]). An eager step stacks those flags for every bucket of every group and
reads them once, after every rule ran (`commit`): accepted steps are written (one
``_foreach_copy_`` per bucket); a skipped one keeps its point and state and warns; a
bucket whose tested point was off is stepped again parameter by parameter from the
projected points (the rare path, where the reads of Note [Off-manifold points at a step]
are paid); a bucket for which a kernel refused its short path for some matrix (a long
step, a badly conditioned factorization: Note [Refused matrices in a step that reads
nothing] in `stiefel.manifolds.kernels.frame`) is stepped again with the kernels reading
their tests, which take the exact paths there. The step counts the host needs (the
schedule of the tests and corrections, ``repair_every``) are kept beside the state's
tensors (`buckets.HOST_STEP`), never read back. A step traced by ``torch.compile`` or
made ``capturable`` reads nothing: points and states are chosen by ``torch.where`` on
the flags (`select`), the skips are counted on the device (`stiefel.optimizers.skips`),
and every point is tested and corrected at every step (no schedule the host would have
to know).

Note [Safe step]
The kernels are overflow-safe (Note [Overflow-safe step]), but a rule's own arithmetic
(e.g. a momentum that overflowed) or a singular limit can still produce inf/NaN (or make
LAPACK refuse its input): such a parameter's step is skipped, its old point kept, never
overwritten. And a rule that raises (a corrupted state, a bad shape) must not leave the
parameters before it moved and those after it not: `step()` computes every bucket's step
first (`compute`, on a copy of the state) and writes them only when all rules returned
(`commit`).

Note [A step of lr 0 leaves the point where it is]
torch's optimizers leave a parameter as it is at lr 0, and code relies on it:
torch.distributed.checkpoint makes an empty optimizer's state by a step of lr 0 on zero
gradients, after the model's weights may have been loaded. A retraction ends with a
drift correction, and POGO's step with its correction, which move a point near the
manifold by its rounding off it. So at an lr of 0 the rule runs (its state advances, as
Adam's moments do) and the point is kept, chosen on the device for a tensor lr (nothing
read; a DTensor point's is corrected), and ``repair_every`` does not project it.

Note [A skipped step leaves the state as it was]
A step whose result is not finite is skipped, and skipped entirely: its momentum,
moments and step count must not be advanced either, or the next steps would use a
momentum holding the rejected gradient (or an infinite moment) and a wrong bias
correction. The point is known to be acceptable only after the rule ran, so the state
before the step is kept aside. A rule that only replaces its state tensors (``state[key]
= new tensor``, never ``state[key].mul_(...)``), as every built-in rule does and
declares with ``writes_state_in_place = False``, needs a copy of the dict only (no
tensor copied); a rule that writes into them (the default for a plugin) gets its state
tensors cloned before each step. The promise is checked by the tensors' version counters
after every step (RuntimeError if broken).

Note [The step's flags are read once, after the step]
Whether a step is accepted (its gradient and its result finite) is a tensor, and reading
it is a synchronisation with the device (under ``torch.compile``, a graph break). So
every rule runs, even on a non-finite gradient (nothing is written from a NaN), and the
flags of every parameter of every group are read in one host read at the end of
``step()`` (`commit`): accepted steps are written, the others restore their state (new
keys removed) and warn at once. A traced step writes ``torch.where(ok, new, old)`` for
each point and state tensor (`select`); a key a rule added on a skipped first step then
holds zeros, which every built-in rule reads as its absence except the first heavy-ball
buffer ((1 − δ)g instead of g). Its skips are counted on the device and warned about
when read (the next eager ``step()`` or ``report_skipped()``). The off-manifold test
(Note [Off-manifold points at a step]) projects under ``torch.cond`` in a traced step;
an eager step reads it only where it can be true: the first step, after a change the
optimizer did not make (its version counter or storage), and every step that forms the
point's Gram (an in-place change through ``.data``, which has a version counter of its
own)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..manifolds.kernels.reads import StepChecks
from ..manifolds.kernels.reduce import absmax_from, memory_order, rows_absmax
from ..manifolds.sharded import any_rank, is_dtensor
from . import master, skips
from .buckets import (
    BOUNDS,
    STEP,
    VERSIONS,
    Bucket,
    check_rows,
    last_bounds,
    publish,
    rule_keys,
    stack_state,
    unstack_state,
    write,
)
from .layout import by_rows

__all__ = ["Computed", "compute", "commit", "select"]


@dataclass(eq=False)
class Computed:
    """A bucket's step, computed and not written.

    Attributes:
        bucket: the parameters.
        group: their param group.
        work: the rule's state after the rule (stacked for a bucket of several).
        before: the rule's state before the rule (for `select`).
        start: the point the rule stepped from (in the rule's orientation).
        new: the rule's result (None: LAPACK refused the input).
        grad_ok: the gradients are finite (one flag per parameter, or a 0-dim one).
        ok: the gradients and the results are finite.
        off: a tested point is off its manifold (an unread 0-dim flag), or None.
        checks: the kernels' tests of their short paths (unread 0-dim flags; one False:
            the bucket is stepped again on the exact paths).
        quiet: computed for a step that reads nothing (traced or capturable).
        measured: the bounds the kernels measured (unread); ``bounds``: the same, read.
        accepted: the step counts of the parameters whose steps were written (eager).
    """

    bucket: Bucket
    group: dict
    work: dict
    before: dict
    start: torch.Tensor
    new: torch.Tensor | None
    grad_ok: torch.Tensor
    ok: torch.Tensor
    off: torch.Tensor | None
    checks: list
    quiet: bool
    measured: list = field(default_factory=list)
    bounds: dict = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)


def _working_state(opt, bucket: Bucket, states: list[dict], x: torch.Tensor) -> dict:
    """The state the rule works on (Note [The rule works on a copy of the state])."""
    copy = opt.writes_state_in_place
    if not bucket.single:
        work = stack_state(bucket, states, x, copy)
        if STEP in work:
            work[STEP] = work[STEP].to(x.device)  # broadcast against the rule's (P, …) numbers
        return work
    work = {k: states[0][k] for k in rule_keys(states[0])}
    if copy:
        work = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in work.items()}
    return work


def compute(
    opt, bucket: Bucket, group: dict, quiet: bool, tested: bool = False, exact: bool = False
) -> Computed:
    """Call the rule once for a bucket; write nothing.

    Args:
        opt: the optimizer.
        bucket: the parameters.
        group: their param group.
        quiet: no host read (a traced or capturable step).
        tested: the points were just tested and projected (the off-manifold test
            is not repeated; the Gram of the projected points is formed for the step).
        exact: the kernels read their tests and take their exact paths where the
            short ones are refused (the step again of a refused bucket, Note [Refused
            matrices in a step that reads nothing] in `stiefel.manifolds.kernels.frame`).
    """
    geo = bucket.binding.geo  # made by the step's bind, again only when the options change
    states = [opt.state[p] for p in bucket.params]
    xs, grads = bucket.params, [p.grad for p in bucket.params]
    if bucket.params[0].dtype in master.LOW_PRECISION:  # their float32 masters
        pairs = [master.working(p, g, s) for p, g, s in zip(xs, grads, states, strict=True)]
        xs, grads = [xp for xp, _ in pairs], [g for _, g in pairs]
    if bucket.single:
        x, grad = xs[0].detach(), grads[0]
    else:  # under no_grad: the stack of the parameters themselves is a detached copy
        x, grad = torch.stack(xs), torch.stack(grads)
    if bucket.binding.transposed:
        x, grad = x.mT, grad.mT
    if geo.stiefel and x.dim() > 2:  # Note [Batches stepped by rows]: a CPU batch by columns
        x, grad = (t if t.is_contiguous() else by_rows(t) for t in (x, grad))
    if bucket.single:
        grad_ok, absmax = finite_gradient(grad)
    else:
        grad_ok, absmax = finite_rows(grad), None
    checks = None if quiet or exact else StepChecks(last_bounds(states))
    for_step = getattr(geo, "for_step", None)  # a third party's geometry may lack it
    if for_step is not None:
        geo = for_step(checks, grad, absmax, reads=not quiet)
    work = _working_state(opt, bucket, states, x)
    count = bucket.count  # None in a quiet step (`buckets.plan`)
    unchanged = not quiet and all(
        master.unchanged(p, s) for p, s in zip(bucket.params, states, strict=True)
    )
    off = None
    if tested:
        geo.off_manifold(x)  # the step reuses the Gram of the projected point
    elif not (opt.accepts_off_manifold and unchanged):
        off = geo.off_manifold(x, count, unchanged, bound=opt.off_manifold_bound)
        if off is not None and quiet:  # Note [One host read per step]
            x = project_where(off, geo, x)
            off = None
    before = dict(work)
    if opt.writes_state_in_place:
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in before.items()}
    traced = torch.compiler.is_compiling()  # a traced step cannot read version counters
    tensors = {k: v for k, v in work.items() if isinstance(v, torch.Tensor)}
    versions = {} if traced else {k: v._version for k, v in tensors.items()}
    steps = work.get(STEP)
    if steps is None:
        shape = () if bucket.single else (len(bucket.params), *(1,) * (x.dim() - 1))
        steps = torch.zeros(shape, device=x.device if quiet or not bucket.single else "cpu")
    work[STEP] = steps + 1
    try:
        new = opt.update(geo, x, grad, work, group)
    except torch.linalg.LinAlgError:  # eager LAPACK refusing a non-finite input
        if not bucket.single:
            raise  # the caller steps the bucket's parameters one by one
        new = None
    if not opt.writes_state_in_place:
        _check_promise(opt, before, versions)
    if not bucket.single:
        check_rows(type(opt).__name__, work, len(bucket.params))
    if new is None:
        ok = torch.zeros_like(grad_ok)
    else:
        ok = grad_ok & (finite(new) if bucket.single else finite_rows(new))
        still = group.get("lr") == 0  # Note [A step of lr 0 leaves the point where it is]
        if not isinstance(still, torch.Tensor):
            new = x if still else new
        elif not is_dtensor(x):  # a tensor lr: chosen on the device, unread
            new = torch.where(still.to(x.device), x, new)
    tests, measured = ([], []) if checks is None else (list(checks), checks.measured)
    return Computed(bucket, group, work, before, x, new, grad_ok, ok, off, tests, quiet, measured)


def _check_promise(opt, before: dict, versions: dict) -> None:
    """A rule declaring ``writes_state_in_place = False`` kept it (else: RuntimeError)."""
    for key, version in versions.items():
        if before[key]._version != version:
            raise RuntimeError(
                f"{type(opt).__name__}.update wrote into state[{key!r}] in place but the "
                "class declares writes_state_in_place = False; replace the tensor "
                "(state[key] = new) or set writes_state_in_place = True, so that a "
                "skipped step can restore the state"
            )


def project_where(flag: torch.Tensor, geo, x: torch.Tensor) -> torch.Tensor:
    """``geo.project(x)`` where the bool tensor ``flag`` is True, else ``x``, without a read.

    Traced: `torch.cond` (the projection runs only when needed); eager (a capturable
    step): both, chosen by ``torch.where``.
    """
    if not torch.compiler.is_compiling():
        return torch.where(flag, geo.project(x), x)

    def project(t: torch.Tensor) -> torch.Tensor:
        return geo.project(t).contiguous()

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format)

    return torch.cond(flag, project, keep, (x,))


def _write(opt, c: Computed, rows: list[int], new=None, work=None) -> None:
    """Write the accepted ``rows`` of a bucket: points (one foreach copy) and states.

    ``new`` and ``work`` replace the rule's result and state (`select`'s choices, after
    which the host does not know which steps were skipped: no count is kept).
    """
    bucket = c.bucket
    work = c.work if work is None else work
    new = c.new if new is None else new
    if bucket.binding.transposed:
        new = new.mT
    params = [bucket.params[r] for r in rows]
    states = [opt.state[p] for p in params]
    views = [new] if bucket.single else new.unbind(0)
    news = [views[r] for r in rows]
    if params[0].dtype in master.LOW_PRECISION:  # Note [float32 master copy ...]
        master.store_all(params, states, news)
    else:
        write(params, states, news)
    shares = [work] if bucket.single else unstack_state(bucket, work, rows)
    count = None if c.quiet else 1 if bucket.count is None else bucket.count + 1
    # finite bounds only: a step that measured none (or NaN) leaves the last ones; one
    # record for the bucket's parameters, never written into (`buckets.last_bounds`)
    bounds = c.bounds if all(map(math.isfinite, c.bounds.values())) else {}
    for state, share in zip(states, shares, strict=True):
        publish(state, share, count)
        if bounds:
            state[BOUNDS] = bounds
    if count is not None:
        c.accepted += [count] * len(rows)


def commit(opt, computed: list[Computed]) -> list[Computed]:
    """Write every accepted step after one host read of all flags (Note [One host read ...]).

    Returns:
        The buckets whose tested points were off their manifolds: they wrote nothing and
        are to be stepped again from their projected points.
    """
    if not computed:
        return []
    device = computed[0].ok.device
    # the one read: every bucket's flags and measured bounds (`_flags`) in one vector
    parts = [_flags(c).to(device) for c in computed]
    values = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    again, at = [], 0
    for c in computed:
        size = len(c.bucket.params)
        grad_ok = [v != 0 for v in values[at : at + size]]
        ok = [v != 0 for v in values[at + size : at + 2 * size]]
        at += 2 * size
        off = c.off is not None and values[at] != 0
        at += c.off is not None
        refused = not all(values[at : at + len(c.checks)])
        at += len(c.checks)
        if c.measured:  # for the next step (Note [Euler's product sized by the last step])
            c.bounds = {site: values[at + i] for i, (site, _) in enumerate(c.measured)}
            at += len(c.measured)
        if off:
            again.append(c)
            continue
        if refused:  # the rare path: the kernels' exact paths, with their reads
            redo = compute(opt, c.bucket, c.group, False, exact=True)
            redo.bounds = c.bounds  # what the refused step measured sizes the next
            again += commit(opt, [redo])
            c.accepted += redo.accepted
            continue
        rows = [r for r in range(size) if ok[r]]  # all False where LAPACK refused (new None)
        if rows:
            _write(opt, c, rows)
        for r in range(size):
            if not ok[r]:
                skips.warn(opt, c.bucket.where(r), grad_ok[r])  # then the next step tests
                opt.state[c.bucket.params[r]].pop(VERSIONS, None)  # the point (Note [Points ...])
    return again


def _flags(c: Computed) -> torch.Tensor:
    """A bucket's flags as numbers (0, 1) and its bounds, in one vector: ``grad_ok``,
    ``ok``, ``off`` (if tested), the kernels' tests, the bounds of ``c.measured``."""
    off = [] if c.off is None else [c.off.reshape(())]
    tail = [*off, *c.checks, *(b for _, b in c.measured)]
    if c.bucket.single:  # all 0-dim: one stack
        return torch.stack([c.grad_ok.reshape(()), c.ok.reshape(()), *tail])
    heads = [c.grad_ok.reshape(-1), c.ok.reshape(-1)]
    return torch.cat(heads + [torch.stack(tail)] if tail else heads)


def select(opt, computed: list[Computed]) -> None:
    """`commit` without a host read: points and states chosen by ``torch.where``.

    A key the rule added gets its new value where the step is accepted and zeros
    elsewhere (what a skipped first step leaves: every built-in rule reads zeros as
    the absence of its moment). The skips are counted on the device (`skips.record`).
    """
    for c in computed:
        bucket = c.bucket
        if c.new is None:
            continue
        # new names, not fields of ``c`` written over: a traced step reads locals
        new = torch.where(_rows(c.ok, c.start, bucket.single), c.new, c.start)
        work = {}
        for key, value in c.work.items():
            if not isinstance(value, torch.Tensor):
                work[key] = value
                continue
            old = c.before.get(key)
            if not isinstance(old, torch.Tensor) or old.shape != value.shape:
                old = torch.zeros_like(value)
            keep = _rows(c.ok, value, bucket.single).to(value.device)
            work[key] = torch.where(keep, value, old.to(value.device, value.dtype))
        rows = list(range(len(bucket.params)))
        _write(opt, c, rows, new, work)
        skips.record(opt, [bucket.where(r) for r in rows], c.grad_ok, c.ok, bucket.params)


def _rows(ok: torch.Tensor, like: torch.Tensor, single: bool) -> torch.Tensor:
    """The flags ``ok`` shaped to choose whole rows of ``like`` (one per parameter)."""
    return ok.reshape(()) if single else ok.reshape(-1, *(1,) * (like.dim() - 1))


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

r"""The step of a bucket: the rule's call (`compute`) and the write of its result (`commit`).

Note [The rule works on a copy of the state]
A rule steps a bucket with a state of its own (the parameters' state tensors
stacked, or a shallow copy of one parameter's state; cloned for a rule that
writes into its tensors): the parameters' states are not touched before
`commit`. So a rule that raises leaves every parameter and every state as
they were (nothing to roll back), and a step skipped for a non-finite
gradient or result keeps its parameter's state exactly (Note [A skipped step
leaves the state as it was] in `stiefel.optimizers.transaction`).

Note [One host read per step]
What the host must learn from a step is whether each parameter's gradient
and result are finite, and whether a point tested this step is off its
manifold (Note [Off-manifold points at a step]). An eager step stacks those
flags for every bucket of every group and reads them once, after every rule
ran (`commit`): accepted steps are written (one ``_foreach_copy_`` per
bucket); a skipped one keeps its point and state and warns; a bucket whose
tested point was off is stepped again parameter by parameter from the
projected points (the rare path, where the reads of Note [Off-manifold points
at a step] are paid); a bucket for which a kernel refused its short path for
some matrix (a long step, a badly conditioned factorization: Note [Refused
matrices in a step that reads nothing] in `stiefel.manifolds.kernels.frame`) is
stepped again with the kernels reading their tests, which take the exact paths
there. The step counts the host needs (the schedule of the
tests and corrections, ``repair_every``) are kept beside the state's tensors
(`buckets.HOST_STEP`), never read back. A step traced by ``torch.compile``
or made ``capturable`` reads nothing: points and states are chosen by
``torch.where`` on the flags (`select`), the skips are counted on the device
(`stiefel.optimizers.skips`), and every point is tested and corrected at every
step (no schedule the host would have to know).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..manifolds.kernels.frame import CHECK_EVERY
from . import master, skips
from .buckets import STEP, Bucket, publish, rule_keys, stack_state, unstack_state
from .layout import by_rows
from .transaction import finite, finite_gradient, finite_rows

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
        refused: a kernel refused its short path for some matrix (an unread 0-dim flag;
            the bucket is stepped again with the kernels' exact paths), or None.
        quiet: computed for a step that reads nothing (traced or capturable).
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
    refused: torch.Tensor | None
    quiet: bool
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
    geo = bucket.binding.bind(group)
    states = [opt.state[p] for p in bucket.params]
    orient = bucket.binding.orient
    if bucket.single:
        x, grad = map(orient, master.working(bucket.params[0], bucket.params[0].grad, states[0]))
    else:  # under no_grad: the stack of the parameters themselves is a detached copy
        xs, grads = bucket.params, [p.grad for p in bucket.params]
        if bucket.params[0].dtype in master.LOW_PRECISION:  # their float32 masters
            pairs = [master.working(p, g, s) for p, g, s in zip(xs, grads, states, strict=True)]
            xs, grads = [xp for xp, _ in pairs], [g for _, g in pairs]
        x, grad = orient(torch.stack(xs)), orient(torch.stack(grads))
    if geo.stiefel:  # Note [Batches stepped by rows]
        x, grad = by_rows(x), by_rows(grad)
    if bucket.single:
        grad_ok, absmax = finite_gradient(grad)
    else:
        grad_ok, absmax = finite_rows(grad), None
    checks = None if quiet or exact else []
    for_step = getattr(geo, "for_step", None)  # a third party's geometry may lack it
    if for_step is not None:
        geo = for_step(checks, grad, absmax)
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
        elif off is not None and unchanged and count is not None and count % CHECK_EVERY:
            off = None  # not a scheduled test: only its Gram is used, by the step
    before = dict(work)
    if opt.writes_state_in_place:
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in before.items()}
    traced = torch.compiler.is_compiling()  # a traced step cannot read version counters
    versions = (
        {} if traced else {k: v._version for k, v in work.items() if isinstance(v, torch.Tensor)}
    )
    steps = work.get(STEP)
    if steps is None:
        shape = () if bucket.single else (len(bucket.params), *(1,) * (x.dim() - 1))
        steps = torch.zeros(shape, device=x.device if quiet or not bucket.single else "cpu")
    work[STEP] = steps + 1
    try:
        new = opt.update(geo, x, grad, work, group)
    except torch.linalg.LinAlgError:  # eager LAPACK refusing a non-finite input
        new = None
    if not opt.writes_state_in_place:
        _check_promise(opt, before, versions)
    if new is None:
        ok = torch.zeros_like(grad_ok)
    else:
        ok = grad_ok & (finite(new) if bucket.single else finite_rows(new))
    refused = ~torch.stack([c.to(x.device) for c in checks]).all() if checks else None
    return Computed(bucket, group, work, before, x, new, grad_ok, ok, off, refused, quiet)


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
    new = bucket.binding.orient(c.new if new is None else new)
    params = [bucket.params[r] for r in rows]
    states = [opt.state[p] for p in params]
    if bucket.single:
        master.store(params[0], states[0], new)
        shares = [work]
    else:
        news = new.unbind(0)
        master.store_all(params, states, [news[r] for r in rows])
        shares = unstack_state(bucket, work, rows)
    count = None if c.quiet else 1 if bucket.count is None else bucket.count + 1
    for state, share in zip(states, shares, strict=True):
        publish(state, share, count)
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
    flags = []
    no = torch.zeros(1, dtype=torch.bool, device=device)
    for c in computed:
        flags += [
            (no if c.off is None else c.off).reshape(1).to(device),
            (no if c.refused is None else c.refused).reshape(1).to(device),
            c.grad_ok.reshape(-1).to(device),
            c.ok.reshape(-1).to(device),
        ]
    values = torch.cat(flags).tolist()  # the one read
    again, at = [], 0
    for c in computed:
        size = len(c.bucket.params)
        off, refused, grad_ok, ok = (
            values[at],
            values[at + 1],
            values[at + 2 : at + 2 + size],
            values[at + 2 + size : at + 2 + 2 * size],
        )
        at += 2 + 2 * size
        if off:
            again.append(c)
            continue
        if refused:  # the rare path: the kernels' exact paths, with their reads
            redo = compute(opt, c.bucket, c.group, False, exact=True)
            again += commit(opt, [redo])
            c.accepted += redo.accepted
            continue
        rows = [r for r in range(size) if ok[r]]  # all False where LAPACK refused (new None)
        if rows:
            _write(opt, c, rows)
        for r in range(size):
            if not ok[r]:
                skips.warn(opt, c.bucket.where(r), grad_ok[r])
    return again


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

r"""Buckets: the parameters of a param group that one call of the rule steps together.

Note [One rule call per bucket]
On a GPU a step over many small parameters is bound by kernel launches and
host reads, not by FLOPs: a rule called once per parameter dispatches its
dozens of operations once per parameter. Every kernel of this package takes a
batch of matrices (leading dimensions), so parameters that the same rule steps
with the same geometry can be stepped as one batch: parameters with the same
manifold (class and options), shape, dtype, device and layout, and the same
state keys and step count. Their points and gradients are stacked into one
(P, ...) tensor (a parameter that is already a batch joins with its matrices),
the rule is called once, and the new points are written back by one
``torch._foreach_copy_``. Each matrix is stepped exactly as alone: the rules
reduce per matrix (Grams, norms, step sizes of shape (..., 1, 1)). Points are
stacked only for a rule that declares so (``RiemannianOptimizer.buckets_points``:
a plugin's rule, written for one parameter, may reduce over all of it), and a
plain tensor only for one that declares its Euclidean form elementwise
(``RiemannianOptimizer.buckets_plain``).

Stacking is not free: the points and gradients are copied into the stack and
the new points out of it, three passes over the data that a rule call per
parameter does not make. A rule call costs a fixed time per operation it
dispatches (on a GPU a kernel launch each), so the stack pays for small
parameters and on a GPU, and costs up to a fifth of a bandwidth-bound step on
large ones on the CPU. ``foreach=None`` (the default) therefore stacks every
parameter on a CUDA device and, elsewhere, parameters of at most `SMALL`
entries; ``foreach=True`` stacks every parameter that can be.

The state stays per parameter in torch's format (``opt.state[p]``, what
``state_dict`` saves): a bucket stacks its parameters' state tensors for the
rule and hands each parameter the view of its row of the result. At the next
step, state tensors that are still those views of one stacked tensor are used
as that tensor (no copy): in a steady run the state is stacked once. The step
count is stacked as a (P,) vector and handed to the rule as (P, 1, …, 1), so
that it broadcasts against the per-matrix quantities of the rule.

Beside each parameter's state the host keeps what it knows without a read: the
step count (``HOST_STEP``) and the versions of the point after the optimizer's
last write (``VERSIONS``, Note [Points as the optimizer left them]), which decide
the buckets and the schedule of the off-manifold tests; `write` puts the new
points back and records them.

Example:
    ```python
    import torch, geoopt
    from stiefel.manifolds import Stiefel
    from stiefel import optimizers

    st = Stiefel(8, 4)
    ws = [geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st) for _ in range(3)]
    alone = [geoopt.ManifoldParameter(w.detach().clone(), manifold=st) for w in ws]
    for a, b in zip(ws, alone):
        a.grad = b.grad = torch.randn(8, 4, dtype=torch.float64)
    optimizers.create("radam", ws, lr=0.1, foreach=True).step()  # one call for the three
    optimizers.create("radam", alone, lr=0.1, foreach=False).step()  # three calls
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ws, alone))
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..parametrizations._precision import real_work_dtype, work_dtype
from .geometry import Binding

__all__ = [
    "Bucket",
    "plan",
    "stack_state",
    "unstack_state",
    "publish",
    "rule_keys",
    "write",
    "check_rows",
    "unchanged",
    "record_versions",
    "STEP",
    "HOST_STEP",
    "VERSIONS",
    "BOUNDS",
    "SMALL",
    "PLAIN",
    "last_bounds",
]

#: the dispatch of plain tensors (Parameter's, geoopt's ManifoldParameter's)
PLAIN = torch.Tensor.__torch_dispatch__
#: with ``foreach=None``, the largest parameter (entries) stacked off a CUDA device
SMALL = 1 << 16
#: the state key of the step count (torch's name), a float tensor per parameter
STEP = "step"
#: the state key of the step count as the host knows it (never saved: `master.strip`)
HOST_STEP = "_host_step"
#: the state key of the versions recorded after the optimizer's last write (never saved)
VERSIONS = "_versions"
#: the state key of what the last step measured for its short paths, ``{site: float}``:
#: the bounds of its near-identity solves and its overflow-safe scales (saved: a resumed
#: run takes the paths of the run it resumes; Note [Euler's product sized by the last
#: step], Note [Scales taken as one from the last step])
BOUNDS = "short_path_bounds"


@dataclass(eq=False)
class Bucket:
    """Parameters of one param group stepped by one call of the rule.

    Attributes:
        params: the parameters (one, or several of the same kind).
        indices: their indices in the group.
        binding: the binding of the first (every parameter's is alike).
        count: their step count as the host knows it (None: never stepped, or unknown).
        views: the state views the last step of the same parameters left.
        group: the index of their param group, and its ``param_names`` (None: not
            given), for messages.
    """

    params: list[torch.Tensor]
    indices: list[int]
    binding: Binding
    count: int | None
    views: dict = field(default_factory=dict)
    group: tuple[int, list[str] | None] = (0, None)

    @property
    def single(self) -> bool:
        return len(self.params) == 1

    def split(self) -> list[Bucket]:
        """A bucket of one for each parameter."""
        return [
            Bucket([p], [i], self.binding, self.count, group=self.group)
            for p, i in zip(self.params, self.indices, strict=True)
        ]

    def where(self, k: int = 0) -> str:
        """Parameter ``k`` of the bucket, named for a warning or an error."""
        p, i, (g, names) = self.params[k], self.indices[k], self.group
        name = f"{names[i]!r}, " if names else ""
        return f"a parameter ({name}index {i} of param group {g}, shape {tuple(p.shape)})"


def rule_keys(state: dict) -> list[str]:
    """The keys of a parameter's state that its rule owns (not the master, not the host's)."""
    return [k for k in state if not k.startswith("_") and k not in ("master", BOUNDS)]


def state_hint(opt, bucket: Bucket) -> str:
    """A likely cause of a rule's failure on ``bucket`` read from its parameters' state, as
    " (...)" to append to the error; "" where they have no state to suspect."""
    wide, held = getattr(opt, "wide_state", frozenset()), False
    for p in bucket.params:
        state = opt.state[p]
        # a complex point keeps real per-matrix terms (radam's second moment) beside its own
        dtypes = {work_dtype(p.dtype), real_work_dtype(p.dtype)}
        for key in rule_keys(state):
            v = state[key]
            if key == STEP or key in wide or not isinstance(v, torch.Tensor):
                continue
            held = True
            if (
                v.device != p.device
                or (v.is_floating_point() or v.is_complex())
                and v.dtype not in dtypes
            ):
                return (
                    f" (its state {key!r} is {v.dtype} on {v.device} where the parameter is "
                    f"{p.dtype} on {p.device}: if a module was moved or cast after the "
                    "optimizer's steps, build the optimizer after the move, as for torch's "
                    "optimizers, or save its state_dict and load it into one built after (the "
                    "load casts it))"
                )
    if not held:
        return ""
    return (
        " (if the state was edited by hand or loaded from elsewhere, a state of another "
        "shape is a common cause)"
    )


def last_bounds(states: list[dict]) -> dict[str, float]:
    """The bounds the parameters' last step measured, the largest per site (empty: unknown).

    Parameters stepped apart before (or one without a record) give no bound: the
    kernels then take their exact paths once and measure. Parameters written by one
    step share one record (the optimizer replaces it, never writes into it).
    """
    records = [s.get(BOUNDS) for s in states]
    if not records or any(r is None for r in records):
        return {}
    if all(r is records[0] for r in records):  # stepped together last: one record
        return records[0]
    sites = set(records[0])
    if any(set(r) != sites for r in records):
        return {}
    return {site: max(r[site] for r in records) for site in sites}


def host_count(state: dict) -> int | None:
    """The step count of a parameter as the host knows it (None: no step yet).

    The count is kept beside the state's tensor (``HOST_STEP``) whenever the
    optimizer writes it; a state that lacks it (a state loaded by hand) is read
    once.
    """
    if STEP not in state:
        return None
    known = state.get(HOST_STEP)
    if known is None:
        known = state[HOST_STEP] = int(state[STEP])
    return known


def _kind(
    p: torch.Tensor,
    binding: Binding,
    state: dict,
    foreach: bool | None,
    batches: tuple[bool, bool],
    quiet: bool,
) -> tuple | None:
    """What a parameter must share with the others of its bucket (None: it steps alone)."""
    if foreach is None and p.device.type != "cuda" and p.numel() > SMALL:
        return None  # Note [One rule call per bucket]: the stack does not pay here
    # a DTensor, a tensor subclass with a dispatch of its own: stepped alone
    if binding.like is not None or type(p).__torch_dispatch__ is not PLAIN or p.grad.is_sparse:
        return None
    man, (plain, points) = binding.manifold, batches
    if (man is None and not plain) or (man is not None and not points):
        return None  # the rule's form for this parameter steps one at a time
    if man is not None and not binding.stiefel:
        return None  # another geoopt manifold: its operations may read the whole tensor
    keys = tuple(sorted(rule_keys(state)))
    if any(not isinstance(state[k], torch.Tensor) for k in keys):
        return None
    return (
        binding.kind, binding.transposed, binding.implied, tuple(p.shape), p.stride(),
        p.dtype, p.device, p.grad.dtype, p.grad.stride(), keys,
        None if quiet else host_count(state),
    )  # fmt: skip


def plan(
    params: list[torch.Tensor],
    bindings: list[Binding],
    states,
    foreach: bool | None,
    batches: tuple[bool, bool],
    quiet: bool = False,
    group: tuple[int, list[str] | None] = (0, None),
) -> list[Bucket]:
    """The buckets of a param group's parameters that have a gradient, in group order.

    Args:
        params: the group's parameters.
        bindings: their bindings.
        states: the optimizer's state (``opt.state``).
        foreach: stack parameters of the same kind (None: those that pay, Note [One
            rule call per bucket]; False: every parameter alone).
        batches: whether plain tensors may be stacked (the rule's Euclidean form is
            elementwise) and whether manifold points may (`RiemannianOptimizer.buckets_points`).
        quiet: no host read (a traced or capturable step): step counts are not known.
        group: the group's index and ``param_names`` (None: not given), for messages.

    Returns:
        One bucket per kind of parameter (each parameter alone without ``foreach``).

    Raises:
        ValueError: a gradient of another shape than its parameter's.
        TypeError: a sparse gradient.
    """
    buckets: list[Bucket] = []
    by_kind: dict[tuple, Bucket] = {}
    alone = foreach is False or len(params) == 1  # every parameter is a bucket of its own
    for i, (p, binding) in enumerate(zip(params, bindings, strict=True)):
        if p.grad is None:
            continue
        if p.grad.shape != p.shape:  # torch's .grad setter refuses it; .grad.data does not
            raise ValueError(
                f"parameter {i} of param group {group[0]} has shape {tuple(p.shape)} and a "
                f"gradient of shape {tuple(p.grad.shape)}; allowed: a gradient of its shape"
            )
        if p.grad.layout != torch.strided:  # before any step of the group is computed
            raise TypeError(
                f"parameter {i} of param group {group[0]} (shape {tuple(p.shape)}) has a "
                f"{p.grad.layout} gradient; allowed: dense (strided) gradients (every rule "
                "here reads the whole gradient); for nn.Embedding(sparse=True) step the "
                "embedding with torch.optim.SparseAdam or SGD, or build it with sparse=False"
            )
        state = states[p]
        kind = None if alone else _kind(p, binding, state, foreach, batches, quiet)
        bucket = None if kind is None else by_kind.get(kind)
        if bucket is None:
            bucket = Bucket([p], [i], binding, None if quiet else host_count(state), group=group)
            buckets.append(bucket)
            if kind is not None:
                by_kind[kind] = bucket
        else:
            bucket.params.append(p)
            bucket.indices.append(i)
    return buckets


def stack_state(bucket: Bucket, states: list[dict], x: torch.Tensor, copy: bool) -> dict:
    """The state a rule steps the bucket with: each key stacked over the parameters.

    Tensors that are the views `unstack_state` handed out at the previous step are
    used as the tensor they view (Note [One rule call per bucket]), unless ``copy``
    (a rule that writes into its state: it gets a fresh copy).
    """
    work: dict = {}
    for key in rule_keys(states[0]):
        values = [s[key] for s in states]
        held = bucket.views.get(key)
        if (
            not copy
            and held is not None
            and all(v is h for v, h in zip(values, held[1], strict=True))
        ):
            base = held[0]
        else:
            base = torch.stack(values)
        work[key] = base
    if STEP in work:
        work[STEP] = work[STEP].view(-1, *(1,) * (x.dim() - 1))
    return work


def check_rows(owner: str, work: dict, rows: int) -> None:
    """Refuse a rule's state for a bucket of ``rows`` parameters that is not one row each.

    Raised before anything is written (Note [Safe step]): `unstack_state` hands each
    parameter its row, which a 0-dim or otherwise shaped tensor does not have. A
    ValueError, not a RuntimeError: the rule's own output is at fault, and the step's
    wrapper of RuntimeErrors would add its hint about edited state.

    Raises:
        ValueError: a state tensor without one row per parameter, named with its shape.
    """
    bad = [
        f"state[{k!r}] of shape {tuple(v.shape)}"
        for k, v in work.items()
        if isinstance(v, torch.Tensor) and (v.dim() == 0 or v.shape[0] != rows)
    ]
    if bad:
        raise ValueError(
            f"{owner}.update stepped {rows} parameters as one batch (buckets_points or "
            f"buckets_plain) and left {', '.join(bad)}, not one row per parameter; keep a "
            "leading dimension of one row per parameter, or step one parameter at a time "
            "(buckets_points = buckets_plain = False)"
        )


def unstack_state(bucket: Bucket, work: dict, rows: list[int] | None = None) -> list[dict]:
    """Each parameter's share of the rule's state (views of its row), for ``rows`` (all)."""
    rows = list(range(len(bucket.params))) if rows is None else rows
    shares: list[dict] = [{} for _ in rows]
    bucket.views.clear()  # in place: the optimizer holds this dict for the next step
    for key, value in work.items():
        if not isinstance(value, torch.Tensor):
            for share in shares:
                share[key] = value
            continue
        base = value.reshape(len(bucket.params)) if key == STEP else value
        views = base.unbind(0)
        if len(rows) == len(bucket.params):
            bucket.views[key] = (base, views)
        for share, r in zip(shares, rows, strict=True):
            share[key] = views[r]
    return shares


def publish(state: dict, share: dict, count: int | None) -> None:
    """Replace a parameter's state by the rule's (its master and version record kept).

    ``count`` is the step count the host knows (None: unknown, read when next needed).
    """
    kept = {k: v for k, v in state.items() if k in ("master", VERSIONS, BOUNDS)}
    state.clear()
    state.update(share)
    state.update(kept)
    state[HOST_STEP] = count


def write(params: list[torch.Tensor], states: list[dict], news: list[torch.Tensor]) -> None:
    """Write new points into the parameters (one ``_foreach_copy_``) and record their versions.

    Not for a float16/bfloat16 parameter with a float32 master (`master.store_all`).

    Args:
        params: the parameters.
        states: their state dicts.
        news: their new points.
    """
    if len(params) == 1:  # a DTensor or another subclass: its own copy_
        params[0].copy_(news[0])
    else:
        torch._foreach_copy_(params, news)
    record_versions(params, states)


def _versions(p: torch.Tensor, state: dict) -> tuple:
    held = state.get("master")
    version = getattr(p, "_version", None)
    return (version, p.data_ptr(), None if held is None else held._version)


def unchanged(p: torch.Tensor, state: dict) -> bool:
    """Whether p (and its master) are as this optimizer's last write left them.

    Note [Points as the optimizer left them]
    torch's version counter of a tensor counts its in-place changes
    (``nn.Module.load_state_dict``'s ``copy_``, an initializer, an edit under
    ``no_grad``); its storage changes when a tensor is assigned to ``p.data``
    (``vector_to_parameters``, a swap with an EMA copy), which leaves the counter as
    it was. After each write the optimizer records p's version and storage address
    and its master's version in p's state (``state["_versions"]``, never saved:
    `master.strip`); p is "as the optimizer left it" when they still match. A
    geometry may then skip its off-manifold test (and the wide Gram of the point,
    Note [The drift correction every k-th step]) on the steps that form no Gram.
    An in-place change through ``.data`` (a counter of its own, the same storage)
    is caught at the next step that forms the Gram: the test is read there with the
    step's flags. A skipped step forgets the record, so the step after it tests the
    point: an optimizer that accepts points off its manifold tests none it wrote
    (pogo, landing), and a point edited in place outside POGO's basin makes every
    step of it fail until projected (Note [POGO's basin]). A loaded optimizer has no
    record, so it tests every point at its next step (which points get corrected
    depends on the saved step count only, so a resumed run repeats the original one
    bit for bit). A step traced by
    ``torch.compile`` cannot read version counters: it records none (the next
    eager step tests the point) and chooses between the master and p by
    ``torch.where`` on the same equality test, without a host read. A DTensor's
    address is 0: its ``.data`` assignments are caught as in-place ones.
    """
    held = state.get(VERSIONS)
    return held is not None and held[0] is not None and held == _versions(p, state)


def record_versions(params: list[torch.Tensor], states: list[dict]) -> None:
    """Record the versions of points just written (none in a traced step: no counters)."""
    compiling = torch.compiler.is_compiling()
    for p, state in zip(params, states, strict=True):
        if compiling:  # no record: the next eager step tests the point
            state.pop(VERSIONS, None)
        else:
            state[VERSIONS] = _versions(p, state)

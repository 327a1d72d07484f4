r"""Deferred initialisation: a constrained weight gets a valid point from torch's own recipe.

Note [Deferred initialisation by reset_parameters]
torch's recipe for a model built without memory (``with torch.device("meta")``,
FSDP2's documented recipe) is ``model.to_empty(device=...)`` and then
``reset_parameters()`` on every module that has one. ``to_empty`` leaves
uninitialised memory in the free parameters and the maps' buffers, and a
module's own ``reset_parameters`` (``nn.Linear``: ``kaiming_uniform_`` of
``self.weight``) writes into the *computed* weight, a temporary, so the
original would stay garbage. The mechanism, one for every constrained weight:
``orthogonalize`` hooks the module's ``reset_parameters`` on the class torch's
``parametrize`` made for that module alone (``ParametrizedLinear``, …; it
disappears with ``remove_parametrizations``, survives ``deepcopy``, and adds
nothing to the ``state_dict``). The hook first writes a fresh point into every
constrained original of the module (the map's ``initial`` with its
``fresh_init``, which also resets the map's buffers), then runs the module's
own ``reset_parameters`` (the bias, which reads the now valid weight). A
`Rotation` (``rotate``) is itself a module with ``reset_parameters``: back to
Q = I. `initialize` does the same for a whole model in one call, with an
``init`` and a generator. What was never initialised is refused at first use
(Note [Free parameters are checked at first use]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import geoopt
import torch
from torch import nn
from torch.nn.utils import parametrize

from .._core import checks as _checks
from ..manifolds import Stiefel, binding
from ._guards import checks_deferred
from .adapter import Rotation
from .base import INITS, RIEMANNIAN
from .factory import build
from .point import ManifoldPoint

__all__ = [
    "initialize",
    "hook_reset_parameters",
    "hook_riemannian_reset",
    "reset_constrained",
    "ResetParameters",
]


def _constrained(module: nn.Module) -> list[tuple[str, torch.Tensor, nn.Module]]:
    """(name, original, parametrization) of the module's own constrained tensors."""
    out = []
    if parametrize.is_parametrized(module):
        for name, plist in module.parametrizations.items():
            if len(plist) == 1 and hasattr(plist[0], "initial"):
                out.append((name, plist.original, plist[0]))
    return out


@torch.no_grad()
def _write(param: nn.Module, original: torch.Tensor, init, generator) -> None:
    """A fresh point's original into ``original`` (no value of the old one is read)."""
    init = param.fresh_init() if init is None else init
    if binding.is_dtensor(original):
        _write_sharded(param, original, init, generator)
    else:
        like = torch.empty(param.weight_shape, dtype=original.dtype, device=original.device)
        original.copy_(param.initial(like, init, generator).to(original.dtype))
    fmap = getattr(param, "map", param)
    if isinstance(fmap, ManifoldPoint) and isinstance(original, nn.Parameter):
        fmap.claim(original)  # to_empty rebuilt a plain Parameter


def _write_sharded(param: nn.Module, original, init, generator) -> None:
    """`_write` into a sharded original (FSDP2's recipe: ``fully_shard`` before the reset).

    Note [A fresh point for a sharded original]
    Every rank draws the whole original, but the ranks' generators need not
    agree: the point is scattered from the first rank of the mesh
    (``distribute_tensor``) and the map's buffers (signs, base points, drawn
    with it) are broadcast from the same rank, so that every rank holds the
    shards and buffers of one point.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    mesh = original.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"{param.label}: a fresh point for an original sharded on a {mesh.ndim}-D mesh is "
            "not supported; allowed: a 1-D mesh (or initialize before fully_shard)"
        )
    local = original.to_local()
    like = torch.empty(param.weight_shape, dtype=original.dtype, device=local.device)
    full = param.initial(like, init, generator).to(original.dtype)
    original.copy_(distribute_tensor(full, mesh, original.placements))
    for buf in param.buffers():
        dist.broadcast(buf, group=mesh.get_group(0), group_src=0)


def reset_constrained(module: nn.Module, init: str | None = None, generator=None) -> None:
    """Write a fresh point into the module's own constrained tensors (not its children's)."""
    for _, original, param in _constrained(module):
        if original.device.type != "meta":
            _write(param, original, init, generator)


@contextlib.contextmanager
def _gathered_weights(module: nn.Module) -> Iterator[None]:
    """Constrained weights with sharded originals readable by the module's own reset.

    FSDP2 gathers a sharded original only inside the forward; a module's own
    ``reset_parameters`` reads its weight outside it (nn.Linear's bias bound
    needs the weight's fan-in), where the map would mix a DTensor original with
    its local buffers. Those weights are computed once from the gathered
    original and served from torch's parametrization cache meanwhile; what the
    reset writes into them is discarded (the point was just written).
    """
    sharded = [c for c in _constrained(module) if binding.is_dtensor(c[1])]
    if not sharded:
        yield
        return
    with parametrize.cached():
        for name, original, param in sharded:
            with torch.no_grad():
                weight = param(original.full_tensor())
            parametrize._cache[(id(module), name)] = weight
        yield


def _own_reset(module: nn.Module):
    """The module's own ``reset_parameters`` (without this package's hooks), or None."""
    hook = module.__dict__.get("reset_parameters")
    if isinstance(hook, ResetParameters) and hook.own is not None:
        return hook.own
    for cls in type(module).__mro__:
        own = vars(cls).get("reset_parameters")
        if own is not None and own is not _RESET:
            return own.__get__(module, type(module))
    return None


def _riemannian(module: nn.Module) -> dict[str, tuple[torch.Tensor, geoopt.Manifold, str]]:
    """{name: (Parameter where it sits now, manifold, label)} of the module's Riemannian weights.

    Note [The manifold lives on the module] and Note [A weight under another
    parametrization] in `stiefel.manifolds.binding`; names whose tensor is gone
    or substituted (not an ``nn.Parameter``) are left out.
    """
    out = {}
    for name, (manifold, label) in binding.records(module).items():
        where = binding.slot(module, name)
        p = where[0]._parameters[where[1]] if where is not None else None
        if isinstance(p, nn.Parameter):
            out[name] = (p, manifold, label)
    return out


@torch.no_grad()
def _reset_riemannian(
    module: nn.Module, name: str, p: torch.Tensor, manifold, label: str, own_wrote: bool
) -> None:
    """A point of ``manifold`` in the Riemannian weight ``p``, marked (Note [A Riemannian
    weight is a point when reset_parameters returns])."""
    if p.device.type != "meta":
        hook = module.__dict__.get("reset_parameters")
        init = hook.inits.get(name) if isinstance(hook, ResetParameters) else None
        projected = False
        if own_wrote and init in (None, "nearest"):
            try:  # the nearest point of the module's own fresh weight
                binding.admit(p, manifold, label, "after the module's own reset_parameters()")
                projected = True
            except ValueError:  # non-finite or rank-deficient (zeros): no nearest point
                pass
        if not projected:
            point = build(RIEMANNIAN, tuple(p.shape), p.dtype, p.device)
            point.label, point.init = label, init
            _write(point, p, None, None)
    binding.mark(p, manifold)


class ResetParameters:
    """``module.reset_parameters`` of a module with a Riemannian weight (picklable).

    Note [A Riemannian weight is a point when reset_parameters returns]
    A map's original is reset by the hook on the class torch's ``parametrize``
    made for the module (Note [Deferred initialisation by reset_parameters]). A
    ``method="riemannian"`` weight has no such class: the module keeps its own
    (``nn.Linear``), shared by every other module of that class. So the hook is
    an instance attribute (``module.__dict__["reset_parameters"]``, which a
    method of the class does not shadow; copied by ``deepcopy`` and pickling,
    kept by ``fully_shard``'s class swap) and runs the same `_reset_parameters`:
    the maps' originals, the module's own reset, then each Riemannian weight:
    the nearest point of what the module's own reset wrote into it (as the
    first forward would project it) when ``init`` was None or ``"nearest"``,
    else a fresh point of that ``init`` ("nearest": a Haar point) — also when
    the module has no reset of its own, when what it wrote has no nearest
    point (zeros, or every rank of a CPU mesh seeded alike writing the same
    rows), or when a parametrization on top of the weight made the own reset
    write into a computed tensor. So a checkpoint
    saved, or a weight read, between the reset and the first forward is a
    point. The weight is marked again (``to_empty`` rebuilt it).
    """

    def __init__(self, module: nn.Module, own=None) -> None:
        self.module = module
        #: an instance attribute ``reset_parameters`` the module had before (its own reset)
        self.own = own
        #: ``{name: init}`` given to ``orthogonalize`` for each Riemannian weight
        self.inits: dict[str, str | None] = {}

    def __call__(self) -> None:
        _reset_parameters(self.module)


def hook_riemannian_reset(module: nn.Module, name: str, init: str | None) -> None:
    """Make ``module.reset_parameters()`` leave ``module.<name>`` a point of its manifold.

    Note [A Riemannian weight is a point when reset_parameters returns].
    """
    hook = module.__dict__.get("reset_parameters")
    if not isinstance(hook, ResetParameters):
        hook = ResetParameters(module, own=hook)
        module.__dict__["reset_parameters"] = hook
    hook.inits[name] = init


def _reset_parameters(self: nn.Module) -> None:
    """Constrained weights first (a fresh point), then the module's own reset, then its
    Riemannian weights (Note [A Riemannian weight is a point when reset_parameters returns]).

    A map whose output is a view of its original (the identity `ManifoldPoint`
    reshaped, ``gates=True`` with ``"riemannian"``) lets the module's own reset
    (``init.uniform_(self.weight_hh_l0)``) write into the original: those
    originals (their ``_version`` moved) get a fresh point again.
    """
    reset_constrained(self)
    own = _own_reset(self)
    points = _riemannian(self)
    before = {name: (p, p._version) for name, (p, _, _) in points.items()}
    if own is not None:
        versions = [(o, o._version) for _, o, _ in _constrained(self)]
        with _gathered_weights(self):
            own()
        for (_, original, param), (_, version) in zip(_constrained(self), versions, strict=True):
            if original._version != version and original.device.type != "meta":
                _write(param, original, None, None)
    for name, (p, manifold, label) in _riemannian(self).items():
        old, version = before.get(name, (None, None))
        # the module's own reset wrote into the Parameter itself (not through a
        # parametrization on top of it, which writes into a computed tensor)
        own_wrote = own is not None and p is old and p._version != version
        _reset_riemannian(self, name, p, manifold, label, own_wrote)
    _finish(self, None)


def _finish(module: nn.Module, init: str | None) -> None:
    """The module's own completion of its factors' point (Note [A module finishes the
    point of its factors]), if it has one."""
    finish = getattr(module, "stiefel_finish_init", None)
    if callable(finish):
        finish(init)


_RESET = _reset_parameters


def hook_reset_parameters(module: nn.Module) -> None:
    """Make ``module.reset_parameters()`` reset its constrained weights too (once per module),
    and its ``_apply`` (``to``, ``to_empty``) leave the first-use check to the next use.

    Note [Deferred initialisation by reset_parameters], Note [Weights computed inside
    _apply]. ``module`` must be parametrized (its class is then torch's per-module class).
    """
    cls = type(module)
    if cls.__dict__.get("reset_parameters") is not _reset_parameters:
        cls.reset_parameters = _reset_parameters
    if cls.__dict__.get("_apply") is not _apply:
        cls._apply = _apply


def _apply(self, fn, recurse=True):
    """The module's own ``_apply``, with the first-use check deferred (Note [Weights
    computed inside _apply])."""
    cls = next(c for c in type(self).__mro__ if c.__dict__.get("_apply") is _apply)
    with checks_deferred():
        return super(cls, self)._apply(fn, recurse)


def initialize(
    module: nn.Module, *, init: str = "random", generator: torch.Generator | None = None
) -> nn.Module:
    r"""Write a fresh manifold point into every constrained weight of ``module``, in place.

    The one call after deferred initialisation: a model built under
    ``with torch.device("meta")`` (``orthogonalize`` reads no values there) and
    allocated with ``module.to_empty(device=...)`` holds uninitialised memory in
    its free parameters and the maps' buffers. Every constrained weight is
    reset: every parametrization with an ``initial`` (the maps of
    ``orthogonalize``, ``conv_kernel=True`` kernels, stacked gates) gets the
    original of a new point and its map's buffers are reset with it; every
    ``geoopt.ManifoldParameter`` on a stiefel manifold (``method="riemannian"``)
    gets a point of its manifold; every rotation of `rotate` goes back to
    Q = I. Other parameters are left alone: torch's recipe, ``reset_parameters()``
    on every module, does both (Note [Deferred initialisation by
    reset_parameters]). A ``method="riemannian"`` weight that ``to_empty``
    rebuilt as a plain ``Parameter`` is found through the manifold its module
    recorded (Note [The manifold lives on the module] in
    `stiefel.manifolds.binding`).

    Note [A module finishes the point of its factors]
    A layer built from several constrained factors may need them in a relation that
    no factor's own ``init`` gives: `stiefel.nn.OrthoConv2d`'s identity
    convolution takes its projector steps on alternating channel halves, where every
    factor at its identity point shifts half the channels against the other half.
    Such a module defines ``stiefel_finish_init(init)``, called after every factor
    was written: by ``initialize(model, init=...)`` with its ``init``, and by the
    ``reset_parameters`` that ``orthogonalize`` installs (torch's recipe, every
    module's ``reset_parameters()``) with None, the module's own. So
    ``initialize(model, init="identity")`` and the recipe give what the layer built
    with ``init="identity"`` has.

    Args:
        module: the model (searched recursively).
        init: ``"random"`` (default: a random point the map reaches; Haar for
            the maps that reach every point), ``"haar"``, ``"identity"`` or
            ``"torus"`` (``"nearest"`` has no weight to be near after ``to_empty``).
        generator: the random generator of ``"random"`` / ``"haar"`` / ``"torus"``.

    Returns:
        ``module``.

    Raises:
        ValueError: an unknown ``init``, a weight still on the meta device
            (call ``module.to_empty(device=...)`` first), or no constrained
            weight in ``module``.
        TypeError: a sharded (DTensor) weight: initialize before ``fully_shard``.

    Example:
        ```python
        import torch
        from torch import nn
        from stiefel.parametrizations import initialize, orthogonalize

        with torch.device("meta"):
            layer = orthogonalize(nn.Linear(8, 8), method="cwy")
        layer.to_empty(device="cpu")
        initialize(layer)
        w = layer.weight
        assert torch.linalg.matrix_norm(w.T @ w - torch.eye(8)) < 1e-5
        ```
    """
    _checks.choice("init", init, [i for i in INITS if i != "nearest"])
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    found: list[tuple[str, torch.Tensor, object]] = []
    for path, sub in module.named_modules():
        where = f"{path}." if path else ""
        found += [(where + name, w, p) for name, w, p in _constrained(sub)]
        if isinstance(sub, Rotation):
            found += [(f"{where}originals.{i}", w, sub) for i, w in enumerate(sub.originals)]
    claimed = {id(w) for _, w, _ in found}
    for sub in module.modules():  # Riemannian weights that to_empty rebuilt, marked again
        binding.restore(sub, check=False)
    for name, w in module.named_parameters():
        if isinstance(w, geoopt.ManifoldParameter) and isinstance(w.manifold, Stiefel):
            if id(w) not in claimed:
                found.append((name, w, None))
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no orthogonalized weight (no parametrization of "
            "orthogonalize, no ManifoldParameter on a stiefel manifold, no rotation)"
        )
    for label, w, _ in found:
        if binding.is_dtensor(w):
            raise TypeError(
                f"{label} is a DTensor (sharded): initialize writes local tensors; call it "
                "after module.to_empty(device=...) and before fully_shard"
            )
        if w.device.type == "meta":
            raise ValueError(
                f"{label} is on the meta device: allocate it first, "
                "module.to_empty(device=...), then initialize(module)"
            )
    with torch.no_grad():
        for _, w, owner in found:
            if isinstance(owner, Rotation):
                continue
            if owner is None:  # method="riemannian": the weight is the point
                owner = build("riemannian", tuple(w.shape), w.dtype, w.device)
            _write(owner, w, init, generator)
        for sub in {id(o): o for _, _, o in found if isinstance(o, Rotation)}.values():
            sub.reset_parameters()
        for sub in module.modules():  # Note [A module finishes the point of its factors]
            _finish(sub, init)
    return module

r"""Where a Riemannian weight's manifold lives: on its module as well as on the tensor.

`attach` records the manifold of ``module.<name>`` on the module and marks the
Parameter; `restore` (called by a forward pre-hook of the module and by the
optimizers when they are given a model) marks whatever Parameter sits at that
name now; `manifold_of` reads the mark of any tensor. A ManifoldParameter made by hand
is recorded when its module registers it (Note [A hand-made ManifoldParameter is ...]).

Note [The manifold lives on the module]
torch and its distributed wrappers rebuild Parameters: ``module.to_empty``,
``load_state_dict(assign=True)``, ``module.to(dtype)`` (a new Parameter when
the storage type changes) and FSDP2's ``fully_shard`` (a DTensor Parameter)
make a new plain ``nn.Parameter`` that has lost the class and the attributes
of the old one. An optimizer that read the manifold from the tensor alone would
then step the weight as a Euclidean one, silently. The module object survives
all of them (and ``deepcopy``/pickling copy its ``__dict__``), so the manifold
is recorded there, keyed by the parameter's name, and re-attached to the
tensor that sits at that name now: by a forward pre-hook (every training step
runs a forward before its optimizer step), and by the optimizers when they are
given the model itself. A Parameter rebuilt from values that were never a
point of the manifold is projected if it is a usable matrix (the module's own
``reset_parameters`` wrote it: the nearest point is the default ``init``) and
refused otherwise (non-finite or rank-deficient memory left by ``to_empty``).

Note [Marking a tensor]
A plain ``nn.Parameter`` becomes a ``geoopt.ManifoldParameter`` in place (its class
only; same object and storage), so geoopt's optimizers see it too. Any other tensor (a
DTensor Parameter, FSDP2's unsharded Parameter, a tensor subclass) cannot change class
and gets the ``manifold`` attribute, which this package's optimizers honour.

Note [A substituted tensor is used as given]
``torch.func.functional_call(module, {"weight": W}, x)`` (and ``vmap`` over
``torch.func.stack_module_state``) puts the caller's tensor at the name for one call, by
a plain ``module._parameters[name] = W``: the pre-hook would take it for a rebuilt
Parameter and project it in place (the caller's ``W`` overwritten, the output computed
with another matrix) and, under ``vmap``, read a batched tensor's values. Every recipe
that rebuilds a weight for good (``to_empty``, ``module.to``,
``load_state_dict(assign=True)``, ``fully_shard``) puts an ``nn.Parameter`` there; a
substitution puts whatever the caller gave, almost always a plain tensor. So a tensor at
a recorded name that is not an ``nn.Parameter`` is the caller's: used as given, never
checked, marked or written (an unmarked ``nn.Parameter`` cannot be told from a rebuilt
one: it is marked, checked and projected as one).

Note [A weight under another parametrization]
``torch.nn.utils.parametrize.register_parametrization(module, "weight", f)`` on
a Riemannian weight moves its Parameter to
``module.parametrizations.weight.original``; the record stays on ``module``
under ``"weight"``. `slot` finds the Parameter in either place, so the
pre-hook, the optimizers and the module's ``reset_parameters`` re-mark, check
and reset the original there too (after ``to_empty`` it is a new, unmarked
Parameter of uninitialised memory).
"""

from __future__ import annotations

import operator
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import geoopt
import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.nn.utils.parametrize import ParametrizationList
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .sharded import (
    admit,
    complex_message,
    fsdp_sharded,
    geometry_of,
    is_dtensor,
    warn_replaced,
)

__all__ = [
    "attach",
    "restore",
    "claim",
    "admit",
    "manifold_of",
    "mark",
    "records",
    "slot",
    "is_dtensor",
    "stepped_optimizers",
]

_ATTR = "_stiefel_manifolds"
#: set on a module by `load_state_dict` until its points were checked (`_check_loaded`)
_LOADED = "_stiefel_loaded"
_LOADING = "_stiefel_loading"  # inside load_state_dict: registered Parameters keep records
_HAND_MADE = "_stiefel_hand_made"  # the names whose records _registered made
# an optimizer's attribute (one per copy of this module): what the guard last saw (Note [The
# guard sees every param group]), or _DONE; on the object (an optimizer may be unhashable)
_SEEN = f"_stiefel_guard_seen.{__name__}"
_DONE = object()
# every optimizer that took an eager step while the guard was registered (weakly held)
_STEPPED: weakref.WeakSet = weakref.WeakSet()
_MARKS = [0]  # how many times a tensor was marked (a new mark: the guard looks again)
# the modules that hold a record, as `attach` and `restore` met them (`claim` looks here;
# the lock: a WeakSet is not read while another thread adds to it)
_HOLDERS, _HOLDERS_LOCK = weakref.WeakSet(), threading.Lock()


def manifold_of(t: torch.Tensor) -> geoopt.Manifold | None:
    """The manifold a tensor carries (None for none, or geoopt's ``Euclidean``)."""
    man = getattr(t, "manifold", None)
    if not isinstance(man, geoopt.Manifold) or isinstance(man, geoopt.Euclidean):
        return None
    return man


def mark(t: torch.Tensor, manifold: geoopt.Manifold) -> None:
    """Make ``t`` carry ``manifold`` (Note [Marking a tensor])."""
    if type(t) is nn.Parameter:
        t.__class__ = geoopt.ManifoldParameter
    t.manifold = manifold
    _MARKS[0] += 1


def records(module: nn.Module) -> dict[str, tuple[geoopt.Manifold, str]]:
    """``{name: (manifold, label)}`` recorded on ``module`` (empty when none)."""
    return module.__dict__.get(_ATTR, {})


def slot(module: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """(the module, its key) where the Parameter recorded as ``module.<name>`` sits now.

    ``module._parameters[name]``, or the ``original`` of a parametrization
    registered on top of it (Note [A weight under another parametrization]);
    None when neither holds it.
    """
    if name in module._parameters:
        return module, name
    plists = module.__dict__.get("_modules", {}).get("parametrizations")
    plist = plists._modules.get(name) if plists is not None else None
    if plist is not None and "original" in plist._parameters:
        return plist, "original"
    return None


def _at_slot(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor at the recorded slot of ``module.<name>`` (`slot`), or None."""
    where = slot(module, name)
    return None if where is None else where[0]._parameters[where[1]]


def attach(module: nn.Module, name: str, manifold: geoopt.Manifold, label: str) -> None:
    """Record ``manifold`` for ``module.<name>`` and mark the Parameter there.

    Args:
        module: the module owning the Parameter.
        name: its name in ``module._parameters``.
        manifold: the manifold of its values.
        label: the dotted name the user gave (for messages).
    """
    _record(module, name, manifold, label)
    mark(module._parameters[name], manifold)


def _record(module: nn.Module, name: str, manifold: geoopt.Manifold, label: str) -> None:
    first = _ATTR not in module.__dict__
    module.__dict__.setdefault(_ATTR, {})[name] = (manifold, label)
    with _HOLDERS_LOCK:
        _HOLDERS.add(module)
    if first:
        module.register_forward_pre_hook(KeepManifold())
        module.register_load_state_dict_pre_hook(_loading)
        module.register_load_state_dict_post_hook(_loaded)


def _registered(module: nn.Module, name: str, param: torch.Tensor) -> None:
    """torch's parameter-registration hook: record the manifold of a ManifoldParameter.

    Note [A hand-made ManifoldParameter is recorded too]
    ``self.w = geoopt.ManifoldParameter(x, manifold=st)`` is rebuilt by ``fully_shard``
    as a weight of ``orthogonalize`` is, and would be stepped as a plain tensor,
    silently. ``fully_shard`` keeps nothing of the old Parameter, so its manifold is
    read when the module registers it (``register_parameter``, which torch calls for
    ``module.w = p``) and recorded as `attach` records it (values are checked where
    `stiefel.manifolds.sharded.geometry_of` knows its points). A plain Parameter
    registered later by ``load_state_dict(assign=True)`` keeps the record (it
    rebuilds so); one the user registers (``module.w = nn.Parameter(...)``) drops
    the record this hook made, as a ManifoldParameter of geoopt's Euclidean does: the
    weight is plain from then on. Not on a ``ParametrizationList`` (Note [A weight
    under another parametrization]).
    """
    if isinstance(module, ParametrizationList):
        return
    man = manifold_of(param) if isinstance(param, geoopt.ManifoldParameter) else None
    made = module.__dict__.get(_HAND_MADE, ())  # a plain module's registrations add nothing
    if man is None and name in made and not module.__dict__.get(_LOADING):
        made.discard(name)
        records(module).pop(name, None)
    elif man is not None and records(module).get(name, (None,))[0] is not man:
        _record(module, name, man, f"{type(module).__name__}.{name}")
        module.__dict__.setdefault(_HAND_MADE, set()).add(name)


_RECORDER = register_module_parameter_registration_hook(_registered)


def stepped_optimizers() -> list[torch.optim.Optimizer]:
    """The optimizers alive that took an eager step since the guard was registered."""
    return list(_STEPPED)


def _euclidean_guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Warn, once per optimizer, when one that is not Riemannian steps a manifold weight.

    A ``torch.optim`` optimizer moves a manifold weight off its manifold at its
    first step (a Euclidean step on a point of St(N, M)): the model is silently
    wrong. Riemannian optimizers say so by a true ``riemannian`` class attribute
    (this package's) or by geoopt's optimizer mixin (refused the points it would step
    as Euclidean ones, `check_geoopt`). Any is told of Parameters ``fully_shard`` replaced.

    Note [The guard sees every param group]
    Looking only at an optimizer's first step misses a manifold weight added
    later (``add_param_group``, an append to a group's ``params``) or marked
    later (``orthogonalize(..., method="riemannian")`` on a weight the optimizer
    already steps, a rebuilt Parameter marked again). So the guard runs at every
    step and looks at the parameters again only when what it saw changed: the
    number of groups and of parameters in each, and the count of marks made so
    far (`mark`). A step that changes none of them costs one tuple of group
    sizes, made by C calls only (a Riemannian step enters no other frame here).
    """
    compiling = torch.compiler.is_compiling()
    if not compiling:  # a traced step touches no weak set
        try:  # Note [Coordinates are a new parameter to an optimizer]
            _STEPPED.add(opt)
        except TypeError:  # a class with __eq__ and no __hash__: not recorded, still stepped
            pass
    riemannian = getattr(type(opt), "riemannian", False)
    geo = isinstance(opt, geoopt.optim.mixin.OptimMixin)
    if compiling and (riemannian or geo):
        return  # before any look-up: a compiled step traces no weak dictionary here
    seen = opt.__dict__.get(_SEEN)
    if seen is _DONE:
        return
    sizes = tuple(map(len, map(operator.itemgetter("params"), opt.param_groups)))
    if seen == (_MARKS[0], sizes):
        return
    if geo:
        from .geoopt_points import check_geoopt  # it reads this module's records

        check_geoopt(opt)  # claims, then refuses (before anything is remembered)
    elif not riemannian:  # this package's optimizers claim when they bind
        claim(p for group in opt.param_groups for p in group["params"])
    warn_replaced(opt)
    opt.__dict__[_SEEN] = (_MARKS[0], sizes)
    if riemannian or geo:
        return
    for group in opt.param_groups:
        for p in group["params"]:
            if manifold_of(p) is not None:
                warnings.warn(
                    f"{type(opt).__name__} is not a Riemannian optimizer: it steps a manifold "
                    f"weight of shape {tuple(p.shape)} ({manifold_of(p)!r}) as a Euclidean "
                    "one, and the weight leaves its manifold. Use a Riemannian optimizer "
                    "(stiefel.optimizers.create('rgd' | 'radam' | ..., model)) or a "
                    "parametrization method (orthogonalize(..., method='cwy')) instead.",
                    stacklevel=3,
                )
                opt.__dict__[_SEEN] = _DONE
                return


# torch.optim's global step pre-hook, registered once, at import: a point built by hand
# (``geoopt.ManifoldParameter(x, manifold=Stiefel(n, m))``) or by `attach` and stepped by a
# torch optimizer left its manifold without a word, and `stepped_optimizers` must know the
# optimizers that stepped before any weight was constrained
_GUARD = register_optimizer_step_pre_hook(_euclidean_guard)


def restore(module: nn.Module, check: bool = True) -> list[torch.Tensor]:
    """Mark every Parameter of ``module`` recorded by `attach` that lost its manifold.

    The Parameter is found where it sits now (`slot`: at its name, or the
    original of a parametrization registered on top of it); a tensor there
    that is not an ``nn.Parameter`` was substituted by the caller and is left
    alone (Note [A substituted tensor is used as given]).

    Args:
        module: a module with records (others give an empty list).
        check: check and project the values of a rebuilt Parameter.

    Returns:
        The Parameters now at the recorded names (the sharded ones under FSDP2).
    """
    found = []
    if records(module):
        with _HOLDERS_LOCK:  # a copy of a recorded module is met here (`claim`)
            _HOLDERS.add(module)
    for name, (manifold, label) in records(module).items():
        where = slot(module, name)
        if where is None:
            continue
        holder, key = where
        p = holder._parameters[key]
        if p is None or not isinstance(p, nn.Parameter):
            continue
        sharded = fsdp_sharded(holder, key)
        if sharded is None or sharded is p:
            if manifold_of(p) is not manifold:
                if check:
                    admit(p, manifold, label, "its Parameter was rebuilt")
                mark(p, manifold)
            found.append(p)
            continue
        # inside FSDP2's forward: p is the gathered copy of the sharded Parameter
        if manifold_of(sharded) is not manifold:
            if check:
                admit(sharded, manifold, label, "its Parameter was rebuilt by fully_shard")
                with torch.no_grad():  # this forward uses the (projected) point
                    p.copy_(sharded.full_tensor())
            mark(sharded, manifold)
        p.manifold = manifold  # attribute only (Note [Marking a tensor])
        found.append(sharded)
    return found


def claim(params: Iterable[torch.Tensor]) -> None:
    """Mark the rebuilt Riemannian weights among ``params`` that no forward has marked yet.

    Note [A rebuilt weight stepped before any forward]
    The forward pre-hook re-marks a rebuilt Parameter, but a step can come
    before any forward: gradients set by hand or by ``torch.func``, accumulated
    from another process, or a first step right after ``fully_shard``,
    ``load_state_dict(assign=True)`` or ``to_empty``. An optimizer built from a
    bare parameter list would then bind the weight as a Euclidean tensor. So the
    optimizers (and the torch.optim guard) claim their unmarked matrices when
    they first see them: a module whose recorded slot holds one of ``params``
    is restored (its Parameters checked, projected if usable, and marked)
    exactly as by its pre-hook. The modules looked at are those `attach` and
    `restore` met, held weakly: every recipe that rebuilds a Parameter keeps its
    module object, and a copy of a module (``deepcopy``, pickling) copies its
    Parameters' marks with them. Nothing is looked at when every matrix is
    marked; the look is paid when parameters are bound, never per step. The
    modules are restored in the order of ``params``, not of the weak set, whose
    order follows object addresses and differs between processes: restoring a
    row-sharded weight runs collectives, which every rank must run in one order.

    Args:
        params: the parameters an optimizer is about to bind (any iterable of tensors).
    """
    wanted = {
        id(p): k
        for k, p in enumerate(params)
        if isinstance(p, nn.Parameter) and p.ndim >= 2 and manifold_of(p) is None
    }
    if not wanted:
        return
    found = []  # (position of the module's first wanted parameter, module)
    with _HOLDERS_LOCK:  # another thread may be adding one (`attach`)
        holders = list(_HOLDERS)
    for module in holders:
        at = [wanted[i] for name in records(module) if (i := id(_at_slot(module, name))) in wanted]
        if at:
            found.append((min(at), module))
    for _, module in sorted(found, key=lambda pair: pair[0]):
        restore(module)


def _loading(module: nn.Module, *args: Any) -> None:
    """``load_state_dict`` pre-hook: Parameters it registers keep their records."""
    module.__dict__[_LOADING] = True


def _loaded(module: nn.Module, incompatible: Any) -> None:
    """``load_state_dict`` post-hook: the module's points are checked at the next forward."""
    module.__dict__[_LOADED] = True
    module.__dict__.pop(_LOADING, None)


def _check_loaded(module: nn.Module) -> None:
    """Refuse a point loaded far from its manifold (Note [A point loaded off its manifold]).

    Note [A point loaded off its manifold]
    A Riemannian weight is the point itself: ``load_state_dict`` copies whatever
    the state dict holds into it, and a dense matrix (a checkpoint of another
    model, a state dict edited by hand) would be used as the layer's weight with
    no warning until an optimizer's step projected it. So the first forward after
    a load checks every recorded point once (one host read), as the maps check
    their free parameters at first use, and refuses one whose ‖WᴴW − I‖_F is past
    the optimizers' bound (`stiefel.manifolds.geometry.OFF_MANIFOLD`): a point
    that drifted by rounding passes. Not while tracing, nor on meta or DTensor
    points (a distributed checkpoint restores its shards as they were saved).
    """
    from .geometry import OFF_MANIFOLD

    if torch.compiler.is_compiling():
        return
    for name, (manifold, label) in records(module).items():
        p = _at_slot(module, name)
        if p is None or p.device.type == "meta" or is_dtensor(p):
            continue
        geo = geometry_of(manifold)  # None: a manifold whose points it cannot test
        err = 0.0 if geo is None else float(geo.error(p.detach()).max())
        if not err <= OFF_MANIFOLD:  # NaN: refused too
            raise ValueError(
                f"{label} was loaded off its manifold {manifold!r} (‖WᴴW − I‖_F = {err:.3g} "
                f"> {OFF_MANIFOLD}): the state dict holds no point of it. Load a checkpoint "
                "saved from this model, or project the loaded matrix first: with "
                "torch.no_grad(): w.copy_(w.manifold.projx(w))"
            )
    module.__dict__.pop(_LOADED, None)


class KeepManifold:
    """Forward pre-hook: re-marks the module's rebuilt manifold Parameters (picklable), and
    checks them once after a ``load_state_dict`` (Note [A point loaded off its manifold]).

    A substituted tensor (``torch.func.functional_call``, ``vmap``) is used as
    given (Note [A substituted tensor is used as given]).
    """

    def __call__(self, module: nn.Module, args: Any) -> None:
        if module.__dict__.get(_LOADED):
            _check_loaded(module)
        for name, (manifold, label) in records(module).items():
            p = _at_slot(module, name)
            if p is None or not isinstance(p, nn.Parameter):
                continue
            if p.is_complex() and not getattr(manifold, "complex", True):
                raise TypeError(complex_message(label, manifold, p.dtype, "module.to(dtype)"))
            if getattr(p, "manifold", None) is not manifold:
                restore(module)
                return

r"""Where a Riemannian weight's manifold lives: on its module as well as on the tensor.

`attach` records the manifold of ``module.<name>`` on the module and marks the
Parameter; `restore` (called by a forward pre-hook of the module and by the
optimizers when they are given a model) marks whatever Parameter sits at that
name now; `manifold_of` reads the mark of any tensor.

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

import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import geoopt
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

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
    first = _ATTR not in module.__dict__
    module.__dict__.setdefault(_ATTR, {})[name] = (manifold, label)
    with _HOLDERS_LOCK:
        _HOLDERS.add(module)
    mark(module._parameters[name], manifold)
    if first:
        module.register_forward_pre_hook(KeepManifold())
        module.register_load_state_dict_post_hook(_loaded)


def stepped_optimizers() -> list[torch.optim.Optimizer]:
    """The optimizers alive that took an eager step since the guard was registered."""
    return list(_STEPPED)


def _euclidean_guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Warn, once per optimizer, when one that is not Riemannian steps a manifold weight.

    A ``torch.optim`` optimizer moves a manifold weight off its manifold at its
    first step (a Euclidean step on a point of St(N, M)): the model is silently
    wrong. Riemannian optimizers say so by a true ``riemannian`` class attribute
    (this package's) or by geoopt's optimizer mixin.

    Note [The guard sees every param group]
    Looking only at an optimizer's first step misses a manifold weight added
    later (``add_param_group``, an append to a group's ``params``) or marked
    later (``orthogonalize(..., method="riemannian")`` on a weight the optimizer
    already steps, a rebuilt Parameter marked again). So the guard runs at every
    step and looks at the parameters again only when what it saw changed: the
    number of groups and of parameters in each, and the count of marks made so
    far (`mark`). A step that changes none of them costs one tuple of group
    sizes.
    """
    if not torch.compiler.is_compiling():  # a traced step touches no weak set
        try:  # Note [Coordinates are a new parameter to an optimizer]
            _STEPPED.add(opt)
        except TypeError:  # a class with __eq__ and no __hash__: not recorded, still stepped
            pass
    if getattr(type(opt), "riemannian", False) or isinstance(opt, geoopt.optim.mixin.OptimMixin):
        return  # before any look-up: a compiled step traces no weak dictionary here
    seen = opt.__dict__.get(_SEEN)
    if seen is _DONE:
        return
    key = (_MARKS[0], tuple(len(group["params"]) for group in opt.param_groups))
    if seen == key:
        return
    claim(p for group in opt.param_groups for p in group["params"])
    opt.__dict__[_SEEN] = (_MARKS[0], key[1])
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


def is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _fsdp_sharded(module: nn.Module, name: str) -> torch.Tensor | None:
    """The sharded Parameter FSDP2 keeps for ``module.<name>`` (None when not sharded).

    During a forward FSDP2 puts an unsharded Parameter at that name; the one the
    optimizer steps is the sharded DTensor Parameter in FSDP2's state.
    """
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    for ref in list(_module_state_mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        group = getattr(state, "_fsdp_param_group", None) if isinstance(state, FSDPState) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            info = fsdp_param._module_info
            if info.module is module and info.param_name == name:
                return fsdp_param.sharded_param
    return None


def _complex_message(label: str, manifold, dtype: torch.dtype, why: str) -> str:
    return (
        f"{label} is a point of the real manifold {manifold!r} but its Parameter is now "
        f"{dtype} ({why}); a real Riemannian weight cannot be stepped as a complex one: keep "
        "it real, or orthogonalize a complex weight (its manifold is then complex)"
    )


@torch.no_grad()
def admit(t: torch.Tensor, manifold: geoopt.Manifold, label: str, why: str) -> None:
    """Check the values of a rebuilt Parameter; project them if usable, refuse them if not.

    Note [The manifold lives on the module]. A plain and a DTensor point take the
    same path: the manifold's geometry (its `ShardedGeometry` on the local rows for
    a DTensor), M×M Grams only, every rank taking the same decision.

    Raises:
        TypeError: a complex tensor on a real manifold.
        ValueError: non-finite or rank-deficient values (naming ``label`` and the fix).
    """
    from .kernels.reduce import gram
    from .sharded import ShardedGeometry

    if t.is_complex() and not getattr(manifold, "complex", True):
        raise TypeError(_complex_message(label, manifold, t.dtype, why))
    if t.device.type == "meta":
        return
    x = t.detach()
    sharded = is_dtensor(x)
    geo = ShardedGeometry(manifold.geometry(), x) if sharded else manifold.geometry()
    local = geo.local(x) if sharded else x
    # the rank's answer, OR-ed over the ranks (the same decision everywhere)
    everywhere = geo.any_rank if sharded else (lambda flag: flag)
    fix = "call the module's reset_parameters() or stiefel.parametrizations.initialize(model)"
    if bool(everywhere(~torch.isfinite(local).all().reshape(1))):
        raise ValueError(f"{label} holds non-finite values ({why}, e.g. to_empty): {fix}")
    err = geo.error(x)
    tol = 10 * x.shape[-1] * torch.finfo(x.dtype).eps
    if not bool(((geo.local(err) if sharded else err) > tol).any()):  # replicated per matrix
        return
    hi = torch.complex128 if x.is_complex() else torch.float64
    rows = geo.row_group if sharded else None  # the M×M Gram of all the rows
    w = torch.linalg.eigvalsh(gram(local, local, rows).to(hi))
    if bool((w[..., 0] <= 1e-12 * w[..., -1].clamp_min(1e-300)).any()):
        hint = (
            " A reset that drew every shard with the same generator (torch.manual_seed on "
            "every rank, on a CPU mesh) writes the same rows on every rank: seed the ranks "
            "differently before reset_parameters(), or initialize before fully_shard."
            if sharded
            else ""
        )
        raise ValueError(
            f"{label} holds a rank-deficient matrix ({why}, e.g. uninitialised memory after "
            f"to_empty), which is no point of {manifold!r} and has no nearest one.{hint} "
            f"Fix: {fix}"
        )
    t.copy_(geo.project(x))


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
        sharded = _fsdp_sharded(holder, key)
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


def _loaded(module: nn.Module, incompatible: Any) -> None:
    """``load_state_dict`` post-hook: the module's points are checked at the next forward."""
    module.__dict__[_LOADED] = True


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
        err = float(manifold.geometry().error(p.detach()).max())
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
                raise TypeError(_complex_message(label, manifold, p.dtype, "module.to(dtype)"))
            if getattr(p, "manifold", None) is not manifold:
                restore(module)
                return

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
A plain ``nn.Parameter`` becomes a ``geoopt.ManifoldParameter`` in place (its
class only; same object and storage), so geoopt's optimizers see it too. Any
other tensor (a DTensor Parameter, FSDP2's unsharded Parameter, a tensor
subclass) cannot change class and gets the ``manifold`` attribute, which this
package's optimizers honour on every tensor.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import geoopt
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["attach", "restore", "admit", "manifold_of", "mark", "records", "is_dtensor"]

_ATTR = "_stiefel_manifolds"
_GUARD: list = []  # the handle of the global optimizer step pre-hook, once registered
_SEEN: weakref.WeakSet = weakref.WeakSet()  # optimizers already looked at by the guard


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


def records(module: nn.Module) -> dict[str, tuple[geoopt.Manifold, str]]:
    """``{name: (manifold, label)}`` recorded on ``module`` (empty when none)."""
    return module.__dict__.get(_ATTR, {})


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
    mark(module._parameters[name], manifold)
    if first:
        module.register_forward_pre_hook(KeepManifold())
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(_euclidean_guard))


def _euclidean_guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Warn, once per optimizer, when one that is not Riemannian steps a manifold weight.

    A ``torch.optim`` optimizer moves a manifold weight off its manifold at its
    first step (a Euclidean step on a point of St(N, M)): the model is silently
    wrong. Riemannian optimizers say so by a true ``riemannian`` class attribute
    (this package's) or by geoopt's optimizer mixin.
    """
    if opt in _SEEN:
        return
    _SEEN.add(opt)
    if getattr(type(opt), "riemannian", False) or isinstance(opt, geoopt.optim.mixin.OptimMixin):
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
                return


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
    from .kernels.reduce import gram, rows_split
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
    with rows_split(geo.row_group if sharded else None):  # the M×M Gram of all the rows
        w = torch.linalg.eigvalsh(gram(local, local).to(hi))
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

    Args:
        module: a module with records (others give an empty list).
        check: check and project the values of a rebuilt Parameter.

    Returns:
        The Parameters now at the recorded names (the sharded ones under FSDP2).
    """
    found = []
    for name, (manifold, label) in records(module).items():
        p = module._parameters.get(name)
        if p is None:
            continue
        sharded = _fsdp_sharded(module, name)
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


class KeepManifold:
    """Forward pre-hook: re-marks the module's rebuilt manifold Parameters (picklable)."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        for name, (manifold, label) in records(module).items():
            p = module._parameters.get(name)
            if p is None:
                continue
            if p.is_complex() and not getattr(manifold, "complex", True):
                raise TypeError(_complex_message(label, manifold, p.dtype, "module.to(dtype)"))
            if getattr(p, "manifold", None) is not manifold:
                restore(module)
                return

r"""Constraining one tensor of a module in place: every check first, then one registration.

`orthogonalize_module` is what ``orthogonalize(module, name)`` does, and what
the other entry points (a bare tensor's `OrthogonalMatrix`, a Parameter
constrained where it is held) end in: it locates the tensor (a dotted name),
checks it (shape, dtype, values, not tied, not constrained already), builds
the parametrization (one map, stacked gates, or a convolution's kernel
matrix) and only then touches the module: a registered parametrization with
its original precomputed, or, for ``"riemannian"``, the Parameter made a
manifold parameter in place. Nothing is modified when a check fails.
"""

from __future__ import annotations

import warnings
from typing import Any

import geoopt
import torch
from torch import nn
from torch.nn.utils import parametrize

from .._core import checks as _checks
from .._core.autocast import enabled_devices, without
from ..manifolds import binding
from . import stale_state
from ._precision import DTYPES
from .base import INITS, RIEMANNIAN
from .conv import CONVOLUTIONS, check_convolution, conv_kernel_map
from .deferred import hook_reset_parameters, hook_riemannian_reset
from .factory import build, resolve
from .gates import StackedGates, gate_count
from .point import ManifoldPoint

__all__ = ["orthogonalize_module", "check_weight"]


def check_weight(label: str, w: object, values: bool = True) -> torch.Tensor:
    """``w`` checked: a tensor of an allowed shape and dtype; finite when ``values`` are read."""
    w = _checks.tensor(label, w)
    if w.dim() < 2:
        raise ValueError(
            f"{label} must have at least 2 dimensions (…, rows, cols), got shape {tuple(w.shape)}"
        )
    if w.dtype not in DTYPES:
        raise TypeError(
            f"{label} has dtype {w.dtype}; allowed: {', '.join(str(d) for d in DTYPES)}"
        )
    if w.numel() == 0:
        raise ValueError(f"{label} is empty (shape {tuple(w.shape)}); every dimension must be > 0")
    # no values on meta (deferred initialisation); none are read by init="haar" etc.,
    # e.g. on the uninitialised memory module.to_empty() leaves
    if values and w.device.type != "meta":
        _checks.finite(label, w.detach())
    return w


def _locate(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule owning a dotted ``name`` ("rnn.weight_hh_l0") and the last part."""
    module = root
    *path, leaf = name.split(".")
    for i, part in enumerate(path):
        sub = module._modules.get(part) if part else None
        if sub is None:
            where = ".".join(path[:i]) or type(root).__name__
            children = ", ".join(module._modules) or "none"
            raise ValueError(
                f"name={name!r}: {where} has no submodule {part!r}; submodules: {children}"
            )
        module = sub
    return module, leaf


def _check_untied(root: nn.Module, module: nn.Module, name: str, w: torch.Tensor) -> None:
    r"""Refuse a weight that another module of ``root`` holds too.

    Note [Tied weights cannot take a parametrization]
    A parametrization replaces ``module.<name>`` by a computed tensor on that
    module only: a second module holding the same Parameter (a tied
    embedding and output layer) would go on multiplying by the unconstrained
    tensor, silently. Only the modules under the ``module_or_tensor`` given
    can be seen: given the root model (with a dotted name) the tie is found;
    given a submodule, the other holder is outside it and cannot be.
    ``method="riemannian"`` keeps the Parameter object, so both holders see
    the manifold parameter: it is allowed.
    """
    holders = [
        f"{path or type(root).__name__}.{key}"
        for path, sub in root.named_modules(remove_duplicate=False)
        for key, p in sub._parameters.items()
        if p is w and not (sub is module and key == name)
    ]
    if holders:
        raise ValueError(
            f"{name} is tied: the same Parameter is also {', '.join(sorted(set(holders)))}; a "
            "parametrization would constrain one holder and leave the other multiplying by "
            "the unconstrained tensor (Note [Tied weights cannot take a parametrization]); "
            "untie them first (e.g. other.weight = nn.Parameter(w.detach().clone())) or use "
            "method='riemannian', which keeps the Parameter"
        )


def _parametrization(module, name, w, method, options, conv_kernel, gates):
    """(the parametrization to register, its map), both built and checked, nothing touched."""
    count = gate_count(module, name)
    if gates:
        if not count:
            raise ValueError(
                f"gates=True constrains the stacked gate matrices of nn.LSTM / nn.GRU "
                f"(weight_hh_l*, weight_ih_l*); {type(module).__name__}.{name} is not one"
            )
        g = count
        shape = (g, w.shape[0] // g, w.shape[1])
        fmap = build(method, shape, w.dtype, w.device, options)
        return StackedGates(tuple(w.shape), g, fmap), fmap
    if count:
        raise ValueError(
            f"{type(module).__name__}.{name} stacks {count} gate matrices (shape "
            f"{tuple(w.shape)} = {count}·hidden × {w.shape[1]}): constraining it as one matrix "
            "makes no gate orthogonal; allowed: gates=True (each gate constrained by the "
            "same map), or constrain a cell whose recurrent matrix is one matrix "
            "(stiefel.nn's recurrent cells, nn.RNN)"
        )
    if conv_kernel:
        param = conv_kernel_map(module, name, method, options)
        return param, param.map
    if isinstance(module, CONVOLUTIONS) and name == "weight":
        warnings.warn(
            f"orthogonalize({type(module).__name__}, 'weight') without conv_kernel=True "
            f"constrains each {tuple(w.shape[-2:])} spatial slice of the kernel as its own "
            "matrix, which does not bound the convolution; conv_kernel=True constrains the "
            "kernel matrix (a non-expansive convolution)",
            UserWarning,
            stacklevel=4,
        )
    fmap = build(method, tuple(w.shape), w.dtype, w.device, options)
    return fmap, fmap


def orthogonalize_module(root: nn.Module, name: str, method: object, options: dict[str, Any]):
    """Validate everything, then register (nothing is modified if anything fails).

    With autocast off (Note [Autocast off for the maps' own products]): inside a region
    the nearest point's products ran in bfloat16 and left the weight 3e-2 off its
    manifold, judged at bfloat16's tolerance and never repaired.
    """
    return without(enabled_devices(), _register, root, name, method, options)


def _register(root: nn.Module, name: str, method: object, options: dict[str, Any]):
    if not isinstance(root, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(root).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}")
    conv_kernel = options.pop("conv_kernel", False)
    gates = options.pop("gates", False)
    _checks.flag("conv_kernel", conv_kernel)
    _checks.flag("gates", gates)
    module, leaf = _locate(root, name)
    if conv_kernel:
        check_convolution(module, leaf)
    label, _, _ = resolve(method)
    if parametrize.is_parametrized(module, leaf):
        raise ValueError(
            f"module.{leaf} is already parametrized; remove it first with "
            f"torch.nn.utils.parametrize.remove_parametrizations(module, {leaf!r})"
        )
    w = getattr(module, leaf, None)
    if not isinstance(w, torch.Tensor):
        tensors = [k for k, _ in module.named_parameters(recurse=False)]
        tensors += [k for k, _ in module.named_buffers(recurse=False)]
        if not tensors:  # a container: the matrices of its submodules, by dotted name
            prefix = name.rpartition(".")[0] + "." if "." in name else ""
            inner = [prefix + k for k, p in module.named_parameters() if p.dim() >= 2]
            tensors = [*inner[:8], "..."] if len(inner) > 8 else inner
        raise ValueError(
            f"name={name!r} is not a tensor of {type(module).__name__}; "
            f"allowed: {', '.join(tensors) if tensors else 'none (it has no tensors)'}"
        )
    if isinstance(w, geoopt.ManifoldParameter):
        raise ValueError(
            f"module.{leaf} is already a manifold parameter (method='riemannian' or geoopt); "
            f"method={label!r} cannot be applied on top of it: a Riemannian optimizer and a "
            "parametrization would both constrain it"
        )
    init = options.pop("init", None)
    check_weight(f"module.{leaf}", w, values=init in (None, "nearest"))
    generator = options.pop("generator", None)
    if init is not None:
        _checks.choice("init", init, INITS)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    in_place = label == RIEMANNIAN and not (conv_kernel or gates)
    if not in_place:
        _check_untied(root, module, leaf, w)
    param, fmap = _parametrization(module, leaf, w, method, options, conv_kernel, gates)
    fmap.label = f"{type(module).__name__}.{leaf}" if module is root else name
    fmap.init = init
    if in_place:
        _make_riemannian(module, leaf, w, fmap, init, generator)
        return root
    with torch.no_grad():
        original = param.initial(w, init, generator).to(dtype=w.dtype, device=w.device)
        if not fmap.tested_here:  # Note [A map from elsewhere is checked at its first point]
            param(original)
    with fmap.initialised_with(original):  # Note [Registering with a precomputed original]
        parametrize.register_parametrization(module, leaf, param, unsafe=True)
    fmap.hold(module.parametrizations[leaf])
    held = module.parametrizations[leaf].original  # the weight's Parameter, now coordinates
    # a gradient left from a backward is the weight's, not the coordinates' (possibly of
    # another shape): an optimizer stepping it would move the coordinates by it
    held.grad = None
    stale_state.forget(held, fmap.label, label)  # Note [Coordinates are a new parameter ...]
    if isinstance(fmap, ManifoldPoint):  # riemannian kernel: the point is the parameter
        fmap.claim(held)
    hook_reset_parameters(module)  # Note [Deferred initialisation by reset_parameters]
    return root


def _make_riemannian(module, name, w, fmap, init, generator) -> None:
    r"""Make module.<name> a ``geoopt.ManifoldParameter`` on our manifold, in place.

    Note [Riemannian weights must be tall]
    A Riemannian optimizer moves the stored tensor itself along St(N, M), whose
    points have orthonormal columns; a wide weight would have to be stored
    transposed, which the module using it would not expect. Wide weights are
    therefore refused (by `build`) and the parametrization methods suggested.

    Note [Riemannian weights keep their Parameter]
    The Parameter object is kept: its class becomes ``geoopt.ManifoldParameter``
    (a subclass of ``nn.Parameter`` with no extra storage, only the
    ``manifold`` attribute) and the point (``fmap.initial``, the map being
    the identity `ManifoldPoint`) is copied into its storage.
    Tied weights stay tied and an optimizer built before the call keeps
    stepping the same tensor (as a Euclidean one until it is rebuilt: only a
    Riemannian optimizer keeps it on the manifold; a torch optimizer stepping
    it is warned about). On a meta weight nothing is computed. The manifold is
    also recorded on the module, so that recipes which rebuild the Parameter
    (``to_empty``, ``fully_shard``, ``load_state_dict(assign=True)``, ...) do
    not turn it into a Euclidean weight (Note [The manifold lives on the
    module] in `stiefel.manifolds.binding`). A DTensor weight (already
    sharded) is marked, not re-classed, and gets its nearest point with M×M
    reductions only.
    """
    if name not in module._parameters or not isinstance(w, nn.Parameter):
        raise ValueError(f"method='riemannian' needs module.{name} to be an nn.Parameter")
    if binding.is_dtensor(w):
        if init not in (None, "nearest"):
            raise ValueError(
                f"init={init!r} for the DTensor weight {fmap.label} (placements "
                f"{tuple(w.placements)}); allowed there: 'nearest' (the point nearest the "
                "sharded weight); orthogonalize before fully_shard for the other inits"
            )
        binding.attach(module, name, fmap.manifold, fmap.label)
        binding.admit(w, fmap.manifold, fmap.label, "orthogonalize")
        hook_riemannian_reset(module, name, init)
        return
    if w.device.type != "meta":
        with torch.no_grad():
            w.copy_(fmap.initial(w, init, generator).to(w.dtype))
    binding.attach(module, name, fmap.manifold, fmap.label)
    hook_riemannian_reset(module, name, init)  # Note [A Riemannian weight is a point when ...]

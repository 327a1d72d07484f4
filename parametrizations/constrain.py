r"""``orthogonalize``: constrain a module's weight (or a bare tensor) to O(n), U(n) or St(N, M)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import geoopt
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .._core import checks as _checks
from ..manifolds import Stiefel, binding
from .base import DTYPES, INITS, RIEMANNIAN, OrthogonalMap
from .conv import CONVOLUTIONS, check_convolution, conv_kernel_map
from .deferred import hook_reset_parameters, hook_riemannian_reset
from .factory import Method, build, resolve
from .gates import StackedGates, gate_count
from .holders import holder_names, holders
from .point import ManifoldPoint

__all__ = ["orthogonalize", "OrthogonalMatrix", "RIEMANNIAN"]


def _check_weight(label: str, w: object, values: bool = True) -> torch.Tensor:
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


def _orthogonalize_module(root: nn.Module, name: str, method: object, options: dict[str, Any]):
    """Validate everything, then register (nothing is modified if anything fails)."""
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
    _check_weight(f"module.{leaf}", w, values=init in (None, "nearest"))
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
    with fmap.initialised_with(original):  # Note [Registering with a precomputed original]
        parametrize.register_parametrization(module, leaf, param, unsafe=True)
    if isinstance(fmap, ManifoldPoint):  # riemannian kernel: the point is the parameter
        fmap.claim(module.parametrizations[leaf].original)
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


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w) if w.dim() == 2 else x @ w.mT


class OrthogonalMatrix(nn.Module):
    r"""A trainable matrix on O(n), U(n) or St(N, M): ``W()`` is the matrix.

    Made by `orthogonalize` from a bare tensor. ``W.linear(x)`` equals
    ``F.linear(x, W())`` (x of shape (…, m), the result (…, n); for a batched
    W, ``x @ W().mT``), computed without forming W() for ``householder``,
    ``cwy`` and ``tcwy`` (O(nL) per vector). ``W.manifold`` and ``W.method``
    say what it is; ``W.map`` is the parametrization module (None for
    ``"riemannian"``).
    """

    def __init__(self, tensor: torch.Tensor, method: Method = "cwy", **options: Any):
        super().__init__()
        t = _check_weight("tensor", tensor)
        self._hold(nn.Parameter(t.detach().clone()), method, options)

    @classmethod
    def _holding(cls, param: nn.Parameter, method: Method, options: dict[str, Any]):
        """The holder of a free ``param`` itself (no copy): ``param`` becomes its free parameter."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._hold(param, method, options)
        return self

    def _hold(self, param: nn.Parameter, method: Method, options: dict[str, Any]) -> None:
        for key, needs in (("conv_kernel", "convolution module"), ("gates", "nn.LSTM/nn.GRU")):
            if options.get(key):
                raise TypeError(f"{key}=True needs a {needs}; got {type(param).__name__}")
        label, _, _ = resolve(method)
        self.weight = param
        _orthogonalize_module(self, "weight", method, dict(options))
        self.method = label

    def forward(self) -> torch.Tensor:
        return self.weight

    @property
    def map(self) -> OrthogonalMap | None:
        if parametrize.is_parametrized(self, "weight"):
            return self.parametrizations.weight[0]  # type: ignore[index, return-value]
        return None

    @property
    def manifold(self) -> Stiefel:
        fmap = self.map
        return fmap.manifold if fmap is not None else self.weight.manifold  # type: ignore

    def operator(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function x ↦ ``F.linear(x, W())`` for applying one W to many inputs.

        For a rollout call it once per sequence: the map's per-weight work (for
        ``cwy``/``tcwy`` the factors U and S, Note [Factors once per rollout])
        is done here, and each call costs O(N·L) per vector without forming W.
        Maps without an operator form form W once, here. (Inside
        ``parametrize.cached()`` this still uses the operator form: torch offers
        no public way to ask whether caching is on, and the factors cost
        O(NL²) once per call of ``operator()``, less than forming W.)

        Example:
            ```python
            import torch
            from stiefel import orthogonalize

            W = orthogonalize(torch.randn(64, 64), method="cwy", reflections=8)
            step = W.operator()
            h = torch.randn(5, 64)
            assert torch.allclose(step(step(h)), h @ W().T @ W().T, atol=1e-5)
            ```
        """
        fmap = self.map
        if fmap is None:
            w = self.weight
            return lambda x: _linear(x, w)
        apply = fmap.prepare_operator(self.parametrizations.weight.original)

        def op(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 1:
                return apply(x.unsqueeze(0)).squeeze(0)
            return apply(x)

        return op

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, W())``, in the operator form where the map has one."""
        return self.operator()(x)

    def extra_repr(self) -> str:
        return f"method={self.method!r}, manifold={self.manifold!r}"


def orthogonalize(
    module_or_tensor: nn.Module | torch.Tensor,
    name: str = "weight",
    method: Method = "cwy",
    **options: Any,
):
    r"""Constrain ``module.<name>`` (or a bare tensor) to O(n), U(n) or St(N, M).

    The manifold follows from the tensor: square real → O(n), square complex →
    U(n), tall N×M → St(N, M), wide → its transpose on St(M, N). Leading
    dimensions are a batch of independent matrices.

    On a module, registers a ``torch.nn.utils.parametrize`` parametrization on
    ``module.<name>`` (``name`` may be dotted, ``"rnn.weight_hh_l0"``) and
    returns the module given (the root, also for a dotted name); for
    ``method="riemannian"`` the Parameter itself
    (same object and storage) becomes a ``geoopt.ManifoldParameter`` for the
    Riemannian optimizers instead. On a plain tensor, returns an
    `OrthogonalMatrix` ``W`` with ``W()`` the matrix, built on a copy. The weight
    starts at the manifold point nearest the current value (polar factor),
    unless ``init`` says otherwise.

    On an ``nn.Parameter`` (``orthogonalize(lin.weight, method=...)``), the
    model that holds it is constrained in place: the module that registers
    this very Parameter object is found and the weight constrained there, as
    ``orthogonalize(module, name)`` would (Note [Constraining a Parameter where
    it is held]). It returns the Parameter given, which stays what optimizers
    step: for a map, the free parameter
    (``module.parametrizations.<name>.original``; its values are the map's
    coordinates, possibly of another shape, not the weight), for
    ``"riemannian"`` the weight itself, now a ``geoopt.ManifoldParameter``. The
    constrained weight is read from the module (``lin.weight``); an optimizer
    built before the call with no state yet trains the constrained model. A
    Parameter held by several modules (tied) is refused naming them (allowed
    for ``"riemannian"``, which keeps the Parameter for every holder); a
    Parameter no module holds returns a new `OrthogonalMatrix` holding that
    same Parameter (no copy).

    The nearest point is the polar factor, O(n³), computed by a scaled Newton
    iteration with the SVD as fallback (Note [Nearest point by the scaled
    Newton iteration]; `benchmarks/init.py` prints its timing against the
    SVD). When the starting point does not matter, ``init="identity"``,
    ``"haar"`` (a random point: the QR of a Gaussian, in the weight's
    precision), ``"random"`` or ``"torus"`` skip it (see the troubleshooting
    page, "Slow initialisation").

    Refused, with the alternative: the stacked gates of ``nn.LSTM``/``nn.GRU``
    as one matrix (``gates=True`` constrains each gate), a weight tied to
    another module under ``module_or_tensor`` (Note [Tied weights cannot take a
    parametrization]; a tie with a module outside the one given cannot be
    seen, but is found when the Parameter itself is given), and a convolution
    whose padding breaks ``conv_kernel=True``'s bound.
    A convolution weight without ``conv_kernel=True`` gets a warning.

    After deferred initialisation (``with torch.device("meta")``, then
    ``module.to_empty(device=...)``), the module's ``reset_parameters()``
    (torch's recipe) or `initialize` writes a valid point; a weight used
    before that is refused with an error (Note [Deferred initialisation by
    reset_parameters]).

    A loop reading a parametrized weight at every step (a recurrent rollout)
    recomputes the map each time: wrap it in ``parametrize.cached()`` or use
    ``W.operator()``.

    Args:
        module_or_tensor: an ``nn.Module`` or a tensor of shape (…, rows, cols).
        name: the tensor attribute of the module, possibly dotted (ignored for
            a tensor).
        method: a name from `available` (``"householder"``, ``"cwy"``,
            ``"tcwy"``, ``"exp"``, ``"cayley"``, ``"scaled_cayley"``,
            ``"riemannian"``, and any registered map), an `OrthogonalMap`
            subclass, or a plain function f of a skew-symmetric (skew-Hermitian)
            n×n A onto O(n) (U(n)), as geotorch's ``triv`` (a `FunctionMap`;
            option ``inverse=g``).
        **options: ``conv_kernel=True`` (an ``nn.Conv1d/2d/3d`` weight constrained
            through its kernel matrix, see `stiefel.parametrizations.conv`),
            ``gates=True`` (each stacked gate of an LSTM/GRU weight), ``init``
            ("nearest", "haar", "identity", "random", "torus"),
            ``generator``, and the method's own options (``reflections=L`` for
            the reflection maps, ``block`` for ``householder``, ``negatives=ρ``
            for ``scaled_cayley``).

    Returns:
        The module given; the Parameter given, for a Parameter that a module
        holds; an `OrthogonalMatrix` for a plain tensor or a Parameter no
        module holds.

    Raises:
        ValueError: unknown method or init, a shape or value the method cannot
            serve, an already constrained weight, a Parameter held by several
            modules (tied).
        TypeError: unknown options, a dtype that is not allowed, a tensor that is
            not a leaf (computed, e.g. an already parametrized ``module.weight``).

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        lin = orthogonalize(torch.nn.Linear(16, 16), method="cwy")
        w = lin.weight
        assert (w.T @ w - torch.eye(16)).norm() < 1e-5

        head = torch.nn.Linear(16, 8)
        p = orthogonalize(head.weight, method="cayley")  # constrains head in place
        assert p is head.parametrizations.weight.original  # what optimizers step
        w = head.weight  # 8×16, rows orthonormal
        assert (w @ w.T - torch.eye(8)).norm() < 1e-5

        W = orthogonalize(torch.randn(64, 64), method="householder", reflections=8)
        x = torch.randn(3, 64)
        assert torch.allclose(W.linear(x), torch.nn.functional.linear(x, W()), atol=1e-5)

        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8))
        assert orthogonalize(model, "1.weight", method="exp") is model

        lstm = orthogonalize(torch.nn.LSTM(4, 4), "weight_hh_l0", gates=True, init="torus")
        gate = lstm.weight_hh_l0[:4]
        assert torch.allclose(gate @ gate.T, torch.eye(4), atol=1e-5)
        ```
    """
    if isinstance(module_or_tensor, nn.Module):
        return _orthogonalize_module(module_or_tensor, name, method, dict(options))
    if isinstance(module_or_tensor, torch.Tensor):
        t = module_or_tensor
        if not t.is_leaf:
            raise TypeError(
                f"module_or_tensor is a computed tensor (shape {tuple(t.shape)}, grad_fn="
                f"{type(t.grad_fn).__name__}), not a leaf: a constrained copy would cut it off "
                "from what it was computed from. A parametrized weight (module.weight after "
                "orthogonalize) is already constrained; allowed: a Parameter (constrained "
                "where it is held), a module and name, or a leaf tensor (e.g. t.detach())"
            )
        if isinstance(t, nn.Parameter):
            return _orthogonalize_parameter(t, method, dict(options))
        return OrthogonalMatrix(t, method, **options)
    raise TypeError(
        "module_or_tensor must be an nn.Module, a tensor or an nn.Parameter, "
        f"got {type(module_or_tensor).__name__}"
    )


def _orthogonalize_parameter(param: nn.Parameter, method: object, options: dict[str, Any]):
    r"""Constrain ``param`` where it is held; a free one gets an `OrthogonalMatrix` holder.

    Note [Constraining a Parameter where it is held]
    ``orthogonalize(lin.weight, method=...)`` means the model's weight: the
    modules that register this very Parameter object are found (Note [Finding
    a Parameter's holders]) and the weight is constrained there, as
    ``orthogonalize(module, name, ...)`` does. The Parameter object stays the
    one the model trains: torch's ``register_parametrization`` keeps it as
    ``module.parametrizations.<name>.original`` (its values become the map's
    free parameters, ``set_`` into the same object, possibly of another
    shape), and ``method="riemannian"`` re-classes it in place; so the call
    returns it, and an optimizer built before the call (with no state yet)
    still steps the constrained model. Held by several modules (tied), a
    parametrization would constrain one holder only (Note [Tied weights
    cannot take a parametrization]): refused with the holders named, except
    for ``method="riemannian"`` (no ``conv_kernel``/``gates``), which keeps
    the Parameter and records the manifold on every holder. A Parameter no
    module holds gets a new `OrthogonalMatrix` holding that same object.
    """
    found = holders(param)
    where = holder_names(found) if found else "a free nn.Parameter"
    if param.dtype not in DTYPES:
        raise TypeError(
            f"module_or_tensor ({where}, shape {tuple(param.shape)}) has dtype {param.dtype}; "
            f"allowed: {', '.join(str(d) for d in DTYPES)}"
        )
    if not found:
        return OrthogonalMatrix._holding(param, method, options)
    for module, key in found:
        if isinstance(module, parametrize.ParametrizationList):
            raise ValueError(
                f"module_or_tensor is the free parameter ({type(module).__name__}.{key}) of a "
                "weight that is already parametrized (constrained); remove it first with "
                "torch.nn.utils.parametrize.remove_parametrizations(module, name)"
            )
    label, _, _ = resolve(method)
    shared = label == RIEMANNIAN and not (options.get("conv_kernel") or options.get("gates"))
    if len(found) > 1 and not shared:
        raise ValueError(
            f"module_or_tensor is tied: the same Parameter is {holder_names(found)}; a "
            f"parametrization (method={label!r}) would constrain one holder and leave the "
            "others multiplying by the unconstrained tensor (Note [Tied weights cannot take a "
            "parametrization]); untie them first (e.g. other.weight = "
            "nn.Parameter(w.detach().clone())) or use method='riemannian', which keeps the "
            "Parameter"
        )
    module, key = found[0]
    _orthogonalize_module(module, key, method, options)
    if len(found) > 1:  # riemannian: every holder keeps the manifold
        manifold, tag = binding.records(module)[key]
        init = module.__dict__["reset_parameters"].inits[key]
        for other, other_key in found[1:]:
            binding.attach(other, other_key, manifold, tag)
            hook_riemannian_reset(other, other_key, init)
    return param

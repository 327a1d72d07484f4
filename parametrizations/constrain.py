r"""``orthogonalize``: constrain a module's weight (or a bare tensor) to O(n), U(n) or St(N, M).

One entry point for three things given: a module and a tensor's name (the
module constrained in place, `registration`), a plain tensor (a new
`OrthogonalMatrix` holding a copy), and a Parameter (the model that holds it
constrained where it is held, Note [Constraining a Parameter where it is
held]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..manifolds import binding
from ._precision import DTYPES
from .base import RIEMANNIAN
from .deferred import hook_riemannian_reset
from .factory import Method, resolve
from .holders import holder_names, holders
from .matrix import OrthogonalMatrix
from .registration import orthogonalize_module

__all__ = ["orthogonalize", "OrthogonalMatrix", "RIEMANNIAN"]


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

    The nearest point is the polar factor, O(n³), computed by the SVD of the weight
    scaled by a power of two (Note [Nearest point of a scaled matrix];
    `benchmarks/init.py` prints its timing). When the starting point does not
    matter, ``init="identity"``, ``"haar"`` (a random point: the QR of a Gaussian, in the weight's
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
        return orthogonalize_module(module_or_tensor, name, method, dict(options))
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
    if param.dtype not in DTYPES:
        where = holder_names(found) if found else "a free nn.Parameter"
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
    orthogonalize_module(module, key, method, options)
    if len(found) > 1:  # riemannian: every holder keeps the manifold
        manifold, tag = binding.records(module)[key]
        init = module.__dict__["reset_parameters"].inits[key]
        for other, other_key in found[1:]:
            binding.attach(other, other_key, manifold, tag)
            hook_riemannian_reset(other, other_key, init)
    return param

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

from ..manifolds import Stiefel, _checks
from .base import (
    DTYPES,
    INITS,
    RIEMANNIAN,
    OrthogonalMap,
    available,
    get,
    manifold_for,
    methods_serving,
    work_dtype,
)
from .deferred import _write_riemannian_point

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


def _serving_error(method: str, w: torch.Tensor, why: str) -> ValueError:
    can = methods_serving(tuple(w.shape), w.dtype)
    return ValueError(
        f"method={method!r} cannot serve a {why} weight of shape {tuple(w.shape)} ({w.dtype}); "
        f"methods that can: {', '.join(can) if can else 'none'}"
    )


def _resolve(method: object) -> tuple[str, type[OrthogonalMap] | None]:
    """(name, class) for a method name or an OrthogonalMap subclass; class None: riemannian."""
    if isinstance(method, type) and issubclass(method, OrthogonalMap):
        return method.method or method.__name__, method
    if method == RIEMANNIAN:
        return RIEMANNIAN, None
    if isinstance(method, type):
        raise TypeError(
            f"method={method!r} is a class but not an OrthogonalMap subclass; allowed: a name "
            f"({', '.join(available())}) or an OrthogonalMap subclass"
        )
    return str(method), get(method)


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


def _orthogonalize_module(module: nn.Module, name: str, method: object, options: dict[str, Any]):
    """Validate everything, then register (nothing is modified if anything fails)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}")
    module, name = _locate(module, name)
    label, cls = _resolve(method)
    if parametrize.is_parametrized(module, name):
        raise ValueError(
            f"module.{name} is already parametrized; remove it first with "
            f"torch.nn.utils.parametrize.remove_parametrizations(module, {name!r})"
        )
    w = getattr(module, name, None)
    if not isinstance(w, torch.Tensor):
        tensors = [k for k, _ in module.named_parameters(recurse=False)]
        tensors += [k for k, _ in module.named_buffers(recurse=False)]
        raise ValueError(
            f"name={name!r} is not a tensor of {type(module).__name__}; "
            f"allowed: {', '.join(tensors) if tensors else 'none (it has no tensors)'}"
        )
    if isinstance(w, geoopt.ManifoldParameter):
        raise ValueError(
            f"module.{name} is already a manifold parameter (method='riemannian' or geoopt); "
            f"method={label!r} cannot be applied on top of it: a Riemannian optimizer and a "
            "parametrization would both constrain it"
        )
    init = options.pop("init", None)
    _check_weight(f"module.{name}", w, values=init in (None, "nearest"))
    generator = options.pop("generator", None)
    if init is not None:
        _checks.choice("init", init, INITS)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if cls is None:
        _make_riemannian(module, name, w, options, init, generator)
        return module
    if cls.real_only and w.dtype.is_complex:
        raise _serving_error(label, w, "complex")
    allowed = cls.options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for method={label!r}; "
            f"allowed: {', '.join(['init', 'generator', *allowed])}"
        )
    fmap = cls(tuple(w.shape), work_dtype(w.dtype), w.device, **options)
    with torch.no_grad():
        original = fmap.initial(w, init, generator).to(dtype=w.dtype, device=w.device)
    with fmap.initialised_with(original):  # Note [Registering with a precomputed original]
        parametrize.register_parametrization(module, name, fmap, unsafe=True)
    return module


def _make_riemannian(module, name, w, options, init, generator) -> None:
    r"""Make module.<name> a ``geoopt.ManifoldParameter`` on our manifold, in place.

    Note [Riemannian weights must be tall]
    A Riemannian optimizer moves the stored tensor itself along St(N, M), whose
    points have orthonormal columns; a wide weight would have to be stored
    transposed, which the module using it would not expect. Wide weights are
    therefore refused and the parametrization methods suggested.

    Note [Riemannian weights keep their Parameter]
    The Parameter object is kept: its class becomes ``geoopt.ManifoldParameter``
    (a subclass of ``nn.Parameter`` with no extra storage, only the
    ``manifold`` attribute) and the projected value is copied into its storage.
    Tied weights stay tied and an optimizer built before the call keeps
    stepping the same tensor (as a Euclidean one until it is rebuilt: only a
    Riemannian optimizer keeps it on the manifold). On a meta weight nothing
    is computed; ``module.to_empty(device=...)`` rebuilds a plain Parameter,
    so call ``orthogonalize(..., method="riemannian")`` again afterwards.
    """
    if options:
        raise TypeError(
            f"unknown option(s) {', '.join(sorted(options))} for method='riemannian'; "
            "allowed: init, generator"
        )
    if w.shape[-2] < w.shape[-1]:
        raise _serving_error(RIEMANNIAN, w, "wide")
    if name not in module._parameters or not isinstance(w, nn.Parameter):
        raise ValueError(f"method='riemannian' needs module.{name} to be an nn.Parameter")
    manifold = manifold_for(tuple(w.shape), w.dtype.is_complex)
    if w.device.type != "meta":
        _write_riemannian_point(w, manifold, init, generator)
    w.__class__ = geoopt.ManifoldParameter
    w.manifold = manifold


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

    def __init__(
        self, tensor: torch.Tensor, method: str | type[OrthogonalMap] = "cwy", **options: Any
    ):
        super().__init__()
        t = _check_weight("tensor", tensor)
        label, _ = _resolve(method)
        self.weight = nn.Parameter(t.detach().clone())
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
    method: str | type[OrthogonalMap] = "cwy",
    **options: Any,
):
    r"""Constrain ``module.<name>`` (or a bare tensor) to O(n), U(n) or St(N, M).

    The manifold follows from the tensor: square real → O(n), square complex →
    U(n), tall N×M → St(N, M), wide → its transpose on St(M, N). Leading
    dimensions are a batch of independent matrices.

    On a module, registers a ``torch.nn.utils.parametrize`` parametrization on
    ``module.<name>`` (``name`` may be dotted, ``"rnn.weight_hh_l0"``) and
    returns the module; for ``method="riemannian"`` the Parameter itself
    (same object and storage) becomes a ``geoopt.ManifoldParameter`` for the
    Riemannian optimizers instead. On a tensor or ``nn.Parameter``, returns an
    `OrthogonalMatrix` ``W`` with ``W()`` the matrix, built on a copy (a
    Parameter of a module is left unchanged: a warning says so). The weight
    starts at the manifold point nearest the current value (polar factor),
    unless ``init`` says otherwise.

    The nearest point costs an SVD, O(n³): for a float32 4096×4096 weight on
    two CPU cores about 20 s (2–3 s at n = 2048; `benchmarks/init.py`), of
    which the reflections of ``householder``/``cwy`` take about 1 s. When the
    starting point does not matter, ``init="identity"``, ``"haar"`` (a random
    point: the QR of a Gaussian, in the weight's precision) or ``"random"``
    skip the SVD (see the troubleshooting page, "Slow initialisation").

    A loop reading a parametrized weight at every step (a recurrent rollout)
    recomputes the map each time: wrap it in ``parametrize.cached()`` or use
    ``W.operator()``.

    Args:
        module_or_tensor: an ``nn.Module`` or a tensor of shape (…, rows, cols).
        name: the tensor attribute of the module, possibly dotted (ignored for
            a tensor).
        method: a name from `available` (``"householder"``, ``"cwy"``,
            ``"tcwy"``, ``"exp"``, ``"cayley"``, ``"scaled_cayley"``,
            ``"riemannian"``, and any registered map), or an `OrthogonalMap`
            subclass.
        **options: ``conv_kernel=True`` (an ``nn.Conv1d/2d/3d`` weight constrained
            through its kernel matrix, see `stiefel.parametrizations.conv`), ``init``
            ("nearest", "haar", "identity", "random"),
            ``generator``, and the method's own options (``reflections=L`` for
            the reflection maps, ``block`` for ``householder``, ``negatives=ρ``
            for ``scaled_cayley``).

    Returns:
        The module, or an `OrthogonalMatrix` for a tensor.

    Raises:
        ValueError: unknown method or init, a shape or value the method cannot
            serve, an already constrained weight.
        TypeError: unknown options, a dtype that is not allowed.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        lin = orthogonalize(torch.nn.Linear(16, 16), method="cwy")
        w = lin.weight
        assert (w.T @ w - torch.eye(16)).norm() < 1e-5

        W = orthogonalize(torch.randn(64, 64), method="householder", reflections=8)
        x = torch.randn(3, 64)
        assert torch.allclose(W.linear(x), torch.nn.functional.linear(x, W()), atol=1e-5)

        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8))
        orthogonalize(model, "1.weight", method="exp")
        ```
    """
    conv_kernel = options.pop("conv_kernel", False)
    if not isinstance(conv_kernel, bool):
        raise TypeError(f"conv_kernel must be True or False, got {conv_kernel!r}")
    if conv_kernel:  # Stiefel convolution kernels: parametrizations/conv.py
        from .conv import orthogonalize_conv

        return orthogonalize_conv(module_or_tensor, name, method, options)
    if isinstance(module_or_tensor, nn.Module):
        return _orthogonalize_module(module_or_tensor, name, method, dict(options))
    if isinstance(module_or_tensor, torch.Tensor):
        if isinstance(module_or_tensor, nn.Parameter):
            warnings.warn(
                "orthogonalize(parameter) returns an independent OrthogonalMatrix built on a "
                "copy: the Parameter (and any module holding it) is unchanged. To constrain a "
                "module's weight in place use orthogonalize(module, 'weight', method=...), or "
                "method='riemannian' on the module to make the Parameter itself a manifold "
                "parameter",
                UserWarning,
                stacklevel=2,
            )
        return OrthogonalMatrix(module_or_tensor, method, **options)
    raise TypeError(
        "module_or_tensor must be an nn.Module, a tensor or an nn.Parameter, "
        f"got {type(module_or_tensor).__name__}"
    )

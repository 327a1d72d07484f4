r"""`build`: the one constructor of every constrained weight's map.

``orthogonalize`` (module weights and bare tensors), the Stiefel convolution
kernels (``conv_kernel=True``) and `rotate` (hence the PEFT method) all make
their maps here, so a method name, an `OrthogonalMap` subclass, ``"riemannian"``
or a plain function means the same thing, with the same checks and the same
errors, wherever it is given.

Note [One map per constrained weight, riemannian included]
``method="riemannian"`` builds a `ManifoldPoint`: the identity map on the
manifold, whose original *is* the point (the caller stores it as a
``geoopt.ManifoldParameter``). Inside a parametrization (a conv kernel, a
rotation) that makes a Riemannian weight one more map: the same
``initial``/``right_inverse``/checks, with no branch of its own. Only
``orthogonalize(module, method="riemannian")`` keeps the Parameter object
itself (the contract: tied weights stay tied), and uses the map for the point
it writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._core.registry import RegistryError
from ._precision import DTYPES, work_dtype
from .base import RIEMANNIAN, OrthogonalMap, available, get, maps
from .function import FunctionMap
from .point import ManifoldPoint

__all__ = ["build", "resolve", "methods_serving"]

Method = str | type[OrthogonalMap] | Callable[[torch.Tensor], torch.Tensor]


def resolve(method: object) -> tuple[str, type[OrthogonalMap], dict[str, Any]]:
    """(label, class, fixed options) of a method name, class, ``"riemannian"`` or function."""
    if isinstance(method, type):
        if issubclass(method, OrthogonalMap):
            return method.method or method.__name__, method, {}
        raise TypeError(
            f"method={method!r} is a class but not an OrthogonalMap subclass; allowed: a name "
            f"({', '.join(available())}), an OrthogonalMap subclass or a function"
        )
    if method == RIEMANNIAN:
        return RIEMANNIAN, ManifoldPoint, {}
    if callable(method) and not isinstance(method, str):
        name = getattr(method, "__name__", type(method).__name__)
        return f"function {name}", FunctionMap, {"function": method}
    if not isinstance(method, str):
        raise RegistryError(
            f"method={method!r} is not allowed; allowed: a name ({', '.join(available())}), "
            "an OrthogonalMap subclass or a function of a skew matrix"
        )
    return method, get(method), {}


def methods_serving(shape: Sequence[int], dtype: torch.dtype) -> list[str]:
    """Names of the methods that can serve a weight of this shape and dtype."""
    out = [name for name, cls in maps().items() if not (cls.real_only and dtype.is_complex)]
    return out + ([RIEMANNIAN] if shape[-2] >= shape[-1] else [])


def build(
    method: Method,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    options: Mapping[str, Any] | None = None,
) -> OrthogonalMap:
    r"""The map constraining a weight of ``shape`` and ``dtype`` with ``method``.

    Args:
        method: a registered name (`available`), ``"riemannian"`` (a
            `ManifoldPoint`: the original is the point itself), an
            `OrthogonalMap` subclass, or a plain function f taking a
            skew-symmetric / skew-Hermitian n×n A to an orthogonal / unitary
            f(A) (geotorch's ``triv``; a `FunctionMap`, option ``inverse``).
        shape: the weight's shape (…, rows, cols); wide weights are served
            through their transpose.
        dtype: the weight's dtype (float16/bfloat16: the map computes in float32).
        device: where the map's buffers live.
        options: the method's own options (``reflections=L``, …).

    Returns:
        The map, an `OrthogonalMap` (an ``nn.Module`` for
        ``torch.nn.utils.parametrize``), not yet holding an original: get one
        from ``fmap.initial(weight, init, generator)`` or ``fmap.right_inverse(Q)``.

    Raises:
        ValueError: an unknown method name, a method that cannot serve the
            shape or dtype.
        TypeError: unknown options, a dtype that is not allowed.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import build

        fmap = build("cwy", (6, 4), torch.float32, options={"reflections": 4})
        original = fmap.initial(torch.randn(6, 4), "haar", None)
        q = fmap(original)
        assert torch.allclose(q.mT @ q, torch.eye(4), atol=1e-5)
        ```
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or min(shape) < 1:
        raise ValueError(f"shape must be (…, rows, cols) with every dimension > 0, got {shape}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} is not allowed; allowed: {', '.join(map(str, DTYPES))}")
    label, cls, fixed = resolve(method)
    options = dict(options or {})
    if cls.real_only and dtype.is_complex:
        can = methods_serving(shape, dtype)
        raise ValueError(
            f"method={label!r} cannot serve a complex weight of shape {shape} ({dtype}); "
            f"methods that can: {', '.join(can) if can else 'none'}"
        )
    if cls is ManifoldPoint and shape[-2] < shape[-1]:
        raise ValueError(
            f"method='riemannian' cannot serve a wide weight of shape {shape} "
            "(Note [Riemannian weights must be tall]); methods that can: "
            + ", ".join(methods_serving(shape, dtype))  # the maps: none is riemannian here
        )
    allowed = [o for o in cls.options() if o not in fixed]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for method={label!r}; "
            f"allowed: {', '.join(['init', 'generator', *allowed])}"
        )
    return cls(shape, work_dtype(dtype), device, **fixed, **options)

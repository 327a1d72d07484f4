r"""The optimizer registry: ``create``, ``register``, ``available``, entry points.

Every name maps to a :class:`torch.optim.Optimizer` subclass or to a factory
``f(params, **hyper) -> Optimizer``. Built in: this package's ``rgd``,
``radam``, ``landing``; torch's ``sgd``, ``adam``, ``adamw``, ``rmsprop``,
``adagrad``; geoopt's ``geoopt_rsgd``, ``geoopt_radam``. Third-party packages
add names through the entry-point group ``stiefel.optimizers``, e.g. in their
pyproject.toml::

    [project.entry-points."stiefel.optimizers"]
    my_opt = "my_package.optim:MyOptimizer"

Entry points are looked up once, on first use, and loaded when their name is
created.

Example::

    >>> import torch
    >>> from stiefel import optimizers
    >>> "rgd" in optimizers.available()
    True
    >>> opt = optimizers.create("adam", [torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    >>> type(opt).__name__
    'Adam'
"""

from __future__ import annotations

import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import geoopt
import torch

__all__ = ["create", "register", "available", "load_entry_points", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "stiefel.optimizers"

_REGISTRY: dict[str, Any] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
    "geoopt_rsgd": geoopt.optim.RiemannianSGD,
    "geoopt_radam": geoopt.optim.RiemannianAdam,
}
_ENTRY_POINTS: dict[str, importlib.metadata.EntryPoint] = {}
_SCANNED = False


def _check_target(name: str, obj: Any) -> None:
    if inspect.isclass(obj):
        if not issubclass(obj, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer {name!r}: {obj.__name__} is a class but not a torch.optim.Optimizer "
                "subclass; register an Optimizer subclass or a factory returning one"
            )
    elif not callable(obj):
        raise TypeError(
            f"optimizer {name!r}: {obj!r} is neither an Optimizer subclass nor a callable factory"
        )


def register(name: str) -> Callable[[Any], Any]:
    """Decorator registering an Optimizer subclass or a factory under ``name``.

    Raises ValueError when ``name`` is taken (built-in, registered or from an
    entry point) and TypeError when the target is neither.

    Example (not run: a name can be registered once per process)::

        @optimizers.register("half_sgd")
        def half_sgd(params, lr):
            return torch.optim.SGD(params, lr=lr / 2)

        opt = optimizers.create("half_sgd", model.parameters(), lr=1.0)
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name={name!r} is not allowed; allowed: a Python identifier string")

    def decorator(obj: Any) -> Any:
        _check_target(name, obj)
        load_entry_points()
        if name in _REGISTRY or name in _ENTRY_POINTS:
            where = "an entry point" if name in _ENTRY_POINTS else repr(_REGISTRY[name])
            raise ValueError(
                f"an optimizer is already registered under name={name!r} ({where}); "
                f"choose another name; taken: {', '.join(available())}"
            )
        _REGISTRY[name] = obj
        return obj

    return decorator


def load_entry_points(force: bool = False) -> list[str]:
    """Scan the entry-point group ``stiefel.optimizers`` (once, or again with ``force``).

    Returns the names found. A name that clashes with a registered one is skipped
    with a warning (the registered one wins).
    """
    global _SCANNED
    if _SCANNED and not force:
        return sorted(_ENTRY_POINTS)
    _SCANNED = True
    _ENTRY_POINTS.clear()
    try:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception as exc:  # noqa: BLE001 - a broken environment must not break the registry
        warnings.warn(f"could not read entry points {ENTRY_POINT_GROUP!r}: {exc}", stacklevel=2)
        return []
    for ep in eps:
        if ep.name in _REGISTRY or ep.name in _ENTRY_POINTS:
            warnings.warn(
                f"entry point {ep.name!r} = {ep.value!r} clashes with an optimizer already "
                "registered under that name; it is ignored",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        _ENTRY_POINTS[ep.name] = ep
    return sorted(_ENTRY_POINTS)


def available() -> list[str]:
    """Sorted names of every optimizer that :func:`create` accepts."""
    load_entry_points()
    return sorted({*_REGISTRY, *_ENTRY_POINTS})


def _resolve(name: str) -> Any:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}; available: {', '.join(available())}")
    load_entry_points()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _ENTRY_POINTS:
        ep = _ENTRY_POINTS[name]
        obj = ep.load()
        _check_target(name, obj)
        _REGISTRY[name] = obj
        del _ENTRY_POINTS[name]
        return obj
    raise ValueError(f"unknown optimizer name={name!r}; available: {', '.join(available())}")


def create(name: str, params, **hyper: Any) -> torch.optim.Optimizer:
    """Build the optimizer registered as ``name`` over ``params`` with ``hyper``.

    Raises ValueError for an unknown name (listing the available ones); the
    optimizer's own checks raise for bad hyper-parameters.
    """
    obj = _resolve(name)
    opt = obj(params, **hyper)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer factory {name!r} returned {type(opt).__name__}, not a torch.optim.Optimizer"
        )
    return opt

"""Everything the harness reads from the map and optimizer registries, in one place.

The harness never lists maps or optimizers by hand: names, FLOP models,
formulas, operator forms and default learning rates are declared on the
registered classes (CONTRACT.md: ``stiefel.parametrizations.maps()`` and the
class capabilities ``flops``, ``formula``, ``domain``, ``has_operator()``,
``takes_reflections()``; ``stiefel.optimizers.info(name)`` with ``default_lr``,
``riemannian``, ``step_flops``, ``formula``, ``variants``). Only this module
calls those APIs; where a registry predates them, the same facts are read from
the class attributes of the same names, with the contract's defaults.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from .. import optimizers, parametrizations

__all__ = [
    "MapInfo",
    "OptimizerInfo",
    "maps",
    "map_info",
    "methods",
    "optimizer_names",
    "optimizer_info",
    "riemannian_optimizers",
    "default_lr",
    "step_label",
    "optimizer_steps",
]


@dataclass(frozen=True)
class MapInfo:
    """What the harness knows of a registered map class."""

    name: str
    cls: type
    formula: str = ""
    domain: str = ""
    operator: bool = False
    reflections: bool = False

    def flops(self, n: int, m: int, reflections: int | None = None) -> float:
        """Forward FLOPs of the tall n×m matrix (NaN: the class declares no model)."""
        fn = getattr(self.cls, "flops", None)
        if fn is None:
            return math.nan
        value = fn(n, m, reflections)
        return math.nan if value is None else float(value)


@dataclass(frozen=True)
class OptimizerInfo:
    """What the harness knows of a registered optimizer (CONTRACT.md's ``OptimizerInfo``)."""

    name: str
    default_lr: float = 1e-3
    riemannian: bool = False
    step_flops: Any = None
    formula: str = ""
    variants: list = field(default_factory=lambda: [{}])

    def flops(self, n: int, m: int, **hyper: Any) -> float:
        """FLOPs of one step on St(n, m) with ``hyper`` (NaN: no model)."""
        if self.step_flops is None:
            return math.nan
        value = self.step_flops(n, m, **hyper)
        return math.nan if value is None else float(value)


def maps() -> dict[str, type]:
    """Registered map classes by name (no ``riemannian``)."""
    if hasattr(parametrizations, "maps"):
        return dict(parametrizations.maps())
    from ..parametrizations import base  # a registry that predates maps(): same content

    return {n: base._REGISTRY[n] for n in base.available() if isinstance(base._REGISTRY[n], type)}


def _flag(cls: type, name: str, default: bool = False) -> bool:
    attr = getattr(cls, name, None)
    return bool(attr()) if callable(attr) else default


def map_info(name: str) -> MapInfo:
    """The capabilities of the registered map ``name`` (ValueError listing the maps)."""
    registered = maps()
    if name not in registered:
        raise ValueError(f"unknown map {name!r}; available: {', '.join(registered)}")
    cls = registered[name]
    if hasattr(cls, "takes_reflections"):
        refl = _flag(cls, "takes_reflections")
    else:
        refl = "reflections" in inspect.signature(cls.__init__).parameters
    return MapInfo(
        name,
        cls,
        formula=getattr(cls, "formula", "") or "",
        domain=getattr(cls, "domain", "") or "",
        operator=_flag(cls, "has_operator")
        if hasattr(cls, "has_operator")
        else getattr(cls, "operator", None) is not parametrizations.OrthogonalMap.operator,
        reflections=refl,
    )


def methods() -> list[str]:
    """Every name ``orthogonalize`` accepts (registered maps, then ``riemannian``)."""
    return list(parametrizations.available())


def optimizer_names() -> list[str]:
    return list(optimizers.available())


def optimizer_info(name: str) -> OptimizerInfo:
    """The declared facts of optimizer ``name`` (ValueError listing the optimizers)."""
    if name not in optimizers.available():
        raise ValueError(
            f"unknown optimizer {name!r}; available: {', '.join(optimizers.available())}"
        )
    if hasattr(optimizers, "info"):
        i = optimizers.info(name)
        return OptimizerInfo(
            name,
            float(i.default_lr),
            bool(i.riemannian),
            i.step_flops,
            i.formula or "",
            list(i.variants or [{}]),
        )
    return from_class(name)


def from_class(name: str) -> OptimizerInfo:
    """The facts of optimizer ``name`` read from its class attributes (contract defaults)."""
    from ..optimizers import registry

    obj = registry._resolve(name)
    cls = obj if isinstance(obj, type) else None
    riem = cls is not None and issubclass(cls, optimizers.RiemannianOptimizer)
    if cls is not None and cls.__module__.startswith("geoopt"):
        riem = True
    lr = getattr(obj, "default_lr", None)
    if lr is None and cls is not None:
        lr_param = inspect.signature(cls.__init__).parameters.get("lr")
        if lr_param is not None and isinstance(lr_param.default, (int, float)):
            lr = lr_param.default
    return OptimizerInfo(
        name,
        float(1e-3 if lr is None else lr),
        bool(getattr(obj, "riemannian", riem)),
        getattr(obj, "step_flops", None),
        getattr(obj, "formula", "") or "",
        list(getattr(obj, "variants", None) or [{}]),
    )


def riemannian_optimizers() -> list[OptimizerInfo]:
    """Every registered optimizer that can step a manifold parameter."""
    return [i for i in map(optimizer_info, optimizer_names()) if i.riemannian]


def step_label(name: str, variant: dict) -> str:
    """``rgd(metric=canonical,retraction=qr)``: an optimizer and one of its variants."""
    if not variant:
        return name
    return f"{name}({','.join(f'{k}={v}' for k, v in sorted(variant.items()))})"


def optimizer_steps() -> dict[str, tuple[OptimizerInfo, dict]]:
    """Every riemannian optimizer × its declared variants, by label."""
    return {
        step_label(i.name, v): (i, dict(v)) for i in riemannian_optimizers() for v in i.variants
    }


def default_lr(name: str) -> float:
    return optimizer_info(name).default_lr

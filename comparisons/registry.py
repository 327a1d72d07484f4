"""Everything the harness reads from the map and optimizer registries, in one place.

The harness never lists maps or optimizers by hand: names, FLOP models,
formulas, operator forms and default learning rates are declared on the
registered classes and read here: `stiefel.parametrizations.maps()` with the
class capabilities `flops`, `formula`, `domain`, `has_operator()`,
`takes_reflections()` (and ``backward_flops`` where a class declares one),
and `stiefel.optimizers.info(name)` with `default_lr`, `riemannian`,
`step_flops`, `formula`, `variants`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import optimizers, parametrizations
from ..optimizers import OptimizerInfo

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
    """What the harness knows of a registered map class (read from the class)."""

    name: str
    cls: type

    @property
    def formula(self) -> str:
        return self.cls.formula

    @property
    def domain(self) -> str:
        return self.cls.domain

    @property
    def operator(self) -> bool:
        return self.cls.has_operator()

    @property
    def reflections(self) -> bool:
        return self.cls.takes_reflections()

    def flops(self, n: int, m: int, reflections: int | None = None) -> float:
        """Forward FLOPs of the tall n×m matrix (NaN: the class declares no model)."""
        value = self.cls.flops(n, m, reflections)
        return math.nan if value is None else float(value)

    def backward_flops(self, n: int, m: int, reflections: int | None = None) -> float:
        """FLOPs of the backward pass alone, from the class's optional ``backward_flops``.

        NaN when the class declares none: the complexity section then charges
        forward+backward by its documented convention
        (`stiefel.comparisons.roofline.forward_backward_flops`).
        """
        model = getattr(self.cls, "backward_flops", None)
        value = None if model is None else model(n, m, reflections)
        return math.nan if value is None else float(value)


def maps() -> dict[str, type]:
    """Registered map classes by name (no ``riemannian``)."""
    return dict(parametrizations.maps())


def map_info(name: str) -> MapInfo:
    """The capabilities of the registered map ``name`` (ValueError listing the maps)."""
    registered = maps()
    if name not in registered:
        raise ValueError(f"unknown map {name!r}; available: {', '.join(registered)}")
    return MapInfo(name, registered[name])


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
    return optimizers.info(name)


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

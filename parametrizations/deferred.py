r"""Deferred initialisation: `initialize` writes a manifold point into orthogonalized weights."""

from __future__ import annotations

import geoopt
import torch
from torch import nn
from torch.nn.utils import parametrize

from ..manifolds import Stiefel, _checks
from .base import INITS, OrthogonalMap

__all__ = ["initialize"]


def _dtensor_type() -> type:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return type(None)
    return DTensor


@torch.no_grad()
def _write_riemannian_point(w: torch.Tensor, manifold: Stiefel, init, generator) -> None:
    """Copy the point of ``manifold`` chosen by ``init`` into the tall weight ``w``."""
    if init in (None, "nearest"):
        value = manifold.projx(w.detach())
    elif init == "identity":
        value = torch.eye(manifold.n, manifold.m, dtype=w.dtype, device=w.device).expand(w.shape)
    else:  # haar and random
        value = manifold.random(
            *w.shape[:-2], manifold.n, manifold.m, dtype=w.dtype, generator=generator
        ).as_subclass(torch.Tensor)
    w.copy_(value.to(w.device))


def initialize(
    module: nn.Module, *, init: str = "random", generator: torch.Generator | None = None
) -> nn.Module:
    r"""Write a fresh manifold point into every orthogonalized weight of ``module``, in place.

    The one call after deferred initialisation: a model built under
    ``with torch.device("meta")`` (``orthogonalize`` reads no values there) and
    allocated with ``module.to_empty(device=...)`` holds uninitialised memory in
    its maps' free parameters and buffers (signs, base points, scalings). For
    every weight parametrized by an `OrthogonalMap`, the original is rewritten
    with the map's own initialisation (the one ``orthogonalize`` uses) and the
    map's buffers are reset with it; every ``geoopt.ManifoldParameter`` on a
    stiefel manifold (``method="riemannian"``) gets a point of its manifold.
    Other parameters are left alone (call the modules' ``reset_parameters``
    for them). ``to_empty`` turns a ``method="riemannian"`` weight back into a
    plain ``Parameter`` (torch rebuilds it): call ``orthogonalize(module, name,
    method="riemannian", init=...)`` on it again instead.

    Args:
        module: the model (searched recursively).
        init: ``"random"`` (default: a random point the map reaches; Haar for
            the maps that reach every point), ``"haar"`` or ``"identity"``
            (``"nearest"`` has no weight to be near after ``to_empty``).
        generator: the random generator of ``"random"`` / ``"haar"``.

    Returns:
        ``module``.

    Raises:
        ValueError: an unknown ``init``, a weight still on the meta device
            (call ``module.to_empty(device=...)`` first), or no orthogonalized
            weight in ``module``.

    Example:
        ```python
        import torch
        from torch import nn
        from stiefel.parametrizations import initialize, orthogonalize

        with torch.device("meta"):
            layer = orthogonalize(nn.Linear(8, 8), method="cwy")
        layer.to_empty(device="cpu")
        initialize(layer)
        w = layer.weight
        assert torch.linalg.matrix_norm(w.T @ w - torch.eye(8)) < 1e-5
        ```
    """
    _checks.choice("init", init, [i for i in INITS if i != "nearest"])
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    found = []
    for path, sub in module.named_modules():
        for name, w in sub.named_parameters(recurse=False):
            if isinstance(w, geoopt.ManifoldParameter) and isinstance(w.manifold, Stiefel):
                found.append((f"{path}.{name}".lstrip("."), w, w.manifold))
        if parametrize.is_parametrized(sub):
            for name, plist in sub.parametrizations.items():
                if len(plist) == 1 and isinstance(plist[0], OrthogonalMap):
                    found.append((f"{path}.{name}".lstrip("."), plist.original, plist[0]))
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no orthogonalized weight (no OrthogonalMap "
            "parametrization, no ManifoldParameter on a stiefel manifold)"
        )
    for label, w, _ in found:
        if isinstance(w, _dtensor_type()):
            raise TypeError(
                f"{label} is a DTensor (sharded): initialize writes local tensors; call it "
                "after module.to_empty(device=...) and before fully_shard"
            )
        if w.device.type == "meta":
            raise ValueError(
                f"{label} is on the meta device: allocate it first, "
                "module.to_empty(device=...), then initialize(module)"
            )
    with torch.no_grad():
        for _, w, owner in found:
            if isinstance(owner, OrthogonalMap):  # resets the map's buffers too
                w.copy_(owner.initial(w, init, generator).to(w.dtype))
            else:
                _write_riemannian_point(w, owner, init, generator)
    return module

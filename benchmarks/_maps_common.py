"""Helpers shared by the map benchmarks (benchmarks.maps and its rollout part)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal as torch_orthogonal

from stiefel.parametrizations import orthogonalize

from ._timing import measure

try:  # geotorch is an optional dependency (extra [compare])
    import geotorch
except ImportError:  # pragma: no cover - exercised only without geotorch
    geotorch = None

Fns = tuple[Callable[[], object], Callable[[], object]]


def _randomize(module: nn.Module, scale: float, gen: torch.Generator) -> None:
    """Set every parametrized original of ``module`` to scale·N(0, 1)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def _fns(module: nn.Module, get: Callable[[], torch.Tensor]) -> Fns:
    """(forward under no_grad, forward + backward of the sum) of a matrix-valued call."""

    def fwd() -> object:
        with torch.no_grad():
            return get()

    def fwd_bwd() -> object:
        module.zero_grad(set_to_none=True)
        get().sum().backward()
        return None

    return fwd, fwd_bwd


def ours(
    method: str, shape: tuple[int, int], reflections: int | None, gen, device="cpu", **extra: Any
) -> Fns:
    """Our map from ``orthogonalize(tensor, method, **extra)``, W() timed on ``device``.

    Built and randomised on the CPU (the same numbers on every device), then
    moved with ``Module.to(device)``, the user's recipe.
    """
    options: dict[str, Any] = dict(extra)
    if reflections is not None:
        options.update(reflections=reflections, init="random")
    else:
        options.update(init="identity")
    w = orthogonalize(torch.randn(shape, generator=gen), method=method, generator=gen, **options)
    _randomize(w, 1 / math.sqrt(max(shape)), gen)
    w = w.to(device)
    return _fns(w, w)


def torch_map(orthogonal_map: str, shape: tuple[int, int], gen, device="cpu") -> Fns:
    """``torch.nn.utils.parametrizations.orthogonal`` on a bias-free Linear of this shape."""
    lin = nn.Linear(shape[1], shape[0], bias=False)
    torch_orthogonal(lin, orthogonal_map=orthogonal_map)
    _randomize(lin, 1 / math.sqrt(max(shape)), gen)
    lin = lin.to(device)
    return _fns(lin, lambda: lin.weight)


def geotorch_map(triv: str, shape: tuple[int, int], gen, device="cpu") -> Fns | None:
    """``geotorch.orthogonal(..., triv=triv)`` on a bias-free Linear (None without geotorch)."""
    if geotorch is None:
        return None
    lin = nn.Linear(shape[1], shape[0], bias=False)
    geotorch.orthogonal(lin, triv=triv)
    _randomize(lin, 1 / math.sqrt(max(shape)), gen)
    lin = lin.to(device)
    return _fns(lin, lambda: lin.weight)


def _time_pair(fns: Fns | None, repeats: int, budget: float, backward: bool = True):
    if fns is None:
        return None, None
    fwd = measure(fns[0], repeats, budget)
    bwd = measure(fns[1], repeats, budget) if backward else None
    return fwd, bwd


def _row(section: str, name: str, family: str, fwd, bwd, **extra) -> dict[str, Any]:
    return {
        "section": section,
        "name": name,
        "family": family,
        "fwd_s": None if fwd is None else fwd.seconds,
        "fwd_bwd_s": None if bwd is None else bwd.seconds,
        "fwd": None if fwd is None else fwd.as_dict(),
        "fwd_bwd": None if bwd is None else bwd.as_dict(),
        **extra,
    }


def _progress(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"  … {msg}", flush=True)

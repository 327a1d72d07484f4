"""Autocast switched off where this package computes in its own precision.

Note [Autocast off for the maps' own products]
``torch.autocast(dtype=torch.bfloat16)`` runs every matrix product in bfloat16.
An orthogonal map's products (a Gram matrix, a Padé solve, a reflection) lose
their orthogonality to bfloat16's 8-bit mantissa (max |QᵀQ − I| about 3e-3
where float32 gives 1e-6), and a solve given operands cast apart fails on mixed
dtypes. So the maps, the rotations of the adapters and the recurrences compute
with autocast off on their tensors' device, in their own dtype (float32 at
least), and so do the backward passes of its autograd Functions of products
and solves (exp's Padé, the blocked reflections, the unpivoted Cayley solve;
torch's ``custom_bwd`` does the same for one fixed device type): a
``loss.backward()`` called inside an autocast region would otherwise run them
in bfloat16. The products a map leaves to autograd are not covered: their
backward follows the region ``backward()`` runs in (bfloat16 inside one, a
gradient about 3e-3 off relative), which docs/scaling.md says, with torch's
advice to call it after the region. Everything around them keeps autocast's
precision.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "AUTOCAST_DEVICES",
    "autocast_on",
    "autocast_off",
    "backward_autocast_off",
    "enabled_devices",
    "without",
]


def _takes(device: str) -> bool:
    try:
        torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type this build of torch has no autocast for
        return False
    return True


#: the device types this torch's autocast takes (an optimizer step turns it off on each)
_KNOWN = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu", "privateuseone")
AUTOCAST_DEVICES = tuple(d for d in _KNOWN if _takes(d))


def autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is enabled on ``t``'s device (never on meta, which it has no type for)."""
    device = t.device.type
    return device != "meta" and torch.is_autocast_enabled(device)


def autocast_off(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context with autocast disabled on ``t``'s device (a no-op where it is off, and on meta).

    Example:
        ```python
        import torch
        from stiefel._core.autocast import autocast_off

        a = torch.randn(4, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.bfloat16
            with autocast_off(a):
                assert (a @ a).dtype == torch.float32
        ```
    """
    if not autocast_on(t):
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def backward_autocast_off(backward: Callable[..., Any]) -> Callable[..., Any]:
    """An autograd Function's ``backward(ctx, g, ...)`` run with autocast off on g's device."""

    @functools.wraps(backward)
    def run(ctx: Any, g: torch.Tensor | None, *rest: Any) -> Any:
        if g is None:
            return backward(ctx, g, *rest)
        with autocast_off(g):
            return backward(ctx, g, *rest)

    return run


def enabled_devices() -> list[str]:
    """The device types autocast is enabled on here (none outside a region)."""
    return [d for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]


def without(devices: list[str], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with autocast disabled on each of ``devices``.

    Note [An optimizer step computes in the parameters' precision]
    torch's advice is to leave ``opt.step()`` outside an autocast region, but a step
    written inside one is common, and torch's own optimizers are unaffected by it
    (their elementwise ops are not autocast ops). A Riemannian step's products are: a
    retraction in bfloat16 left a float32 point 1e-2 off its manifold with no
    warning, and mixed dtypes made a later step fail. So a step runs with autocast
    off, in the dtype of its parameters and states. One ``torch.autocast`` context per
    device, nested by recursion (``torch.compile`` traces these, not an ``ExitStack``).
    """
    if not devices:
        return fn(*args)
    with torch.autocast(devices[0], enabled=False):
        return without(devices[1:], fn, *args)

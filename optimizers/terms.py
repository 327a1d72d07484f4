r"""The update terms several rules share, written once: weight decay, momentum, stabilize.

`rgd`, `radam`, `manifold_muon` and `pogo` compose their rules from these
(and a plugin may): L2 weight decay on the Euclidean gradient, the heavy-ball
momentum buffer with dampening and Nesterov's look-ahead, and geoopt's
``stabilize``, the alias of ``repair_every``. Each is the formula of torch's
(or geoopt's) optimizers.

Example:
    ```python
    import torch
    from stiefel.optimizers import terms

    g, x = torch.ones(3), torch.full((3,), 2.0)
    assert torch.equal(terms.weight_decay(g, x, 0.5), torch.full((3,), 2.0))
    b = terms.momentum(None, g, 0.9)  # the first buffer is the gradient (torch's SGD)
    b = terms.momentum(b, g, 0.9, dampening=0.5)  # 0.9·1 + 0.5·1
    assert torch.allclose(b, torch.full((3,), 1.4))
    assert torch.allclose(terms.nesterov(g, b, 0.9), g + 0.9 * b)
    ```
"""

from __future__ import annotations

from typing import Any

import torch

from .._core import checks as _checks
from ..manifolds.frame_geometry import FrameGeometry

__all__ = [
    "weight_decay",
    "carry_moment",
    "momentum",
    "nesterov",
    "check_momentum",
    "check_betas",
    "repair_period",
    "stabilize_alias",
    "REPAIR_KEYS",
]

#: the param-group keys of the periodic re-projection: ours and geoopt's name for it
REPAIR_KEYS = ("repair_every", "stabilize")


def weight_decay(grad: torch.Tensor, x: torch.Tensor, decay: float) -> torch.Tensor:
    """G + w·X (L2 weight decay on the Euclidean gradient, torch's and geoopt's), a new tensor.

    Args:
        grad: the Euclidean gradient G.
        x: the point X.
        decay: w ≥ 0; 0 returns ``grad`` itself.

    Returns:
        G + w·X.
    """
    return grad.add(x, alpha=decay) if decay else grad


def momentum(
    buf: torch.Tensor | None,
    g: torch.Tensor,
    mu: float,
    dampening: float = 0.0,
    *,
    update_first: bool = False,
) -> torch.Tensor:
    r"""The heavy-ball buffer B ← μB + (1 − δ)g, as a new tensor (``buf`` is not written).

    The first buffer (``buf`` None) is g itself, as in torch's SGD; with
    ``update_first`` it is g updated once, μg + (1 − δ)g (pogo-torch's ``base.SGD``).

    Args:
        buf: the buffer B of the previous step, or None at the first step.
        g: the direction accumulated (a gradient or Riemannian gradient).
        mu: μ.
        dampening: δ.
        update_first: start from g and update it (pogo-torch), not from g (torch).

    Returns:
        The new buffer.
    """
    if buf is None:
        if not update_first:
            return g.clone()
        buf = g
    return buf.mul(mu).add_(g, alpha=1 - dampening)


def carry_moment(frame, x: torch.Tensor, state: dict, key: str) -> str:
    """The state key of a transported moment in this step's form, carried over from the other.

    ``state[key]`` holds the moment m itself; on a square point whose geometry
    has a frame (``frame``, from ``geo.frame(x)``), ``state[key + "_frame"]``
    holds its coordinates Ω, m = XΩ (Note [Moments in the frame of X] in
    `stiefel.manifolds.geometry`). A moment saved in the other form (a checkpoint
    of an earlier version, a param group whose retraction changed) is converted,
    never read as the wrong one.

    Args:
        frame: the `FrameGeometry` of ``x``, or None.
        x: the point.
        state: the parameter's state (the converted entry replaces the other).
        key: the moment's key in its ambient form (``"exp_avg"``, ``"momentum_buffer"``).

    Returns:
        ``key`` or ``key + "_frame"``.
    """
    held = key + "_frame"
    if frame is not None:
        if key in state:
            state[held] = frame.lower(x, state.pop(key))
        return held
    if held in state:
        state[key] = FrameGeometry.lift(x, state.pop(held))
    return key


def nesterov(g: torch.Tensor, buf: torch.Tensor, mu: float) -> torch.Tensor:
    """Nesterov's look-ahead direction g + μB (torch's SGD with ``nesterov=True``)."""
    return g.add(buf, alpha=mu)


def check_momentum(group: dict, *, dampening: bool = True) -> None:
    """Check ``momentum`` μ ∈ [0, 1), ``dampening`` δ ∈ [0, 1] and ``nesterov`` of a group.

    Nesterov needs μ > 0 and δ = 0 (torch's rule).

    Args:
        group: the param group (with ``momentum``, ``nesterov`` and, when
            ``dampening``, a ``dampening`` key).
        dampening: whether the rule has a dampening option.

    Raises:
        ValueError: a value out of range, or Nesterov without momentum (or with dampening).
        TypeError: a value of the wrong type.
    """
    mu = _checks.number("momentum", group["momentum"], high=1.0)
    damp = 0.0
    if dampening:
        damp = _checks.number("dampening", group["dampening"], high=1.0, closed_high=True)
    if _checks.flag("nesterov", group["nesterov"]) and (mu <= 0 or damp != 0):
        allowed = "momentum > 0 and dampening = 0" if dampening else "momentum > 0"
        given = f"momentum={group['momentum']!r}" + (
            f", dampening={group['dampening']!r}" if dampening else ""
        )
        raise ValueError(f"nesterov=True with {given}; allowed: {allowed}")


def check_betas(group: dict) -> tuple[float, float]:
    """Check Adam's ``betas`` (β₁, β₂), each in [0, 1); return them as floats."""
    b1, b2 = _checks.pair("betas", group["betas"])
    return _checks.number("betas[0]", b1, high=1.0), _checks.number("betas[1]", b2, high=1.0)


def stabilize_alias(stabilize: int | None, repair_every: int | None) -> int | None:
    """A constructor's ``repair_every``, given as itself or as geoopt's ``stabilize`` (not both).

    Raises:
        ValueError: both given (not None).
    """
    if stabilize is not None and repair_every is not None:
        raise ValueError(
            f"stabilize={stabilize!r} and repair_every={repair_every!r} both given; "
            "allowed: one of them (stabilize is geoopt's name for repair_every)"
        )
    return repair_every if stabilize is None else stabilize


def repair_period(group: dict[str, Any]) -> int | None:
    """The re-projection period of a group: ``repair_every``, or geoopt's ``stabilize``.

    A group holds both keys with the same value (geoopt's optimizers and their
    users read ``group["stabilize"]``); giving only one (None counts as not
    given) sets both, giving two different values is refused.

    Args:
        group: the param group (either key may be missing).

    Returns:
        k ≥ 1, or None (never re-project).

    Raises:
        ValueError: the two keys disagree, or the value is not None or an int ≥ 1.
    """
    given = {key: group[key] for key in REPAIR_KEYS if group.get(key) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(
            f"stabilize={given['stabilize']!r} and repair_every={given['repair_every']!r} both "
            "given; allowed: one of them (stabilize is geoopt's name for repair_every)"
        )
    value = next(iter(given.values()), None)
    return _checks.positive_int("repair_every", value, none_ok=True)

r"""An optimizer's state of a weight that a map turned into coordinates: dropped, not used.

Note [Coordinates are a new parameter to an optimizer]
``orthogonalize(module, name, method=<map>)`` keeps the weight's Parameter object
(an optimizer built before the call steps the constrained model) but its values
become the map's coordinates: a skew matrix, reflectors, a generator, often of
another shape. An optimizer that stepped the weight before the call keeps a state
made for the weight (Adam's moments of the weight's gradient, a momentum along the
weight): on coordinates of another shape its next step fails, and on coordinates
of the same shape (a square weight under ``cayley`` or ``exp``) it moves them by
the weight's old moments, a silently wrong step. So every optimizer that stepped
in this process (torch's, geoopt's, this package's) forgets the Parameter's state
when it becomes coordinates, with a warning, and starts afresh on it, as on a new
parameter. Which optimizers hold a state is learnt from torch.optim's global step
pre-hook, registered when the package is imported (`stiefel.manifolds.binding`),
which records each optimizer at its eager steps in a weak set. Three states escape
it, and an optimizer holding one is to be built again, or its ``opt.state[p]``
cleared, after the call: a state made only by steps traced by ``torch.compile``
(a traced step touches no weak set), or before the package was imported, and a
state loaded into an optimizer that has not stepped since. Finding those would
take a search of every object of the process at every call (the holders of the
Parameter), tens of milliseconds each, for what is rare. A state loaded after the
call is taken for the coordinates' and kept.
"""

from __future__ import annotations

import sys
import warnings

import torch

from ..manifolds.binding import stepped_optimizers

__all__ = ["forget"]


def forget(p: torch.Tensor, label: str, method: str) -> None:
    """Drop the state every optimizer that stepped keeps for ``p``, warning once if any.

    Args:
        p: the Parameter that holds the map's coordinates now.
        label: the weight's name, for the warning.
        method: the map's name, for the warning.
    """
    dropped = []
    for opt in stepped_optimizers():
        state = opt.state
        if p in state:  # ``in``: a defaultdict makes no entry
            keys = [k for k in state[p] if not str(k).startswith("_")]
            del state[p]
            if keys:
                dropped.append(f"{type(opt).__name__} ({', '.join(map(str, keys))})")
    if dropped:
        warnings.warn(
            f"orthogonalize({label}, method={method!r}): the weight's Parameter holds the "
            f"map's coordinates now, and the state an optimizer kept for the weight was "
            f"dropped, as it would move the coordinates by the weight's history: "
            f"{'; '.join(dropped)}; the optimizer starts afresh on them",
            RuntimeWarning,
            stacklevel=_outside_the_package(),
        )


def _outside_the_package() -> int:
    # the ``stacklevel`` of the first frame that is not this package's: the caller's
    # line, whichever entry point (a module and a name, a Parameter) led here
    package = __name__.partition(".")[0] + "."
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(package):
        frame, level = frame.f_back, level + 1
    return level

r"""Stacked gate matrices (``nn.LSTM``/``nn.GRU``): one constraint per gate.

``nn.LSTM`` stores its four gate matrices stacked, ``weight_hh_l0`` of shape
(4·hidden, hidden) (``nn.GRU``: three). Constraining that tensor as one matrix
puts the stack on St(4h, h): no single gate is orthogonal. ``orthogonalize(lstm,
"weight_hh_l0", gates=True)`` instead reads it as a batch (g, h, cols) and
constrains each gate with the same map (a batched map, one original per gate).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import OrthogonalMap

__all__ = ["StackedGates", "gate_count"]

GATES = {"LSTM": 4, "GRU": 3}


def gate_count(module: nn.Module, name: str) -> int:
    """How many gates ``module.<name>`` stacks (0: not a stacked gate weight)."""
    if isinstance(module, nn.RNNBase) and name.startswith(("weight_hh", "weight_ih")):
        return GATES.get(module.mode, 0)
    return 0


class StackedGates(nn.Module):
    r"""The parametrization W = reshape(Q, (g·h, cols)) for a batched map Q of shape (g, h, cols).

    Attributes:
        map: the batched `OrthogonalMap` (one matrix per gate).
        manifold: the manifold of each gate.
        gates: g.
    """

    def __init__(self, weight_shape: tuple[int, ...], gates: int, fmap: OrthogonalMap):
        super().__init__()
        self.weight_shape, self.gates, self.map = tuple(weight_shape), gates, fmap
        self.manifold = fmap.manifold

    def split(self, weight: torch.Tensor) -> torch.Tensor:
        """The gates of a weight: shape (g, h, cols)."""
        if tuple(weight.shape) != self.weight_shape:
            raise ValueError(
                f"value must have the weight's shape {self.weight_shape}, got {tuple(weight.shape)}"
            )
        return weight.reshape(self.gates, -1, self.weight_shape[-1])

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return self.map(original).reshape(self.weight_shape)

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        return self.map.right_inverse(self.split(value))

    def initial(self, weight: torch.Tensor, init, generator) -> torch.Tensor:
        """The original for ``init`` and the gates of ``weight`` (`OrthogonalMap.initial`)."""
        return self.map.initial(self.split(weight), init, generator)

    def fresh_init(self) -> str:
        """The init of a reset (`OrthogonalMap.fresh_init`)."""
        return self.map.fresh_init()

    def extra_repr(self) -> str:
        return f"gates={self.gates}, manifold={self.manifold!r} each"

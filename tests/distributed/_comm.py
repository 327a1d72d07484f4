"""Count the collectives of a block and the bytes they move (a TorchDispatchMode)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class CommBytes(TorchDispatchMode):
    """Names and tensor bytes of every c10d / functional collective run inside the block."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        if name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")):
            if not name.endswith(("wait_tensor", "barrier")):
                flat, _ = tree_flatten((args, kwargs or {}))
                tensors = [t for t in flat if isinstance(t, torch.Tensor)]
                size = sum(t.numel() * t.element_size() for t in tensors)
                self.calls.append((name, size))
        return func(*args, **(kwargs or {}))

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.calls)

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

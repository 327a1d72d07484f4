"""The task interface shared by the harness."""

from __future__ import annotations

import torch
from torch import nn


class Task:
    """A learning problem on which strategies are compared.

    Subclasses build a model for a strategy, give its loss for a training step,
    the constrained matrix (for drift), and where known the optimum and the
    baseline of the loss.
    """

    name = "task"
    #: "matrix" tasks train one constrained matrix; "sequence" tasks train an RNN
    kind = "matrix"
    optimum: float | None = None
    baseline: float | None = None

    def __init__(self, dtype: torch.dtype, device: torch.device, seed: int):
        self.dtype, self.device, self.seed = dtype, device, seed
        self.generator = torch.Generator().manual_seed(seed)

    def build(self, method: str, method_options: dict) -> nn.Module:
        raise NotImplementedError

    def constrained(self, model: nn.Module) -> nn.Module:
        """The submodule that holds the constrained matrix (the strategy's optimizer trains it)."""
        return model.transition

    def weight(self, model: nn.Module) -> torch.Tensor:
        """The constrained matrix (for the drift metric)."""
        return self.constrained(model)()

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics (accuracy, test loss); empty by default."""
        return {}

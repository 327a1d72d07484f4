"""A Dynamo backend that counts its graphs: the suites' proof that something was traced."""

from __future__ import annotations

import torch


class Counting:
    """A backend that counts the graphs Dynamo hands it and runs them with ``aot_eager``."""

    def __init__(self) -> None:
        self.graphs = 0
        self.inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)

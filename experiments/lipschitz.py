"""A Lipschitz classifier of scikit-learn's digits with orthogonal convolutions.

The 8×8 digits (1397 train / 400 test, split by the seed) are upsampled
bilinearly to ``size``×``size`` and classified by `LipschitzNet`: two
`OrthogonalConv2d` layers and an orthogonal head (the strategy's map names
the layers' map: ``cayley+adam``, ``exp+adam``, ``cwy+adam``), or by its
unconstrained twin (the ``conv`` baseline of ``extra_methods``: ``nn.Conv2d``
and ``nn.Linear``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from experiments import real_dtype
from experiments.lipschitz_net import LipschitzNet
from stiefel.comparisons.task import (
    Classification,
    Task,
    digits_split,
    positive_int,
    register,
)

__all__ = ["LipschitzDigits"]


@register("lipschitz_digits")
class LipschitzDigits(Classification, Task):
    r"""Digits classification with a measured Lipschitz bound.

    Metrics: test accuracy; ``lipschitz_bound``, the product of the layers'
    spectral norms (each by power iteration, `operator_norm`) times the logits'
    scale; and ``certified_accuracy``: the test images classified correctly
    with a margin (top logit minus the runner-up) above √2·L·``radius``, which
    no input perturbation of ℓ₂ norm ≤ ``radius`` can flip (Tsuzuku et al. 2018).
    """

    kind = "image"
    extra_methods = {"conv": "the unconstrained convolutional twin"}
    table_metrics = ("test_accuracy", "lipschitz_bound", "certified_accuracy")

    def __init__(
        self,
        dtype,
        device,
        seed,
        channels: int = 8,
        kernel_size: int = 3,
        size: int = 16,
        batch: int = 64,
        scale: float = 8.0,
        radius: float = 0.3,
    ):
        super().__init__(dtype, device, seed)
        real_dtype(self.name, dtype)
        self.channels = positive_int(self.name, "channels", channels)
        self.kernel_size = positive_int(self.name, "kernel_size", kernel_size)
        self.size = positive_int(self.name, "size", size)
        self.batch = positive_int(self.name, "batch", batch)
        if self.kernel_size > self.size:
            raise ValueError(
                f"task 'lipschitz_digits': kernel_size={kernel_size}; allowed: ≤ size={size}"
            )
        self.scale, self.radius = float(scale), float(radius)
        x, y, xt, yt = digits_split(self.name, self.generator)

        def upsample(images: torch.Tensor) -> torch.Tensor:
            images = F.interpolate(
                images[:, None], size=(size, size), mode="bilinear", align_corners=False
            )
            return images.to(device=device, dtype=dtype)

        self.x_train, self.y_train = upsample(x), y.to(device)
        self.x_test, self.y_test = upsample(xt), yt.to(device)
        self.baseline = math.log(10)
        self.chance = {"test_accuracy": 0.1}

    def build(self, method: str, method_options: dict) -> nn.Module:
        if method_options:
            raise ValueError(
                f"task 'lipschitz_digits': method options {method_options!r}; allowed: none"
            )
        return LipschitzNet(
            method, self.channels, self.kernel_size, self.size, 10, self.scale, dtype=self.dtype
        ).to(self.device)

    def constrained(self, model: nn.Module) -> nn.Module:
        """The orthogonal layers (the strategy's optimizer trains them); empty for the twin."""
        if model.method == "conv":
            return nn.ModuleList()
        return nn.ModuleList([*model.convs, model.head])

    def weight(self, model: nn.Module) -> torch.Tensor | None:
        """The head's weight transposed, on St(c·s², 10) (None for the twin)."""
        return None if model.method == "conv" else model.head.weight.T

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        logits = model(self.x_test)
        with torch.enable_grad():
            bound = model.lipschitz_bound(generator=torch.Generator().manual_seed(self.seed))
        top2 = logits.topk(2, -1).values
        correct = logits.argmax(-1) == self.y_test
        certified = correct & (top2[:, 0] - top2[:, 1] > math.sqrt(2) * bound * self.radius)
        return {
            **self.test_metrics(logits),
            "lipschitz_bound": bound,
            "certified_accuracy": float(certified.float().mean()),
        }

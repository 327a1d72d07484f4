"""A Lipschitz classifier of scikit-learn's digits with orthogonal convolutions.

The 8×8 digits (1397 train / 400 test, split by the seed) are upsampled
bilinearly to ``size``×``size`` and classified by `LipschitzNet`: two
orthogonal convolutions and an orthogonal head. The strategy names the
convolutions (all stride 1, circular "same" padding):

- ``cayley+adam``: the FFT layer `OrthogonalConv2d` with the map Cayley
  (``exp``, ``cwy`` likewise); the method option ``layer`` picks the others,
  with the strategy's map: ``tcwy(layer=conv_kernel)+adam`` (an ``nn.Conv2d``
  with ``conv_kernel=True``), ``cwy(layer=orthoconv)+adam`` (`OrthoConv2d`);
  the other method options go to the map (``cwy(layer=orthoconv,reflections=4)``);
- ``aoc+adam``: orthogonium's ``AdaptiveOrthoConv2d`` (``extra_methods``,
  float32 only; its parametrization and the head trained by the strategy's
  optimizer);
- ``conv+adam``: the unconstrained twin (``nn.Conv2d`` and ``nn.Linear``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from experiments import real_dtype
from experiments.lipschitz_layers import DEFAULT_MAPS
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

    Metrics: test accuracy; ``lipschitz_bound``, the certified bound: the
    product of the layers' exact spectral norms times the logits' scale
    (`LipschitzNet.lipschitz_bound`); and ``certified_accuracy``: the test
    images classified correctly with a margin (top logit minus the runner-up)
    above √2·L·``radius``, which no input perturbation of ℓ₂ norm ≤ ``radius``
    can flip (Tsuzuku et al. 2018). The logits and the bound are computed at
    one weight (``parametrize.cached()``: orthogonium's layer changes its
    weight at every forward).
    """

    kind = "image"
    extra_methods = {
        "conv": "the unconstrained convolutional twin",
        "aoc": "orthogonium's AdaptiveOrthoConv2d (float32)",
    }
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
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(
                f"task 'lipschitz_digits': scale={scale}; allowed: a finite number > 0 "
                "(the logits' factor)"
            )
        if not (math.isfinite(self.radius) and self.radius >= 0):
            raise ValueError(
                f"task 'lipschitz_digits': radius={radius}; allowed: a finite number >= 0 "
                "(the ℓ₂ radius of the certified accuracy)"
            )
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
        """`LipschitzNet` of the strategy: the layer of the method, or of its ``layer`` option."""
        options = dict(method_options)
        if method in self.extra_methods:
            layer, method = method, None
            if options:
                raise ValueError(
                    f"task 'lipschitz_digits': method {layer!r} with options {options!r}; "
                    "allowed: none"
                )
        else:
            layer = options.pop("layer", "fft")
            if layer not in DEFAULT_MAPS:
                raise ValueError(
                    f"task 'lipschitz_digits': layer={layer!r}; allowed: "
                    f"{', '.join(DEFAULT_MAPS)} (or the methods {', '.join(self.extra_methods)})"
                )
        try:
            net = LipschitzNet(
                layer,
                method,
                self.channels,
                self.kernel_size,
                self.size,
                10,
                self.scale,
                dtype=self.dtype,
                **options,
            )
        except ValueError as exc:
            if layer != "fft" or "not supported" not in str(exc):
                raise
            raise ValueError(
                f"{exc} (the FFT layer's maps; the method option layer= picks a layer that "
                "takes the others: tcwy(layer=conv_kernel), cwy(layer=orthoconv))"
            ) from exc
        return net.to(self.device)

    def check_method(self, method: str, method_options: dict) -> None:
        """Build the network: an unknown layer, a map its layer refuses or bad options raise."""
        self.build(method, method_options)

    def constrained(self, model: nn.Module) -> nn.Module:
        """The orthogonal layers (the strategy's optimizer trains them); empty for the twin."""
        if model.layer == "conv":
            return nn.ModuleList()
        return nn.ModuleList([*model.convs, model.head])

    def weight(self, model: nn.Module) -> torch.Tensor | None:
        """The head's weight transposed, on St(c·s², 10) (None for the twin)."""
        return None if model.layer == "conv" else model.head.weight.T

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        with parametrize.cached():
            logits = model(self.x_test)
            bound = model.lipschitz_bound()
        top2 = logits.topk(2, -1).values
        correct = logits.argmax(-1) == self.y_test
        certified = correct & (top2[:, 0] - top2[:, 1] > math.sqrt(2) * bound * self.radius)
        return {
            **self.test_metrics(logits),
            "lipschitz_bound": bound,
            "certified_accuracy": float(certified.float().mean()),
        }

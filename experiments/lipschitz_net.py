"""A small Lipschitz classifier of images: orthogonal convolutions, MaxMin, an orthogonal head.

``LipschitzNet`` maps (B, 1, s, s) images to logits through

    zero-pad the channels to c → conv → MaxMin → conv → MaxMin → flatten → linear → ×scale

where each conv is one of `experiments.lipschitz_layers.LAYERS` (stride 1,
circular "same" padding: the FFT layer `stiefel.nn.OrthogonalConv2d`, a
``conv_kernel=True`` ``nn.Conv2d``, the explicit-kernel `stiefel.nn.OrthoConv2d`,
orthogonium's ``AdaptiveOrthoConv2d``) and the linear head has orthonormal
rows (`orthogonalize` with T-CWY, O(c·s²·10²) per call), or, in the
unconstrained twin, an ``nn.Conv2d`` with circular padding and an
``nn.Linear`` of the same shapes.

Note [Lipschitz bound of a composition]
‖f∘g‖_Lip ≤ ‖f‖_Lip·‖g‖_Lip. Zero-padding the channels is an isometry, MaxMin
(the sorted pair of two channels, Anil et al. 2019) is a permutation of its
inputs at every point and hence 1-Lipschitz and gradient-norm preserving, and a
bias does not change a Lipschitz constant. The network's certified bound is
therefore scale·‖C₁‖₂·‖C₂‖₂·‖W‖₂, the spectral norms of the two convolutions
(as linear maps of s×s images, each exact: Note [Exact norm of a circular
convolution]) and of the head (its SVD). Each factor is exact; the product is
an upper bound of the network's Lipschitz constant (tight only where the
layers' top singular vectors line up through the MaxMins). It is scale for
the exactly orthogonal layers, at most scale with ``conv_kernel=True``
(non-expansive), and scale up to orthogonium's iterations for AOC.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from experiments.lipschitz_layers import LAYERS, circular_norm, conv_layer
from stiefel.nn import lipschitz_bound
from stiefel.parametrizations import orthogonalize

__all__ = ["LipschitzNet", "maxmin", "operator_norm"]


def maxmin(x: torch.Tensor) -> torch.Tensor:
    """MaxMin activation: channels (a, b) halves → (max(a, b), min(a, b)); 1-Lipschitz."""
    a, b = x.chunk(2, 1)
    return torch.cat((torch.maximum(a, b), torch.minimum(a, b)), 1)


def operator_norm(
    fn: Callable[[torch.Tensor], torch.Tensor],
    shape: tuple[int, ...],
    iters: int = 50,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> float:
    r"""‖A‖₂ of the linear map ``fn`` on inputs of ``shape``, by power iteration on AᵀA.

    `stiefel.nn.lipschitz_bound` with ``iters`` steps: Aᵀu is the gradient of
    ⟨A v, u⟩ with respect to v (autograd), so ``fn`` need only be linear and
    differentiable. Returns ‖A v‖ for the last unit v, a lower bound that
    converges to ‖A‖₂ at the rate (σ₂/σ₁)^{2·iters}.

    Args:
        fn: the linear map.
        shape: the shape of its input.
        iters: power iterations (≥ 1).
        generator: random generator of the start.
        dtype: dtype of the start.
        device: device of the start (that of ``fn``'s weights; default the CPU). The
            start is drawn on the CPU (``generator`` is a CPU generator, the same
            numbers on every device) and moved.

    Returns:
        The estimate of the largest singular value.

    Example:
        ```python
        import torch
        from experiments.lipschitz_net import operator_norm

        a = torch.diag(torch.tensor([3.0, 1.0, 0.5]))
        assert abs(operator_norm(lambda v: a @ v, (3,)) - 3.0) < 1e-4
        ```
    """
    return lipschitz_bound(
        lambda v: fn(v[0]),
        shape,
        iterations=iters,
        rtol=0,
        generator=generator,
        dtype=dtype,
        device=device,
    )


class LipschitzNet(nn.Module):
    """The two-convolution classifier of the module docstring.

    Args:
        layer: the convolutions, a name of `experiments.lipschitz_layers.LAYERS`
            (``"fft"``, ``"conv_kernel"``, ``"orthoconv"``, ``"aoc"``), or
            ``"conv"`` for the unconstrained twin (with an ``nn.Linear`` head).
        method: the convolutions' map (None: the layer's default,
            `experiments.lipschitz_layers.DEFAULT_MAPS`); None for ``"aoc"`` and
            ``"conv"``.
        channels: c (even).
        kernel_size: k of both convolutions.
        size: s, the image height and width.
        classes: number of logits.
        scale: the logits' fixed factor (the orthogonal network's Lipschitz bound).
        dtype: parameter dtype.
        **options: the map's options (``reflections``, ...).
    """

    def __init__(
        self,
        layer: str = "fft",
        method: str | None = None,
        channels: int = 8,
        kernel_size: int = 3,
        size: int = 16,
        classes: int = 10,
        scale: float = 8.0,
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> None:
        super().__init__()
        if layer not in LAYERS:
            raise ValueError(f"layer={layer!r}; allowed: {', '.join(LAYERS)}")
        if channels % 2:
            raise ValueError(f"channels={channels}; allowed: an even int (MaxMin pairs channels)")
        self.layer, self.channels, self.size, self.scale = layer, channels, size, scale
        self.convs = nn.ModuleList(
            conv_layer(layer, method, channels, kernel_size, dtype, **options) for _ in range(2)
        )
        self.head = nn.Linear(channels * size * size, classes, dtype=dtype)
        if layer != "conv":
            # T-CWY for the head whatever the convolutions' map: St(c·s², 10) is tall and
            # thin, and the dense maps (Cayley, exp) would solve with (c·s²)² matrices
            orthogonalize(self.head, method="tcwy")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of images (B, 1, s, s)."""
        x = F.pad(x, (0, 0, 0, 0, 0, self.channels - x.shape[1]))
        for conv in self.convs:
            x = maxmin(conv(x))
        return self.scale * self.head(x.flatten(1))

    @torch.no_grad()
    def layer_norms(self) -> list[float]:
        """‖C₁‖₂, ‖C₂‖₂ (exact, `circular_norm`) and ‖W‖₂ of the head (its SVD, float64).

        A layer whose weight changes at every forward (orthogonium's power
        iteration) is measured at its current call: evaluate the logits and the
        norms under ``torch.nn.utils.parametrize.cached()`` to see one weight.
        """
        norms = [circular_norm(conv, self.channels, self.size) for conv in self.convs]
        head = self.head.weight.double()
        if not bool(torch.isfinite(head).all()):
            return [*norms, math.nan]  # a diverged head: its SVD would fail
        return [*norms, float(torch.linalg.matrix_norm(head, ord=2))]

    def lipschitz_bound(self) -> float:
        """|scale| · Π ‖layer‖₂, an upper bound of the network's Lipschitz constant (module Note).

        NaN when a layer is not finite (`circular_norm`).
        """
        bound = abs(self.scale)
        for norm in self.layer_norms():
            bound *= norm
        return bound

"""A small Lipschitz classifier of images: orthogonal convolutions, MaxMin, an orthogonal head.

``LipschitzNet`` maps (B, 1, s, s) images to logits through

    zero-pad the channels to c → conv → MaxMin → conv → MaxMin → flatten → linear → ×scale

where each conv is an exactly orthogonal circular convolution
(`stiefel.nn.OrthogonalConv2d`) and the linear head has orthonormal rows
(`orthogonalize` with T-CWY, O(c·s²·10²) per call), or, in the
unconstrained twin, an ``nn.Conv2d`` with circular padding and an
``nn.Linear`` of the same shapes.

Note [Lipschitz bound of a composition]
‖f∘g‖_Lip ≤ ‖f‖_Lip·‖g‖_Lip. Zero-padding the channels is an isometry, MaxMin
(the sorted pair of two channels, Anil et al. 2019) is a permutation of its
inputs at every point and hence 1-Lipschitz and gradient-norm preserving, and a
bias does not change a Lipschitz constant. The network's bound is therefore
scale·‖C₁‖₂·‖C₂‖₂·‖W‖₂, the spectral norms of the two convolutions (as linear
maps of s×s images) and of the head: 1·1·1·scale for the orthogonal network.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stiefel.nn import OrthogonalConv2d
from stiefel.nn.conv import FFT_METHODS
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

    Aᵀu is the gradient of ⟨A v, u⟩ with respect to v (autograd), so ``fn``
    need only be linear and differentiable. Returns ‖A v‖ for the last unit v,
    a lower bound that converges to ‖A‖₂ at the rate (σ₂/σ₁)^{2·iters}.

    Args:
        fn: the linear map.
        shape: the shape of its input.
        iters: power iterations.
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
    v = torch.randn(shape, generator=generator, dtype=dtype).to(device)
    v = v / v.norm()
    sigma = 0.0
    for _ in range(iters):
        v = v.detach().requires_grad_(True)
        u = fn(v)
        sigma = float(u.detach().norm())
        (w,) = torch.autograd.grad(u, v, u.detach())
        v = w / w.norm()
    with torch.no_grad():
        return float(fn(v).norm()) if iters else sigma


class LipschitzNet(nn.Module):
    """The two-convolution classifier of the module docstring.

    Args:
        method: a map of `OrthogonalConv2d` (``"cayley"``, ``"exp"``, ``"cwy"``)
            for the orthogonal network, or ``"conv"`` for the unconstrained twin.
        channels: c (even).
        kernel_size: k of both convolutions.
        size: s, the image height and width.
        classes: number of logits.
        scale: the logits' fixed factor (the orthogonal network's Lipschitz bound).
        dtype: parameter dtype.
    """

    def __init__(
        self,
        method: str = "cayley",
        channels: int = 8,
        kernel_size: int = 3,
        size: int = 16,
        classes: int = 10,
        scale: float = 8.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        allowed = [*FFT_METHODS, "conv"]
        if method not in allowed:
            raise ValueError(f"method={method!r}; allowed: {', '.join(allowed)}")
        if channels % 2:
            raise ValueError(f"channels={channels}; allowed: an even int (MaxMin pairs channels)")
        self.method, self.channels, self.size, self.scale = method, channels, size, scale
        if method == "conv":
            self.convs = nn.ModuleList(
                nn.Conv2d(
                    channels,
                    channels,
                    kernel_size,
                    padding=kernel_size // 2,
                    padding_mode="circular",
                    dtype=dtype,
                )
                for _ in range(2)
            )
            self.head = nn.Linear(channels * size * size, classes, dtype=dtype)
        else:
            self.convs = nn.ModuleList(
                OrthogonalConv2d(channels, kernel_size, method, bias=True, dtype=dtype)
                for _ in range(2)
            )
            # T-CWY for the head whatever the convolutions' map: St(c·s², 10) is tall and
            # thin, and the dense maps (Cayley, exp) would solve with (c·s²)² matrices
            self.head = orthogonalize(
                nn.Linear(channels * size * size, classes, dtype=dtype), method="tcwy"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of images (B, 1, s, s)."""
        x = F.pad(x, (0, 0, 0, 0, 0, self.channels - x.shape[1]))
        for conv in self.convs:
            x = maxmin(conv(x))
        return self.scale * self.head(x.flatten(1))

    def layer_maps(self) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]]:
        """The linear part of every layer with bias removed, and its input shape."""
        c, s = self.channels, self.size
        maps = []
        for conv in self.convs:
            if isinstance(conv, nn.Conv2d):
                maps.append((lambda v, conv=conv: conv._conv_forward(v, conv.weight, None), conv))
            else:
                maps.append((lambda v, conv=conv: conv(v) - _bias(conv), conv))
        head = self.head
        out = [(fn, (1, c, s, s)) for fn, _ in maps]
        out.append((lambda v: F.linear(v, head.weight), (c * s * s,)))
        return out

    def lipschitz_bound(self, iters: int = 50, generator: torch.Generator | None = None) -> float:
        """scale · Π ‖layer‖₂, each norm by `operator_norm` (see the module's Note)."""
        dtype, device = self.head.weight.dtype, self.head.weight.device
        bound = self.scale
        for fn, shape in self.layer_maps():
            bound *= operator_norm(fn, shape, iters, generator, dtype, device)
        return bound


def _bias(conv: OrthogonalConv2d) -> torch.Tensor | float:
    return 0.0 if conv.bias is None else conv.bias[:, None, None]

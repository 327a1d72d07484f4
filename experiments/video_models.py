"""Video-prediction models: the CWY paper's recurrent bottleneck (appendix E), scaled down.

Frames (B, T, 1, H, W) are moved to (B, T, 4, H/2, W/2) by 2×2 space-to-depth
(as the paper does with KTH), then five recurrent units alternate with strided
convolutions and transposed convolutions, with skip connections:

    c₁ @ H/2 → c₂ @ H/4 → c₃ @ H/8 → c₂ @ H/4 → c₁ @ H/2 → 4 channels → 1 @ H

(the paper: 32 → 64 → 128 → 64 → 32 channels at 32² → 16² → 8²). ReLU after
every convolution and transposed convolution, and on the output frame.

Note [Output of the video predictor]
Frames are ≥ 0 and mostly black. A linear output trained with the MSE leaves
small errors of both signs on every black pixel (test MAE 0.036 after 200
steps, above the black frame's 0.031); a ReLU output predicts exact zeros
there (0.027 in the same run). A sigmoid saturates, and with the ℓ₁ loss on
sparse frames collapses to black.
The recurrent unit is a ``ConvNERUCell`` (its kernel K from any map,
``riemannian``, or the paper's unconstrained variants) or a ``ConvLSTMCell``
(the baseline).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from stiefel.manifolds.kernels import haar
from stiefel.nn import ConvNERUCell
from stiefel.parametrizations.conv import ConvKernel

__all__ = ["ConvLSTMCell", "VideoPredictor", "VARIANTS", "parameter_count"]

#: recurrent units that are not a map name: the paper's Table 5 rows
VARIANTS = ("convlstm", "zeros", "glorot", "orthinit")


class ConvLSTMCell(nn.Module):
    """ConvLSTM (Shi et al. 2015): gates from one convolution of [X_t, H_{t−1}].

    Args:
        in_channels: channels of X_t.
        hidden_channels: channels of H_t and C_t.
        kernel_size: odd kernel size ("same" zero padding).
        dtype: parameter dtype.
    """

    def __init__(
        self, in_channels: int, hidden_channels: int, kernel_size: int = 3, dtype=None
    ) -> None:
        super().__init__()
        self.hidden_channels = hidden_channels
        self.gates = nn.Conv2d(
            in_channels + hidden_channels,
            4 * hidden_channels,
            kernel_size,
            padding=kernel_size // 2,
            dtype=dtype,
        )
        with torch.no_grad():  # forget-gate bias 1
            self.gates.bias[hidden_channels : 2 * hidden_channels].fill_(1.0)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One step: returns (H_t, (H_t, C_t))."""
        if state is None:
            z = x.new_zeros(x.shape[0], self.hidden_channels, *x.shape[2:])
            state = (z, z)
        h, c = state
        i, f, o, g = self.gates(torch.cat((x, h), 1)).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, (h, c)


class _NERU(nn.Module):
    """A ConvNERUCell with the (output, state) interface of ConvLSTMCell."""

    def __init__(self, cell: ConvNERUCell) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x, state=None):
        g = self.cell(x, state)
        return g, g


def _neru(channels: int, kernel_size: int, variant: str, options: dict, generator, dtype):
    """A ConvNERU unit for a map name (constrained K) or a Table-5 variant."""
    if variant in ("zeros", "glorot", "orthinit"):
        cell = ConvNERUCell(channels, channels, kernel_size, method=None, dtype=dtype)
        w = cell.recurrent.weight
        with torch.no_grad():
            if variant == "zeros":  # K = 0: no recurrence (the paper's "Zeros")
                w.zero_()
                w.requires_grad_(False)
            elif variant == "orthinit":  # unconstrained, started on the Stiefel manifold
                shape = tuple(w.shape)
                param = ConvKernel(shape, None, None)
                n, m = channels * kernel_size**2, channels
                t = haar(max(n, m), min(n, m), dtype=torch.float64, generator=generator)
                w.copy_(param(t.to(w.dtype)))
        return _NERU(cell)
    cell = ConvNERUCell(channels, channels, kernel_size, method=variant, dtype=dtype, **options)
    return _NERU(cell)


class VideoPredictor(nn.Module):
    """One-step-ahead frame prediction with a recurrent convolutional bottleneck.

    Args:
        recurrent: ``"convlstm"``, ``"zeros"``, ``"glorot"``, ``"orthinit"``, or a
            map name of ``orthogonalize`` (``"tcwy"``, ``"riemannian"``, ...) for a
            ConvNERU whose K is constrained (``conv_kernel=True``).
        channels: (c₁, c₂, c₃) of the bottleneck.
        kernel_size: q of the recurrent units.
        method_options: options of the map.
        generator: random generator of the ``orthinit`` start.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        recurrent: str = "tcwy",
        channels: tuple[int, int, int] = (8, 16, 32),
        kernel_size: int = 3,
        method_options: dict[str, Any] | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        c1, c2, c3 = channels
        self.recurrent = recurrent

        def unit(c):
            if recurrent == "convlstm":
                return ConvLSTMCell(c, c, kernel_size, dtype=dtype)
            return _neru(c, kernel_size, recurrent, dict(method_options or {}), generator, dtype)

        kw = dict(dtype=dtype)
        self.inp = nn.Conv2d(4, c1, 3, padding=1, **kw)
        self.units = nn.ModuleList([unit(c1), unit(c2), unit(c3), unit(c2), unit(c1)])
        self.down = nn.ModuleList(
            [nn.Conv2d(c1, c2, 4, 2, 1, **kw), nn.Conv2d(c2, c3, 4, 2, 1, **kw)]
        )
        self.up = nn.ModuleList(
            [nn.ConvTranspose2d(c3, c2, 4, 2, 1, **kw), nn.ConvTranspose2d(c2, c1, 4, 2, 1, **kw)]
        )
        self.head = nn.Conv2d(c1, 4, 3, padding=1, **kw)

    def recurrent_convolutions(self) -> list[nn.Conv2d]:
        """The recurrent kernels K of the ConvNERU units (empty for ConvLSTM)."""
        return [u.cell.recurrent for u in self.units if isinstance(u, _NERU)]

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """Predictions of frames 2…T+1 from frames 1…T: (B, T, 1, H, W) → (B, T, 1, H, W)."""
        x = F.pixel_unshuffle(frames.flatten(0, 1), 2).unflatten(0, frames.shape[:2])
        states: list[Any] = [None] * 5
        outs = []
        with parametrize.cached():  # each constrained K computed once per sequence
            for t in range(x.shape[1]):
                outs.append(self._step(x[:, t], states))
        return torch.stack(outs, 1)

    def _step(self, x: torch.Tensor, states: list[Any]) -> torch.Tensor:
        a = F.relu(self.inp(x))
        s0, states[0] = self.units[0](a, states[0])
        s1, states[1] = self.units[1](F.relu(self.down[0](s0)), states[1])
        s2, states[2] = self.units[2](F.relu(self.down[1](s1)), states[2])
        s3, states[3] = self.units[3](F.relu(self.up[0](s2)) + s1, states[3])
        s4, states[4] = self.units[4](F.relu(self.up[1](s3)) + s0, states[4])
        return F.relu(F.pixel_shuffle(self.head(s4), 2))


def parameter_count(model: nn.Module) -> int:
    """Trainable parameters (``parameters()`` lists a shared tensor once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

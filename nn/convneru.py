r"""The convolutional non-exploding recurrent unit, ConvNERU (CWY paper §3.4)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._core import checks as _checks
from ..parametrizations import orthogonalize

__all__ = ["ConvNERUCell", "NONLINEARITIES"]

#: nonlinearities of ConvNERU, each with |σ(x)| ≤ |x| and 1-Lipschitz (CWY paper, appendix C)
NONLINEARITIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "tanh": torch.tanh,
    "leaky_relu": F.leaky_relu,
    "identity": lambda x: x,
}


class GlorotConv2d(nn.Conv2d):
    """ConvNERU's unconstrained K: Glorot-uniform, in its constructor and its own reset."""

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)


def _odd_size(kernel_size: object) -> int:
    _checks.positive_int("kernel_size", kernel_size)
    if kernel_size % 2 == 0:
        raise ValueError(
            f"kernel_size={kernel_size} is even; allowed: a positive odd int (centred "
            "'same' padding keeps the hidden state's size)"
        )
    return kernel_size


class ConvNERUCell(nn.Module):
    r"""Convolutional non-exploding recurrent unit (CWY paper §3.4).

    G_t = σ(K ∗ G_{t−1} + B + K_in ∗ X_t), with zero "same" padding, B a
    per-channel bias and K constrained by ``orthogonalize(..., conv_kernel=True)``:
    q·K̂ ∈ St(q²·c, c) (c = ``hidden_channels``, q = ``kernel_size``), so
    ‖K ∗ G‖ ≤ ‖G‖ (Note [A Stiefel kernel makes the convolution non-expansive]).
    With a 1-Lipschitz σ with σ(0) = 0 the unit is non-expansive in G:
    ‖G_t − G'_t‖ ≤ ‖G_{t−1} − G'_{t−1}‖, hidden states grow at most linearly in
    t for bounded inputs, and gradients through time do not explode (appendix C).

    Reading the constrained kernel recomputes its map; for a sequence, run the
    steps inside ``torch.nn.utils.parametrize.cached()`` (the map once per
    sequence).

    Args:
        in_channels: channels of X_t.
        hidden_channels: channels c of G_t.
        kernel_size: q, odd (both K and K_in are q×q).
        method: the map of K (any of ``stiefel.parametrizations.available()``,
            ``"riemannian"`` included), or None for an unconstrained K
            (Glorot-uniform initialised: the paper's unconstrained baseline).
        nonlinearity: one of ``NONLINEARITIES`` (relu, tanh, leaky_relu, identity).
        **options: the map's options (``init``, ``reflections``, ...).

    Raises:
        ValueError: ``in_channels`` or ``hidden_channels`` not a positive int, an even or
            non-positive ``kernel_size``, an unknown ``nonlinearity``, or what
            ``orthogonalize`` refuses.
        TypeError: a ``dtype`` that is not a real floating dtype, a ``nonlinearity`` that
            is not a string.

    Example:
        ```python
        import torch
        from torch.nn.utils import parametrize
        from stiefel.nn import ConvNERUCell

        cell = ConvNERUCell(1, 4, 3)  # K on St(36, 4) through T-CWY
        frames = torch.randn(6, 2, 1, 8, 8)  # (T, batch, channels, h, w)
        g = torch.zeros(2, 4, 8, 8)
        with parametrize.cached():
            for x in frames:
                g = cell(x, g)
        assert g.shape == (2, 4, 8, 8)
        ```
    """

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        kernel_size: int,
        method: str | None = "tcwy",
        nonlinearity: str = "relu",
        **options: Any,
    ):
        super().__init__()
        in_channels = _checks.positive_int("in_channels", in_channels)
        hidden_channels = _checks.positive_int("hidden_channels", hidden_channels)
        q = _odd_size(kernel_size)
        _checks.choice("nonlinearity", nonlinearity, NONLINEARITIES)
        dtype, device = options.pop("dtype", None), options.pop("device", None)
        if dtype is not None and dtype not in _checks.REAL_DTYPES:
            allowed = ", ".join(map(str, _checks.REAL_DTYPES))
            raise TypeError(f"dtype={dtype}; allowed: {allowed} (the kernels are real)")
        if method is None and options:
            raise TypeError(f"options {sorted(options)} need a method; method=None takes none")
        kw = dict(padding=q // 2, bias=False, dtype=dtype, device=device)
        self.hidden_channels = hidden_channels
        self.nonlinearity = nonlinearity
        recurrent = GlorotConv2d if method is None else nn.Conv2d
        self.recurrent = recurrent(hidden_channels, hidden_channels, q, **kw)
        self.input = nn.Conv2d(in_channels, hidden_channels, q, **kw)
        self.bias = nn.Parameter(torch.zeros(hidden_channels, dtype=dtype, device=device))
        if method is not None:
            orthogonalize(self.recurrent, "weight", method, conv_kernel=True, **options)

    def reset_parameters(self) -> None:
        """The bias B back to zeros, as built (torch's name: FSDP2's recipe calls it on every
        module after ``to_empty``; K and K_in have resets of their own)."""
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """One step.

        Args:
            x: X_t, shape (batch, in_channels, h, w).
            g: G_{t−1}, shape (batch, hidden_channels, h, w); zeros if None.

        Returns:
            G_t, shape (batch, hidden_channels, h, w).
        """
        drive = self.input(x) + self.bias[:, None, None]
        if g is not None:
            drive = drive + self.recurrent(g)
        return NONLINEARITIES[self.nonlinearity](drive)

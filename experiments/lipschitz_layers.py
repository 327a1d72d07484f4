r"""The convolutions of the Lipschitz classifier, and the exact spectral norm of a circular one.

Every layer is a stride-1 c → c convolution with circular "same" padding, so
that each is a map of c×s×s images that commutes with circular shifts
(`circular_norm` measures its norm exactly). ``LAYERS`` names them:

- ``"fft"``: `stiefel.nn.OrthogonalConv2d` (Trockman & Kolter 2021), one c×c
  unitary per spatial frequency from the map ``method`` (default Cayley):
  every singular value is 1;
- ``"conv_kernel"``: ``nn.Conv2d`` whose kernel matrix is constrained by
  ``orthogonalize(conv, method, conv_kernel=True)`` (default T-CWY on
  St(c·k², c)): non-expansive, ‖conv‖₂ ≤ 1, and in general < 1 (Note [A Stiefel
  kernel makes the convolution non-expansive] in `stiefel.parametrizations.conv`);
- ``"orthoconv"``: `stiefel.nn.OrthoConv2d`, an explicit kernel assembled from
  exact maps (default CWY): every singular value is 1;
- ``"aoc"``: orthogonium's ``AdaptiveOrthoConv2d`` (Boissin et al. 2025; its
  default parameters: a 3-step power-iteration normalisation, then 12 Björck
  steps): every singular value is 1 up to the error of those iterations (a
  float32 layer only, orthogonium fixes its normaliser's dtype when built);
- ``"conv"``: the unconstrained ``nn.Conv2d``.

Note [Exact norm of a circular convolution]
A linear map A of c-channel s×s images that commutes with every circular
shift is a multichannel circular convolution, block-diagonalised by the 2-D
DFT: its singular values are those of the s² c×c transfer matrices Ĥ(ω),
whose columns are the DFTs of its impulse responses (Sedghi, Gupta & Long
2019). `stiefel.nn.singular_values` computes them (Note [Singular values of a
circular convolution by impulse responses] in `stiefel.nn.spectrum`), so
‖A‖₂ = max_ω ‖Ĥ(ω)‖₂ is exact up to the rounding of the layer's own
arithmetic (no power iteration, whose estimate is a lower bound). An affine
layer's linear part is A x = layer(x) − layer(0).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stiefel.nn import OrthoConv2d, OrthogonalConv2d, singular_values
from stiefel.parametrizations import orthogonalize

__all__ = ["LAYERS", "DEFAULT_MAPS", "conv_layer", "circular_norm"]

LAYERS = {
    "fft": "stiefel.nn.OrthogonalConv2d (FFT), exactly orthogonal",
    "conv_kernel": "nn.Conv2d with orthogonalize(conv_kernel=True), non-expansive",
    "orthoconv": "stiefel.nn.OrthoConv2d (explicit kernel), exactly orthogonal",
    "aoc": "orthogonium's AdaptiveOrthoConv2d (Björck), orthogonal to its iterations",
    "conv": "the unconstrained nn.Conv2d",
}
#: the map of each layer built from one of this package's maps, when none is named
DEFAULT_MAPS = {"fft": "cayley", "conv_kernel": "tcwy", "orthoconv": "cwy"}


def conv_layer(
    layer: str,
    method: str | None,
    channels: int,
    kernel_size: int,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> nn.Module:
    """A stride-1 ``channels`` → ``channels`` convolution with bias, circular "same" padding.

    Args:
        layer: a name of ``LAYERS``.
        method: the map of ``"fft"``, ``"conv_kernel"`` and ``"orthoconv"`` (None:
            ``DEFAULT_MAPS``); None for ``"aoc"`` and ``"conv"``.
        channels: c.
        kernel_size: k.
        dtype: parameter dtype (``"aoc"``: float32 only).
        **options: the map's options (``reflections``, ``init``, ...).

    Returns:
        The layer.

    Raises:
        ValueError: an unknown ``layer``, a ``method`` or options given to a layer
            without a map, a dtype other than float32 for ``"aoc"``, or what the
            layer refuses.
        ImportError: ``"aoc"`` without orthogonium installed.

    Example:
        ```python
        import torch
        from experiments.lipschitz_layers import circular_norm, conv_layer

        conv = conv_layer("orthoconv", None, 4, 3, dtype=torch.float64)
        assert abs(circular_norm(conv, 4, 8) - 1.0) < 1e-12
        ```
    """
    if layer not in LAYERS:
        raise ValueError(f"layer={layer!r}; allowed: {', '.join(LAYERS)}")
    if layer not in DEFAULT_MAPS and (method is not None or options):
        raise ValueError(
            f"layer={layer!r} takes no map; got method={method!r}, options {options!r}"
        )
    method = DEFAULT_MAPS.get(layer) if method is None else method
    c, k = channels, kernel_size
    if layer == "fft":
        return OrthogonalConv2d(c, k, method, bias=True, dtype=dtype, **options)
    if layer == "orthoconv":
        return OrthoConv2d(c, c, k, method=method, dtype=dtype, **options)
    if layer == "aoc":
        return _aoc(c, k, dtype)
    conv = nn.Conv2d(c, c, k, padding="same", padding_mode="circular", dtype=dtype)
    if layer == "conv_kernel":
        return orthogonalize(conv, method=method, conv_kernel=True, **options)
    return conv


def _aoc(channels: int, kernel_size: int, dtype: torch.dtype) -> nn.Module:
    if dtype != torch.float32:
        raise ValueError(
            f"layer='aoc' with dtype={dtype}; allowed: torch.float32 (orthogonium's "
            "power-iteration normaliser fixes its dtype when built)"
        )
    try:
        from orthogonium.layers.conv.AOC import AdaptiveOrthoConv2d
    except ImportError as exc:
        raise ImportError(
            "layer='aoc' needs orthogonium (pip install orthogonium; in the test extra)"
        ) from exc
    return AdaptiveOrthoConv2d(
        channels, channels, kernel_size, padding="same", padding_mode="circular", bias=True
    )


@torch.no_grad()
def circular_norm(layer: nn.Module, channels: int, size: int) -> float:
    r"""‖A‖₂ of the linear part A of a shift-commuting layer on ``channels``×``size``² images.

    The first of `stiefel.nn.singular_values` (``method="fft"``): one forward of
    the c unit impulses, a random image and the zero image (one batch: a layer
    whose weight changes at every call, as orthogonium's, is measured at one
    weight), the responses' FFT, and the largest singular value of the s²
    transfer matrices in float64 (Note [Exact norm of a circular convolution]).
    The layer's ``bias`` tensor, if it has one, is zero during the measurement
    (restored after): A x = layer(x) − layer(0) does not depend on it, and a
    bias far larger than A x (a float32 run at a large learning rate) would leave
    only rounding in the difference.

    Args:
        layer: a stride-1 circular convolution (any of `conv_layer`), or any
            affine map of (B, c, s, s) to (B, c, s, s) that commutes with
            circular shifts.
        channels: c.
        size: s.

    Returns:
        The largest singular value of the layer's linear part; NaN for a layer
        whose response to the zero image or to a unit impulse is not finite (a
        diverged run's: its norm is undefined, and a NaN layer commutes with no shift).

    Raises:
        ValueError: the layer does not map (B, c, s, s) to (B, c, s, s), or does not
            commute with circular shifts.

    Example:
        ```python
        import torch
        from experiments.lipschitz_layers import circular_norm

        conv = torch.nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular", bias=False)
        dense = torch.stack([conv(e.reshape(1, 2, 5, 5)).flatten() for e in torch.eye(50)], 1)
        assert abs(circular_norm(conv, 2, 5) - torch.linalg.matrix_norm(dense, 2)) < 1e-5
        ```
    """
    bias = getattr(layer, "bias", None)
    if not isinstance(bias, torch.Tensor):
        return _circular_norm(layer, channels, size)
    saved = bias.detach().clone()
    with torch.no_grad():
        bias.zero_()  # A does not depend on it; a large bias would drown A x in rounding
    try:
        return _circular_norm(layer, channels, size)
    finally:
        with torch.no_grad():
            bias.copy_(saved)


def _circular_norm(layer: nn.Module, channels: int, size: int) -> float:
    params = next(iter(layer.parameters()), None)
    dtype = params.dtype if params is not None else torch.float32
    device = params.device if params is not None else None
    shape = (1, channels, size, size)
    probe = torch.zeros((2, *shape[1:]), dtype=dtype, device=device)
    probe[1, :, 0, 0] = 1  # the zero image and an impulse in every channel
    out = layer(probe)
    if out.shape[1:] != shape[1:]:
        raise ValueError(
            f"layer maps {(channels + 1, *shape[1:])} to {(channels + 1, *out.shape[1:])}; "
            f"allowed: a shape-preserving circular convolution ({channels} channels, "
            f"{size}×{size})"
        )
    if not bool(torch.isfinite(out).all()):
        return math.nan
    return float(singular_values(layer, shape[1:], method="fft", dtype=dtype, device=device)[0])

r"""Stiefel-constrained convolution kernels: ``orthogonalize(conv, conv_kernel=True)``.

A convolution weight W of shape (out, in, k₁, …, k_d) with k = k₁⋯k_d taps is
read as the kernel matrix K̂ = reshape(W, (out, in·k))ᵀ of shape (in·k) × out
(CWY paper §3.4, rows ordered channel-major, tap-minor). The constraint is

    √k · K̂ ∈ St(in·k, out)   (its transpose when in·k < out),

served by any registered map (the map sees the tall matrix) or by
``method="riemannian"`` (the tall matrix is the stored manifold parameter).

Note [A Stiefel kernel makes the convolution non-expansive]
For stride 1 and zero padding, output position p of ``conv(x)`` is
y_p = K̂ᵀ x̄_p, where x̄_p ∈ ℝ^{in·k} stacks the k shifted input vectors
x_{p+t−pad} (zero outside the input) — CWY paper, appendix C. With
√k·K̂ = Q, ‖Qᵀ‖₂ = 1 (orthonormal columns, or rows when wide), so
‖y_p‖² ≤ ‖x̄_p‖²/k. Summing over p, each tap t contributes
Σ_p ‖x_{p+t−pad}‖² ≤ ‖x‖², because p ↦ p + t − pad is injective (each input
position is read at most once per tap; out-of-range reads are zeros). Hence
‖y‖² ≤ (1/k)·k·‖x‖² = ‖x‖². Injectivity also holds for any stride and
dilation, so the bound does too; with circular padding every tap reads every
position at most once as long as the output is not longer than the input
(2·padding ≤ dilation·(k_i − 1) in each dimension; then Σ_p ‖x̄_p‖² ≤ k‖x‖²),
and with k = 1, in = out the map is y_p = Qᵀx_p with Q orthogonal: ‖y‖ = ‖x‖
exactly. A larger circular padding wraps around and reads positions twice per
tap (‖conv‖₂ up to 1.23 was measured for k = 2, padding = 1), and reflect and
replicate padding read some positions twice: they are refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .base import OrthogonalMap
from .factory import build

__all__ = ["ConvKernel", "conv_kernel_map", "check_convolution"]

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
PADDING_MODES = ("zeros", "circular")


class ConvKernel(nn.Module):
    r"""The parametrization W = reshape(Tᵀ or T)/√k of a Stiefel convolution kernel.

    ``forward(original)`` returns the weight (out, in, *kernel_size) from the
    tall point T = ``map(original)`` (n × m; for ``"riemannian"`` the map is a
    `ManifoldPoint` and the original is T itself, a manifold parameter).
    ``right_inverse`` and ``initial`` read the kernel matrix of a weight and
    hand it to the map (Note [A Stiefel kernel makes the convolution
    non-expansive]).

    ``ConvKernel(shape, None)`` is the bare reshape T ↦ W, for callers that
    hold T themselves (it is not registered).

    Attributes:
        map: the `OrthogonalMap` of T (built by `build`).
        manifold: St(in·k, out) or St(out, in·k), the manifold of T.
        taps: k, the number of kernel taps.
        wide: whether T = √k·K̂ᵀ (in·k < out) rather than √k·K̂.
    """

    def __init__(
        self, weight_shape: tuple[int, ...], fmap: OrthogonalMap | None, manifold: Any = None
    ):
        super().__init__()
        self.weight_shape = tuple(weight_shape)
        out, cin = weight_shape[:2]
        self.taps = math.prod(weight_shape[2:])
        self.wide = cin * self.taps < out
        self.map = fmap
        self.manifold = fmap.manifold if fmap is not None else manifold

    def kernel_matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """The tall point T of a weight: √k·K̂ (or its transpose when wide)."""
        khat = weight.reshape(self.weight_shape[0], -1).mT * math.sqrt(self.taps)
        return khat.mT if self.wide else khat

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        t = original if self.map is None else self.map(original)
        khat_t = t if self.wide else t.mT  # K̂ᵀ·√k, shape (out, in·k)
        return khat_t.reshape(self.weight_shape) / math.sqrt(self.taps)

    def _weight(self, value: object) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != self.weight_shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"value must have the weight's shape {self.weight_shape}, got {got}")
        return value

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        """The original of a weight whose kernel matrix is on the manifold (ValueError if not)."""
        return self.map.right_inverse(self.kernel_matrix(self._weight(value)))

    def initial(
        self, weight: torch.Tensor, init: str | None, generator: torch.Generator | None
    ) -> torch.Tensor:
        """The original for ``init`` and the kernel matrix of ``weight``."""
        return self.map.initial(self.kernel_matrix(self._weight(weight)), init, generator)

    def fresh_init(self) -> str:
        """The init of a reset (`OrthogonalMap.fresh_init`)."""
        return self.map.fresh_init()

    def extra_repr(self) -> str:
        return f"taps={self.taps}, manifold={self.manifold!r}"


def _check_padding(module: nn.Module, what: str = "conv_kernel=True") -> None:
    """Refuse paddings that break the non-expansive bound (Note [A Stiefel kernel …]).

    Args:
        module: the convolution, or anything with its ``padding_mode``, ``padding``,
            ``kernel_size`` and ``dilation`` (per spatial axis).
        what: what the messages begin with: the option or layer that needs the bound
            (``"conv_kernel=True"``, or the class name of an orthogonal layer).
    """
    if module.padding_mode not in PADDING_MODES:
        raise ValueError(
            f"{what} with padding_mode={module.padding_mode!r}; allowed: "
            f"{', '.join(PADDING_MODES)} (Note [A Stiefel kernel makes the convolution "
            "non-expansive])"
        )
    if module.padding_mode != "circular" or isinstance(module.padding, str):
        return  # zeros: any padding; "same"/"valid" never lengthen the output
    for pad, k, dil in zip(module.padding, module.kernel_size, module.dilation, strict=True):
        if 2 * pad > dil * (k - 1):
            raise ValueError(
                f"{what} with padding_mode='circular' and padding={module.padding} "
                f"(kernel_size={module.kernel_size}, dilation={module.dilation}): the padding "
                "wraps around and reads input positions twice, so the convolution is not "
                "non-expansive; allowed: 2·padding ≤ dilation·(kernel_size − 1) in every "
                "dimension with circular padding (e.g. padding='same'), or padding_mode='zeros' "
                "with any padding"
            )


def conv_kernel_map(
    module: nn.Module, name: str, method: Any, options: dict[str, Any]
) -> ConvKernel:
    """The `ConvKernel` of ``orthogonalize(module, name, method, conv_kernel=True, **options)``.

    Checks the module (type, ``groups``, ``padding_mode`` and padding) and
    builds the map of the kernel matrix with `build`; the module is not
    touched (``orthogonalize`` registers the result).

    Raises:
        TypeError: ``module`` is not an ``nn.Conv1d/2d/3d``; unknown options.
        ValueError: ``name`` is not ``"weight"``, ``groups`` ≠ 1, a padding or
            ``padding_mode`` that breaks the bound, or any error of `build`.
    """
    check_convolution(module, name)
    w = module.weight
    out, cin = w.shape[:2]
    rows = cin * math.prod(w.shape[2:])
    shape = (max(rows, out), min(rows, out))
    return ConvKernel(tuple(w.shape), build(method, shape, w.dtype, w.device, options))


def check_convolution(module: nn.Module, name: str) -> None:
    """The module checks of ``conv_kernel=True`` (type, name, groups, padding)."""
    if not isinstance(module, CONVOLUTIONS):
        raise TypeError(
            f"conv_kernel=True needs a convolution module; got {type(module).__name__}; "
            "allowed: nn.Conv1d, nn.Conv2d, nn.Conv3d (conv_kernel=False for other weights)"
        )
    if name != "weight":
        raise ValueError(f"name={name!r} with conv_kernel=True; allowed: 'weight' (the kernel)")
    if module.groups != 1:
        raise ValueError(
            f"conv_kernel=True needs groups=1, got groups={module.groups}: a grouped kernel is "
            "block diagonal; constrain a convolution per group instead"
        )
    _check_padding(module)

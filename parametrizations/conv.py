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
position exactly once (Σ_p ‖x̄_p‖² = k‖x‖²), and with k = 1, in = out the map
is y_p = Qᵀx_p with Q orthogonal: ‖y‖ = ‖x‖ exactly. Reflect and replicate
padding read some positions twice, which breaks the bound: they are refused.
"""

from __future__ import annotations

import math
from typing import Any

import geoopt
import torch
from torch import nn
from torch.nn.utils import parametrize

from ..manifolds.kernels import orthogonality_error
from .base import OrthogonalMap
from .constrain import orthogonalize

__all__ = ["ConvKernel", "orthogonalize_conv"]

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
PADDING_MODES = ("zeros", "circular")


class ConvKernel(nn.Module):
    r"""The parametrization W = reshape(K̂ᵀ)/… of a Stiefel convolution kernel.

    ``forward(original)`` returns the weight (out, in, *kernel_size):
    W = reshape(Tᵀ or T, (out, in, *kernel_size)) / √k with T the tall point
    (n × m, from the map, or the stored manifold parameter for
    ``"riemannian"``). ``right_inverse`` inverts it
    (Note [A Stiefel kernel makes the convolution non-expansive]).

    Attributes:
        map: the ``OrthogonalMap`` (None for ``"riemannian"``).
        manifold: St(in·k, out) or St(out, in·k), the manifold of T.
        taps: k, the number of kernel taps.
        wide: whether T = √k·K̂ᵀ (in·k < out) rather than √k·K̂.
    """

    def __init__(self, weight_shape: tuple[int, ...], fmap: OrthogonalMap | None, manifold):
        super().__init__()
        self.weight_shape = tuple(weight_shape)
        out, cin = weight_shape[:2]
        self.taps = math.prod(weight_shape[2:])
        self.wide = cin * self.taps < out
        self.map = fmap
        self.manifold = manifold
        self._pending: torch.Tensor | None = None

    def kernel_matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """The tall point T of a weight: √k·K̂ (or its transpose when wide)."""
        khat = weight.reshape(self.weight_shape[0], -1).mT * math.sqrt(self.taps)
        return khat.mT if self.wide else khat

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        t = original if self.map is None else self.map(original)
        khat_t = t if self.wide else t.mT  # K̂ᵀ·√k, shape (out, in·k)
        return khat_t.reshape(self.weight_shape) / math.sqrt(self.taps)

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        """The original of a weight whose kernel matrix is on the manifold (ValueError if not)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return pending
        if tuple(value.shape) != self.weight_shape:
            raise ValueError(
                f"value must have the weight's shape {self.weight_shape}, got {tuple(value.shape)}"
            )
        t = self.kernel_matrix(value)
        if self.map is not None:
            return self.map.right_inverse(t)
        err = float(orthogonality_error(t.detach()))
        tol = self.manifold.default_atol(t.dtype)
        if not err <= tol:
            raise ValueError(
                f"value's kernel matrix √k·K̂ is not on {self.manifold!r}: "
                f"‖QᴴQ − I‖_F = {err:.3e} > {tol:.3e}"
            )
        return t

    def extra_repr(self) -> str:
        return f"taps={self.taps}, manifold={self.manifold!r}"


def orthogonalize_conv(module: nn.Module, name: str, method: Any, options: dict[str, Any]):
    """``orthogonalize(module, name, method, conv_kernel=True, **options)``.

    Checks everything first (module type, ``groups``, ``padding_mode``, the
    method and its options, through ``orthogonalize`` on the kernel matrix of a
    scratch holder), then registers a ``ConvKernel`` parametrization; nothing
    is modified if a check fails.

    Raises:
        TypeError: ``module`` is not an ``nn.Conv1d/2d/3d``.
        ValueError: ``name`` is not ``"weight"``, ``groups`` ≠ 1, an unsupported
            ``padding_mode``, an already parametrized weight, or any error of
            ``orthogonalize`` for the kernel matrix (unknown method, options).
    """
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
    if module.padding_mode not in PADDING_MODES:
        raise ValueError(
            f"conv_kernel=True with padding_mode={module.padding_mode!r}; allowed: "
            f"{', '.join(PADDING_MODES)} (Note [A Stiefel kernel makes the convolution "
            "non-expansive])"
        )
    if parametrize.is_parametrized(module, name):
        raise ValueError(
            f"module.{name} is already parametrized; remove it first with "
            f"torch.nn.utils.parametrize.remove_parametrizations(module, {name!r})"
        )
    w = module.weight
    shape = tuple(w.shape)
    param = ConvKernel(shape, None, None)
    holder = nn.Module()  # the tall kernel matrix, orthogonalized with every check
    holder.weight = nn.Parameter(param.kernel_matrix(w.detach()).clone())
    orthogonalize(holder, "weight", method, **options)
    if parametrize.is_parametrized(holder, "weight"):
        param.map = holder.parametrizations.weight[0]
        param.manifold = param.map.manifold
        param._pending = holder.parametrizations.weight.original.detach()
    else:  # riemannian: the tall matrix itself is the manifold parameter
        point = holder.weight
        param.manifold = point.manifold
        param._pending = point.detach()
    parametrize.register_parametrization(module, name, param, unsafe=True)
    if param.map is None:
        plist = module.parametrizations[name]
        plist.original = geoopt.ManifoldParameter(
            plist.original.detach(), manifold=param.manifold, requires_grad=w.requires_grad
        )
    return module

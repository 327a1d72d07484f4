r"""Explicit-kernel orthogonal convolutions: ``OrthoConv2d`` and ``OrthoConvTranspose2d``.

The kernel is assembled from exact maps (`stiefel.nn.orthokernel`), then the
layer is one ordinary ``F.conv2d`` (``F.conv_transpose2d``) with it.

Note [Padding of an orthogonal convolution]
With ``padding_mode="circular"`` and ``padding="same"`` the layer is a
convolution on the torus: every singular value is 1 (for a stride s, when s
divides the image size, else ‖y‖ ≤ ‖x‖; with a dilation d > 1 too, an image
size on which the stride's blocks wrap onto each other is refused at the
forward: Note [Strided blocks on a torus the stride does not tile]). "same"
pads d(k − 1) + 1 − s in total (d the dilation; at least 0), the left side
⌊total/2⌋ as ``nn.Conv2d`` does, so the output has ⌊n/s⌋ positions per axis;
any split of the total is a circular shift of the output, still orthogonal.
With zero padding the layer is the circular one on a torus large enough to
hold the zero-extended image, restricted to the output window: ‖conv(x)‖ ≤
‖x‖ always, and ‖conv(x)‖ = ‖x‖ (isometric layers: out ≥ in) for x that
vanishes within d(k − 1) of the border. The transposed layer is the adjoint:
``F.conv_transpose2d`` without padding, then the adjoint of the padding (a
crop for zeros; for circular, the border added back onto the opposite side).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .._core import checks as _checks
from ..parametrizations.conv import _check_padding
from ..parametrizations.deferred import initialize
from .orthokernel import OrthoKernel, wrapped_block_read

__all__ = ["OrthoConv2d", "OrthoConvTranspose2d"]

PADDING_MODES = ("circular", "zeros")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INITS = ("haar", "identity", "random")


def _padding(value: object, k: int, stride: int, dilation: int) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) for ``padding`` ("same", "valid", an int or an (h, w) pair)."""
    if value == "same":
        total = max(0, dilation * (k - 1) + 1 - stride)
        return (total // 2, total - total // 2) * 2
    if value == "valid":
        return (0, 0, 0, 0)
    if _checks.integer(value) and value >= 0:
        return (int(value),) * 4
    if (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(_checks.integer(p) and p >= 0 for p in value)
    ):
        h, w = map(int, value)
        return (w, w, h, h)
    raise ValueError(
        f"padding={value!r}; allowed: 'same', 'valid', a non-negative int or a pair of them"
    )


def _check_circular(
    cls: str,
    padding: object,
    pads: tuple[int, int, int, int],
    kernel_size: int,
    stride: int,
    dilation: int,
) -> None:
    """Refuse a circular padding that wraps around (the check of ``conv_kernel=True``).

    Note [Circular padding longer than "same"]
    The circular layer is orthogonal on the torus with "same" padding; a
    padding p ≤ "same" (2p ≤ d(k − 1) per axis) restricts its output to a
    window of distinct positions, so ‖y‖ ≤ ‖x‖ (and the adjoint, the
    transposed layer, is non-expansive too); a longer one wraps around and
    reads input positions twice per tap, and the layer is expansive (the
    dense operator's σ_max is √2 for k = 3, p = (1, 2)). It is the condition of a Stiefel
    kernel (Note [A Stiefel kernel makes the convolution non-expansive]), so
    the same check refuses it. With a stride s > 1 the circular layer is
    orthogonal on a torus the s×s blocks tile (Note [Strided orthogonal
    convolutions]); a padding other than "same" makes the torus of the
    transposed layer's output, (n − 1)s + d(k − 1) + 1 − 2p, one the stride
    does not tile (σ_max 1.49 measured for k = 3, s = 2, p = 1, every n), and
    the forward layer's one too on some images: refused ("same", "valid" or
    zero padding serve a stride).
    """
    if isinstance(padding, str):
        return  # "same", "valid": never longer than the input
    if stride > 1 and any(pads):
        raise ValueError(
            f"{cls} with padding_mode='circular', padding={padding!r} and stride={stride}: "
            "the circular padding then wraps a torus the stride does not tile, and the layer "
            "is not non-expansive; allowed with a stride > 1: padding='same' or 'valid', or "
            "padding_mode='zeros' with any padding"
        )
    view = SimpleNamespace(
        padding_mode="circular",
        padding=(pads[2], pads[0]),  # (h, w), as the message shows it
        kernel_size=(kernel_size, kernel_size),
        dilation=(dilation, dilation),
    )
    _check_padding(view, what=cls)


def _check(
    in_channels, out_channels, kernel_size, stride, groups, dilation, padding_mode, dtype, names
) -> None:
    """Every argument check of the two layers (before anything is built).

    ``in_channels``/``out_channels`` are those of the convolution whose kernel is
    built; ``names`` are the user's names for them (swapped for the transposed layer).
    """
    ni, no = names
    for name, value in (
        (ni, in_channels),
        (no, out_channels),
        ("kernel_size", kernel_size),
        ("stride", stride),
        ("groups", groups),
        ("dilation", dilation),
    ):
        _checks.positive_int(name, value)
    if in_channels % groups or out_channels % groups:
        raise ValueError(
            f"groups={groups} does not divide both channel counts ({ni}={in_channels}, "
            f"{no}={out_channels}); allowed: a common divisor of both"
        )
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode={padding_mode!r}; allowed: {', '.join(PADDING_MODES)}")
    if dtype is not None and dtype not in DTYPES:
        raise TypeError(f"dtype={dtype}; allowed: {', '.join(str(d) for d in DTYPES)}")
    ci, co, k, s = in_channels // groups, out_channels // groups, kernel_size, stride
    if s > 1 and math.gcd(dilation, s) != 1:
        raise ValueError(
            f"dilation={dilation} with stride={s}: the taps then miss some input positions; "
            f"allowed: a dilation coprime to the stride (Note [Strided orthogonal convolutions])"
        )
    if s > k and co > ci * k * k:
        raise ValueError(
            f"stride={s} > kernel_size={k} reads k×k of every s×s block: orthogonal only as "
            f"a co-isometry, which needs {no}/groups ≤ {ni}/groups·k² = {ci * k * k}; "
            f"got {ni}={in_channels}, {no}={out_channels}, groups={groups}"
        )
    size = k if s == 1 else k - s + 1
    inner = max(ci, co) if s == 1 else max(ci, co // (s * s))
    if size > 1 and inner < 2:
        raise ValueError(
            f"kernel_size={k} with stride={s} needs at least 2 channels per group in its "
            f"projector part ({'max(in, out)' if s == 1 else 'max(in, out/stride²)'}/groups ≥ 2, "
            f"a rank-⌊c/2⌋ projector per tap, in = {ni}, out = {no}); got {ni}={in_channels}, "
            f"{no}={out_channels}, groups={groups}"
        )


def _map_options(options: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    opts = dict(options)
    dtype, device = opts.pop("dtype", None), opts.pop("device", None)
    init = opts.get("init", "haar")
    if init not in INITS:
        raise ValueError(
            f"init={init!r}; allowed: {', '.join(INITS)} (a fresh layer has no weight to be near)"
        )
    return dtype, device, opts


def _adjoint_pad(y: torch.Tensor, pads: tuple[int, int, int, int], mode: str) -> torch.Tensor:
    """The adjoint of ``F.pad(x, pads, mode)`` (zeros: a crop; circular: borders wrapped back)."""
    for dim, (lo, hi) in ((-1, pads[:2]), (-2, pads[2:])):
        n = y.shape[dim] - lo - hi
        inner = y.narrow(dim, lo, n)
        if mode == "circular":
            if lo:
                inner = inner + F.pad(y.narrow(dim, 0, lo), _along(dim, n - lo, 0))
            if hi:
                inner = inner + F.pad(y.narrow(dim, lo + n, hi), _along(dim, 0, n - hi))
        y = inner
    return y


def _along(dim: int, before: int, after: int) -> tuple[int, ...]:
    return (before, after) if dim == -1 else (0, 0, before, after)


class _OrthoConvBase(nn.Module):
    """Arguments, kernel, bias and initialisation shared by the two layers."""

    transposed: ClassVar[bool]  # the layer is the adjoint of the convolution its kernel is

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        groups: int = 1,
        dilation: int = 1,
        padding: Any = "same",
        padding_mode: str = "circular",
        bias: bool = True,
        method: Any = "cwy",
        **options: Any,
    ):
        transposed = self.transposed
        dtype, device, opts = _map_options(options)
        # the kernel is that of a convolution conv_in → conv_out (the transposed layer's adjoint)
        conv_in, conv_out = (
            (out_channels, in_channels) if transposed else (in_channels, out_channels)
        )
        names = ("out_channels", "in_channels") if transposed else ("in_channels", "out_channels")
        _check(conv_in, conv_out, kernel_size, stride, groups, dilation, padding_mode, dtype, names)
        # numpy's integers pass the checks: Python's from here on (repr, state, arithmetic)
        in_channels, out_channels, kernel_size, stride, groups, dilation = map(
            int, (in_channels, out_channels, kernel_size, stride, groups, dilation)
        )
        conv_in, conv_out = int(conv_in), int(conv_out)
        pads = _padding(padding, kernel_size, stride, dilation)
        if padding_mode == "circular":
            _check_circular(type(self).__name__, padding, pads, kernel_size, stride, dilation)
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.groups, self.dilation = (
            kernel_size,
            stride,
            groups,
            dilation,
        )
        if _checks.integer(padding) or isinstance(padding, tuple | list):  # checked: ints
            padding = int(padding) if _checks.integer(padding) else tuple(map(int, padding))
        self.padding, self.padding_mode, self.pads = padding, padding_mode, pads
        self.method = method
        self.kernel = OrthoKernel(
            conv_in, conv_out, kernel_size, stride, groups, method, opts, dtype, device
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_channels, dtype=dtype, device=device)) if bias else None
        )

    @property
    def weight(self) -> torch.Tensor:
        """The assembled kernel (cached without gradients until a factor changes)."""
        return self.kernel()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """A fresh point for every factor (the layer's ``init``) and a zero bias.

        After ``module.to_empty(device=...)`` (deferred initialisation) this makes
        the layer orthogonal again.
        """
        # the kernel centres an identity init (Note [The identity convolution from ...])
        initialize(self.kernel, init=self.kernel.init, generator=generator)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def _check_input(self, x: torch.Tensor) -> None:
        """Refuse an input the layer cannot map as promised (dtype; wrapping strided blocks)."""
        name = type(self).__name__
        if x.dtype not in _checks.DTYPES:  # the kernel cast to an integer dtype would be zeros
            raise TypeError(
                f"{name} got an input of dtype {x.dtype}; allowed: "
                f"{', '.join(map(str, _checks.DTYPES))} (a floating or complex image)"
            )
        s, d, taps = self.stride, self.dilation, min(self.kernel_size, self.stride)
        if self.transposed or s == 1 or d == 1 or self.padding_mode != "circular":
            return
        if not any(self.pads) or x.dim() < 2:
            return
        h, w = (int(n) for n in x.shape[-2:])
        for axis, n in (("height", h), ("width", w)):
            hit = n % s and wrapped_block_read(n, s, d, taps)
            if hit:
                a, b = hit
                sign = "+" if b > 0 else "−"
                raise ValueError(
                    f"{name} with stride={s}, dilation={d} and circular padding="
                    f"{self.padding!r} on a {h}×{w} image: the stride does not divide the "
                    f"{axis} {n}, and the strided blocks wrap around onto positions they "
                    f"already read ({s}·{a} {sign} {d}·{abs(b)} = {s * a + d * b}, a multiple "
                    f"of {n}): the layer would be expansive (Note [Strided blocks on a torus "
                    f"the stride does not tile]); allowed: an image size the stride divides "
                    "(or one where the blocks do not wrap), dilation=1, padding='valid' or "
                    "padding_mode='zeros'"
                )

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias[:, None, None].to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, groups={self.groups}, dilation={self.dilation}, "
            f"padding={self.padding!r}, padding_mode={self.padding_mode!r}, "
            f"bias={self.bias is not None}, method={self.method!r}"
        )


class OrthoConv2d(_OrthoConvBase):
    r"""An exactly orthogonal k×k convolution with an explicit kernel (BCOP/AOC from exact maps).

    The kernel (out, in/groups, k, k) is the composition of an isometric 1×1
    convolution, k − 1 two-tap projector steps per axis (P = VVᵀ) and, for a
    stride s > 1, a reshaped s×s factor, every orthonormal factor from the map
    ``method`` (`stiefel.nn.orthokernel`); the forward is one ``F.conv2d``.
    With ``padding_mode="circular"`` and ``padding="same"`` every singular
    value of the layer (a map of the whole image) is 1 to working precision:
    an isometry (‖y‖ = ‖x‖) when out ≥ in·s² (the output has out/s² values per
    input pixel), a co-isometry (its adjoint is an isometry) otherwise. With
    zero padding ‖y‖ ≤ ‖x‖, with equality in the interior (Note [Padding of an
    orthogonal convolution]).

    Args:
        in_channels: input channels (``groups`` divides them).
        out_channels: output channels (``groups`` divides them).
        kernel_size: k ≥ 1 (square kernels; odd and even k).
        stride: s ≥ 1 (s ≤ k, or out/groups ≤ in/groups·k²); exact when s
            divides the image size, ‖y‖ ≤ ‖x‖ otherwise.
        groups: independent channel groups, each orthogonal.
        dilation: d ≥ 1 (coprime to s when s > 1).
        padding: "same" (default; n/s outputs per axis), "valid", an int or a pair.
        padding_mode: "circular" (default) or "zeros".
        bias: add a learned per-channel bias.
        method: the map of every factor (any of
            ``stiefel.parametrizations.available()``).
        **options: ``dtype``, ``device``, ``init`` ("haar" default, "identity":
            the identity convolution for in = out, stride 1, odd k and an even
            channel count per group, a delta-orthogonal kernel for odd k and even
            channels, every factor at its identity point otherwise (Note [The
            identity convolution from projector steps]), "random"), ``generator`` and
            the map's options (e.g. ``reflections``).

    Raises:
        ValueError: a non-positive size, stride, dilation or group count,
            ``groups`` not dividing both channel counts, a stride the
            construction cannot serve (the message gives the channel counts it
            needs), a dilation not coprime to the stride, an unknown
            ``padding``/``padding_mode``/``init``, or what ``orthogonalize``
            refuses (unknown method); at the forward, with a stride and a
            dilation > 1 and circular padding, an image size on which the
            strided blocks wrap onto each other (the message names it).
        TypeError: an unsupported dtype or unknown map options; at the
            forward, an input that is not floating or complex (integer, bool).

    Example:
        ```python
        import torch
        from stiefel.nn import OrthoConv2d

        conv = OrthoConv2d(8, 8, 3, bias=False, dtype=torch.float64)
        x = torch.randn(2, 8, 12, 12, dtype=torch.float64)
        assert torch.allclose(conv(x).norm(), x.norm())
        down = OrthoConv2d(8, 16, 3, stride=2)
        assert down(x.float()).shape == (2, 16, 6, 6)
        ```
    """

    transposed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = conv(x) (+ bias), x of shape (batch, in_channels, h, w)."""
        self._check_input(x)
        w = self.kernel().to(x.dtype)
        left, right, top, bottom = self.pads
        if self.padding_mode == "circular" and any(self.pads):
            x = F.pad(x, self.pads, mode="circular")
            pad = 0
        elif left == right == top == bottom:
            pad = left
        else:
            x = F.pad(x, self.pads)
            pad = 0
        y = F.conv2d(x, w, None, self.stride, pad, self.dilation, self.groups)
        return self._add_bias(y)


class OrthoConvTranspose2d(_OrthoConvBase):
    r"""The adjoint of an `OrthoConv2d`: an exactly orthogonal transposed convolution.

    ``OrthoConvTranspose2d(in, out, k, stride=s, ...)`` maps (in, n, n) to
    (out, n·s, n·s) (``padding="same"``) as the adjoint of the orthogonal
    convolution out → in with the same kernel (``weight`` has
    ``nn.ConvTranspose2d``'s layout (in, out/groups, k, k)): one
    ``F.conv_transpose2d``, then the adjoint of the padding, circular
    included (Note [Padding of an orthogonal convolution]). The adjoint of an
    isometry is a co-isometry and conversely: every singular value is 1.

    The arguments are those of `OrthoConv2d`; the stride and channel
    conditions apply to the convolution out → in whose adjoint this is.

    Raises:
        ValueError: as `OrthoConv2d` (its output, n·s per axis, is never refused).
        TypeError: as `OrthoConv2d`.

    Example:
        ```python
        import torch
        from stiefel.nn import OrthoConvTranspose2d

        up = OrthoConvTranspose2d(16, 8, 3, stride=2, bias=False, dtype=torch.float64)
        x = torch.randn(2, 16, 6, 6, dtype=torch.float64)
        y = up(x)
        assert y.shape == (2, 8, 12, 12)
        assert torch.allclose(y.norm(), x.norm())
        ```
    """

    transposed = True

    @property
    def output_padding(self) -> int:
        """Rows and columns ``F.conv_transpose2d`` adds for a kernel narrower than the stride."""
        k_eff = self.dilation * (self.kernel_size - 1) + 1
        return max(0, self.stride - k_eff) if self.padding == "same" else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = convᵀ(x) (+ bias), x of shape (batch, in_channels, h, w)."""
        self._check_input(x)
        w = self.kernel().to(x.dtype)
        left, right, top, bottom = self.pads
        symmetric = self.padding_mode == "zeros" and left == right == top == bottom
        pad = left if symmetric else 0
        y = F.conv_transpose2d(
            x, w, None, self.stride, pad, self.output_padding, self.groups, self.dilation
        )
        if not symmetric:
            y = _adjoint_pad(y, self.pads, self.padding_mode)
        return self._add_bias(y)

r"""Convolutional layers with orthogonality constraints: the FFT orthogonal conv (and ConvNERU,
from `stiefel.nn.convneru`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._core import checks as _checks
from ..manifolds.kernels.reduce import abs_square
from ..parametrizations import kernels
from ..parametrizations._precision import work_dtype
from ..parametrizations._spectral import SPECTRAL_PER_ROW, SPECTRAL_THRESHOLD
from .convneru import NONLINEARITIES, ConvNERUCell

__all__ = ["ConvNERUCell", "OrthogonalConv2d", "NONLINEARITIES"]


def _exp(a: torch.Tensor) -> torch.Tensor:
    return kernels.exp_map(a, torch.eye(a.shape[-1], dtype=a.dtype, device=a.device))


def _cwy(v: torch.Tensor) -> torch.Tensor:
    r"""The compact WY map of the columns of P̂(ω), a vanishing column read as no reflection.

    Note [A vanishing column of the transfer matrix]
    A column of P̂(ω) is a sum of taps times phases and can vanish at some
    frequency (at every one for a zero kernel, at ω = 0 for taps summing to
    zero); its reflection I − 2vvᴴ/‖v‖² is then 0/0, and one NaN there made
    the whole output NaN. Such a column is taken as no reflection (H = I, the
    zero column of U): Q(ω) stays unitary, and the gradient through it is 0
    (Q is quadratic in the column near 0). Other columns are normalised as in
    ``kernels.cwy_matrix`` (whose zero column stays NaN: its gradient would be 0,
    the reflection lost for good; here other frequencies move the taps).
    """
    sq = abs_square(v).sum(-2, keepdim=True)  # Note [|v|² as a sum of squares]
    return kernels.unit_cwy_matrix(v / torch.where(sq == 0, torch.ones_like(sq), sq).sqrt())


#: per-frequency unitary maps of OrthogonalConv2d: name -> (skew input?, kernel)
FFT_METHODS: dict[str, tuple[bool, Callable[[torch.Tensor], torch.Tensor]]] = {
    "cayley": (True, kernels.cayley_map),
    "exp": (True, _exp),
    "cwy": (False, _cwy),
}


def _phases(k: int, size: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
    r"""[cos θ_t(ω), sin θ_t(ω)] at the half spectrum, shape (h·(w//2+1), 2k²), tap t = (a, b).

    θ_t(ω) = 2π(ω_h·(a − p)/h + ω_w·(b − p)/w), reduced exactly to (−π, π]
    (Note [Conjugate-symmetric transfer matrices]).

    Note [Conjugate-symmetric transfer matrices]
    The output is read back by ``irfft2``, which assumes Q(−ω) = conj Q(ω) and a
    real Q at the self-conjugate frequencies; the maps commute with conjugation
    exactly only when their inputs do. So θ is reduced as the integer
    N = ω_h(a − p)w + ω_w(b − p)h modulo hw to the signed r ∈ (−hw/2, hw/2] and
    θ = 2πr/(hw): −ω gives −r, hence cos and sin of exactly opposite angles, and
    sin θ is set to 0 where θ ∈ {0, π}. Unreduced, the two sides of a pair
    rounded apart by about eps·|θ|, which a column of P̂(ω) near 0 (a zero-sum
    kernel) turned into reflections of other directions: 2 % of the norm lost.
    """
    h, w = size
    p = (k - 1) // 2
    off = torch.arange(k, dtype=torch.int64) - p
    nh = torch.arange(h, dtype=torch.int64)[:, None] * off * w  # (h, k)
    nw = torch.arange(w // 2 + 1, dtype=torch.int64)[:, None] * off * h  # (w', k)
    total = h * w
    r = torch.remainder(nh[:, None, :, None] + nw[None, :, None, :], total)  # (h, w', k, k)
    r = torch.where(2 * r > total, r - total, r)
    theta = (2 * math.pi / total) * r.to(torch.float64)
    sin = torch.where((r == 0) | (2 * r == total), torch.zeros_like(theta), theta.sin())
    trig = torch.cat([theta.cos().reshape(-1, k * k), sin.reshape(-1, k * k)], 1)
    return trig.to(dtype=dtype, device=device)


def tap_dft(cos_taps: torch.Tensor, sin_taps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    r"""Σ_t C_t cos θ_t(ω) + i Σ_t S_t sin θ_t(ω) at the half spectrum: (h·(w//2+1), r, c).

    Note [Transfer matrices by a direct DFT of the taps]
    The transfer matrix of the centred circular cross-correlation by a real
    k×k kernel P is P̂(ω) = Σ_t P_t e^{iθ_t(ω)} (tap t = (a, b) reads x at
    offset (a − p, b − p)): a DFT of k² terms, not an FFT of P zero-padded to
    the image. It is one real product (F × 2k²)·(2k² × 2rc), F = h·(w//2+1),
    written directly in the per-frequency complex layout (F, r, c). The skew part needs
    no conjugate transpose either: A(ω) = P̂ − P̂ᴴ = Σ_t (P_t − P_tᵀ) cos θ_t +
    i Σ_t (P_t + P_tᵀ) sin θ_t, real k²-tap arrays formed before the DFT.

    Args:
        cos_taps, sin_taps: real (r, c, k, k).
        size: (h, w) of the image.
    """
    r, c, k = cos_taps.shape[0], cos_taps.shape[1], cos_taps.shape[-1]
    trig = _phases(k, size, cos_taps.dtype, cos_taps.device)  # (F, 2k²)
    # one real product in the complex layout: rows t of the cos taps feed the real
    # parts, rows k² + t of the sin taps the imaginary parts, so (F, 2k²)·(2k², rc·2) is
    # the complex (F, rc) already interleaved (and its gradient is read back unstrided)
    zero = torch.zeros_like(cos_taps)
    taps = torch.cat([torch.stack([cos_taps, zero], -1), torch.stack([zero, sin_taps], -1)])
    taps = taps.reshape(2, r * c, k * k, 2).transpose(1, 2).reshape(2 * k * k, r * c * 2)
    out = trig @ taps
    return torch.view_as_complex(out.reshape(-1, r, c, 2))


class OrthogonalConv2d(nn.Module):
    r"""An exactly orthogonal 2-D convolution with circular padding (Trockman & Kolter 2021).

    The layer is the circular convolution whose transfer matrix at every
    spatial frequency ω is a c×c unitary Q(ω), so ‖y‖ = ‖x‖ for every input
    (and y = Q x is orthogonal as a linear map of the whole image). The free
    parameter is a real kernel P of k×k support; with P̂(ω) the transfer
    matrix of the centred circular cross-correlation by P (the FFT of P
    zero-padded to the image, conjugated), Q(ω) is

    - ``"cayley"``: (I + A)⁻¹(I − A) with A(ω) = P̂(ω) − P̂(ω)ᴴ (the paper's
      choice: A is the transfer matrix of the skew-symmetric convolution
      P ∗ · − Pᵀ ∗ ·, whose support is k×k);
    - ``"exp"``: expm(A(ω));
    - ``"cwy"``: the compact WY transform of the columns of P̂(ω), P of shape
      (c, L, k, k) (``reflections=L``, default c).

    Note [Real output of the frequency-domain layer]
    P is real, so P̂(−ω) = conj P̂(ω), and each map commutes with conjugation:
    Q(−ω) = conj Q(ω). The output spectrum is therefore conjugate-symmetric and
    the layer computes only the half spectrum (``rfft2``/``irfft2``), n·(n/2+1)
    c×c maps instead of n²; at the self-conjugate frequencies Q(ω) is real.

    Note [Cost of the FFT orthogonal convolution]
    Per call: two FFTs of the input (O(B·c·n² log n)), the transfer matrices
    by a k²-term DFT of the taps (O(n²c²k²/2), Note [Transfer matrices by a
    direct DFT of the taps]) and the maps at n(n/2+1) frequencies. Cayley
    runs in its operator form, Q(ω)x̂(ω) = 2(I + A)⁻¹x̂(ω) − x̂(ω): one batched
    LU of the c×c matrices I + A (O(n²c³/6)) and a solve with the B columns
    of the batch, Q(ω) never formed. ``exp`` and ``cwy`` form Q(ω) and apply
    it (O(B·n²c²)). The maps depend on the image size only; in a loop over
    many batches of one size, compute them once with ``frequency_matrices``
    and pass them as ``q``.

    Args:
        channels: c (input and output channels).
        kernel_size: k, the support of P (k ≤ the input's height and width).
        method: ``"cayley"`` (default), ``"exp"`` or ``"cwy"``.
        bias: add a learned per-channel bias after the orthogonal map.
        stride: must be 1 (a strided layer is not orthogonal).
        **options: ``reflections`` (``"cwy"`` only), ``dtype``, ``device``.

    Raises:
        ValueError: unknown ``method``, ``stride`` not the int 1, ``channels`` or
            ``kernel_size`` not a positive int, bad ``reflections``.
        TypeError: unknown options, a ``dtype`` that is not a real floating dtype, a
            ``bias`` that is not a bool.

    Example:
        ```python
        import torch
        from stiefel.nn import OrthogonalConv2d

        conv = OrthogonalConv2d(4, 3)
        x = torch.randn(2, 4, 8, 8)
        y = conv(x)
        assert torch.allclose(y.norm(), x.norm(), rtol=1e-4)
        ```
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        method: str = "cayley",
        bias: bool = False,
        stride: int = 1,
        **options: Any,
    ):
        super().__init__()
        _checks.choice("method", method, FFT_METHODS)
        if not _checks.integer(stride) or stride != 1:
            raise ValueError(
                f"stride={stride!r}; allowed: 1 (a strided convolution is not orthogonal)"
            )
        kernel_size = _checks.positive_int("kernel_size", kernel_size)
        channels = _checks.positive_int("channels", channels)
        _checks.flag("bias", bias)
        dtype, device = options.pop("dtype", None), options.pop("device", None)
        if dtype is not None and dtype not in _checks.REAL_DTYPES:
            raise TypeError(
                f"dtype={dtype}; allowed: {', '.join(map(str, _checks.REAL_DTYPES))} (the "
                "kernel P is real; its transfer matrices are complex)"
            )
        allowed = ["reflections"] if method == "cwy" else []
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise TypeError(
                f"unknown option(s) {', '.join(unknown)} for method={method!r}; "
                f"allowed: {', '.join(['dtype', 'device', *allowed])}"
            )
        width = channels
        if method == "cwy":
            width = channels if options.get("reflections") is None else options["reflections"]
            _checks.int_in_range("reflections", width, 1, channels)
        self.channels, self.kernel_size, self.method = channels, kernel_size, method
        self.weight = nn.Parameter(
            torch.empty(channels, width, kernel_size, kernel_size, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(channels, dtype=dtype, device=device)) if bias else None
        )
        self._path: tuple[torch.Tensor, tuple[int, int], bool | None] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the kernel and the bias (torch's name: a module built on the meta
        device and moved by ``to_empty`` gets its values here)."""
        if self.method == "cwy":
            nn.init.normal_(self.weight)
        else:  # nn.Conv2d's initialisation, as in the paper (a CayleyConv is an nn.Conv2d)
            nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self._path = None

    def _check_size(self, size: tuple[int, int]) -> None:
        h, w = size
        k = self.kernel_size
        if k > h or k > w:
            raise ValueError(
                f"kernel_size={k} is larger than the input ({h}×{w}); allowed: "
                f"kernel_size ≤ min(height, width) = {min(h, w)}"
            )

    def transfer(self, size: tuple[int, int]) -> torch.Tensor:
        """P̂(ω) at the half spectrum of an h×w image: shape (h·(w//2+1), c, width).

        Args:
            size: (h, w) of the input.

        Raises:
            ValueError: if the kernel is larger than the image.
        """
        self._check_size(size)
        taps = self._taps()
        return tap_dft(taps, taps, size)

    def skew_transfer(self, size: tuple[int, int]) -> torch.Tensor:
        """A(ω) = P̂(ω) − P̂(ω)ᴴ at the half spectrum: (h·(w//2+1), c, c), from the taps."""
        self._check_size(size)
        taps = self._taps()
        pt = taps.transpose(0, 1)
        return tap_dft(taps - pt, taps + pt, size)

    def _taps(self) -> torch.Tensor:
        """The weight in the dtype the transforms compute in: float32 for a half-precision
        one (torch.fft has no half precision on the CPU; Note [Maps compute in float32 or
        wider]), the weight itself otherwise."""
        return self.weight.to(work_dtype(self.weight.dtype))

    def _spectral(self) -> bool | None:
        """False when ‖A(ω)‖₁ is certainly below the ``eigh`` threshold, once per weight version.

        Note [The Cayley path is chosen once per parameter version]
        |A(ω)ᵢⱼ| ≤ Σ_t |P_t,ij| + |P_t,ji| at every ω, so the column sums of
        those tap sums bound ‖A(ω)‖₁ at all frequencies at once, from the k²c²
        taps (no transform). The bound is read (one host synchronisation) once
        per version of the weight and kept; while it is below the threshold
        of `spectral_needed` the LU path is taken without reading ‖A‖₁ per
        call. Above it (rare: ‖A‖₁ > max(64, 4c)), None lets ``cayley_map``
        test ‖A(ω)‖₁ itself. A version is the counter and the address of the
        values (``weight.data = …`` keeps the counter); a write through
        ``weight.data`` in place changes neither, and keeps the choice of the
        last version until a change the counter sees (an optimizer's step): a
        path chosen for a smaller ‖A‖₁ is still a Cayley transform, less
        accurate only past the threshold.
        """
        w = self.weight
        if w.device.type == "meta" or torch.compiler.is_compiling():
            return None  # traced: no value can be read, ``cayley_map`` chooses in the graph
        try:  # under torch.func transforms (grad, vmap) no value nor address can be read
            key = (w._version, w.data_ptr())  # the address: ``w.data = …`` keeps the version
        except RuntimeError:
            return None
        if self._path is None or self._path[0] is not w or self._path[1] != key:
            a = w.detach().abs().sum((-2, -1))
            try:
                bound = float((a + a.mT).sum(0).max())
            except RuntimeError:
                return None
            limit = max(SPECTRAL_THRESHOLD, SPECTRAL_PER_ROW * self.channels)
            self._path = (w, key, False if bound <= limit else None)
        return self._path[2]

    def frequency_matrices(self, size: tuple[int, int]) -> torch.Tensor:
        """Q(ω), the c×c unitary matrices at the half spectrum: (h·(w//2+1), c, c).

        The tensor records its image size as ``q.image_size`` = (h, w) (two sizes can have
        as many frequencies: 4×10 and 6×6); ``forward`` checks it (a copy has none: set it).
        """
        if self.method == "cayley":
            q = kernels.cayley_map(self.skew_transfer(size), spectral=self._spectral())
        else:
            skew, fn = FFT_METHODS[self.method]
            q = fn(self.skew_transfer(size) if skew else self.transfer(size))
        q.image_size = tuple(size)
        return q

    def _check_q(self, q: object, size: tuple[int, int]) -> torch.Tensor:
        """Refuse a ``q`` of ``forward`` computed for another image size (or shape)."""
        q, (h, w), c = _checks.tensor("q", q), size, self.channels
        made = getattr(q, "image_size", None)
        if made is None:
            raise ValueError(
                f"q has no image_size (frequency_matrices records it; a copy such as "
                f"q.detach() does not); allowed: frequency_matrices(({h}, {w})) as returned, "
                f"or a copy given q.image_size = ({h}, {w})"
            )
        if tuple(made) != (h, w):
            raise ValueError(
                f"q is for a {made[0]}×{made[1]} image and x is {h}×{w}; allowed: "
                f"frequency_matrices(({h}, {w}))"
            )
        if tuple(q.shape) != (h * (w // 2 + 1), c, c):
            raise ValueError(
                f"q has shape {tuple(q.shape)}; allowed: ({h * (w // 2 + 1)}, {c}, {c}) for a "
                f"{h}×{w} image"
            )
        return q

    def forward(self, x: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
        """y = Q x (+ bias), x of shape (batch, c, h, w).

        Args:
            x: the input.
            q: ``frequency_matrices((h, w))`` computed beforehand (optional), for x's size.

        Returns:
            y, same shape and dtype as x (computed in the wider of x's and the
            weight's precision, float32 at least, and rounded once).

        Raises:
            ValueError: x not of shape (batch, channels, h, w), or smaller than the kernel;
                a ``q`` for another image size, without ``image_size`` or of another shape.
            TypeError: x not real (float32, float64, float16 or bfloat16), q not a tensor.
        """
        if x.dim() != 4 or x.shape[1] != self.channels:
            raise ValueError(
                f"x must have shape (batch, {self.channels}, h, w), got {tuple(x.shape)}"
            )
        if x.dtype not in _checks.REAL_DTYPES:
            raise TypeError(
                f"x has dtype {x.dtype}; allowed: {', '.join(map(str, _checks.REAL_DTYPES))} "
                "(a real image)"
            )
        b, c, h, w = x.shape
        if q is not None:
            q = self._check_q(q, (h, w))
        # computed in the wider of x's and the weight's precision (float32 at least: no
        # half-precision torch.fft on the CPU); y, bias included, is rounded once to x's dtype
        dtype = x.dtype
        work = torch.promote_types(work_dtype(dtype), work_dtype(self.weight.dtype))
        xf = torch.fft.rfft2(x.to(work)).permute(2, 3, 1, 0).reshape(-1, c, b)
        if q is not None:
            yf = q.to(xf.dtype) @ xf
        elif self.method == "cayley":  # the operator form: Q(ω) never formed
            a = self.skew_transfer((h, w)).to(xf.dtype)
            yf = kernels.cayley_map(a, xf, spectral=self._spectral())
        else:
            yf = self.frequency_matrices((h, w)).to(xf.dtype) @ xf
        y = torch.fft.irfft2(yf.reshape(h, w // 2 + 1, c, b).permute(3, 2, 0, 1), s=(h, w))
        if self.bias is not None:
            y = y + self.bias[:, None, None].to(y.dtype)
        return y.to(dtype)

    def extra_repr(self) -> str:
        cwy = f", reflections={self.weight.shape[1]}" if self.method == "cwy" else ""
        head = f"{self.channels}, kernel_size={self.kernel_size}, method={self.method!r}"
        return f"{head}{cwy}, bias={self.bias is not None}"

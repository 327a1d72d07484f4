r"""The kernel of an exactly orthogonal convolution, assembled from exact maps (BCOP/AOC).

A k×k kernel is a composition of convolutions that are each orthogonal on the
torus (circular padding), so their composition is too:

- an isometric 1×1 convolution H ∈ St(c, m) (m → c channels);
- k − 1 two-tap steps along the width, x ↦ P x(·) + (I − P) x(· + 1), and
  k − 1 along the height, with P = VVᵀ a symmetric projector, V ∈ St(c, ⌊c/2⌋)
  (block convolution orthogonal parametrization, BCOP: Li et al., NeurIPS 2019);
- for a stride s > 1, a reshaped s×s factor R (AOC: Boissin et al., ICML 2025):
  the s×s convolution of stride s is a space-to-depth reordering (orthogonal)
  followed by the 1×1 map R of shape out × (c·s²), row- or column-orthonormal.

Every orthonormal factor (H, each V, R) comes from a registered map of
``stiefel.parametrizations`` (``method=``, exact to working precision); no
iteration (Björck, Newton–Schulz) is involved.

Note [Two-tap projector steps are unitary per frequency]
The step x ↦ P x + (I − P) x(· + e) has the transfer matrix P + (I − P) z at
z = e^{iω}; with P a symmetric projector, (P + (I − P)z)ᴴ(P + (I − P)z) =
P + (I − P)|z|² = I. Composing kernels multiplies transfer matrices, so the
assembled kernel's transfer matrix is M(ω) = B_{k−1}(ω)⋯B₁(ω)H, with H the
isometry: M(ω)ᴴM(ω) = I at every frequency, i.e. every singular value of the
circular convolution (as a map of the whole image) is 1. A step is applied to
the kernel K (taps t) as K'[t] = P K[t] + (I − P) K[t − e]: two thin products
V(VᵀK), never a c×c projector. The taps of a composition of cross-correlations
are the full convolution of the tap arrays, so the kernel grows by one tap per
step: k − 1 steps per axis give k×k, for odd and even k alike.

Note [Strided orthogonal convolutions]
With stride s the layer is R_s ∘ B, with B the stride-1 BCOP kernel of size
k − s + 1 (m = in → c = inter channels, an isometry) and R_s the s×s, stride-s
reshaped factor: conv_{s}(x, B ⋆ R) = conv_{s}(conv_{1}(x, B), R) (the taps of
the composed kernel are the full convolution of both). R_s reads every input
position exactly once (the s×s blocks tile the image when s divides it and
gcd(dilation, s) = 1), so it is the orthogonal space-to-depth map followed by
the 1×1 map R: out × (inter·s²). With inter = max(in, ⌊out/s²⌋) either
inter = in (B orthogonal, R row-orthonormal: a co-isometry, every singular
value 1) or inter·s² ≤ out (R column-orthonormal, B an isometry: an isometry).
For k < s the layer is R alone on k×k blocks read at stride s; the blocks
miss some positions, so it is orthogonal only as a co-isometry, out ≤ in·k².

Note [Strided blocks on a torus the stride does not tile]
With circular padding the strided layer is B on the torus Z_n (an isometry
for every n: its steps shift by d, a permutation), then R read at the outputs
i < ⌊n/s⌋, the block of output i being the positions s·i + d·j (mod n),
j < r = min(k, s), per axis. The layer is non-expansive when these positions
are distinct (R on disjoint blocks) and orthogonal when they also cover Z_n.
Two coincide when s·a + d·b ≡ 0 (mod n) with |a| < ⌊n/s⌋, |b| < r, (a, b) ≠ 0.
When s divides n that cannot be (mod s, d·b ≡ 0 forces b = 0, as gcd(d, s) = 1,
then s·a ≢ 0); for d = 1 neither (0 < |s·a + b| ≤ s⌊n/s⌋ − 1 < n). For d > 1
and s ∤ n the last blocks can wrap around onto positions the first ones
read: s = 2, d = 3, n = 7 reads position 0 for outputs 0 and 2 (2·2 + 3·1 = 7),
and the layer is expansive (σ_max of the dense float64 operator: 2 for k = 2,
√2 per axis; 1.52 for k = 3, in = out = 4). One strided
``F.conv2d`` reads the positions s·i + d·j whatever the split of the
padding, so no circular layer with this kernel avoids the overlap: such an
image size is refused at the forward (`wrapped_block_read`). Zero padding
and padding="valid" never wrap; the transposed layer maps n to n·s, which s
divides.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..manifolds.kernels.reads import host_reads_allowed
from ..parametrizations import orthogonalize
from ..parametrizations._precision import work_dtype

__all__ = [
    "OrthoKernel",
    "projector_step",
    "compose_kernels",
    "kernel_plan",
    "wrapped_block_read",
]


def projector_step(kernel: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    r"""K'[t] = P K[t] + (I − P) K[t − e_dim] with P = VVᵀ (one more tap along ``dim``).

    Args:
        kernel: K of shape (g, c, m, h, w) (groups, output, input channels, taps).
        v: V of shape (g, c, r) with orthonormal columns.
        dim: -1 (width) or -2 (height).

    Returns:
        K' of shape (g, c, m, h + 1, w) or (g, c, m, h, w + 1).
    """
    g, c = kernel.shape[:2]
    t = (v @ (v.mT @ kernel.reshape(g, c, -1))).reshape(kernel.shape)
    d = kernel - t
    n = kernel.shape[dim]
    middle = t.narrow(dim, 1, n - 1) + d.narrow(dim, 0, n - 1)
    return torch.cat([t.narrow(dim, 0, 1), middle, d.narrow(dim, n - 1, 1)], dim)


def compose_kernels(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    r"""The kernel of ``second ⋆ (first ⋆ x)``: C[t] = Σ_{a+b=t} second[b]·first[a].

    Args:
        first: (g, c2, c1, h1, w1) applied first.
        second: (g, c3, c2, h2, w2) applied second.

    Returns:
        (g, c3, c1, h1 + h2 − 1, w1 + w2 − 1): one grouped ``F.conv2d`` of the tap
        arrays (the full convolution, hence the flipped, fully padded ``second``).
    """
    g, c2, c1, h1, w1 = first.shape
    c3, h2, w2 = second.shape[1], second.shape[-2], second.shape[-1]
    inp = first.reshape(g * c2, c1, h1, w1).transpose(0, 1)
    weight = second.reshape(g * c3, c2, h2, w2).flip(-2, -1)
    out = F.conv2d(inp, weight, padding=(h2 - 1, w2 - 1), groups=g)  # (c1, g·c3, h, w)
    return out.transpose(0, 1).reshape(g, c3, c1, h1 + h2 - 1, w1 + w2 - 1)


def kernel_plan(
    in_channels: int, out_channels: int, kernel_size: int, stride: int, groups: int
) -> dict[str, Any]:
    """The factors of the construction (shapes per group), after the checks of the layer.

    Returns:
        ``bcop``: None or (c, m, size) of the stride-1 BCOP part (m → c channels);
        ``reshaped``: None or (out, inter, size) of the reshaped factor R;
        ``transpose``: whether the BCOP kernel is used channel-transposed (out < in).
    """
    ci, co, k, s = in_channels // groups, out_channels // groups, kernel_size, stride
    if s == 1:
        return dict(bcop=(max(ci, co), min(ci, co), k), reshaped=None, transpose=co < ci)
    r = min(k, s)
    if k - r + 1 == 1:
        return dict(bcop=None, reshaped=(co, ci, r), transpose=False)
    inter = max(ci, co // (s * s))
    return dict(bcop=(inter, ci, k - s + 1), reshaped=(co, inter, s), transpose=False)


@functools.lru_cache(maxsize=1024)
def wrapped_block_read(n: int, stride: int, dilation: int, taps: int) -> tuple[int, int] | None:
    r"""(a, b) with stride·a + dilation·b ≡ 0 (mod n), 0 ≤ a < ⌊n/stride⌋, 0 < |b| < taps or None.

    The circular layer of stride s and dilation d on an axis of size n then
    reads one position for the outputs i and i + a, at the taps j and j + b of
    its stride-s factor (``taps`` = min(k, s) of them; Note [Strided blocks on
    a torus the stride does not tile]); None when every read differs.
    """
    for a in range(n // stride):
        for b in range(1 - taps, taps):
            if (a, b) > (0, 0) and (stride * a + dilation * b) % n == 0:
                return a, b
    return None


class OrthoKernel(nn.Module):
    r"""The weight (out, in/groups, k, k) of an orthogonal convolution, from exact maps.

    Factors (each an ``orthogonalize``d parameter with leading batch dimensions,
    so ``method="riemannian"`` works too: every factor is stored tall):
    ``isometry`` (g, c, m), ``projectors`` (g, 2(k' − 1), c, ⌊c/2⌋) and
    ``reshaped`` (g, max(out, inter·s²), min(…)), as ``kernel_plan`` says.
    Calling the module assembles the kernel (module docstring); without
    gradients (evaluation) it is cached until a factor changes (a parameter or
    buffer replaced, modified in place or given new memory by ``.data = …``:
    Note [What the kernel cache is keyed on]).

    Args:
        in_channels: input channels of the convolution.
        out_channels: its output channels.
        kernel_size: k.
        stride: s.
        groups: independent channel groups.
        method: the map of every factor.
        options: ``init`` ("haar" by default, "identity", "random"),
            ``generator`` and the map's own options.
        dtype: of the factors.
        device: of the factors.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        groups: int,
        method: Any,
        options: dict[str, Any],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.groups, self.kernel_size = groups, kernel_size
        self.plan = kernel_plan(in_channels, out_channels, kernel_size, stride, groups)
        self.weight_shape = (out_channels, in_channels // groups, kernel_size, kernel_size)
        self.init = options.get("init", "haar")
        opts = dict(options, init=self.init)
        g = groups
        bcop, reshaped = self.plan["bcop"], self.plan["reshaped"]
        self.wide = False  # whether R (out × inter·s²) is stored transposed
        if bcop is not None:
            c, m, size = bcop
            self._factor("isometry", (g, c, m), method, opts, dtype, device)
            if size > 1:
                self._factor(
                    "projectors", (g, 2 * (size - 1), c, c // 2), method, opts, dtype, device
                )
        if reshaped is not None:
            co, cr, r = reshaped
            rows, cols = co, cr * r * r
            self.wide = rows < cols
            shape = (g, max(rows, cols), min(rows, cols))
            self._factor("reshaped", shape, method, opts, dtype, device)
        self._cache: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self.stiefel_finish_init(None)

    @torch.no_grad()
    def stiefel_finish_init(self, init: str | None) -> None:
        r"""With ``init="identity"``: the projector steps that put every channel at the centre tap.

        Called after every factor was written (Note [A module finishes the point of its
        factors]): by `stiefel.parametrizations.initialize` with its ``init``, by
        ``reset_parameters`` and at construction with None (the kernel's own ``init``).

        Note [The identity convolution from projector steps]
        Every factor at its identity point (V = the first ⌊c/2⌋ columns of I) makes P
        the same projector at every step: the first half of the channels is never
        delayed, the second half by one tap per step, and the layer shifts half its
        channels by k − 1 against the other half. With P on the first half at even
        steps and on the second half (V = the last c/2 columns) at odd ones, each
        channel is delayed at half of the k − 1 steps of an axis: for odd k and an
        even c every channel sits at the centre tap (k − 1)/2, the kernel is the
        isometry there and zero elsewhere (Xiao et al. 2018's delta-orthogonal
        kernel, with H at its identity point): for in = out and stride 1, the
        identity convolution. For even k or odd c no composition of rank-⌊c/2⌋ steps
        delays every channel equally; the factors are left at their identity points.
        """
        bcop = self.plan["bcop"]
        init = self.init if init is None else init
        if init != "identity" or bcop is None or bcop[2] % 2 == 0 or bcop[0] % 2:
            return
        c, steps = bcop[0], bcop[2] - 1
        if steps == 0 or self.projectors.device.type == "meta":  # to_empty, then reset
            return
        eye = torch.eye(c, dtype=self.projectors.dtype, device=self.projectors.device)
        top, bottom = eye[:, : c // 2], eye[:, c // 2 :]
        points = torch.stack([top if (j // 2) % 2 == 0 else bottom for j in range(2 * steps)])
        points = points.expand(self.groups, *points.shape).clone()
        if "projectors" in getattr(self, "parametrizations", {}):
            self.projectors = points  # through the map's right inverse
        else:  # method="riemannian": the parameter is the point
            self.projectors.copy_(points)

    def _factor(self, name: str, shape, method, options, dtype, device) -> None:
        """Register ``name`` as a constrained (…, n, m) factor: the one call to the map API."""
        self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        orthogonalize(self, name, method, **options)

    def _inputs(self) -> list[torch.Tensor] | None:
        r"""The tensors the kernel is computed from, its parameters and buffers (None: no cache).

        Note [What the kernel cache is keyed on]
        A tensor's ``_version`` counts the in-place changes made through it, but
        not those made through ``param.data`` (``p.data.add_``: an EMA, SWA, a
        hand-written optimizer), and ``param.data = t`` (``vector_to_parameters``,
        some checkpoint loaders) swaps its memory and keeps the counter: neither
        the version nor the address says that the values changed. So the cache
        keeps a copy of every parameter and buffer and compares values (with
        shape, dtype and device): one pass over the factors, far smaller than the
        products that assemble the kernel, and one host read per tensor and
        cached forward. Tensors whose memory has no address (meta, tensor
        subclasses such as DTensor) are not cached, nor is a forward that may not
        read a value (traced by ``torch.compile``, captured in a CUDA graph).
        """
        tensors = [*self.parameters(), *self.buffers()]
        if any(t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter)
               for t in tensors):  # fmt: skip
            return None
        return tensors

    def forward(self) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiled program is the construction: no cache
            return self._assemble()
        if torch.is_grad_enabled():
            self._cache = None
            return self._assemble()
        tensors = self._inputs() if host_reads_allowed() else None
        if tensors is not None and self._cache is not None:
            held, kernel = self._cache
            if _same_values(tensors, held):
                return kernel
        kernel = self._assemble()
        self._cache = None if tensors is None else ([t.detach().clone() for t in tensors], kernel)
        return kernel

    def _assemble(self) -> torch.Tensor:
        # factors in float32 or wider (Note [Maps compute in float32 or wider]); the kernel is
        # rounded to the factors' dtype once, at the end
        g = self.groups
        bcop, reshaped = self.plan["bcop"], self.plan["reshaped"]
        first = self.isometry if bcop is not None else self.reshaped
        dtype = first.dtype
        work = work_dtype(dtype)
        kernel = None
        if bcop is not None:
            kernel = self.isometry.to(work)[..., None, None]  # (g, c, m, 1, 1)
            if bcop[2] > 1:
                vs = self.projectors.to(work)
                for j in range(bcop[2] - 1):
                    kernel = projector_step(kernel, vs[:, 2 * j], -1)
                    kernel = projector_step(kernel, vs[:, 2 * j + 1], -2)
            if self.plan["transpose"]:
                kernel = kernel.transpose(1, 2)
        if reshaped is not None:
            co, cr, r = reshaped
            q = self.reshaped.to(work)
            rk = (q.mT if self.wide else q).reshape(g, co, cr, r, r)
            kernel = rk if kernel is None else compose_kernels(kernel, rk)
        return kernel.reshape(self.weight_shape).to(dtype)

    def extra_repr(self) -> str:
        plan = ", ".join(f"{k}={v}" for k, v in self.plan.items())
        return f"weight_shape={self.weight_shape}, {plan}"


def _same_values(tensors: list[torch.Tensor], held: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` hold the values of the copies ``held`` (Note [What the kernel ...])."""
    return len(tensors) == len(held) and all(
        t.shape == h.shape and t.dtype == h.dtype and t.device == h.device and torch.equal(t, h)
        for t, h in zip(tensors, held, strict=True)
    )

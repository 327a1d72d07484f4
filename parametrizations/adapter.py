r"""`Rotation`: the learned Q of a rotated module, k factors of b orthogonal blocks.

Q = F_{k−1}⋯F_0, each factor block-diagonal with b orthogonal s×s blocks
(one factor: OFT), the factors butterfly-permuted (BOFT), each factor's
blocks one map made by `build` (reflections: HRA). A `Rotation` starts
at Q = I (Note [Paired start] for the reflection maps), applies Q to features
without forming it (`Rotation.operator`) and forms it for `merge`
(`Rotation.matrix`). `rotate` in `stiefel.parametrizations.finetuning` puts one
on a module.

Note [Butterfly factors as index gathers]
BOFT's Q = F_{k−1}⋯F_0 with F_i = P_i·diag(B_i1, …, B_ib)·P_iᵀ, P_i the
butterfly permutation of level i (chunks of s/2 features inside groups of
s·2^i, evens then odds; level 0 is the identity). Rows x ↦ x F_iᵀ are
x[…, π_i⁻¹] (x P_i), b independent s×s products, then […, π_i] (· P_iᵀ):
two gathers, O(n) each, never an n×n permutation matrix.

Note [Only the free values of a skew block are stored]
The ``exp``, ``cayley`` and ``scaled_cayley`` maps read only the strict upper
triangle of their (s, s) original (and, complex, the imaginary part of its
diagonal): A = X₊ − X₊ᴴ (`kernels.skew_from_raw`). A `Rotation` built with
``free=True`` stores just those values, s(s−1)/2 per real block (PEFT's OFT
stores as many for the same Q; s(s+1)/2 per complex block, the diagonal's
real part unused), and scatters them into a zero (s, s) original before the
map runs. The map, its checks and its gradient are unchanged; the entries
it never read are no longer parameters (nor trained, nor decayed, nor saved).
`full_original` converts a stored full original (an older checkpoint) into
the free values, exactly: the entries dropped are those the map ignores.

Note [Q keeps its precision]
Q is computed in float32, or in W's dtype when that is float64 or complex
(`q_dtype`). Two standard recipes would lower it silently or break it:
``torch.autocast(dtype=bfloat16)`` runs the map's products in bfloat16 (max
|QᵀQ − I| about 3e-3 where float32 gives 1e-6), and a cast of the whole model
after `rotate` or ``get_peft_model`` (``model.to(torch.bfloat16)``, ``.half()``,
``.double()``) casts Q's tensors while the rotation computes in the dtype it was
built with (a dtype mismatch at the next forward). So Q's operator
runs with autocast off (`Rotation.along`, Note [Autocast off for the maps' own
products]), and a cast of a `Rotation` (``Module._apply``, whoever holds it)
applies the rule of `q_dtype` to its tensors: float64 is taken, anything
narrower leaves Q in float32 (only the device follows); a cast to complex keeps
a real Q real (a real Q maps both parts of complex features), and a complex Q
stays complex, each at the precision the cast asks for by the same rule (a cast to
float64 makes a complex64 Q complex128; one to complex128 a float32 Q float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._core import checks as _checks
from .._core.autocast import autocast_off
from .base import OrthogonalMap
from .dense import Cayley, Exp, ScaledCayley
from .factory import build, resolve
from .point import ManifoldPoint
from .reflections import _Reflections

__all__ = ["Rotation", "butterfly_permutation", "blockwise"]


def butterfly_permutation(n: int, block: int, level: int) -> torch.Tensor:
    """π of the level-``level`` butterfly on n features for blocks of size ``block``.

    P[k, π[k]] = 1 is BOFT's permutation matrix: inside each group of
    ``block·2^level`` features, the chunks of ``block/2`` are reordered evens
    first, then odds (Note [Butterfly factors as index gathers]).
    """
    if level == 0:
        return torch.arange(n)
    group, chunk = block * 2**level, block // 2
    chunks = torch.arange(group).view(group // chunk, chunk)
    order = torch.cat([chunks[0::2], chunks[1::2]]).reshape(-1)
    return (torch.arange(0, n, group).unsqueeze(1) + order).reshape(-1)


def blockwise(x: torch.Tensor, blocks: int, fn: Callable[[torch.Tensor], torch.Tensor]):
    """Apply ``fn`` to the feature blocks of x (…, b·s) laid out as one batch (b, N, s)."""
    if x.numel() == 0:  # an empty batch (0 tokens, an idle expert) is its own image
        return x.clone()
    lead = x.shape[:-1]
    z = x.reshape(-1, blocks, x.shape[-1] // blocks).transpose(0, 1)
    return fn(z).transpose(0, 1).reshape(*lead, -1)


def q_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype Q is computed in for a weight of ``dtype``: float32 at least, float64 and
    complex as they are (Note [Q keeps its precision])."""
    if dtype in (torch.float64, torch.complex128):
        return dtype
    return torch.complex64 if dtype.is_complex else torch.float32


def _keeping_precision(fn: Any, tensors: set[int]) -> Any:
    """``fn`` of ``Module._apply``, the tensors of ``tensors`` cast by the rule of `q_dtype`.

    Note [Q keeps its precision]: a cast to a narrower dtype moves the tensor (the
    device of ``fn``'s result) in the dtype `q_dtype` gives (float32 at least).
    """

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if id(t) not in tensors or out.dtype == t.dtype:
            return out
        if not (out.is_floating_point() or out.is_complex()):
            return out
        kind = out.dtype
        if out.is_complex() != t.is_complex():  # Q keeps its kind at the cast's precision
            kind = kind.to_complex() if t.is_complex() else kind.to_real()
        want = q_dtype(kind)
        return out if want == out.dtype else t.to(device=out.device, dtype=want)

    return apply


class Rotation(nn.Module):
    r"""The learned Q of a rotated module: k factors, each b orthogonal s×s blocks.

    Q = F_{k−1}⋯F_0 (Note [Butterfly factors as index gathers]); with
    ``butterfly=0`` one block-diagonal factor. Each factor's blocks are one
    map made by `build` (shape (b, s, s), or (s, s) for one block) with its
    free parameter in ``originals``; for ``"riemannian"`` the map is the
    identity `ManifoldPoint` and the original is the blocks themselves, a
    ``geoopt.ManifoldParameter`` on O(s)/U(s). ``reset_parameters()`` puts Q
    back to the identity (torch's deferred-initialisation recipe, Note
    [Deferred initialisation by reset_parameters]).
    """

    def __init__(
        self,
        features: int,
        method: Any,
        blocks: int,
        butterfly: int,
        dtype: torch.dtype,
        device: torch.device | None,
        options: dict[str, Any],
        free: bool = False,
    ):
        super().__init__()
        _checks.flag("free", free)
        self.features, self.blocks, self.butterfly = features, blocks, butterfly
        self.method, self.dtype = resolve(method)[0], dtype
        size = features // blocks
        shape = (size, size) if blocks == 1 else (blocks, size, size)
        factors = max(butterfly, 1)
        self.maps = nn.ModuleList()
        self.originals = nn.ParameterList()
        for _ in range(factors):
            fmap = build(method, shape, dtype, device, options)
            fmap.label = "a rotation factor"
            self.maps.append(fmap)
        #: the originals hold only the free values of skew blocks (Note [Only the free
        #: values of a skew block are stored])
        self.free = free and isinstance(self.maps[0], SKEW_MAPS)
        for fmap in self.maps:
            self.originals.append(nn.Parameter(self._identity(fmap, device)))
            if isinstance(fmap, ManifoldPoint):  # riemannian: the blocks are the parameter
                fmap.claim(self.originals[-1])
        for level in range(factors if butterfly else 0):
            perm = butterfly_permutation(features, size, level)
            self.register_buffer(f"perm{level}", perm.to(device), persistent=False)
            self.register_buffer(f"inv{level}", torch.argsort(perm).to(device), persistent=False)

    def _identity(self, fmap: OrthogonalMap, device) -> torch.Tensor:
        """The map's original of Q = I (its buffers reset with it), free values if ``free``."""
        eye = torch.eye(fmap.n, dtype=self.dtype).expand(fmap.weight_shape).clone()
        meta = device is not None and torch.device(device).type == "meta"
        with torch.no_grad():
            if meta:
                x = fmap.initial(eye.to("meta"), "identity", None)
            elif isinstance(fmap, _Reflections) and not self.dtype.is_complex:
                x = _paired_reflections(fmap, self.dtype).to(device)
            else:
                x = fmap.inverse(eye.to(device)).to(dtype=self.dtype, device=device).clone()
        return self.free_values(x) if self.free else x

    def _triangle(self, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and columns of an (s, s) block's stored entries (complex: the diagonal too)."""
        offset = 0 if self.dtype.is_complex else 1
        return tuple(torch.triu_indices(size, size, offset, device=device))  # type: ignore[return-value]

    def free_values(self, full: torch.Tensor) -> torch.Tensor:
        """The stored values (…, P) of full originals (…, s, s): their strict upper triangle.

        Note [Only the free values of a skew block are stored]; the inverse of `full_original`.
        """
        rows, cols = self._triangle(full.shape[-1], full.device)
        return full[..., rows, cols]

    def full_original(self, values: torch.Tensor) -> torch.Tensor:
        """The (…, s, s) original the map reads: zero off the stored triangle (differentiable)."""
        size = self.features // self.blocks
        rows, cols = self._triangle(size, values.device)
        full = values.new_zeros(*values.shape[:-1], size, size)
        return _scatter(full, rows, cols, values)

    def _original(self, i: int) -> torch.Tensor:
        """The i-th factor's original as its map reads it."""
        original = self.originals[i]
        return self.full_original(original) if self.free else original

    def _apply(self, fn: Any, recurse: bool = True) -> Rotation:
        """``Module._apply`` (``.to``, ``.half()``, ``.double()``, …), Q keeping its precision.

        Note [Q keeps its precision].
        """
        tensors = {id(t) for t in self.parameters()} | {id(t) for t in self.buffers()}
        tensors |= {id(p.grad) for p in self.parameters() if p.grad is not None}
        super()._apply(_keeping_precision(fn, tensors), recurse)
        # Q's dtype is its originals' (a map's own parameters may be real beside complex
        # originals: the phases of a complex reflection map)
        self.dtype = self.originals[0].dtype
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Q = I again: every factor's original (and map buffers) of the identity."""
        for fmap, original in zip(self.maps, self.originals, strict=True):
            if original.device.type != "meta":
                original.copy_(self._identity(fmap, original.device))
                if isinstance(fmap, ManifoldPoint):  # to_empty rebuilt a plain Parameter
                    fmap.claim(original)

    def _blocks(self, i: int) -> torch.Tensor:
        q = self.maps[i](self._original(i))  # square blocks: the map's output is Q's blocks
        return q if self.blocks > 1 else q.unsqueeze(0)

    def operator(self) -> Callable[[torch.Tensor], torch.Tensor]:
        r"""x ↦ ``F.linear(x, Q)`` = x Qᵀ for x of shape (…, features), Q never formed.

        The maps' per-weight work (e.g. CWY's U and S) is done here, once per call.
        """
        ops = []
        for i in range(max(self.butterfly, 1)):
            fmap, original = self.maps[i], self._original(i)
            fmap.verify(original)  # Note [Free parameters are checked at first use]
            ops.append(fmap.prepare_operator(original))

        def apply(x: torch.Tensor) -> torch.Tensor:
            for i, op in enumerate(ops):
                if self.butterfly:
                    x = x[..., getattr(self, f"inv{i}")]
                x = blockwise(x, self.blocks, op)
                if self.butterfly:
                    x = x[..., getattr(self, f"perm{i}")]
            return x

        return apply

    def along(self, x: torch.Tensor, axis: int = -1) -> torch.Tensor:
        r"""x with its features (dimension ``axis``) mapped by Q (x ↦ Qx), in x's dtype.

        Q is applied in its own dtype with autocast off (Note [Autocast off for the
        maps' own products]). A complex x and a real Q (a model cast to complex) map
        the real and the imaginary part alike: Q(a + ib) = Qa + iQb.
        """
        if x.numel() == 0:  # an idle expert's batch: Q's parameters get zero gradients, as
            zero = sum(p.sum() for p in self.parameters()) * 0  # a product would give them
            return x + (zero.real if zero.is_complex() else zero).to(x.dtype)
        with autocast_off(x):
            op = self.operator()
            z = x if axis == -1 else x.movedim(axis, -1)
            if z.is_complex() and not self.dtype.is_complex:
                parts = torch.view_as_real(z).movedim(-1, 0)
                parts = op(parts.to(self.dtype)).to(parts.dtype).movedim(0, -1)
                z = torch.view_as_complex(parts.contiguous())
            else:
                z = op(z.to(self.dtype)).to(x.dtype)
        return z if axis == -1 else z.movedim(-1, axis)

    def matrix(self) -> torch.Tensor:
        """The dense Q (features × features): for inspection and `merge`.

        In Q's dtype with autocast off (Note [Autocast off for the maps' own products]):
        the product of butterfly factors ran in bfloat16 inside a region.
        """
        q = None
        with autocast_off(self.originals[0]):
            for i in range(max(self.butterfly, 1)):
                f = torch.block_diag(*self._blocks(i).unbind(0))
                if self.butterfly:
                    perm = getattr(self, f"perm{i}")
                    f = f[perm][:, perm]
                q = f if q is None else f @ q
        assert q is not None
        return q

    def extra_repr(self) -> str:
        return (
            f"method={self.method!r}, features={self.features}, blocks={self.blocks}, "
            f"butterfly={self.butterfly}, dtype={self.dtype}" + (", free" if self.free else "")
        )


def _paired_reflections(fmap: _Reflections, dtype: torch.dtype) -> torch.Tensor:
    r"""V = [(e₁), u₁, u₁, u₂, u₂, …] and d = 1 (d₁ = −1 for odd L): Q = I (Note [Paired start]).

    Note [Paired start]
    H(u)H(u) = I for every u ≠ 0, so pairs of equal vectors give Q = I while
    each pair's derivative is not degenerate: moving its two vectors apart
    rotates in the plane they span, by twice the angle between them (PEFT's
    HRA start). For odd L the first reflection is H(e₁), undone by d₁ = −1.
    The vectors are drawn as PEFT draws them, uniform in ±1/√(L/2) (PEFT's
    ``kaiming_uniform_(a=√5)`` of its (n, L/2) tensor), from torch's global
    generator on the CPU: the same start, hence the same training, as
    ``HRAConfig(r=L)`` at the same seed and lr. The scale is not
    incidental: Q depends on V only through the directions v/‖v‖, so an
    update δ moves a direction by about ‖δ‖/‖v‖, and Adam's steps (about lr
    per entry, whatever the scale of v) turn each pair by about lr·√n/‖v‖.
    Here ‖v‖ ≈ √(n/(1.5·L)), so a step turns by about lr·√(1.5·L), the
    same for every n; a start 3.5× longer (unit-variance vectors, ‖v‖ ≈ √n,
    the map's own padding) trains as with a 3.5× smaller lr.
    """
    batch, n, L = fmap.batch, fmap.n, fmap.reflections
    v = torch.zeros(*batch, n, L, dtype=dtype)
    d = torch.ones(*batch, fmap.m, dtype=dtype)
    half = L // 2
    if half:
        bound = 1.0 / math.sqrt(half)
        u = torch.empty(*batch, n, half, dtype=dtype).uniform_(-bound, bound)
        v[..., L % 2 :] = u.repeat_interleave(2, dim=-1)
    if L % 2:
        v[..., 0, 0] = 1.0
        d[..., 0] = -1.0
    fmap.set_diagonal(d)
    return v


#: maps whose original's free part is a triangle (Note [Only the free values of a skew
#: block are stored])
SKEW_MAPS = (Exp, Cayley, ScaledCayley)


def _scatter(
    full: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """``full`` with ``values`` at [..., rows, cols] (out of place: the gradient reaches values)."""
    flat = full.flatten(-2)
    index = (rows * full.shape[-1] + cols).expand(*values.shape[:-1], -1)
    return flat.scatter(-1, index, values).view(full.shape)

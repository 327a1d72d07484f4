r"""Skew-Hermitian matrices from raw parameters, and back.

A = X₊ − X₊ᴴ (+ i·Im diag X if complex) from the strict upper triangle X₊ of a
raw square X, with its dispatcher (`skew_from_raw_path`: the formula, or the CPU's
copy by panels for large n), and the right inverse `raw_from_skew`. Plain
functions of plain tensors; the public face is `stiefel.parametrizations.kernels`.
"""

from __future__ import annotations

import torch

from .._core.dispatch import dispatcher

__all__ = ["PANELS_FROM", "skew_from_raw_path", "skew_from_raw", "raw_from_skew"]

# --------------------------------------------------------------------------- skew matrices
_PANEL = 128  # columns of the lower triangle written at a time by `_skew`
#: the order from which `skew_from_raw` writes by panels on the CPU
PANELS_FROM = 1024


@dispatcher(
    "skew_from_raw",
    paths=("formula", "panels"),
    why="panels: the CPU from n = PANELS_FROM, where the formula's transposed read "
    "walks across cache lines (Note [Skew part by copies])",
)
def skew_from_raw_path(x: torch.Tensor) -> str:
    """``"panels"`` (`_SkewFromRaw`) on the CPU for n ≥ `PANELS_FROM`, else ``"formula"``.

    Traced by ``torch.compile``, the formula (Inductor writes its own loops, and
    Dynamo does not trace a Function with a ``jvp``); off the CPU too: the panels are
    a CPU cache's matter, and on a GPU the loop is four kernel launches per panel
    where the formula takes two in all.
    """
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return "formula"
    return "panels" if x.shape[-1] >= PANELS_FROM else "formula"


def _skew(x: torch.Tensor) -> torch.Tensor:
    """X ↦ X₊ − X₊ᴴ (+ i·Im diag X), transposed by panels (Note [Skew part by copies])."""
    a = torch.triu(x, 1)
    n = a.shape[-1]
    for j0 in range(0, n, _PANEL):
        j1 = min(j0 + _PANEL, n)
        a[..., j1:, j0:j1].copy_(a[..., j0:j1, j1:].mH).neg_()
        block = a[..., j0:j1, j0:j1]
        block.sub_(block.mH.contiguous())
    if x.is_complex():
        a.diagonal(dim1=-2, dim2=-1).copy_(1j * x.diagonal(dim1=-2, dim2=-1).imag)
    return a


def _skew_adjoint(g: torch.Tensor) -> torch.Tensor:
    """G ↦ triu(G − Gᴴ, 1) (+ i·Im diag G): the adjoint of `_skew` under Re tr(XᴴY)."""
    x = torch.triu(g.sub(g.mH.contiguous()), 1)
    if g.is_complex():
        x.diagonal(dim1=-2, dim2=-1).copy_(1j * g.diagonal(dim1=-2, dim2=-1).imag)
    return x


class _SkewFromRaw(torch.autograd.Function):
    r"""`skew_from_raw` with its adjoint written out (Note [Skew part by copies]).

    Note [Skew part by copies]
    X₊ − X₊ᴴ read as an elementwise op on a transposed view walks one operand
    across rows, a cache line per element, once the matrix no longer fits in the
    cache. The forward writes the lower triangle one panel of `_PANEL` columns at a
    time, from the transpose of a row panel that fits in cache; the backward makes
    one blocked copy of Gᴴ (``.contiguous()``), after which every pass runs along
    memory. Autograd would form the gradient the strided way (G + (−G)ᴴ accumulated
    into one tensor), so the backward is the adjoint written the same way:
    ⟨G, X₊ − X₊ᴴ⟩ = ⟨G − Gᴴ, X₊⟩ gives triu(G − Gᴴ, 1), and the diagonal i·Im xⱼⱼ
    (complex) has adjoint i·Im gⱼⱼ. The map is linear, so its tangent (forward mode)
    is the map itself. Below `PANELS_FROM` the matrix is cache-sized and the panels'
    extra passes cost more than they save, so the formula stays there.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _skew(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _skew_adjoint(g)

    @staticmethod
    def jvp(ctx, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _skew(t)


def skew_from_raw(x: torch.Tensor) -> torch.Tensor:
    r"""The skew-Hermitian A = X₊ − X₊ᴴ (+ i·Im diag X if complex), X₊ the strict upper triangle.

    Only the strict upper triangle (and, for complex X, the imaginary part of
    the diagonal) is read, so A has exactly dim 𝔬(n) or 𝔲(n) free parameters.
    The path is `skew_from_raw_path`'s: the formula, or by panels (Note [Skew part
    by copies]); the same values.
    """
    if skew_from_raw_path(x) == "panels":
        return _SkewFromRaw.apply(x)
    a = torch.triu(x, 1)
    a = a - a.mH
    if x.is_complex():
        a = a + torch.diag_embed(1j * torch.diagonal(x, dim1=-2, dim2=-1).imag)
    return a


def raw_from_skew(a: torch.Tensor) -> torch.Tensor:
    """Right inverse of `skew_from_raw`: the upper triangle of A, imaginary diagonal."""
    x = torch.triu(a, 1)
    if a.is_complex():
        x = x + torch.diag_embed(1j * torch.diagonal(a, dim1=-2, dim2=-1).imag)
    return x

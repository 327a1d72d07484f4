r"""The Householder product H(v₁)⋯H(v_L)·X as an autograd Function with an O(nL) backward.

H(v) = I − 2vvᴴ/‖v‖² is the reflection through the hyperplane orthogonal to v.
The forward pass applies the reflections one block after another; the backward
pass implements Algorithm 1 of Mhammedi et al. (2017), "Efficient orthogonal
parametrisation of recurrent neural networks using Householder reflections",
by blocks, recomputing every intermediate from the output instead of storing
the n×L intermediates.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["householder_apply", "wy_triangle"]

DEFAULT_BLOCK = 64


def wy_triangle(v: torch.Tensor) -> torch.Tensor:
    r"""T = striu(VᴴV) + ½ diag(VᴴV), so that H(v₁)⋯H(v_b) = I − V T⁻¹ Vᴴ.

    Note [Compact WY with unnormalised vectors]
    This is Proposition 1 of the Householder paper (eq. 12–13): with the
    diagonal ½‖v_k‖² the columns of V need not be normalised. T is upper
    triangular with a positive real diagonal, so it is invertible whenever
    every v_k ≠ 0, and T + Tᴴ = VᴴV.
    """
    g = v.mH @ v
    diag = torch.diagonal(g, dim1=-2, dim2=-1).real
    return torch.triu(g, 1) + torch.diag_embed(0.5 * diag).to(g.dtype)


def _solve_t(t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(t, b, upper=True)


def _solve_th(t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(t.mH, b, upper=False)


def _blocks(length: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, length)) for i in range(0, length, block)]


class _HouseholderApply(torch.autograd.Function):
    r"""Y = H(v₁)⋯H(v_L) X for V = [v₁ … v_L] of shape (…, n, L) and X of shape (…, n, p).

    Note [Algorithm 1 by blocks, recomputed from the output]
    Each block Q_b = I − V_b T_b⁻¹ V_bᴴ of b consecutive reflections is applied
    as two thin products. Its inverse is Q_bᴴ, and more cheaply: with
    h̃ = T_b⁻¹ V_bᴴ X_in (the paper's h̃), V_bᴴ Y_out = (T_b − V_bᴴV_b) h̃ = −T_bᴴ h̃,
    so h̃ = −T_b⁻ᴴ V_bᴴ Y_out and X_in = Y_out + V_b h̃. The backward pass walks
    the blocks from the outermost one inwards, recovering each block's input from
    its output in O(n·b·p) and never storing the L intermediate matrices.
    For one block, with C̃ = T_b⁻ᴴ V_bᴴ G (G the gradient of the output),
    Theorem 2 of the paper, extended to complex V with Hermitian transposes, gives

        ∂L/∂V_b = V_b (P + Pᴴ) − G h̃ᴴ − X_in C̃ᴴ,  P = (C̃ h̃ᴴ) ∘ (striu(J) + ½I),
        ∂L/∂X_in = G − V_b C̃.

    With b = 1 these are exactly lines 8–14 of Algorithm 1 (h̃_k = 2/N_k u_kᵀh,
    C̃_k = 2/N_k u_kᵀg); blocks of b > 1 reflections do the same arithmetic with
    matrix-matrix products. The cost is O(n·L·p) time and O(n·p + L·b) memory.
    """

    # torch.func (vmap, grad, jacrev) needs forward without ctx and setup_context;
    # the forward and backward are batched tensor code, so vmap's rule is generated.
    generate_vmap_rule = True

    @staticmethod
    def forward(v: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:  # type: ignore[override]
        y = x
        for i, j in reversed(_blocks(v.shape[-1], block)):
            vb = v[..., i:j]
            y = y - vb @ _solve_t(wy_triangle(vb), vb.mH @ y)
        return y

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        v, _, block = inputs
        ctx.block = block
        ctx.save_for_backward(v, output)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        v, y = ctx.saved_tensors
        need_v, need_x = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = []
        for i, j in _blocks(v.shape[-1], ctx.block):
            vb = v[..., i:j]
            t = wy_triangle(vb)
            h = -_solve_th(t, vb.mH @ y)  # h̃ = T⁻¹ Vᴴ X_in
            x_in = y + vb @ h
            c = _solve_th(t, vb.mH @ g)  # C̃ = T⁻ᴴ Vᴴ G
            if need_v:
                p = torch.triu(c @ h.mH, 1)
                p = p + 0.5 * torch.diag_embed(torch.diagonal(c @ h.mH, dim1=-2, dim2=-1))
                grads.append(vb @ (p + p.mH) - g @ h.mH - x_in @ c.mH)
            g = g - vb @ c
            y = x_in
        gv = torch.cat(grads, dim=-1) if need_v else None
        return gv, (g if need_x else None), None


def householder_apply(v: torch.Tensor, x: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    r"""H(v₁)⋯H(v_L)·X without forming the n×n product, in O(n·L·p).

    ``v`` has shape (…, n, L) (the columns are the reflection vectors, not
    necessarily normalised, all non-zero), ``x`` has shape (…, n, p); leading
    dimensions broadcast. The backward pass is the paper's Algorithm 1 by
    blocks of ``block`` reflections (see Note [Algorithm 1 by blocks,
    recomputed from the output]).

    Example:
        ```python
        import torch
        from stiefel.parametrizations._householder import householder_apply

        v = torch.randn(5, 3, dtype=torch.float64)
        x = torch.randn(5, 2, dtype=torch.float64)
        h = lambda u: torch.eye(5, dtype=u.dtype) - 2 * torch.outer(u, u) / (u @ u)
        ref = h(v[:, 0]) @ h(v[:, 1]) @ h(v[:, 2]) @ x
        assert torch.allclose(householder_apply(v, x), ref)
        ```
    """
    batch = torch.broadcast_shapes(v.shape[:-2], x.shape[:-2])
    # Note [Reflection vectors scaled by their max-abs]
    # H(v) = H(v/c) for every c > 0, so dividing each v_k by c_k = max_i |v_ik| changes
    # nothing but keeps ‖v_k‖² in [1, n]: at entries ~1e20 it would overflow float32
    # (NaN output). c is detached: the gradient of a scale-invariant f satisfies
    # ∇f(v) = ∇f(v/c)/c exactly (∇f(u)ᴴu = 0), which is what autograd then returns.
    scale = v.detach().abs().amax(dim=-2, keepdim=True)
    v = v / torch.where(scale > 0, scale, torch.ones_like(scale))
    v = v.expand(*batch, *v.shape[-2:])
    x = x.expand(*batch, *x.shape[-2:])
    return _HouseholderApply.apply(v, x, int(block))

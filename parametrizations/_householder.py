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

from .._core.autocast import backward_autocast_off
from .._core.first_order import first_order

__all__ = ["default_block", "householder_apply", "wy_triangle"]

MIN_BLOCK, MAX_BLOCK = 64, 256


def default_block(columns: int) -> int:
    r"""Reflections per block for an n×p right-hand side: p/2, clamped to [64, 256].

    Note [Block size]
    A block of b reflections does 4·n·b·p FLOPs of thin products (V_bᴴY, then
    Y − V_b h̃) and (2·n + p)·b² of overhead (its Gram V_bᴴV_b and the triangular
    solve): a share (2·n + p)·b/(4·n·p) of the useful work, growing linearly with
    b, about b/(2p) when p ≪ n and 3b/(4n) when p = n (3/4 at b = n, one compact
    WY block). Against it, the products read Y for V_bᴴY and read and write it in
    the update, 3·n·p values for 4·n·b·p FLOPs: b/3 FLOPs per byte in float32,
    and a product with one dimension b runs at the rate of a square one only
    once b is past the register and cache blocking of a GEMM, a few hundred.
    b = p/2 holds the overhead at (2·n + p)/(8·n), a quarter to three eighths;
    from p = 512 on the cap b = 256 makes the thin dimension of every product
    256, ≈ 85 FLOPs per byte in float32 (well above a CPU's or GPU's GEMM rate
    over its bandwidth), at an overhead of 3/16 on a square n = 1024.
    Below p = 128 the floor of 64 bounds the number of blocks (L/64), each a
    fixed number of kernel calls, where the products are bound by reading V.
    """
    return min(MAX_BLOCK, max(MIN_BLOCK, int(columns) // 2))


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
    # T⁻¹B = (Bᵀ T⁻ᵀ)ᵀ: the row-major B, read as the column-major Bᵀ, reaches LAPACK's
    # triangular solve without a transposed copy in and out
    return torch.linalg.solve_triangular(t.mT, b.mT, upper=False, left=False).mT


def _solve_th(t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # T⁻ᴴB = (Bᵀ T̄⁻¹)ᵀ, solved from the right as in `_solve_t`
    return torch.linalg.solve_triangular(t.conj(), b.mT, upper=True, left=False).mT


def _addmm(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float, new: bool):
    """Y + α·A B as one fused GEMM (β = 1) per matrix of the batch.

    ``new=False`` writes into Y (a contiguous buffer of ours); ``new=True`` returns a
    new tensor, for a Y that is an input, or unbatched under vmap while A, B are not.
    """
    if y.dim() == 2:
        return torch.addmm(y, a, b, alpha=alpha) if new else y.addmm_(a, b, alpha=alpha)
    shape = y.shape[:-2]
    a3 = a.expand(*shape, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*shape, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    if new:
        return torch.baddbmm(y.reshape(-1, *y.shape[-2:]), a3, b3, alpha=alpha).view(y.shape)
    y.view(-1, *y.shape[-2:]).baddbmm_(a3, b3, alpha=alpha)
    return y


def _blocks(length: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, length)) for i in range(0, length, block)]


class _HouseholderApply(torch.autograd.Function):
    r"""Y = H(v₁)⋯H(v_L) X for V = [v₁ … v_L] of shape (…, n, L) and X of shape (…, n, p).

    Note [Algorithm 1 by blocks, recomputed from the output]
    Each block Q_b = I − V_b T_b⁻¹ V_bᴴ of b consecutive reflections is applied
    as two thin products, Y = X_in − V_b h̃ with h̃ = T_b⁻¹ V_bᴴ X_in (the paper's
    h̃). The forward pass keeps every block's h̃ (L×p in all, no more than the
    n×p output) and T_b (L×b in all); the backward pass walks the blocks from
    the outermost one inwards, recovering each block's input from its output,
    X_in = Y + V_b h̃, in O(n·b·p), and never stores the L intermediate n×p
    matrices. For one block, with C̃ = T_b⁻ᴴ V_bᴴ G (G the gradient of the
    output), Theorem 2 of the paper, extended to complex V with Hermitian
    transposes, gives

        ∂L/∂V_b = V_b (P + Pᴴ) − G h̃ᴴ − X_in C̃ᴴ,  P = (C̃ h̃ᴴ) ∘ (striu(J) + ½I),
        ∂L/∂X_in = G − V_b C̃.

    With b = 1 these are exactly lines 8–14 of Algorithm 1 (h̃_k = 2/N_k u_kᵀh,
    C̃_k = 2/N_k u_kᵀg); blocks of b > 1 reflections do the same arithmetic with
    matrix-matrix products. With X_in = Y + V_b h̃ the first line reads
    V_b (P + Pᴴ − h̃ C̃ᴴ) − G h̃ᴴ − Y C̃ᴴ, so the gradient of a block needs its
    output Y, and X_in only as the next block's output. The cost is O(n·L·p)
    time and O(n·p + L·b) memory.

    Note [Householder FLOPs]
    A block of b reflections costs 2·n·b² for its Gram V_bᴴV_b (T_b), b²·p for
    a triangular solve with T_b and 2·n·b·p for each product of V_b or V_bᴴ
    with an n×p or b×p matrix. The forward pass does the Gram, one solve and
    two products, 4·n·b·p + (2·n + p)·b²: 4·n·L·p + (2·n + p)·Σ_k b_k² over the
    blocks. The backward pass takes T_b and h̃ from the forward pass and does
    one solve, five products (V_bᴴG, G − V_bC̃, Y + V_bh̃, Gh̃ᴴ, YC̃ᴴ), C̃h̃ᴴ
    (2·b²·p) and V_b(P + Pᴴ − h̃C̃ᴴ) (2·n·b²): 10·n·L·p + (3·p + 2·n)·Σ_k b_k²,
    less 4·n·b·p for the innermost block, whose two updates are needed only
    for ∂L/∂X. Without ∂L/∂X that is 1.6× the forward pass for one block at
    L = n = p, 2.2× for four, and tends to 2.5× with more: more than the 2× of
    a product's backward, because the output and the gradient are both swept
    back through every block instead of storing the intermediates.
    """

    # torch.func (vmap, grad, jacrev) needs forward without ctx and setup_context;
    # the forward and backward are batched tensor code, so vmap's rule is generated.
    generate_vmap_rule = True

    @staticmethod
    def forward(v: torch.Tensor, x: torch.Tensor, block: int):  # type: ignore[override]
        y, hs, ts = x, [], []
        for i, j in reversed(_blocks(v.shape[-1], block)):
            vb = v[..., i:j]
            t = wy_triangle(vb)
            h = _solve_t(t, vb.mH @ y)
            y = _addmm(y, vb, h, -1.0, new=y is x)  # Y = X_in − V_b h̃
            hs.append(h)
            ts.append(t)
        # h̃ and T_b of every block, innermost first, for the backward pass
        return (y, *hs[::-1], *ts[::-1])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        v, _, block = inputs
        ctx.block = block
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(v, *output)

    @staticmethod
    @first_order("the householder map (its backward by Algorithm 1)")
    @backward_autocast_off  # Note [Autocast off for the maps' own products]
    def backward(ctx, g: torch.Tensor | None, *_):  # type: ignore[override]
        if g is None:
            return None, None, None
        v, y, *saved = ctx.saved_tensors
        need_v, need_x = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        blocks = _blocks(v.shape[-1], ctx.block)
        hs, ts = saved[: len(blocks)], saved[len(blocks) :]
        y_in, g_in, grads = y, g, []
        for k, (i, j) in enumerate(blocks):
            vb, h = v[..., i:j], hs[k]
            c = _solve_th(ts[k], vb.mH @ g)  # C̃ = T⁻ᴴ Vᴴ G
            if need_v:
                w = c @ h.mH  # C̃ h̃ᴴ
                upper = torch.triu(w, 1)
                diag = torch.diagonal(w, dim1=-2, dim2=-1).real.to(w.dtype)
                gv = vb @ (upper + upper.mH + torch.diag_embed(diag) - w.mH)  # V(P + Pᴴ − h̃C̃ᴴ)
                _addmm(gv, g, h.mH, -1.0, new=False)  # − G h̃ᴴ
                _addmm(gv, y, c.mH, -1.0, new=False)  # − Y C̃ᴴ
                grads.append(gv)
            last = k + 1 == len(blocks)
            if need_v and not last:
                y = _addmm(y, vb, h, 1.0, new=y is y_in)  # X_in = Y + V_b h̃
            if need_x or not last:
                g = _addmm(g, vb, c, -1.0, new=g is g_in)  # ∂L/∂X_in = G − V_b C̃
        gv = torch.cat(grads, dim=-1) if need_v else None
        return gv, (g if need_x else None), None


def householder_apply(v: torch.Tensor, x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    r"""H(v₁)⋯H(v_L)·X without forming the n×n product, in O(n·L·p).

    ``v`` has shape (…, n, L) (the columns are the reflection vectors, not
    necessarily normalised, all non-zero), ``x`` has shape (…, n, p); leading
    dimensions broadcast. The backward pass is the paper's Algorithm 1 by
    blocks of ``block`` reflections (see Note [Algorithm 1 by blocks,
    recomputed from the output]), by default `default_block` (p) (Note
    [Block size]).

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
    block = default_block(x.shape[-1]) if block is None else int(block)
    return _HouseholderApply.apply(v, x, block)[0]

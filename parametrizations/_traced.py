r"""exp(A) and Cayley(A) of a skew-Hermitian A as one operator for ``torch.compile``.

Note [Skew maps under torch.compile]
The ``exp``, ``cayley`` and ``scaled_cayley`` kernels decide two things from
the values of A: whether ‖A‖₁ is large enough for the ``eigh`` path (Note
[Large skew-Hermitian matrices go through eigh]) and how many squarings the
Padé approximant needs (Note [Scaling and squaring with its Fréchet
derivative]). Traced by Dynamo, either read is a graph break, and the two
paths cannot both be computed at the cost of one. So a traced map calls
``stiefel::skew_map``, a custom operator (`torch.library.custom_op`) that
Dynamo and Inductor keep whole: inside it the eager kernel runs as it is, with
its one read of ‖A‖₁, on real values; its fake form gives the shape. Its
backward is a second operator that recomputes the forward and returns the
eager kernel's own gradient (the adjoint Fréchet derivative of the Padé path,
the Daleckii–Krein form of the ``eigh`` path), so the compiled forward and
backward equal the eager ones to rounding. The cost of the recomputation is
one forward more per backward, in a compiled graph only (an eager call keeps
the forward's intermediates). The LU Cayley transform needs no recomputation: its
adjoint G ↦ −2M⁻ᴴGM⁻ᴴ (M = I + A) is −½(Q + I)ᴴG(Q + I)ᴴ from the output Q,
two products. (Not on the ``eigh`` path: there the gradient is O(1/‖A‖²)
while the rounding of Q + I is O(eps), so the eigh path's own backward keeps
its relative accuracy.) Its outputs are the n×n matrix; the products by a
base or a block of columns stay in the traced graph, for Inductor to fuse.

Note [Conjugate views inside a compiled operator]
AOTAutograd's runtime (``aot_eager``, Inductor; torch 2.13) calls a custom
operator with the Conjugate and Negative dispatch keys excluded, so a lazy
conjugate view (``h.mH`` of a complex h) is read as the plain transpose:
h + hᴴ of i·A came out as zero, and ``eigh`` returned λ = 0. The operators run
their kernels with those two keys restored (`_views_resolved`), as in eager.

Example:
    ```python
    import torch
    from stiefel.parametrizations._traced import skew_map

    a = torch.randn(5, 5, dtype=torch.float64)
    a = a - a.mT
    assert torch.allclose(skew_map(a, "exp"), torch.linalg.matrix_exp(a))
    ```
"""

from __future__ import annotations

import torch

from ._spectral import spectral_needed

__all__ = ["skew_map"]


def _views_resolved():
    """Restore the Conjugate and Negative keys (Note [Conjugate views inside a ...])."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(keys.Conjugate)
    return torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(), exclude.remove(keys.Negative)
    )


def _eager(a: torch.Tensor, kind: str) -> torch.Tensor:
    """The eager kernel, by the path its dispatcher picks (``exp_map``, ``cayley_map``)."""
    from . import kernels  # the kernels module imports this one

    return kernels.eager_exp(a) if kind == "exp" else kernels.eager_cayley(a)


@torch.library.custom_op("stiefel::skew_map", mutates_args=())
def _skew_map(a: torch.Tensor, kind: str) -> torch.Tensor:
    with torch.no_grad(), _views_resolved():
        return _eager(a, kind).contiguous()


@_skew_map.register_fake
def _(a: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("stiefel::skew_map_backward", mutates_args=())
def _skew_map_backward(
    a: torch.Tensor, q: torch.Tensor, g: torch.Tensor, kind: str
) -> torch.Tensor:
    with _views_resolved():
        if kind == "cayley" and not spectral_needed(a):
            # Q = 2M⁻¹ − I, M = I + A: M⁻¹ = (Q + I)/2, and the adjoint G ↦ −2M⁻ᴴGM⁻ᴴ is
            # −½(Q + I)ᴴG(Q + I)ᴴ, two products from the output (nothing recomputed)
            eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
            p = (q + eye).mH
            return (-0.5 * (p @ g @ p)).contiguous()
        # inside an operator torch's own kernels record no autograd graph; the package's
        # autograd.Functions (Padé with its adjoint Fréchet derivative, eigh) do
        with torch.enable_grad():
            leaf = a.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(_eager(leaf, kind), leaf, g)
        return grad.contiguous()


@_skew_map_backward.register_fake
def _(a: torch.Tensor, q: torch.Tensor, g: torch.Tensor, kind: str) -> torch.Tensor:
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    a, kind = inputs
    ctx.kind = kind
    ctx.save_for_backward(a, output)


def _backward(ctx, g: torch.Tensor):
    a, q = ctx.saved_tensors
    return _skew_map_backward(a, q, g.contiguous(), ctx.kind), None


_skew_map.register_autograd(_backward, setup_context=_setup)


def skew_map(a: torch.Tensor, kind: str) -> torch.Tensor:
    r"""exp(A) (``kind="exp"``) or (I + A)⁻¹(I − A) (``kind="cayley"``) as one operator.

    The same numbers as the eager kernels (`stiefel.parametrizations.kernels`),
    with no graph break under ``torch.compile`` (Note [Skew maps under
    torch.compile]).

    Args:
        a: skew-Hermitian (…, n, n), real or complex.
        kind: ``"exp"`` or ``"cayley"``.

    Returns:
        The n×n unitary matrix, same shape and dtype as ``a``.
    """
    return _skew_map(a, kind)

r"""Backward passes written by hand, first order only: a second derivative through one raises.

Note [A second derivative through a first-order backward]
Some maps have a backward written by hand (the adjoint Fréchet derivative of exp,
Algorithm 1 of the Householder product, the unpivoted Cayley solve, the spectral
path of exp and Cayley): its value is the gradient, but it is computed from saved
intermediates marked non-differentiable, so autograd cannot differentiate it again.
torch's ``once_differentiable`` makes such a gradient depend on a node that raises
when reached, but that node's inputs are detached copies of the gradient: a second
derivative asked with ``torch.autograd.grad(..., inputs=θ)`` never reaches it and
finds θ unused, so ``allow_unused=True`` (as Hessian-vector-product and MAML code
passes) gives zeros, silently. Here the gradient is made to depend on the
tensors a second derivative really flows through (the incoming gradient and the
saved inputs that require grad), through a node whose backward raises, naming the
computation: a Hessian-vector product, a MAML inner step or a gradient penalty
through these maps is refused instead of zero.

Example:
```python
import torch
from stiefel.parametrizations._expm import expm

a = torch.randn(3, 3, dtype=torch.float64)
a = (a - a.mT).requires_grad_()
(g,) = torch.autograd.grad(expm(a).sin().sum(), a, create_graph=True)
try:
    torch.autograd.grad(g.square().sum(), a, allow_unused=True)
except RuntimeError as e:
    assert "second derivative" in str(e)
```
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["first_order"]


class _SecondOrderRefused(torch.autograd.Function):
    """The gradients as they are, tied to the tensors a second derivative flows through."""

    generate_vmap_rule = True

    @staticmethod
    def forward(what: str, count: int, *tensors: torch.Tensor):  # type: ignore[override]
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        ctx.what = inputs[0]

    @staticmethod
    def backward(ctx, *_):  # type: ignore[override]
        raise RuntimeError(
            f"a second derivative through {ctx.what} is not supported: its backward is "
            "written by hand and is first order only (Note [A second derivative through a "
            "first-order backward]); 'cwy' and 'tcwy' are differentiated twice, and so are "
            "'cayley' and 'scaled_cayley' below the sizes and norms that take these paths"
        )


def first_order(what: str) -> Callable:
    """Decorator for an ``autograd.Function``'s backward with no second derivative.

    As ``torch.autograd.function.once_differentiable``: the backward runs without
    recording a graph. When a graph is asked for (``create_graph=True``, torch.func's
    transforms) its gradients depend on the incoming gradients and the saved tensors
    that require grad through a node that raises if a second derivative reaches it
    (Note [A second derivative through a first-order backward]).

    Args:
        what: the computation, for the message (e.g. "the exp map's adjoint Fréchet
            backward").
    """

    def wrap(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def run(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            if not torch.is_grad_enabled():
                return out
            anchors = [
                t
                for t in (*grads, *ctx.saved_tensors)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if not anchors:
                return out
            outs = list(out) if isinstance(out, tuple) else [out]
            where = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
            tied = _SecondOrderRefused.apply(what, len(where), *(outs[i] for i in where), *anchors)
            for i, t in zip(where, tied, strict=True):
                outs[i] = t
            return tuple(outs) if isinstance(out, tuple) else outs[0]

        return run

    return wrap

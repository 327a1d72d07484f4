r"""Riemannian Adam (Bécigneul & Ganea 2019) with transported moments (``"radam"``).

Example::

    >>> import torch, geoopt
    >>> from stiefel.manifolds import Unitary
    >>> from stiefel import optimizers
    >>> u = Unitary(6)
    >>> w = geoopt.ManifoldParameter(u.random(dtype=torch.complex128), manifold=u)
    >>> opt = optimizers.create("radam", [w], lr=0.01)
    >>> opt.zero_grad(); w.real.sum().backward(); opt.step()
    >>> bool(u.orthogonality_error(w.detach()) < 1e-12)
    True
"""

from __future__ import annotations

import torch

from .base import RiemannianOptimizer, check_number
from .geometry import Geometry
from .registry import register

__all__ = ["RAdam"]


@register("radam")
class RAdam(RiemannianOptimizer):
    r"""Riemannian Adam; Adam on plain tensors.

    With ξ = rgrad(X, G) (the manifold's metric, e.g. Euclidean G − X sym(XᴴG)):

        m ← β₁·τ(m) + (1 − β₁)ξ,   v ← β₂v + (1 − β₂)⟨ξ, ξ⟩_X,
        X ← retr(X, −lr·m̂/(√v̂ + ε)),   m̂ = m/(1 − β₁ᵗ),  v̂ = v/(1 − β₂ᵗ),

    and m is transported to the new point (Cayley: the same orthogonal map,
    isometric, in the same 2M×2M solve; QR/polar: projection).

    Note [Adaptive term per manifold component]
    Bécigneul & Ganea keep one second moment per factor of a product of
    manifolds: ⟨ξ, ξ⟩_X is a scalar per matrix (per batch element), so the
    direction m̂/(√v̂ + ε) stays tangent. A plain tensor is the product of its
    one-dimensional entries, which gives exactly Adam's per-element v.

    Args:
        params: parameters or param groups.
        lr: step size (≥ 0).
        betas: (β₁, β₂), each in [0, 1).
        eps: ε > 0 added to √v̂.
        retraction: ``"cayley"``, ``"qr"`` or ``"polar"``.
        repair_every: re-project (polar) after every k-th step, or None.
        telemetry: record the orthogonality error per step (keyword-only).
    """

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        retraction: str = "cayley",
        repair_every: int | None = None,
        *,
        telemetry: bool = False,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, retraction=retraction, repair_every=repair_every
        )
        super().__init__(params, defaults, telemetry=telemetry)

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_number("betas[0]", betas[0], high=1.0)
        check_number("betas[1]", betas[1], high=1.0)
        if check_number("eps", group["eps"]) <= 0:
            raise ValueError(f"eps={group['eps']!r} is out of range; allowed: eps > 0")

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        b1, b2 = group["betas"]
        xi = geo.rgrad(x, grad)
        sq = geo.component_inner(x, xi)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(x)
            state["exp_avg_sq"] = torch.zeros_like(sq)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(xi, alpha=1 - b1)
        v.mul_(b2).add_(sq, alpha=1 - b2)
        t = state["step"].to(v.dtype)
        bias1 = 1 - b1**t
        bias2 = 1 - b2**t
        denom = (v.sqrt() / bias2.sqrt()).add_(group["eps"])
        new, state["exp_avg"] = geo.descend_transport(x, m, (group["lr"] / bias1) / denom)
        return new

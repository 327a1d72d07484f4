r"""Riemannian Adam (Bécigneul & Ganea 2019) with transported moments (`"radam"`).

Example:
    ```python
    import torch, geoopt
    from stiefel.manifolds import Unitary
    from stiefel import optimizers

    u = Unitary(6)
    w = geoopt.ManifoldParameter(u.random(dtype=torch.complex128), manifold=u)
    opt = optimizers.create("radam", [w], lr=optimizers.info("radam").default_lr)
    opt.zero_grad()
    w.real.sum().backward()
    opt.step()
    assert u.orthogonality_error(w.detach()) < 1e-12
    ```
"""

from __future__ import annotations

import math

import torch

from .base import RiemannianOptimizer, check_number
from .geometry import Geometry
from .registry import register

__all__ = ["RAdam"]


@register("radam")
class RAdam(RiemannianOptimizer):
    r"""Riemannian Adam; torch's Adam (L2 weight decay, amsgrad) on plain tensors.

    With G ← G + w·X (`weight_decay` w, on the Euclidean gradient, as in
    geoopt) and ξ = rgrad(X, G) (the manifold's metric, e.g. Euclidean
    G − X sym(XᴴG)):

        m ← β₁·τ(m) + (1 − β₁)ξ,   v ← β₂v + (1 − β₂)⟨ξ, ξ⟩_X,
        X ← retr(X, −lr·m̂/(√v̂ + ε)),   m̂ = m/(1 − β₁ᵗ),  v̂ = v/(1 − β₂ᵗ)

    (`amsgrad`: v̂ from the running maximum of v), and m is transported to the
    new point (Cayley: the same orthogonal map, isometric, in the same 2M×2M
    solve; QR/polar: projection). The options of geoopt's `RiemannianAdam`
    are accepted with its meaning: `amsgrad`, `weight_decay`, and `stabilize`
    as an alias of `repair_every`.

    Note [Adaptive term per manifold component]
    Bécigneul & Ganea keep one second moment per factor of a product of
    manifolds: ⟨ξ, ξ⟩_X is a scalar per matrix (per batch element), so the
    direction m̂/(√v̂ + ε) stays tangent. A plain tensor is the product of its
    one-dimensional entries, which gives exactly Adam's per-element v.

    Note [Step length of radam against Adam]
    With a steady gradient (ξ constant), m̂ = ξ and √v̂ = ‖ξ‖_F, so radam moves
    a matrix by lr·ξ/‖ξ‖_F: a step of length lr in the Frobenius norm,
    whatever the size of the matrix. Adam normalises each entry, m̂ᵢ/√v̂ᵢ = ±1,
    so it moves each of the s = N·M entries by lr: a step of length lr·√s.
    At the same lr, radam's step is 1/√s of Adam's (1/64 for a 64×64 matrix),
    which is why radam at Adam's usual lr = 1e-3 barely moves. A step of
    Frobenius length lr on St(N, M), whose points have norm √M, turns the
    columns by about lr radians; `default_lr` = 0.05 (a few degrees per step)
    is what the harness uses. To match an Adam learning rate a on an N×M
    matrix, use lr ≈ a·√(N·M).

    Args:
        params: parameters or param groups.
        lr: step size (≥ 0): the Frobenius length of a step with a steady gradient.
        betas: (β₁, β₂), each in [0, 1).
        eps: ε > 0 added to √v̂.
        retraction: `"cayley"`, `"qr"` or `"polar"`.
        repair_every: re-project (polar) after every k-th step, or None.
        weight_decay: w ≥ 0.
        amsgrad: use the running maximum of v.
        stabilize: geoopt's name for `repair_every` (give one of the two).
        telemetry: record the orthogonality error per step (keyword-only).

    Raises:
        ValueError: a hyper-parameter out of range (named, with its range).
        TypeError: a hyper-parameter of the wrong type.
    """

    default_lr = 0.05
    formula = "cayley: 16NM² + 6M³ (the fused step plus the moment's transport)"
    variants = ({"retraction": "cayley"},)

    @classmethod
    def step_flops(cls, n: int, m: int, retraction: str = "cayley", **hyper) -> float:
        """FLOPs of one step on St(n, m) (`"cayley"` only; NaN for the others).

        Args:
            n: rows N.
            m: columns M.
            retraction: the retraction.
            **hyper: other hyper-parameters (ignored).

        Returns:
            The FLOP count, NaN where there is no model.
        """
        return 16 * n * m * m + 6 * m**3 if retraction == "cayley" else math.nan

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        retraction: str = "cayley",
        repair_every: int | None = None,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        stabilize: int | None = None,
        *,
        telemetry: bool = False,
    ):
        if stabilize is not None:
            if repair_every is not None:
                raise ValueError(
                    f"stabilize={stabilize!r} and repair_every={repair_every!r} both given; "
                    "allowed: one of them (stabilize is geoopt's name for repair_every)"
                )
            repair_every = stabilize
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            retraction=retraction,
            repair_every=repair_every,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
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
        check_number("weight_decay", group["weight_decay"])
        if not isinstance(group["amsgrad"], bool):
            raise TypeError(f"amsgrad={group['amsgrad']!r} is not allowed; allowed: True, False")

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        b1, b2 = group["betas"]
        if group["weight_decay"]:
            grad = grad.add(x, alpha=group["weight_decay"])
        xi = geo.rgrad(x, grad)
        sq = geo.component_inner(x, xi)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(x)
            state["exp_avg_sq"] = torch.zeros_like(sq)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(xi, alpha=1 - b1)
        v.mul_(b2).add_(sq, alpha=1 - b2)
        if group["amsgrad"]:
            vmax = state.get("max_exp_avg_sq")
            vmax = v.clone() if vmax is None else torch.maximum(vmax, v, out=vmax)
            state["max_exp_avg_sq"] = v = vmax
        t = state["step"].to(v.dtype)
        bias1 = 1 - b1**t
        bias2 = 1 - b2**t
        denom = (v.sqrt() / bias2.sqrt()).add_(group["eps"])
        new, state["exp_avg"] = geo.descend_transport(x, m, (group["lr"] / bias1) / denom)
        return new

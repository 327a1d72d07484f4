r"""POGO, the proximal one-step geometric orthoptimizer (``"pogo"``).

Javaloy & Vergari (2026), "An embarrassingly simple way to optimize orthogonal
matrices at scale" (arXiv 2602.14656); reference implementation ``pogo-torch``.

Example:
```python
import torch, geoopt
from stiefel.manifolds import Stiefel
from stiefel import optimizers

st = Stiefel(64, 16)
w = geoopt.ManifoldParameter(torch.linalg.qr(torch.randn(256, 64, 16))[0], manifold=st)
opt = optimizers.create("pogo", [w], lr=0.05, base="adam")
for _ in range(10):
    opt.zero_grad()
    (w[..., :4, :] ** 2).sum().neg().backward()
    opt.step()
assert st.orthogonality_error(w.detach()).max() < 1e-4
```
"""

from __future__ import annotations

from typing import ClassVar

import geoopt
import torch

from ..manifolds import Stiefel as _OurStiefel
from ..manifolds.kernels import inner_euclidean
from ..manifolds.kernels.msign import pogo_step
from .base import RiemannianOptimizer, check_choice, check_number
from .geometry import Geometry, manifold_of
from .muon import check_positive_lr
from .registry import register

__all__ = ["POGO", "BASES"]

BASES = ("sgd", "adam")


@register("pogo")
class POGO(RiemannianOptimizer):
    r"""POGO on St(N, M), O(n), U(n): a relative-gradient step and one polar-like correction.

    With G̃ the base optimizer's update of the gradient G (+ weight_decay·X),

        ψ = ½(G̃(XᴴX) − XG̃ᴴX),   M = X − lr·ψ,   X ← M + λ(M − MMᴴM),

    (`stiefel.manifolds.kernels.msign.pogo_step`; pogo-torch's formula
    ½(XXᴴG̃ − XG̃ᴴX) on row-orthonormal matrices, transposed). No retraction: the
    point stays within O(lr²‖ψ‖²) of the manifold, the correction (one Newton–Schulz
    step for λ = ½) removing the first-order error at every step, so errors do not
    accumulate. Each step costs about 10NM² flops, all matrix products.

    Bases (G̃):

    - ``"sgd"``: momentum μ, dampening d, optional Nesterov, as pogo-torch's
      ``base.SGD`` (its first step sets B = (μ + 1 − d)·G: the buffer starts at G
      and is then updated once, unlike ``torch.optim.SGD``; followed so the two agree);
    - ``"adam"``: pogo-torch's ``base.VectorAdam``: Adam whose second moment is the
      squared Frobenius norm of each matrix, so G̃ is the first moment rescaled,
      never reshaped entry by entry (a rotation of G rotates G̃).

    Parameters on a manifold other than St/O/U (e.g. geoopt's Sphere) are refused
    at construction. Plain tensors get X ← X − lr·G̃ (VectorAdam normalising by the
    whole tensor's norm), the Euclidean form every optimizer here has.

    DTensor points (``Replicate()``, batch shards, ``Shard(0)`` on the rows of St(N, M))
    step on their local shards; a row-sharded step all-reduces XᴴX, G̃ᴴX, MᴴM (M×M)
    and VectorAdam's ‖G‖²_F, never the N×M point.

    Args:
        params: parameters or param groups.
        lr: step size (> 0).
        base: ``"adam"`` (default, VectorAdam) or ``"sgd"``.
        momentum: μ in [0, 1) (``"sgd"``).
        nesterov: Nesterov momentum (``"sgd"``).
        dampening: d in [0, 1] (``"sgd"``).
        betas: (β₁, β₂) in [0, 1) (``"adam"``).
        eps: ε > 0 added to the Adam denominator.
        weight_decay: ≥ 0, added to the gradient as weight_decay·X.
        lam: λ in [0, 1] of the correction (½, pogo-torch's default).
        repair_every: re-project (polar) after every k-th step, or None.
        telemetry: record the orthogonality error per step (keyword-only).
    """

    default_lr: ClassVar[float] = 0.01
    # it replaces its buffers (Note [A skipped step leaves the state as it was])
    writes_state_in_place: ClassVar[bool] = False
    # one polar-like correction per step: the iterate is near the manifold (error of
    # order (lr‖ψ‖)² per step, not decaying to rounding), like landing's
    feasible: ClassVar[bool] = False
    # so a state saved mid-training (its point near the manifold) loads and steps on
    accepts_off_manifold: ClassVar[bool] = True
    formula: ClassVar[str] = "ψ: 6NM², correction: 4NM² (all GEMMs, no factorization)"

    def __init__(
        self,
        params,
        lr: float,
        base: str = "adam",
        momentum: float = 0.0,
        nesterov: bool = False,
        dampening: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        lam: float = 0.5,
        repair_every: int | None = None,
        *,
        telemetry: bool = False,
    ):
        defaults = dict(
            lr=lr,
            base=base,
            momentum=momentum,
            nesterov=nesterov,
            dampening=dampening,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            lam=lam,
            repair_every=repair_every,
        )
        super().__init__(params, defaults, telemetry=telemetry)

    @classmethod
    def step_flops(cls, n: int, m: int, **_: object) -> float:
        """Real flops of one step on a real N×M point: five N×M×M products and updates."""
        return 10.0 * n * m * m + 12.0 * n * m

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        check_positive_lr(group)
        check_choice("base", group["base"], BASES)
        check_number("momentum", group["momentum"], high=1.0)
        check_number("dampening", group["dampening"], high=1.0, closed_high=True)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov={group['nesterov']!r} is not allowed; allowed: True, False")
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas={betas!r} is not allowed; allowed: a pair (β₁, β₂) in [0, 1)")
        check_number("betas[0]", betas[0], high=1.0)
        check_number("betas[1]", betas[1], high=1.0)
        if check_number("eps", group["eps"]) <= 0:
            raise ValueError(f"eps={group['eps']!r} is out of range; allowed: > 0")
        check_number("weight_decay", group["weight_decay"])
        check_number("lam", group["lam"], high=1.0, closed_high=True)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for i, p in enumerate(params):
            man = manifold_of(p)
            if man is not None and not isinstance(man, (_OurStiefel, geoopt.Stiefel)):
                raise ValueError(
                    f"pogo: parameter {i} of the new param group lies on {man!r}, not a Stiefel "
                    "manifold; allowed: parameters on St(N, M), O(n), U(n) (this package's or "
                    "geoopt's Stiefel manifolds) or plain tensors"
                )
        super().add_param_group({**param_group, "params": params})

    # ------------------------------------------------------------------ base optimizers
    @staticmethod
    def _sgd(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        mu = group["momentum"]
        if mu == 0:
            return grad
        buf = state.get("momentum_buffer")
        buf = grad if buf is None else buf  # pogo-torch's first buffer: G, then updated
        buf = state["momentum_buffer"] = buf.mul(mu).add_(grad, alpha=1 - group["dampening"])
        return grad.add(buf, alpha=mu) if group["nesterov"] else buf

    @staticmethod
    def _vector_adam(grad: torch.Tensor, state: dict, group: dict, geo: Geometry) -> torch.Tensor:
        b1, b2 = group["betas"]
        t = int(state["step"])
        if geo.stiefel:  # ‖G‖²_F per matrix, summed over all rows of a row-sharded point
            sq = geo.apply(inner_euclidean, grad, grad, grad, keepdim=True)
        else:
            dims = tuple(range(grad.dim()))
            sq = torch.linalg.vector_norm(grad, dim=dims, keepdim=True).square()
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(sq)
        m = state["exp_avg"] = state["exp_avg"].lerp(grad, 1 - b1)
        v = state["exp_avg_sq"] = state["exp_avg_sq"].mul(b2).add_(sq, alpha=1 - b2)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        return (m / bc1) / (v.sqrt() / bc2**0.5 + group["eps"])

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        wd = group["weight_decay"]
        g = grad if wd == 0 else grad + wd * x
        if group["base"] == "sgd":
            g = self._sgd(g, state, group)
        else:
            g = self._vector_adam(g, state, group, geo)
        if geo.stiefel:  # through the geometry: M×M all-reduces on a row-sharded point
            return geo.apply(pogo_step, x, g, group["lr"], group["lam"])
        return x - group["lr"] * g

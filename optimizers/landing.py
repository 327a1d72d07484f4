r"""The retraction-free landing method (`"landing"`).

Ablin & Peyré 2022 (O(n)); Ablin, Vary, Gao & Absil 2024 (St(N, M)).

Example:
    ```python
    import torch, geoopt
    from stiefel.manifolds import Stiefel
    from stiefel import optimizers

    st = Stiefel(50, 3)
    x0 = st.random(dtype=torch.float64) + 0.05 * torch.randn(50, 3, dtype=torch.float64)
    w = geoopt.ManifoldParameter(x0, manifold=st)  # off the manifold: accepted
    opt = optimizers.create("landing", [w], lr=0.1)
    for _ in range(200):
        opt.zero_grad()
        (0 * w).sum().backward()
        opt.step()
    assert st.orthogonality_error(w.detach()) < 1e-10
    ```
"""

from __future__ import annotations

import math

import torch

from .._core.checks import flag
from ..manifolds.kernels import landing_direction, landing_safe_step, landing_update
from .base import RiemannianOptimizer, check_number
from .geometry import Geometry
from .registry import Passes, register

__all__ = ["Landing"]


@register("landing")
class Landing(RiemannianOptimizer):
    r"""Landing: X ← X − η(skew(GXᴴ)X + λX(XᴴX − I)), no retraction.

    The first term follows the (relative) Riemannian gradient, the second pulls
    X back to the manifold; both cost O(NM²) (Note [Landing field in O(NM²)] in
    `stiefel.manifolds.kernels`). With `safe_step=True` the step is
    η = min(lr, η*(X)), which keeps ‖XᴴX − I‖_F ≤ ε once inside that region and
    brings an iterate started outside it back without overshooting (Note [Safe
    step of the landing method]). The iterate is near, not on, the manifold: at
    a fixed point of a noisy gradient the distance is about η‖skew(GXᴴ)X‖²/(2λ).
    A point off the manifold is accepted at construction. Plain tensors get
    gradient descent; non-Stiefel geoopt manifolds a Riemannian gradient step.

    Args:
        params: parameters or param groups.
        lr: step size (≥ 0).
        attraction: λ > 0.
        eps: ε in (0, 1), the radius of the safe region.
        safe_step: cap the step at η*(X).
        repair_every: re-project (polar) after every k-th step, or None.
        telemetry: record the orthogonality error per step (keyword-only).
        foreach: step parameters of the same kind as one batch (keyword-only; None:
            where it pays; False: each alone, the same result to rounding).
        capturable: no host read in a step, for CUDA graphs (keyword-only).
    """

    accepts_off_manifold = True
    # its attraction converges from any full-rank point: only a rank-deficient one
    # is projected at a step (Note [Off-manifold points at a step])
    off_manifold_bound = math.inf
    feasible = False
    writes_state_in_place = False  # no state but the step count
    buckets_plain = True  # its Euclidean form is elementwise (gradient descent)
    buckets_points = True  # its kernels reduce per matrix (Note [One rule call per bucket])
    default_lr = 0.02
    formula = (
        "8NM² (two N×M×M products for XᴴX and XᴴG, two for the field); 10NM² for N ≤ 3M "
        "(ψX formed for its norm, Note [Landing field in O(NM²)])"
    )

    step_bytes = Passes(reads=4, writes=1)  # XᴴX, XᴴG (X, G), then the update (X, G → X)

    @classmethod
    def step_flops(cls, n: int, m: int, **hyper) -> float:
        """FLOPs of one step on St(n, m): 8NM², 10NM² for N ≤ 3M (hyper-parameters aside).

        Note [Landing field in O(NM²)] gives both forms: the field's four products,
        and a fifth for ψX itself on squarish points.

        Args:
            n: rows N.
            m: columns M.
            **hyper: hyper-parameters (ignored).

        Returns:
            The FLOP count.
        """
        return (10 if n <= 3 * m else 8) * n * m * m

    def __init__(
        self,
        params,
        lr: float,
        attraction: float = 1.0,
        eps: float = 0.5,
        safe_step: bool = True,
        repair_every: int | None = None,
        *,
        telemetry: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
    ):
        defaults = dict(
            lr=lr, attraction=attraction, eps=eps, safe_step=safe_step, repair_every=repair_every
        )
        super().__init__(
            params, defaults, telemetry=telemetry, foreach=foreach, capturable=capturable
        )

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        check_number("attraction", group["attraction"], low_open=True)
        check_number("eps", group["eps"], high=1.0, low_open=True)
        flag("safe_step", group["safe_step"])

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        lr = group["lr"]
        if not geo.stiefel:
            return geo.gradient_step(x, grad, lr)
        lam = group["attraction"]
        # x.shape is global; a row-sharded point's kernel sees its local rows
        field, dist, a2, psi2 = geo.apply(landing_direction, x, grad, lam, rows=x.shape[-2])
        if group["safe_step"]:
            eta = geo.apply(landing_safe_step, a2, dist, psi2, lr, lam, group["eps"])
        else:
            eta = lr
        return geo.apply(landing_update, x, field, eta)

r"""Riemannian gradient descent with transported momentum (``"rgd"``).

Example::

    >>> import torch, geoopt
    >>> from stiefel.manifolds import Stiefel
    >>> from stiefel import optimizers
    >>> st = Stiefel(100, 4)
    >>> w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    >>> opt = optimizers.create("rgd", [w], lr=0.05, momentum=0.9, metric="canonical")
    >>> for _ in range(3):
    ...     opt.zero_grad(); (w[:4] ** 2).sum().neg().backward(); opt.step()
    >>> bool(st.orthogonality_error(w.detach()) < 1e-12)
    True
"""

from __future__ import annotations

import torch

from .base import RiemannianOptimizer, check_number
from .geometry import Geometry
from .registry import register

__all__ = ["RGD"]


@register("rgd")
class RGD(RiemannianOptimizer):
    r"""Riemannian SGD on St(N, M), O(n), U(n); SGD with momentum on plain tensors.

    With ξ = rgrad(X, G) under ``metric`` (Euclidean: G − X sym(XᴴG); canonical:
    G − XGᴴX) and momentum μ:

        B ← μ·τ(B) + ξ,   X ← retr(X, −lr·B),   τ(B) ← B transported to the new X.

    ``retraction="cayley"`` (default) is the Cayley retraction done with a 2M×2M
    Sherman–Morrison–Woodbury solve, and the transport is the same orthogonal map
    (isometric); ``"qr"`` and ``"polar"`` transport by projection. The CWY paper's
    RGD-C-C, RGD-E-C, RGD-C-QR and RGD-E-QR are ``metric`` × ``retraction``.
    Without momentum a step costs six N×M×M products (Note [Fused gradient step]
    in `stiefel.manifolds.kernels`). Plain tensors get torch's SGD
    (momentum, no dampening) update.

    Args:
        params: parameters or param groups.
        lr: step size (≥ 0).
        momentum: μ in [0, 1).
        metric: ``"euclidean"``, ``"canonical"`` or None (the manifold's own).
        retraction: ``"cayley"``, ``"qr"`` or ``"polar"``.
        repair_every: re-project (polar) after every k-th step, or None.
        telemetry: record the orthogonality error per step (keyword-only).
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.0,
        metric: str | None = None,
        retraction: str = "cayley",
        repair_every: int | None = None,
        *,
        telemetry: bool = False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            metric=metric,
            retraction=retraction,
            repair_every=repair_every,
        )
        super().__init__(params, defaults, telemetry=telemetry)

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        check_number("momentum", group["momentum"], high=1.0)

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        lr, mu = group["lr"], group["momentum"]
        if mu == 0:
            return geo.gradient_step(x, grad, lr)
        xi = geo.rgrad(x, grad)
        buf = state.get("momentum_buffer")
        buf = xi.clone() if buf is None else buf.mul_(mu).add_(xi)
        new, state["momentum_buffer"] = geo.descend_transport(x, buf, lr)
        return new

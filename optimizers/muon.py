r"""Manifold Muon: steepest descent under the spectral norm on St(N, M) (``"manifold_muon"``).

Example:
```python
import torch, geoopt
from stiefel.manifolds import Stiefel
from stiefel import optimizers

st = Stiefel(40, 4)
w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
opt = optimizers.create("manifold_muon", [w], lr=0.05, momentum=0.9)
for _ in range(5):
    opt.zero_grad()
    (w[:4] ** 2).sum().neg().backward()
    opt.step()
assert st.orthogonality_error(w.detach()) < 1e-12
```
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..manifolds.kernels.msign import (
    MSIGN_METHODS,
    msign,
    msign_flops,
    spectral_direction,
)
from .base import RiemannianOptimizer, check_choice, check_number
from .geometry import Geometry
from .registry import register

__all__ = ["ManifoldMuon", "check_positive_lr"]


def check_positive_lr(group: dict) -> None:
    """lr must be a finite real number > 0 (ValueError/TypeError naming it)."""
    if check_number("lr", group["lr"]) <= 0:
        raise ValueError(f"lr={group['lr']!r} is out of range; allowed: a finite number > 0")


@register("manifold_muon")
class ManifoldMuon(RiemannianOptimizer):
    r"""Manifold Muon on St(N, M), O(n), U(n); Muon on 2-D plain tensors, SGD on others.

    With momentum μ on the Euclidean gradient (B ← μB + G; Nesterov: G + μB), the
    direction is the tangent Φ of unit spectral norm most aligned with B,

        Φ = argmax Re tr(BᴴΦ)  s.t.  ‖Φ‖₂ ≤ 1,  XᴴΦ + ΦᴴX = 0,

    computed by descent on its dual, Φ = msign(B + XΛ) with Hermitian Λ ←
    Λ − t·sym(XᴴΦ) (`stiefel.manifolds.kernels.msign.spectral_direction`,
    ``inner_steps`` msign evaluations; exact after the first on O(n)/U(n)), then
    X ← retr(X, −lr·Φ) with the group's ``retraction``. Every step moves X by
    lr in spectral norm (J. Bernstein, Modula docs, "Stiefel manifold", 2025;
    J. Su 2025, "Steepest descent on manifolds: 3. Muon + Stiefel").

    The momentum buffer lives in the ambient space: it needs no transport, since
    each step solves for the tangent direction at the current point.

    Plain tensors: a 2-D tensor gets Muon's Euclidean update X ← X − lr·msign(B)
    (no shape scaling), any other tensor SGD with the same momentum (X ← X − lr·B).
    Other geoopt manifolds get a Riemannian gradient step along rgrad(B).

    Args:
        params: parameters or param groups.
        lr: step size (> 0): the spectral norm of each manifold step.
        momentum: μ in [0, 1).
        nesterov: use G + μB instead of B.
        inner_steps: msign evaluations of the dual descent (≥ 1).
        msign: ``"polar_express"`` (default), ``"newton_schulz"`` (Muon's quintic:
            rough, singular values in about [0.7, 1.2]), ``"newton_schulz_cubic"`` or
            ``"svd"`` (exact).
        msign_steps: iterations per msign (None: the method's default).
        dual_step: step of the dual descent as a multiple of the rms singular value.
        retraction: ``"cayley"``, ``"qr"`` or ``"polar"``.
        repair_every: re-project (polar) after every k-th step, or None.
        telemetry: record the orthogonality error per step (keyword-only).
    """

    default_lr: ClassVar[float] = 0.02
    # it replaces its momentum buffer (Note [A skipped step leaves the state as it was])
    writes_state_in_place: ClassVar[bool] = False
    dtensor_points: ClassVar[bool] = False  # the msign kernels are not routed through reduce
    formula: ClassVar[str] = (
        "inner_steps × msign(N×M) [steps × (4NM² + 2M³)] + 4NM² per inner step + retraction"
    )
    variants: ClassVar[list[dict]] = [{}, {"inner_steps": 1}]

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        inner_steps: int = 10,
        msign: str = "polar_express",
        msign_steps: int | None = None,
        dual_step: float = 1.0,
        retraction: str = "cayley",
        repair_every: int | None = None,
        *,
        telemetry: bool = False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            inner_steps=inner_steps,
            msign=msign,
            msign_steps=msign_steps,
            dual_step=dual_step,
            retraction=retraction,
            repair_every=repair_every,
        )
        super().__init__(params, defaults, telemetry=telemetry)

    @classmethod
    def step_flops(
        cls,
        n: int,
        m: int,
        inner_steps: int = 10,
        msign: str = "polar_express",
        msign_steps: int | None = None,
        **_: object,
    ) -> float:
        """Real flops of one step on a real N×M point (Cayley retraction ≈ 12NM² + 8M³)."""
        per_inner = msign_flops(n, m, msign, msign_steps) + 4.0 * n * m * m
        retraction = 12.0 * n * m * m + 8.0 * m**3
        return 2.0 * n * m * m + inner_steps * per_inner + retraction

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        check_positive_lr(group)
        check_number("momentum", group["momentum"], high=1.0)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov={group['nesterov']!r} is not allowed; allowed: True, False")
        if group["nesterov"] and group["momentum"] == 0:
            raise ValueError("nesterov=True needs momentum > 0; allowed: momentum in (0, 1)")
        k = group["inner_steps"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"inner_steps={k!r} is not allowed; allowed: an int >= 1")
        check_choice("msign", group["msign"], MSIGN_METHODS)
        s = group["msign_steps"]
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"msign_steps={s!r} is not allowed; allowed: None or an int >= 1")
        if check_number("dual_step", group["dual_step"]) <= 0:
            raise ValueError(f"dual_step={group['dual_step']!r} is out of range; allowed: > 0")

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        lr, mu = group["lr"], group["momentum"]
        b = grad
        if mu > 0:
            buf = state.get("momentum_buffer")
            buf = grad.clone() if buf is None else buf.mul(mu).add_(grad)
            state["momentum_buffer"] = buf
            b = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        method, steps = group["msign"], group["msign_steps"]
        if geo.stiefel:
            phi = spectral_direction(x, b, group["inner_steps"], method, steps, group["dual_step"])
            return geo.descend(x, phi, lr)
        if not geo.riemannian:
            if x.dim() == 2:
                return x - lr * msign(b, method, steps)
            return x - lr * b
        return geo.descend(x, geo.rgrad(x, b), lr)

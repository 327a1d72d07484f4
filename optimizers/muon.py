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

from .._core.checks import positive_int
from ..manifolds.geometry import EuclideanGeometry
from ..manifolds.kernels.frame import correction_flops
from ..manifolds.kernels.msign import (
    MSIGN_METHODS,
    msign,
    msign_flops,
    spectral_direction,
)
from ..manifolds.sharded import ShardedGeometry, check_placements, is_dtensor
from . import terms
from .base import RiemannianOptimizer, check_choice, check_number
from .geometry import Geometry
from .registry import Passes, register

__all__ = ["ManifoldMuon"]


def _plain_msign(b: torch.Tensor, method: str, steps: int | None) -> torch.Tensor:
    """msign(B) of a plain 2-D tensor; a row-sharded DTensor on its local rows.

    A plain weight sharded on its rows (FSDP2's ``Shard(0)``) runs the iteration on
    the local rows with the Gram BᴴB all-reduced (Note [msign on sharded rows]), not
    through DTensor's propagation, which all-gathers. Other layouts (and ``"svd"``)
    are left to DTensor.
    """
    if is_dtensor(b) and method != "svd":
        try:
            rows = check_placements(b)
        except ValueError:  # e.g. Shard(1): DTensor's own propagation
            rows = None
        if rows is not None:
            return ShardedGeometry(EuclideanGeometry(), b).apply(msign, b, method, steps)
    return msign(b, method, steps)


@register("manifold_muon")
class ManifoldMuon(RiemannianOptimizer):
    r"""Manifold Muon on St(N, M), O(n), U(n); Muon on 2-D plain tensors, SGD on others.

    With momentum μ on the Euclidean gradient (B ← μB + G; Nesterov: G + μB), the
    direction is the tangent Φ of unit spectral norm most aligned with B,

        Φ = argmax Re tr(BᴴΦ)  s.t.  ‖Φ‖₂ ≤ 1,  XᴴΦ + ΦᴴX = 0,

    computed by descent on its dual, Φ = msign(B + XΛ) with Hermitian Λ ←
    Λ − t·sym(XᴴΦ) (`stiefel.manifolds.kernels.msign.spectral_direction`,
    ``inner_steps`` msign evaluations; exact after the first on O(n)/U(n); the
    descent's iterative msign maps singular values below its resolution to 0, so
    rounding in a rank-deficient B + XΛ does not grow), then
    X ← retr(X, −lr·Φ) with the group's ``retraction``. Every step moves X by at
    most lr in spectral norm, by lr once the dual descent has converged (it stops short
    where B + XΛ is rank-deficient at the optimum: 1 ≤ N − M < M, or a gradient of rank
    below M; `spectral_direction`; Note [The tangent direction within the ball];
    J. Bernstein, Modula docs, "Stiefel manifold", 2025; J. Su 2025, "Steepest descent on
    manifolds: 3. Muon + Stiefel").

    The momentum buffer lives in the ambient space: it needs no transport, since
    each step solves for the tangent direction at the current point.

    Φ does not depend on the scale of B, and neither does the step: B is divided
    exactly by a power of two before any norm is taken (Note [msign at any scale]),
    so a float32 gradient of 1e20 or 1e-30 moves X as the same gradient of size 1
    does. The step is skipped, with a warning, only when it is not finite: a
    momentum buffer μB + G that overflows (gradients near the dtype's largest
    value) or a learning rate so large that the retraction overflows.

    Plain tensors: a 2-D tensor gets Muon's Euclidean update X ← X − lr·msign(B)
    (no shape scaling), any other tensor SGD with the same momentum (X ← X − lr·B).
    msign takes the engine of fewer flops (`stiefel.manifolds.kernels.msign`): on a
    weight whose long side exceeds 1.5 × the short one, the Gram engine (Gram
    Newton–Schulz), the same polynomials in 1.5× fewer flops at five steps on 4:1.
    Other geoopt manifolds get a Riemannian gradient step along rgrad(B).

    DTensor points (``Replicate()``, batch shards, ``Shard(0)`` on the rows of St(N, M))
    step on their local shards; on row-sharded points every msign iteration all-reduces
    an M×M Gram and nothing N-sized moves (Note [msign on sharded rows]), and so does
    Muon's msign of a row-sharded plain 2-D weight. ``msign="svd"`` needs whole
    matrices: refused for row-sharded manifold points.

    Args:
        params: parameters or param groups.
        lr: step size (≥ 0): the largest spectral norm of a manifold step.
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
        foreach: step parameters of the same kind as one batch (keyword-only; None:
            where it pays; False: each alone, the same result to rounding).
        capturable: no host read in a step, for CUDA graphs (keyword-only).
    """

    default_lr: ClassVar[float] = 0.02
    # it replaces its momentum buffer (Note [A skipped step leaves the state as it was])
    writes_state_in_place: ClassVar[bool] = False
    buckets_points: ClassVar[bool] = True  # its kernels reduce per matrix
    formula: ClassVar[str] = (
        "inner_steps × msign(N×M) [N ≤ 1.5M: steps × (4NM² + 2M³); else the Gram engine, "
        "(4 + 4r)NM² + 2M³(4·steps − 3 − 3r), r = ⌊(steps − 1)/3⌋; for polar_express "
        "and newton_schulz_cubic 2 more steps, not in r] + 4NM² per inner step + retraction"
    )
    variants: ClassVar[tuple[dict, ...]] = ({}, {"inner_steps": 1})

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
        foreach: bool | None = None,
        capturable: bool = False,
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
        super().__init__(
            params, defaults, telemetry=telemetry, foreach=foreach, capturable=capturable
        )

    step_bytes = Passes(reads=4, writes=1)  # Grams of X, G (the dual problem is M×M), update

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
        """Real flops of one step on a real N×M point (Cayley retraction ≈ 10NM² + 8M³ and
        the float64 XᴴX of every k-th step, `frame.correction_flops`); the converging
        msign methods take two more steps (Note [A dead zone for the dual descent] in
        `stiefel.manifolds.kernels.msign`)."""
        per_inner = msign_flops(n, m, msign, msign_steps, sharpen=True) + 4.0 * n * m * m
        retraction = 10.0 * n * m * m + 8.0 * m**3 + correction_flops(n, m)
        return 2.0 * n * m * m + inner_steps * per_inner + retraction

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        check_number("lr", group["lr"])  # ≥ 0, as torch's (a schedule may reach 0)
        terms.check_momentum(group, dampening=False)
        positive_int("inner_steps", group["inner_steps"])
        check_choice("msign", group["msign"], MSIGN_METHODS)
        positive_int("msign_steps", group["msign_steps"], none_ok=True)
        check_number("dual_step", group["dual_step"], low_open=True)

    def check_parameter(self, i: int, p: torch.Tensor, geo: Geometry, group: dict) -> None:
        # Note [msign on sharded rows]: "svd" needs the whole matrix; refused up front
        # for a row-sharded manifold point, before anything is added.
        rows = getattr(geo, "row_group", None) is not None
        if rows and geo.stiefel and group["msign"] == "svd":
            raise ValueError(
                f"manifold_muon: parameter {i} of the new param group is row-sharded "
                f"(placements {tuple(p.placements)}) and msign='svd' needs the whole "
                "matrix; allowed for row-sharded points: msign="
                f"{', '.join(repr(m) for m in MSIGN_METHODS if m != 'svd')} (M×M Grams "
                "only); 'svd' is allowed on Replicate() and batch-sharded points"
            )

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        lr, mu = group["lr"], group["momentum"]
        b = grad
        if mu > 0:
            buf = state["momentum_buffer"] = terms.momentum(state.get("momentum_buffer"), grad, mu)
            b = terms.nesterov(grad, buf, mu) if group["nesterov"] else buf
        method, steps = group["msign"], group["msign_steps"]
        if geo.stiefel:
            # through the geometry: on a row-sharded point the kernel runs on the local
            # rows with M×M all-reduces (Note [msign on sharded rows]); x.shape is global
            square = x.shape[-2] == x.shape[-1]
            phi = geo.apply(
                spectral_direction,
                x,
                b,
                group["inner_steps"],
                method,
                steps,
                group["dual_step"],
                square=square,
            )
            return geo.descend(x, phi, lr)
        if not geo.riemannian:
            if x.dim() == 2:
                return x.add(_plain_msign(b, method, steps), alpha=-lr)
            return x - lr * b
        return geo.descend(x, geo.rgrad(x, b), lr)

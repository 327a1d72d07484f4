r"""Riemannian gradient descent with transported momentum (`"rgd"`).

Example:
    ```python
    import torch, geoopt
    from stiefel.manifolds import Stiefel
    from stiefel import optimizers

    st = Stiefel(100, 4)
    w = geoopt.ManifoldParameter(st.random(dtype=torch.float64), manifold=st)
    opt = optimizers.create("rgd", [w], lr=0.05, momentum=0.9, metric="canonical")
    for _ in range(3):
        opt.zero_grad()
        (w[:4] ** 2).sum().neg().backward()
        opt.step()
    assert st.orthogonality_error(w.detach()) < 1e-12
    ```
"""

from __future__ import annotations

import math

import torch

from ..manifolds.kernels import proj_tangent
from ..manifolds.kernels.factor import right_solve_flops
from ..manifolds.kernels.frame import correction_flops
from . import terms
from .base import RiemannianOptimizer, check_number
from .geometry import Geometry
from .registry import Passes, register

__all__ = ["RGD"]


def _transport(geo: Geometry, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Vector transport of `v` from `x` to `y` for Nesterov's buffer (by projection).

    Note [A momentum buffer through steps without momentum]
    torch's SGD neither reads nor changes its buffer at a step with momentum 0 (a
    schedule passing through 0) and uses it again when the momentum returns. Here
    the buffer is a tangent vector at the point of its last step: kept as it was,
    it would be added at a point it is not tangent to (‖XᴴB + BᴴX‖ of order 1
    after one step). It is carried to every new point by this transport instead;
    on a plain tensor the transport is the identity, so the rule is torch's. A
    buffer held in the frame of a square point (B = XΩ, Note [Moments in the frame
    of X]) is carried by keeping Ω, as at every step: nothing to do.
    """
    if geo.stiefel:  # also on the shards of a DTensor point, by DTensor propagation
        return proj_tangent(y, v)
    return geo.transport(x, y, v)


@register("rgd")
class RGD(RiemannianOptimizer):
    r"""Riemannian SGD on St(N, M), O(n), U(n); torch's SGD on plain tensors.

    With G ← G + w·X (`weight_decay` w, on the Euclidean gradient, as in
    geoopt and torch), ξ = rgrad(X, G) under `metric` (Euclidean:
    G − X sym(XᴴG); canonical: G − XGᴴX), momentum μ and dampening δ:

        B ← μ·τ(B) + (1 − δ)ξ   (B = ξ at the first step),
        d = ξ + μB (nesterov) or d = B,   X ← retr(X, −lr·d),

    and τ(B) is B transported to the new X. `retraction="cayley"` (default) is
    the Cayley retraction done with a 2M×2M Sherman–Morrison–Woodbury solve,
    whose transport is the same orthogonal map (isometric); `"qr"` and
    `"polar"` transport by projection, and so does Nesterov's buffer for every
    retraction. On O(n) and U(n) the Cayley step keeps B in the frame of X,
    B = XΩ with Ω in `state["momentum_buffer_frame"]`, which its transport
    leaves unchanged (Note [Moments in the frame of X]); elsewhere
    `state["momentum_buffer"]` holds B. The CWY paper's RGD-C-C, RGD-E-C,
    RGD-C-QR and RGD-E-QR are `metric` × `retraction` (`variants`). Without
    momentum a step costs five N×M×M products and a 2M×2M solve (`step_flops`).
    Plain tensors get torch's `SGD` update (momentum, dampening, nesterov, weight
    decay), to the rounding of another order of operations.

    The options of geoopt's `RiemannianSGD` are accepted with its meaning:
    `nesterov`, `dampening`, `weight_decay`, and `stabilize` as an alias of
    `repair_every`. Two differences, both deliberate: the first momentum
    buffer is ξ as in torch's SGD (geoopt starts from μ·G + (1 − δ)ξ, with the
    Euclidean G); weight decay is a no-op on Stiefel manifolds in both (the
    Riemannian gradient of ½‖X‖² vanishes there, since ‖X‖² = M is constant).

    Args:
        params: parameters or param groups.
        lr: step size (≥ 0).
        momentum: μ in [0, 1).
        metric: `"euclidean"`, `"canonical"` or None (the manifold's own).
        retraction: `"cayley"`, `"qr"` or `"polar"`.
        repair_every: re-project (polar) after every k-th step, or None.
        dampening: δ in [0, 1].
        weight_decay: w ≥ 0.
        nesterov: Nesterov momentum (needs μ > 0 and δ = 0, as in torch).
        stabilize: geoopt's name for `repair_every` (give one of the two).
        telemetry: record the orthogonality error per step (keyword-only).
        foreach: step parameters of the same kind as one batch (keyword-only; None:
            where it pays; False: each alone, the same result to rounding).
        capturable: no host read in a step, for CUDA graphs (keyword-only).

    Raises:
        ValueError: a hyper-parameter out of range (named, with its range).
        TypeError: a hyper-parameter of the wrong type.
    """

    default_lr = 0.05
    writes_state_in_place = False  # Note [A skipped step leaves the state as it was]
    buckets_plain = True  # its Euclidean form is elementwise (torch's SGD/Adam)
    buckets_points = True  # its kernels reduce per matrix (Note [One rule call per bucket])
    formula = (
        "cayley: 10NM² + 6M³ + 2NM²/k either metric (five N×M×M products, a 2M×2M "
        "solve, the float64 XᴴX every k-th step), 20n³/3 + 2n³/k on O(n) (two products, "
        "an n×n solve); qr: 7NM² + 19M³/3 + 2NM²/k either metric (three products, a "
        "triangular solve and a Cholesky-QR of the Gram; for N ≥ 8M R⁻¹ and a product "
        "instead of the solve, 8NM² + 20M³/3 + 2NM²/k), 22n³/3 + 2n³/k on O(n) "
        "(k = √M/2 in [1, 8], frame.correction_period)"
    )
    variants = (
        {"metric": "canonical", "retraction": "qr"},
        {"metric": "euclidean", "retraction": "qr"},
        {"metric": "canonical", "retraction": "cayley"},
        {"metric": "euclidean", "retraction": "cayley"},
    )

    step_bytes = Passes(reads=4, writes=1)  # Grams (X, G), update (X, G → X); no momentum

    @classmethod
    def step_flops(
        cls, n: int, m: int, metric: str | None = None, retraction: str = "cayley", **hyper
    ) -> float:
        """FLOPs of one step without momentum on St(n, m), as the kernels compute it.

        Counted products include the optimizer's float64 XᴴX of every k-th step
        (its off-manifold test and drift correction, reused by the step), counted
        as its share per step, `frame.correction_flops` (Notes [The drift
        correction every k-th step], [Tall steps correct every k-th step]). Tall
        points: the Cayley step of Note [Cayley through Sherman–Morrison–Woodbury
        with 2M columns]; the QR step of Note [QR retraction through the Gram of
        X − lr·d] (XᴴS, SᴴS, the product X·C − S and the triangular solve
        (X·C − S)·R⁻¹ of NM², or for N ≥ 8M the product by R⁻¹ of 2NM² + M³/3,
        `kernels.factor.right_solve_flops`, with M×M work: three products and a
        Cholesky factorization). Square points (Note [Square steps in the frame of X]):
        XᴴS and the update X + X·F, with an LU solve with n right-hand sides
        (Cayley; a short step of small n forms Cayley(S) − I by a few products
        instead, within the device type's limits of Note [Cayley of a small skew
        matrix by Euler's product], not counted here) or PᴴP, a Cholesky
        factorization and a triangular solve (QR); a correcting step longer than
        ‖D‖_F = ½ adds one product. The CWY paper's Householder counts are
        `paper_formula`'s.

        Args:
            n: rows N.
            m: columns M.
            metric: `"euclidean"` or `"canonical"` (the same count; None: either).
            retraction: `"cayley"`, `"qr"` (`"polar"` has no model: NaN).
            **hyper: other hyper-parameters (ignored).

        Returns:
            The FLOP count, NaN where there is no model.
        """
        if retraction not in ("cayley", "qr"):
            return math.nan
        gram = correction_flops(n, m)
        if n == m:  # O(n), U(n)
            return (20 if retraction == "cayley" else 22) * n**3 / 3 + gram
        if retraction == "cayley":  # our fused step, either metric
            return 10 * n * m * m + 6 * m**3 + gram
        return 6 * n * m * m + 19 * m**3 / 3 + right_solve_flops(n, m) + gram

    @classmethod
    def paper_formula(cls, metric: str | None = None, retraction: str = "cayley", **hyper) -> str:
        """The CWY paper's Table 2 FLOP count for this (metric, retraction), or "".

        Args:
            metric: `"canonical"` or `"euclidean"` (None: the manifold's, Euclidean).
            retraction: `"cayley"` or `"qr"` (the paper has no `"polar"` row).
            **hyper: other hyper-parameters (ignored).

        Returns:
            The formula as text.
        """
        table = {
            ("canonical", "cayley"): "28NM² + 16M³ (2M×2M)",
            ("euclidean", "cayley"): "72NM² + 25M³ in the paper (3M×3M); 2M×2M here",
            ("canonical", "qr"): "10NM² − 2M³/3",
            ("euclidean", "qr"): "14NM² − 2M³/3",
        }
        return table.get((metric or "euclidean", retraction), "")

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.0,
        metric: str | None = None,
        retraction: str = "cayley",
        repair_every: int | None = None,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        stabilize: int | None = None,
        *,
        telemetry: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            metric=metric,
            retraction=retraction,
            repair_every=terms.stabilize_alias(stabilize, repair_every),
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        super().__init__(
            params, defaults, telemetry=telemetry, foreach=foreach, capturable=capturable
        )

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        terms.check_momentum(group)
        check_number("weight_decay", group["weight_decay"])

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        lr, mu = group["lr"], group["momentum"]
        if group["weight_decay"]:
            grad = terms.weight_decay(grad, x, group["weight_decay"])
        if mu == 0:
            new = geo.gradient_step(x, grad, lr)
            # Note [A momentum buffer through steps without momentum]
            if state.get("momentum_buffer") is not None:  # torch < 2.0 saved None
                state["momentum_buffer"] = _transport(geo, x, new, state["momentum_buffer"])
            return new
        # a square point keeps B in its frame (Note [Moments in the frame of X]), except
        # Nesterov's: its transport by projection onto the tangent space at the new point
        # changes the coordinates
        frame = None if group["nesterov"] else geo.frame(x)
        key = terms.carry_moment(frame, x, state, "momentum_buffer")
        geo = geo if frame is None else frame
        xi = geo.rgrad(x, grad)
        buf = terms.momentum(state.get(key), xi, mu, group["dampening"])
        if not group["nesterov"]:
            new, state[key] = geo.descend_transport(x, buf, lr)
            return new
        new = geo.descend(x, terms.nesterov(xi, buf, mu), lr)
        state[key] = _transport(geo, x, new, buf)
        return new

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

from .._core.checks import flag
from ..manifolds.kernels.frame import correction_flops
from ..manifolds.kernels.reduce import rows_absmax
from ..manifolds.sharded import per_matrix
from . import terms
from .base import RiemannianOptimizer, check_number
from .geometry import Geometry
from .registry import Passes, register
from .rgd import RGD

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
    solve; QR/polar: projection). On O(n) and U(n) the Cayley step keeps m in
    the frame of X, m = XΩ with Ω in `state["exp_avg_frame"]`, which its
    transport leaves unchanged (Note [Moments in the frame of X]); elsewhere
    `state["exp_avg"]` holds m. The state holds v in a scaled form,
    v = `exp_avg_sq`·`exp_avg_sq_scale`², so that a gradient whose square
    overflows the dtype (float32: ‖ξ‖ ≳ 1e19) still gives a finite step and a
    finite state (Note [Second moment in scaled form]); for ordinary
    gradients the scale is 1 and the arithmetic is Adam's formula unscaled (equal to
    torch's Adam to the rounding of another order of operations). The
    options of geoopt's `RiemannianAdam` are accepted with its meaning:
    `amsgrad`, `weight_decay`, and `stabilize` as an alias of `repair_every`.

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
        "cayley: 16NM² + 6M³ + 2NM²/k (the Riemannian gradient's Gram and product, the "
        "step's Xᴴd and dᴴd, two products for the point and two for the moment's image; "
        "the float64 XᴴX every k-th step, frame.correction_period); O(n), U(n): rgd's "
        "square Cayley step (the moment in the frame of X)"
    )
    variants = ({"retraction": "cayley"},)

    step_bytes = Passes(reads=7, writes=3)  # ξ: X, G; moment: X, G, m → m; retract: X, m → X, m

    @classmethod
    def step_flops(cls, n: int, m: int, retraction: str = "cayley", **hyper) -> float:
        """FLOPs of one step on St(n, m) (`"cayley"` only; NaN for the others).

        On O(n) and U(n) the moment is kept in the frame of X and the step is
        `RGD`'s square Cayley step on it (Note [Moments in the frame of X]).

        Args:
            n: rows N.
            m: columns M.
            retraction: the retraction.
            **hyper: other hyper-parameters (ignored).

        Returns:
            The FLOP count, NaN where there is no model.
        """
        if retraction != "cayley":
            return math.nan
        if n == m:
            return RGD.step_flops(n, m, retraction="cayley")
        return 16 * n * m * m + 6 * m**3 + correction_flops(n, m)

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
        foreach: bool | None = None,
        capturable: bool = False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            retraction=retraction,
            repair_every=terms.stabilize_alias(stabilize, repair_every),
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
        super().__init__(
            params, defaults, telemetry=telemetry, foreach=foreach, capturable=capturable
        )

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        terms.check_betas(group)
        check_number("eps", group["eps"], low_open=True)
        check_number("weight_decay", group["weight_decay"])
        flag("amsgrad", group["amsgrad"])

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        if not geo.riemannian and x.is_complex():
            return _as_real_pairs(self.update, geo, x, grad, state, group)
        b1, b2 = group["betas"]
        grad = terms.weight_decay(grad, x, group["weight_decay"])
        # a square point keeps m in its frame, m = X·exp_avg_frame (Note [Moments in
        # the frame of X]); `geo` then works on the coordinates Ω of ξ = XΩ
        frame = geo.frame(x)
        key = terms.carry_moment(frame, x, state, "exp_avg")
        geo = geo if frame is None else frame
        xi = geo.rgrad(x, grad)
        # Note [Second moment in scaled form]: v = exp_avg_sq · exp_avg_sq_scale²
        mu = _pow2_at_least(_component_amax(geo, x, xi) / _sq_headroom(x))
        # ⟨ξ, ξ⟩/μ², exact (μ a power of two: ξ/1 = ξ bit for bit), no host read; the pass
        # of ξ/μ skipped where μ was 1 at the last step (Note [Scales taken as one ...])
        one = geo.taken_as_one("second moment scale", mu)
        sq = geo.component_inner(x, xi if one else xi / mu)
        if key not in state:
            state[key] = torch.zeros_like(xi)
            state["exp_avg_sq"] = torch.zeros_like(sq)
        # the rule replaces its state tensors, never writes into them (Note [A skipped
        # step leaves the state as it was] in stiefel.optimizers.base)
        m, v = state[key], state["exp_avg_sq"]
        s = state.get("exp_avg_sq_scale")
        s = torch.ones_like(v) if s is None else s
        s1 = torch.maximum(s, mu)  # ratios ≤ 1 below: their squares cannot overflow
        m = torch.lerp(m, xi, 1 - b1)  # b1·m + (1 − b1)ξ, one pass
        v = v.mul((s / s1) ** 2).mul_(b2).add_(sq.mul((mu / s1) ** 2), alpha=1 - b2)
        vmax = state.get("max_exp_avg_sq") if group["amsgrad"] else None
        if group["amsgrad"]:
            vmax = v if vmax is None else torch.maximum(vmax.mul((s / s1) ** 2), v)
        # then the scale follows √v (√vmax for amsgrad) down again; r = s1/s2 is
        # applied twice, not squared, since r² may overflow where v·r² cannot
        top = v if vmax is None else vmax
        s2 = _pow2_at_least(top.sqrt() / _sq_headroom(x) * s1)
        r = s1 / s2
        v = v.mul(r).mul_(r)
        state["exp_avg_sq"], state["exp_avg_sq_scale"] = v, s2
        if vmax is not None:
            state["max_exp_avg_sq"] = v = vmax.mul(r).mul_(r)
        t = state["step"].to(v.dtype)
        bias1 = 1 - b1**t
        bias2 = 1 - b2**t
        # m̂/(√v̂ + ε) with √v̂ = s·√ṽ/√bias2, divided through by s (never overflows)
        denom = (v.sqrt() / bias2.sqrt()).add_(group["eps"] / s2)
        new, state[key] = geo.descend_transport(x, m, (group["lr"] / bias1) / s2 / denom)
        return new


def _as_real_pairs(update, geo: Geometry, x, grad, state: dict, group: dict) -> torch.Tensor:
    """The Adam step of a plain complex tensor as torch's: on its real and imaginary parts.

    Note [A plain complex tensor is its real and imaginary parts]
    A plain tensor is the product of its entries (Note [Adaptive term per manifold
    component]); torch's Adam takes a complex entry as two real ones (``view_as_real``),
    each with its own second moment, where one moment of |ξ|² per entry gives another
    step. The state is kept in torch's form, complex tensors of the parameter's shape
    whose real and imaginary parts are the two moments, so a state of torch's Adam
    continues here and the reverse.
    """
    pairs = torch.view_as_real(x)
    # the pairs have one more dimension: the state's tensors of x's shape are viewed
    # as pairs, and its numbers shaped to broadcast against x (a bucket's step counts,
    # (P, 1, 1)) get a trailing dimension of 1
    work = {k: _pairs(v, x) for k, v in state.items()}
    new = update(geo, pairs, torch.view_as_real(grad), work, group)
    for k, v in work.items():
        state[k] = _unpaired(v, pairs)
    return torch.view_as_complex(new.contiguous())


def _pairs(v: object, x: torch.Tensor) -> object:
    if not isinstance(v, torch.Tensor):
        return v
    if v.is_complex() and v.shape == x.shape:
        return torch.view_as_real(v)
    return v.unsqueeze(-1) if not v.is_complex() and v.dim() == x.dim() > 0 else v


def _unpaired(v: object, pairs: torch.Tensor) -> object:
    if not isinstance(v, torch.Tensor) or v.dim() != pairs.dim():
        return v
    return torch.view_as_complex(v.contiguous()) if v.shape == pairs.shape else v.squeeze(-1)


# Note [Second moment in scaled form]
# ⟨ξ, ξ⟩ overflows float32 once ‖ξ‖_F > 1.8e19 (and float64 past 1.3e154), and an
# infinite v makes every later step a no-op. Adam's direction m/(√v + ε) equals
# m/s / (√(v/s²) + ε/s) for any s > 0, so the state keeps ṽ = v/s² with a power of
# two s ≥ 1 per component (`exp_avg_sq_scale`), and the squares are formed from
# ξ/μ, μ a power of two ≥ 1 bringing max|ξ| below a headroom H with
# numel·H² ≤ max/16: ⟨ξ/μ, ξ/μ⟩ cannot overflow, and neither can
# ṽ ← β₂ṽ(s/s')² + (1 − β₂)⟨ξ/μ, ξ/μ⟩(μ/s')² with s' = max(s, μ). Afterwards s
# is reset to the least power of two ≥ 1 with √ṽ ≤ H, so ṽ keeps its precision
# while v decays. Ordinary gradients (max|ξ| ≤ H, ≈ 1e15–1e19 in float32) have
# μ = s = 1: every scaling is by exactly 1 and the arithmetic is, bit for bit,
# that of the unscaled formula. Scalings by powers of two are exact, so a
# scaled step differs from the exact-arithmetic one by rounding only (to the
# dtype's precision; a small component of a tensor whose other components are
# ≥ 1e30 may lose bits to underflow). Adam's memory is unchanged: after a burst of size B, v needs
# about ln(B²/g²)/(1 − β₂) steps to forget it, as in float64.


def _sq_headroom(x: torch.Tensor) -> float:
    """H, a power of two with numel·H² ≤ max/16 in x's (real) dtype."""
    maxexp = math.frexp(torch.finfo(x.dtype).max)[1]  # 128 for float32, 1024 for float64
    return 2.0 ** ((maxexp - 4 - math.ceil(math.log2(max(x.numel(), 1)))) // 2)


def _pow2_at_least(r: torch.Tensor) -> torch.Tensor:
    """A power of two ≥ r, and ≥ 1 (1 exactly when r ≤ 1)."""
    return torch.exp2(torch.ceil(torch.log2(r))).clamp_min_(1.0)


@per_matrix  # Note [Per-matrix results are declared, not guessed]
def _rows_amax_abs(x: torch.Tensor, u: torch.Tensor, group=None) -> torch.Tensor:
    return rows_absmax(u, group)  # over all ranks' rows of a row-sharded point


def _component_amax(geo: Geometry, x: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    """max|ξ| per component of `component_inner` (matrix, entry, or the whole tensor)."""
    if geo.stiefel:  # one per matrix, reduced over the ranks of a row-sharded point
        return geo.apply(_rows_amax_abs, x, xi)
    if not geo.riemannian:  # a plain tensor: one component per entry
        return xi.abs()
    return xi.abs().amax()  # another geoopt manifold: one scale for the tensor

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

import math
from typing import ClassVar

import geoopt
import torch

from ..manifolds import Stiefel
from ..manifolds.kernels.basic import gram_minus_identity, polar_step, three_products
from ..manifolds.kernels.frame import positive_definite, replace_refused
from ..manifolds.kernels.msign import exact_scale
from ..manifolds.kernels.reduce import gram, rows_sum_squares
from ..manifolds.sharded import per_matrix
from . import terms
from .base import RiemannianOptimizer, check_choice, check_number
from .geometry import Geometry
from .registry import Passes, register

__all__ = ["POGO", "BASES", "pogo_step"]

BASES = ("sgd", "adam")

#: the options of one base and their defaults: set away from them on a group of the
#: other base, they would do nothing, so they are refused (`unused_options`)
BASE_OPTIONS = {
    "sgd": {"momentum": 0.0, "nesterov": False, "dampening": 0.0},
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8},
}

#: ‖XᴴX − I‖₂ of a point beyond which a step projects it first (`off_manifold_bound`,
#: Note [Off-manifold points at a step]; a midpoint's test is Note [POGO's basin])
BASIN = 1.0


def pogo_step(
    x: torch.Tensor,
    g: torch.Tensor,
    lr: float | torch.Tensor,
    lam: float = 0.5,
    group=None,
    checks: list | None = None,
    reads: bool = True,
) -> torch.Tensor:
    r"""One POGO step on tall points (Javaloy & Vergari 2026, arXiv 2602.14656).

    Note [POGO in column orientation]
    pogo-torch works on row-orthonormal P×N matrices X' (X'X'ᴴ = I) with the relative
    gradient ψ' = ½(X'X'ᴴG' − X'G'ᴴX'). For tall points X = X'ᵀ (XᴴX = I) and
    G = G'ᵀ the same step reads

        ψ = ½(G(XᴴX) − X(GᴴX)),   M = X − lr·ψ,   X ← M + λ(M − M(MᴴM)),

    every product through an M×M matrix (O(NM²), no N×N matrix). XᴴX is computed,
    not assumed to be I, as pogo-torch does, so the two agree step for step to
    rounding (the correction's MᴴM − I is formed more exactly here, Note [POGO's
    correction from the exact diagonal]).
    For XᴴX = I, ψ is half the canonical Riemannian gradient G − XGᴴX; the
    correction with λ = ½ is one Newton–Schulz step, which leaves a point at
    distance O(lr²‖ψ‖²) from the manifold whose error does not accumulate.
    XᴴX, GᴴX and MᴴM are products over the rows (`gram`): on row-sharded points
    (``group`` given, the process group the rows are split over) the step
    all-reduces three M×M matrices and MᴴM's diagonal, and updates the local rows.

    Note [POGO's basin]
    The correction maps each singular value σ of M to σ(1 + λ(1 − σ²)); iterated
    (one per step) it brings σ to 1 only from inside a basin, and a step so long
    that M leaves it (a learning rate of 1e10: ‖XᴴX − I‖_F = 1e55 after one step)
    is not a step of the method. With E = MᴴM − I, the correction keeps every σ positive
    exactly when σ² ∈ (0, 1 + 1/λ), i.e. every eigenvalue of E lies in (−1, 1/λ), and
    that range is kept: the largest value of σ(1 + λ(1 − σ²)) is 2((1 + λ)/3)^{3/2}/√λ,
    whose square is 4(1 + λ)²/27 ≤ 16/27 of 1 + 1/λ (λ = ½ maps it into (0, 1], one
    Newton–Schulz step). So the next steps' corrections keep σ positive and, with
    |1 − 2λ| < 1 the slope at 1, take it there. Outside, a σ is sent to 0 or below
    (the point loses rank or flips a column). The test is on the eigenvalues, not on
    ‖E‖_F < 1, a bound that refused steps of the method: a midpoint with ‖E‖_F = 1.06
    and eigenvalues in [0.09, 0.69] (pogo-torch takes it) was refused, and so was the
    same step at every later iteration of a full-batch run. The eigenvalues lie in
    (−1, 1/λ) ⇔ I + E and I − λE are positive definite (λ = 0, no correction: the
    first alone), decided by the infos of Cholesky factorizations of the two M×M
    matrices (on the device, no host read; no product E², which would cost six times
    their flops); a non-finite E is outside. Those factorizations cost as much as
    the step on a CPU batch of small matrices, one LAPACK call each, while a step
    of training has ‖E‖_F ≈ 1e-7: ‖E‖_F < 1, which implies the range, is the short
    path, and the eigenvalues are tested only where it fails (Note [Refused
    matrices in a step that reads nothing]).
    A matrix outside is returned as NaN, so that the optimizer's safe
    step (Note [Safe step]) skips the whole step with a warning and keeps the point.

    Args:
        x: points (..., N, M), N ≥ M.
        g: the base optimizer's direction G̃, same shape.
        lr: the step size.
        lam: λ of the correction, in [0, 1].
        group: the process group the rows are split over, or None.
        checks: where the short path's test is appended unread, or None (read).
        reads: False for a step that reads nothing: both paths, by ``torch.where``.

    Returns:
        The new points; NaN for a matrix whose step leaves the basin.
    """
    if isinstance(lam, int | float) and not 0 <= lam <= 1:  # the short path needs λ ≤ 1
        raise ValueError(f"pogo_step: lam={lam!r}; allowed: 0 <= lam <= 1")
    xx = gram(x, x, group)
    h = gram(g, x, group)  # GᴴX
    half = 0.5 * lr
    # Note [POGO's midpoint without ψ]
    # M = X − lr·½(G·XᴴX − X·GᴴX) = X + X(½lr·GᴴX) + G(−½lr·XᴴX): the same two
    # N×M×M products as ψ, accumulated on a copy of X by two fused multiply-adds,
    # instead of ψ, lr·ψ and X − lr·ψ (three more N×M passes). X is added, not
    # multiplied by I + ½lr·GᴴX: a product would round X itself over its M terms,
    # and that rounding is the drift the correction cannot remove
    mid = three_products(x, x, half * h, g, -half * xx)
    # Note [POGO's correction from the exact diagonal]
    # The correction removes MᴴM − I and leaves the rounding of that matrix: in
    # float32 the diagonal of the product MᴴM is off by about 1e-7, ten times the
    # drift of a rounded point, and was most of POGO's drift (pogo-torch's too).
    # Its diagonal is taken from M's columns instead (`gram_minus_identity`,
    # Note [The Gram's diagonal from offset squares]): one N×M pass more, and the
    # drift after 1000 float32 steps 0.3–0.6× pogo-torch's, the rest being the
    # off-diagonal rounding (docs/performance.md, "Batched regime (many small matrices)").
    e = gram_minus_identity(mid, group=group)
    # ‖E‖₂ ≤ ‖E‖_F < 1 ≤ 1/λ; a non-finite E is short too: its point is not finite, and
    # the safe step skips it without stepping the bucket again
    short = (~(torch.linalg.matrix_norm(e) >= 1))[..., None, None]

    def exact(select) -> torch.Tensor:
        # outside the basin MᴴM − I, and with it the corrected point, is NaN
        es = select(e)
        inside = _within_basin(es, lam)[..., None, None]
        return polar_step(select(mid), lam, torch.where(inside, es, math.nan))

    return replace_refused(polar_step(mid, lam, e), short, exact, checks, reads)


def _within_basin(e: torch.Tensor, lam: float) -> torch.Tensor:
    """Every eigenvalue of Hermitian E (..., M, M) in (−1, 1/λ), a flag per matrix.

    Note [POGO's basin]: I + E and I − λE positive definite (for λ > 0 the second is
    I/λ − E > 0; at λ = 0 it is I, no branch on a tensor λ).
    """
    eye = torch.eye(e.shape[-1], dtype=e.dtype, device=e.device)
    return positive_definite(eye + e, eye - lam * e) & torch.linalg.matrix_norm(e).isfinite()


def unused_options(group: dict, inherited: dict | None = None) -> list[str]:
    """The options of a group its base does not use, set away from what it would hold.

    Args:
        group: the param group (merged with the optimizer's defaults).
        inherited: the optimizer's defaults, which a group of another base inherits
            without setting them; None compares the defaults themselves with the
            signature's (`BASE_OPTIONS`).
    """

    def value(v):
        return tuple(v) if isinstance(v, list) else v

    return [
        f"{key}={group[key]!r}"
        for base, options in BASE_OPTIONS.items()
        if base != group["base"]
        for key, default in options.items()
        if value(group[key]) != value(default if inherited is None else inherited[key])
    ]


def _refuse_unused(group: dict, inherited: dict | None) -> None:
    unused = unused_options(group, inherited)
    if unused:
        hint = (  # OneCycleLR/CyclicLR cycle betas[0] where the optimizer has betas
            " (a scheduler's cycle_momentum sets betas[0] on every group: pass "
            "cycle_momentum=False)"
            if any(u.startswith("betas=") for u in unused)
            else ""
        )
        raise ValueError(
            f"pogo: {', '.join(unused)} in a param group with base={group['base']!r}, which "
            f"does not use them{hint}; allowed with base={group['base']!r}: "
            f"{', '.join(BASE_OPTIONS[group['base']])} (and lr, weight_decay, lam)"
        )


@per_matrix  # Note [Per-matrix results are declared, not guessed]
def _squared_norm(g: torch.Tensor, group=None) -> torch.Tensor:
    """‖G‖²_F per matrix in float64, shape (..., 1, 1) (Note [VectorAdam's second moment in
    float64]); on row-sharded points summed over all rows (split over ``group``)."""
    s = exact_scale(g, group)
    return rows_sum_squares(g / s, group).double() * s.double().square()


@register("pogo")
class POGO(RiemannianOptimizer):
    r"""POGO on St(N, M), O(n), U(n): a relative-gradient step and one polar-like correction.

    With G̃ the base optimizer's update of the gradient G (+ weight_decay·X),

        ψ = ½(G̃(XᴴX) − XG̃ᴴX),   M = X − lr·ψ,   X ← M + λ(M − MMᴴM),

    (`pogo_step`; pogo-torch's formula
    ½(XXᴴG̃ − XG̃ᴴX) on row-orthonormal matrices, transposed). No retraction: the
    point stays within O(lr²‖ψ‖²) of the manifold, the correction (one Newton–Schulz
    step for λ = ½) removing the first-order error at every step, so errors do not
    accumulate. Each step costs about 12NM² flops in matrix products, and two M×M
    Cholesky factorizations for its basin test (Note [POGO's basin]).

    Bases (G̃):

    - ``"sgd"``: momentum μ, dampening d, optional Nesterov, as pogo-torch's
      ``base.SGD`` (its first step sets B = (μ + 1 − d)·G: the buffer starts at G
      and is then updated once, unlike ``torch.optim.SGD``; followed so the two agree);
    - ``"adam"``: pogo-torch's ``base.VectorAdam``: Adam whose second moment is the
      squared Frobenius norm of each matrix, so G̃ is the first moment rescaled,
      never reshaped entry by entry (a rotation of G rotates G̃).

    Parameters on a manifold other than St/O/U (e.g. geoopt's Sphere) are refused
    at construction. As in pogo-torch, which treats every parameter it is given as
    orthogonal, a plain matrix (or batch of matrices, ``dim() >= 2``) is a point of
    St(N, M): a tall one as it is, a wide or square one through its transpose
    (pogo-torch's row-orthonormal default, its step to rounding); a parameter
    group's ``manifold=`` names another. Plain vectors (``dim() < 2``) get X ← X − lr·G̃
    (VectorAdam normalising by the whole tensor's norm).

    Points off the manifold are accepted (a state saved mid-training resumes), but
    one outside the correction's basin (‖XᴴX − I‖₂ ≥ 1 or rank-deficient: a weight
    scaled by 3, the zero matrix) is projected back with a warning at its first
    step, and a step that would leave the basin is skipped with a warning (Note
    [POGO's basin]).

    DTensor points (``Replicate()``, batch shards, ``Shard(0)`` on the rows of St(N, M))
    step on their local shards; a row-sharded step all-reduces XᴴX, G̃ᴴX, MᴴM (M×M)
    and VectorAdam's ‖G‖²_F, never the N×M point.

    Args:
        params: parameters or param groups.
        lr: step size (≥ 0).
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
        foreach: step parameters of the same kind as one batch (keyword-only; None:
            where it pays; False: each alone, the same result to rounding).
        capturable: no host read in a step, for CUDA graphs (keyword-only).
    """

    default_lr: ClassVar[float] = 0.01
    # it replaces its buffers (Note [A skipped step leaves the state as it was])
    writes_state_in_place: ClassVar[bool] = False
    buckets_points: ClassVar[bool] = True  # its kernels reduce per matrix
    # one polar-like correction per step: the iterate is near the manifold (error of
    # order (lr‖ψ‖)² per step, not decaying to rounding), like landing's
    feasible: ClassVar[bool] = False
    # so a state saved mid-training (its point near the manifold) loads and steps on
    accepts_off_manifold: ClassVar[bool] = True
    off_manifold_bound: ClassVar[float] = BASIN
    # Note [VectorAdam's second moment in float64]: float64 whatever the parameter's dtype
    wide_state: ClassVar[frozenset[str]] = frozenset({"exp_avg_sq"})
    formula: ClassVar[str] = (
        "midpoint: 8NM², correction: 4NM², MᴴM's diagonal: 3NM, basin test: 2M³/3 "
        "(two M×M Cholesky factorizations)"
    )

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
        foreach: bool | None = None,
        capturable: bool = False,
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
        super().__init__(
            params, defaults, telemetry=telemetry, foreach=foreach, capturable=capturable
        )

    # ‖G‖, Grams of X, m (X, G, m); MᴴM's diagonal (X, m); update (X, G, m → X, m)
    step_bytes = Passes(reads=8, writes=2)

    @classmethod
    def step_flops(cls, n: int, m: int, **_: object) -> float:
        """Real flops of one step on a real N×M point: 12NM² + 9NM + 2M³/3.

        Six N×M×M products: the Grams XᴴX, G̃ᴴX and MᴴM, the midpoint M (two,
        Note [POGO's midpoint without ψ]) and the correction M·((1 + λ)I − λMᴴM);
        then VectorAdam's first moment (a lerp), ‖G‖² (a scaling and a sum) and MᴴM's
        diagonal from M's offset squares (a multiply-add and a sum, Note [POGO's
        correction from the exact diagonal]); the basin test's two Cholesky
        factorizations of M×M matrices (Note [POGO's basin]).
        """
        return 12.0 * n * m * m + 9.0 * n * m + 2.0 * m**3 / 3.0

    def check_group(self, group: dict, defaults: bool = False) -> None:
        super().check_group(group, defaults)
        check_number("lr", group["lr"])  # ≥ 0, as torch's (a schedule may reach 0)
        check_choice("base", group["base"], BASES)
        terms.check_momentum(group)
        terms.check_betas(group)
        check_number("eps", group["eps"], low_open=True)
        check_number("weight_decay", group["weight_decay"])
        check_number("lam", group["lam"], high=1.0, closed_high=True)
        _refuse_unused(group, None if defaults else self.defaults)

    def implied_manifold(self, p: torch.Tensor) -> tuple[geoopt.Manifold, bool] | None:
        """A plain matrix is a point of St (pogo-torch's rows: wide and square ones transposed)."""
        if p.dim() < 2:
            return None
        n, m = p.shape[-2:]
        return Stiefel(max(n, m), min(n, m), complex=p.is_complex()), n <= m

    def check_parameter(self, i: int, p: torch.Tensor, geo: Geometry, group: dict) -> None:
        if geo.riemannian and not geo.stiefel:
            man = getattr(geo, "manifold", None)
            raise ValueError(
                f"pogo: parameter {i} of the new param group lies on {man!r}, not a "
                "Stiefel manifold; allowed: parameters on St(N, M), O(n), U(n) (this "
                "package's or geoopt's Stiefel manifolds) or plain tensors"
            )

    # ------------------------------------------------------------------ base optimizers
    @staticmethod
    def _sgd(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        mu = group["momentum"]
        if mu == 0:
            return grad
        # pogo-torch's first buffer: G, then updated
        buf = terms.momentum(state.get("momentum_buffer"), grad, mu, group["dampening"],
                             update_first=True)  # fmt: skip
        state["momentum_buffer"] = buf
        return terms.nesterov(grad, buf, mu) if group["nesterov"] else buf

    @staticmethod
    def _vector_adam(
        grad: torch.Tensor, state: dict, group: dict, geo: Geometry
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """VectorAdam's G̃ as (m, c), G̃ = c·m with c = 1/(bc₁(√(v/bc₂) + ε)) one number per matrix.

        G̃ is the first moment times a scalar: the caller folds c into the step size
        (the M×M coefficients of `pogo_step`) instead of writing G̃.
        """
        b1, b2 = group["betas"]
        t = state["step"].double()  # a tensor: no host read in a traced step
        # Note [VectorAdam's second moment in float64]
        # The first step is G/(‖G‖_F + ε): it does not depend on the scale of G, but
        # ‖G‖²_F overflows float32 for entries above ~1e18 (the step became 0, then
        # was skipped) and underflows below ~1e-19. v, one number per matrix, is kept
        # in float64, whose range holds the square of every float32 norm; ‖G‖²_F is
        # summed in the working dtype on G divided exactly by a power of two
        # (`exact_scale`, Note [msign at any scale]) and the scale put back in float64.
        if geo.stiefel:  # ‖G‖²_F per matrix, summed over all rows of a row-sharded point
            sq = geo.apply(_squared_norm, grad)
        else:
            dims = tuple(range(grad.dim()))
            wide = torch.complex128 if grad.is_complex() else torch.float64
            sq = torch.linalg.vector_norm(grad, dim=dims, keepdim=True, dtype=wide).square()
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(sq)
        m = state["exp_avg"] = state["exp_avg"].lerp(grad, 1 - b1)
        v = state["exp_avg_sq"] = state["exp_avg_sq"].to(sq.dtype).mul(b2).add_(sq, alpha=1 - b2)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        return m, (1 / (bc1 * (v.sqrt() / bc2**0.5 + group["eps"]))).to(m.real.dtype)

    def update(
        self, geo: Geometry, x: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> torch.Tensor:
        g = terms.weight_decay(grad, x, group["weight_decay"])  # pogo-torch's add(alpha=wd)
        lr = group["lr"]
        if group["base"] == "sgd":
            g = self._sgd(g, state, group)
        else:
            g, scale = self._vector_adam(g, state, group, geo)
            lr = lr * scale
        if geo.stiefel:  # through the geometry: M×M all-reduces on a row-sharded point
            tests = getattr(geo, "kernel_tests", dict)()  # a plugin geometry: read the tests
            return geo.apply(pogo_step, x, g, lr, group["lam"], **tests)
        return x - lr * g

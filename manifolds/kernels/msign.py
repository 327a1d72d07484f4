r"""The matrix sign (polar factor) engine: ``msign(G) = U Vᴴ`` for G = U Σ Vᴴ.

For a tall or wide matrix G of full rank, msign(G) = G (GᴴG)^{-1/2} is the
polar factor of G: the point with orthonormal columns (rows) nearest to G, and
the maximiser of Re tr(GᴴΦ) over the spectral-norm ball ‖Φ‖₂ ≤ 1 (the Muon
update). Singular values equal to zero map to zero (sign(0) = 0), so the
result of a rank-deficient G has spectral norm 1 on G's range only.

Methods (every one batched over leading dimensions, real or complex):

- ``"newton_schulz"``: the quintic iteration X ← aX + bX(XᴴX) + cX(XᴴX)² with
  Muon's coefficients (a, b, c) = (3.4445, −4.7750, 2.0315) (K. Jordan 2024).
  They maximise the slope at 0, so small singular values grow fast, but the
  iteration does not converge to 1: the singular values end in about
  [0.7, 1.2]. A fast, rough direction (Muon's own use), not a polar factor.
- ``"newton_schulz_cubic"``: the classical iteration X ← X(3I − XᴴX)/2, which
  converges (quadratically near 1) for singular values in (0, √3); small ones
  grow by 1.5× per step, so an ill-conditioned G needs many steps.
- ``"polar_express"``: Amsel, Persson, Musco & Gower (2025), "The Polar
  Express": at iteration k the odd quintic p_k(x) = a_k x + b_k x³ + c_k x⁵
  that is minimax-optimal for sign(x) on the interval [ℓ_k, u_k] where the
  singular values lie after k − 1 steps (ℓ₁ = 10⁻³, u₁ = 1). The published
  coefficients are used, divided by 1.01, 1.01³, 1.01⁵ (the paper's safety
  factor against rounding) except the last; from the eighth step on the
  polynomial is the fixed (15x − 10x³ + 3x⁵)/8, the quintic Newton–Schulz map
  with cubic convergence.
- ``"svd"``: the exact reference U diag(σ > tol) Vᴴ from one SVD,
  tol = max(N, M)·eps·σ_max.

The iterative methods start from G divided by its Frobenius norm (‖G‖_F ≥ ‖G‖₂,
so every singular value is in (0, 1]); Polar Express by 1.01‖G‖_F (Note [msign
at any scale]). Every step works through the smaller Gram matrix, by one of two
engines (`stiefel.manifolds.kernels.polynomial_sign`, ``engine=``): ``"direct"``
re-forms it from X every step (4NM² + 2M³ real flops per step for a tall N×M
matrix, ×4 for complex); ``"gram"`` (Gram Newton–Schulz) touches the N×M matrix
only at the start, every third step and the end, and iterates on M×M matrices
between. The default ``"auto"`` takes the one of fewer flops: Gram when the long
side exceeds 1.5 × the short one, e.g. 1.5× fewer flops for Polar Express-5 on
1024×4096. Half-precision inputs are computed in float32 and returned in their dtype.

Accuracy, measured in float64 by ``tests/manifolds/test_msign.py::test_accuracy_table``
(it prints this table with ``pytest -s`` and asserts its converged entries): the
largest deviation max_i |σ_i(msign(G)) − 1| for a 256×64 Gaussian G (κ ≈ 3)
and for a 256×64 G with singular values log-spaced in [10⁻³, 1] (κ = 10³):

```text
steps   newton_schulz      newton_schulz_cubic   polar_express
        gauss   κ=1e3      gauss    κ=1e3        gauss    κ=1e3
  3     0.32    0.98       0.79     1.0          0.85     0.94
  5     0.32    0.79       0.55     1.0          0.13     0.58
  6     0.32    0.32       0.37     0.99         2.5e-3   0.30
  7     0.32    0.32       0.18     0.99         4.6e-6   0.058
  8     0.32    0.32       0.046    0.99         9e-16    4.8e-4
 10     0.32    0.32       1.5e-5   0.97         1e-15    2e-15
 12     0.32    0.32       9e-16    0.94         1e-15    1e-15
 20     0.32    0.32       9e-16    0.067        1e-15    1e-15
 30     0.32    0.32       7e-16    9e-16        1e-15    1e-15
```

Muon's quintic stalls at 0.32 by design; Polar Express reaches float64
rounding in 8–10 steps where the cubic iteration needs 12–30. (256×64 runs the
Gram engine by default; the direct engine gives the same table.)

Example:
```python
import torch
from stiefel.manifolds.kernels import msign

g = torch.randn(4, 100, 8, dtype=torch.float64)
q = msign(g, method="polar_express", steps=10)
exact = msign(g, method="svd")
assert torch.allclose(q, exact, atol=1e-10)
assert torch.allclose(q.mH @ q, torch.eye(8, dtype=torch.float64).expand(4, 8, 8), atol=1e-10)
```
"""

from __future__ import annotations

import torch

from ..._core.checks import LOW_PRECISION, choice, positive_int
from .basic import inner_euclidean, product_on, sub_product, sym
from .polynomial_sign import ENGINES, engine_flops, exact_scale, iterate
from .reduce import gram

__all__ = [
    "MSIGN_METHODS",
    "MSIGN_ENGINES",
    "MSIGN_DEFAULT_STEPS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "MUON_QUINTIC_COEFFICIENTS",
    "SHARPEN_STEPS",
    "SHARPENED_METHODS",
    "exact_scale",
    "msign",
    "msign_flops",
    "spectral_direction",
]

MSIGN_METHODS = ("newton_schulz", "newton_schulz_cubic", "polar_express", "svd")
MSIGN_ENGINES = ENGINES

# Steps used when ``steps`` is None; chosen from the accuracy table above.
MSIGN_DEFAULT_STEPS = {
    "newton_schulz": 5,
    "newton_schulz_cubic": 30,
    "polar_express": 10,
    "svd": 1,
}

MUON_QUINTIC_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

_PE_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# Note [Polar Express safety factor]
# The paper divides every polynomial but the last by 1.01 in its argument
# (p(x/1.01)), so that singular values pushed slightly above 1 by rounding stay
# inside the interval the next polynomial was optimised for. The last, fixed
# polynomial is the quintic Newton–Schulz map, stable on its own.
POLAR_EXPRESS_COEFFICIENTS = tuple(
    (a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE_RAW[:-1]
) + (_PE_RAW[-1],)

# Note [A dead zone for the dual descent]
# An iterative msign is an odd polynomial p of the singular values with p(σ) ≈ p'(0)σ
# below its resolution: p'(0) = Π a_k/1.01 ≈ 2.2e4 for Polar Express at 10 steps, 1.5³⁰
# ≈ 1.9e5 for the cubic. The dual descent (`spectral_direction`) is then gradient
# descent on Σ P(σ_i(Z)), P' = p, whose curvature at a zero singular value of Z is
# p'(0)/(1.01‖Z‖_F), with a step t ≈ ‖Z‖_F/√M. Where Z = G + XΛ is rank-deficient (a
# Riemannian gradient of rank below M: fewer samples than M, a least-squares loss
# whose XᴴG is symmetric up to low rank) its null-space component e is multiplied by
# up to 1 + t·p'(0)/(1.01‖Z‖_F) ≈ 1 + 2.2e4/√M per inner step: rounding (1e-16)
# reached p's resolution in four steps (St(12, 6), float64), and the step depended on
# it by 3e-4. Exact msign maps σ ≤ N·eps·σ_max to 0 and has no such growth.
# Inside the descent p is followed by SHARPEN_STEPS steps of h(s) = (5s³ − 3s⁵)/2:
# h(0) = h'(0) = 0, h(1) = 1, h'(1) = 0, increasing on [0, 1] with fixed points 0,
# √(2/3) and 1. The composite has zero slope at 0 (e changes by O((p'(0)e)⁹)), so
# rounding stays rounding, while a converged sign (σ(Φ) ∈ {0, 1}) is unchanged: it is
# exact msign with its threshold at the resolution ~‖Z‖_F/p'(0) instead of N·eps·σ_max.
# Two steps, not one: float32 rounding (e ≈ 1e-7‖Z‖_F) is within 1/p'(0) by less than
# 10³, and one step, slope O((p'(0)e)²), still let it grow. On O(n) (one msign, no
# descent) the null-space rounding of a rank-deficient skew Z was multiplied by p'(0)
# once: it is sharpened too. ‖W‖₂ ≤ 1.05 in h's steps: the Gram engine needs no restart
# in them, and costs 6–8 more M×M products (no N×M one, no all-reduce); the direct
# engine (N ≤ 1.5M, O(n)) two more steps.
# Muon's quintic ends in [0.7, 1.2], where h is no sign (h(1.2) ≈ 0.6), and so may a
# method run for fewer than its default steps (above √(5/3) h turns negative and grows
# as s⁵: Polar Express at 3 steps gave 2e6; its slope at 0 is smaller): not sharpened.
SHARPEN, SHARPEN_STEPS = (0.0, 2.5, -1.5), 2
SHARPENED_METHODS = ("newton_schulz_cubic", "polar_express")


def _sharpened(method: str, steps: int) -> bool:  # Note [A dead zone for the dual descent]
    return method in SHARPENED_METHODS and steps >= MSIGN_DEFAULT_STEPS[method]


def _check(method: str, steps: int | None) -> int:
    choice("method", method, MSIGN_METHODS)
    steps = positive_int("steps", steps, none_ok=True)
    return MSIGN_DEFAULT_STEPS[method] if steps is None else steps


def _svd_sign(g: torch.Tensor) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    tol = max(g.shape[-2:]) * torch.finfo(s.dtype).eps * s[..., :1]
    keep = (s > tol).to(u.dtype)
    return (u * keep.unsqueeze(-2)) @ vh


def _real_trace(a: torch.Tensor, b: torch.Tensor, group) -> torch.Tensor:
    # Re tr(AᴴB) per matrix, shape (..., 1, 1), summed over all rows (reduce)
    return inner_euclidean(a, a, b, keepdim=True, group=group)


def _unit_scale(a: torch.Tensor, group) -> torch.Tensor:
    return a / exact_scale(a, group)


def _frobenius(a: torch.Tensor, group) -> torch.Tensor:
    # ‖A‖_F per matrix, shape (..., 1, 1), summed over all rows (reduce)
    return _real_trace(a, a, group).sqrt()


def _coefficients(method: str, steps: int) -> tuple[list[tuple[float, float, float]], float]:
    # the (a, b, c) of each step and the factor the Frobenius norm is multiplied by
    if method == "newton_schulz":
        return [MUON_QUINTIC_COEFFICIENTS] * steps, 1.0
    if method == "newton_schulz_cubic":
        return [(1.5, -0.5, 0.0)] * steps, 1.0
    pe = POLAR_EXPRESS_COEFFICIENTS
    return [pe[min(k, len(pe) - 1)] for k in range(steps)], 1.01


def _engine(engine: str, method: str, steps: int, n: int, m: int, sharded: bool, tail=0) -> str:
    # Note [The cheaper engine]
    # "auto" takes the engine of fewer flops (`engine_flops`): the Gram engine exactly
    # when the long side exceeds 1.5 × the short one (Note [Restart every third
    # step]), the direct one on square and nearly square matrices. On row-sharded
    # rows every Gram is an all-reduce and the local row count may differ between
    # ranks (which must run the same collectives): there "auto" is the Gram engine,
    # 1 + restarts all-reduces of an M×M matrix instead of one per step.
    if engine != "auto":
        return engine
    if sharded:
        return "gram"
    quintic = method != "newton_schulz_cubic"
    gram_flops = engine_flops(n, m, steps, quintic, "gram", tail)
    return "gram" if gram_flops < engine_flops(n, m, steps, quintic, "direct") else "direct"


def msign(
    g: torch.Tensor,
    method: str = "polar_express",
    steps: int | None = None,
    *,
    engine: str = "auto",
    group=None,
) -> torch.Tensor:
    r"""Matrix sign U Vᴴ of a batch of matrices G = U Σ Vᴴ (shape (..., N, M)).

    Args:
        g: real or complex tensor with at least two dimensions.
        method: ``"newton_schulz"`` (Muon's quintic), ``"newton_schulz_cubic"``,
            ``"polar_express"`` or ``"svd"`` (exact); see the module docstring.
        steps: iterations (ignored by ``"svd"``); None uses
            ``MSIGN_DEFAULT_STEPS[method]``.
        engine: how an iterative method forms its products (keyword-only):
            ``"direct"`` (on the N×M matrix every step), ``"gram"`` (on the M×M Gram,
            the N×M matrix only at the start, every third step and the end:
            `stiefel.manifolds.kernels.polynomial_sign`) or ``"auto"`` (the one of
            fewer flops: Gram when the long side exceeds 1.5 × the short one). The
            same polynomials, equal in exact arithmetic; ignored by ``"svd"``.
        group: the process group the rows of ``g`` are split over (``g`` holds this
            rank's rows; Note [Row-sharded kernels] in
            `stiefel.manifolds.kernels.reduce`), or None for whole matrices.

    Returns:
        A tensor like ``g``: its polar factor (approximate for the iterative methods).

    Raises:
        ValueError: unknown ``method`` or ``engine``, ``steps`` < 1, ``g`` with fewer
            than 2 dimensions, or ``"svd"`` on row-sharded matrices (``group``
            given).
        TypeError: ``g`` not a floating or complex tensor.

    Note [msign on sharded rows]
    Every iterative method is an odd polynomial p(G) = G·q(GᴴG) (q a polynomial,
    GᴴG the Gram over the rows), the same matrix as q(GGᴴ)·G: so the iteration may
    run on either Gram, and a single process takes the smaller one. When the rows
    of G are split over ranks (``group``), only GᴴG (M×M) can be formed without
    moving rows: it is all-reduced (`gram`), and so is the Frobenius scaling (its
    trace), and each rank multiplies its own rows, X_r ← X_r·W; the result equals
    the single-process one to rounding, whatever N/p is relative to M. The exact
    ``"svd"`` needs the whole matrix and is refused there.
    """
    return _msign(g, method, _check(method, steps), engine, group, sharpen=False)


def _msign(g, method: str, steps: int, engine: str, group, sharpen: bool) -> torch.Tensor:
    # msign, with the dead zone of the descent if ``sharpen`` (Note [A dead zone ...])
    choice("engine", engine, ENGINES)
    if not isinstance(g, torch.Tensor) or not (g.is_floating_point() or g.is_complex()):
        raise TypeError(f"msign needs a floating or complex tensor, got {type(g).__name__}")
    if g.dim() < 2:
        raise ValueError(f"msign needs a matrix (..., N, M), got shape {tuple(g.shape)}")
    dtype = g.dtype
    if dtype in LOW_PRECISION:
        g = g.float()
    sharded = group is not None
    if method == "svd":
        if sharded:
            raise ValueError(
                "msign method='svd' (one SVD of the whole matrix) does not run on row-sharded "
                "matrices (DTensor Shard on the rows); allowed there: "
                f"{', '.join(m for m in MSIGN_METHODS if m != 'svd')} (M×M Grams only); "
                "'svd' is allowed on Replicate() and batch-sharded points"
            )
        return _svd_sign(g).to(dtype)
    # square G runs as wide: Grams G·Gᴴ of row-major G (Note [Products in the layout of X])
    wide = not sharded and g.shape[-2] <= g.shape[-1]
    x = g.mH if wide else g
    coefficients, safety = _coefficients(method, steps)
    tail = SHARPEN_STEPS if sharpen else 0
    coefficients += [SHARPEN] * tail
    engine = _engine(engine, method, len(coefficients), *x.shape[-2:], sharded, tail)
    # Note [msign at any scale]
    # msign(cG) = msign(G) for every c > 0, so the result must not depend on the
    # scale of G; but ‖G‖_F² overflows for entries above ~1e19 (float32: the
    # factor came out 0) and underflows below ~1e-19 (the division by a zero norm
    # then blew the iteration up to NaN). G is first divided by the power of two
    # nearest below max|G_ij|, exactly (no rounding), so the entries lie in
    # [1, 2) at most and ‖G‖_F² in [1, 4NM): neither can happen. An all-zero
    # matrix keeps its zero sign. (`iterate` does it, Note [Normalization on the Gram].)
    x = iterate(x, coefficients, safety, engine, group, tail)
    return (x.mH if wide else x).to(dtype)


def msign_flops(
    n: int,
    m: int,
    method: str = "polar_express",
    steps: int | None = None,
    *,
    engine: str = "auto",
    sharpen: bool = False,
) -> float:
    """Real floating-point operations of one `msign` of a real N×M matrix (model).

    With N ≥ M (else swapped), a direct step costs XᴴX and X·W (2NM² each) and the
    square of the Gram matrix for the quintics (2M³); the Gram engine 2NM² at the
    start and the end, 4NM² per restart and at most four M×M products per step
    (`stiefel.manifolds.kernels.polynomial_sign.engine_flops`); both add 2NM for the
    scaling. ``engine="auto"`` counts the engine `msign` takes. The SVD is counted as
    6NM² + 8M³ (thin SVD and the product U Vᴴ). ``sharpen``: the sign of
    `spectral_direction` (Note [A dead zone for the dual descent]).
    """
    steps = _check(method, steps)
    choice("engine", engine, ENGINES)
    big, small = max(n, m), min(n, m)
    if method == "svd":
        return float(4 * big * small**2 + 8 * small**3 + 2 * big * small**2)
    tail = SHARPEN_STEPS if sharpen and _sharpened(method, steps) else 0
    engine = _engine(engine, method, steps + tail, big, small, False, tail)
    return engine_flops(big, small, steps + tail, method != "newton_schulz_cubic", engine, tail)


def spectral_direction(
    x: torch.Tensor,
    g: torch.Tensor,
    inner_steps: int = 5,
    method: str = "polar_express",
    steps: int | None = None,
    dual_step: float = 0.5,
    *,
    square: bool | None = None,
    group=None,
) -> torch.Tensor:
    r"""The tangent Φ at X with ‖Φ‖₂ ≤ 1 maximising Re tr(GᴴΦ) (manifold Muon), by dual descent.

    Solves max Re tr(GᴴΦ) s.t. ‖Φ‖₂ ≤ 1, sym(XᴴΦ) = 0 on St(N, M) (tall X, XᴴX = I).

    Note [Dual of the spectral steepest-descent problem]
    With a Hermitian multiplier Λ for the tangency constraint the Lagrangian is
    Re tr((G + XΛ)ᴴΦ) (because Re tr(Λ sym(XᴴΦ)) = Re tr((XΛ)ᴴΦ)), whose maximum over
    the spectral ball is the nuclear norm: the dual function is f(Λ) = ‖G + XΛ‖_*,
    convex, with maximiser Φ(Λ) = msign(G + XΛ) and gradient ∇f(Λ) = sym(XᴴΦ(Λ))
    (smooth where G + XΛ has full rank). Strong duality holds (Slater: Φ = 0 is
    strictly feasible in the norm), so Φ(Λ*) at the minimiser Λ* is tangent and optimal
    (J. Bernstein, Modula docs "Stiefel manifold" 2025; J. Su 2025). We descend f:
    Λ ← Λ − t·sym(XᴴΦ), starting from Λ₀ = −sym(XᴴG), which makes G + XΛ₀ the
    Euclidean Riemannian gradient. On O(n)/U(n) (N = M) that start is already
    optimal: G + XΛ₀ = X skew(XᴴG) and msign of a skew-Hermitian matrix is
    skew-Hermitian, so XᴴΦ is skew and no iteration is needed beyond the first msign.

    Note [Step of the dual descent]
    f is positively homogeneous of degree 1 and its curvature near Λ* is about
    1/σ_min(G + XΛ), so the step is t = ``dual_step`` × ‖G + XΛ₀‖_F/√M (the rms
    singular value), per matrix. A trial step that does not decrease f, evaluated as
    Re tr(ΦᴴZ) = ‖Z‖_* with the step's own msign (up to a few ulps of rounding), is
    rejected and t halved for that matrix: the iteration is monotone, needs no SVD,
    and is batched. Its msign maps the singular values of G + XΛ below its resolution
    to 0 (Note [A dead zone for the dual descent]), so rounding does not grow. The
    result is projected onto the tangent space, Φ − X sym(XᴴΦ) (a no-op at
    convergence), so every retraction moves along the same tangent.

    Where the optimal G + XΛ* is rank-deficient (often if 1 ≤ N − M < M, or G has rank
    below M) f is not smooth there, and the descent stalls short of the optimum: the
    direction is then approximate (a descent direction: the first iterate is msign of
    the Riemannian gradient, whose inner product with G is its nuclear norm).

    Args:
        x: points (..., N, M), N ≥ M.
        g: Euclidean gradients, same shape.
        inner_steps: msign evaluations (≥ 1); 1 returns msign(G + XΛ₀).
        method: msign method (see `msign`).
        steps: msign iterations (None: the method's default).
        dual_step: t as a multiple of the rms singular value of G + XΛ₀.
        square: whether the points are square (O(n), U(n): N = M); None reads it
            from ``x``'s shape. Pass it when ``x`` holds the local rows of
            row-sharded points (``group`` given).
        group: the process group the rows of ``x`` and ``g`` are split over, or
            None: every product over the rows then goes through `gram` and the
            norms through `rows_sum` over it, so the step all-reduces M×M
            matrices only.

    Returns:
        Φ, shape of ``x``: tangent, with ‖Φ‖₂ ≤ 1 (Note [The tangent direction within
        the ball]; on O(n), U(n) to msign's accuracy).
    """
    m = x.shape[-1]
    if square is None:
        square = x.shape[-2] == m
    # Φ maximises Re tr(GᴴΦ), so it is that of cG for every c > 0; the step t and the
    # trial values f scale with G and would overflow or underflow with ‖G‖²_F (a
    # float32 gradient of 1e20 or 1e-30 left the dual descent at its first iterate):
    # the descent runs on G scaled exactly to unit size (Note [msign at any scale]).
    g = _unit_scale(g, group)
    lam = -sym(gram(x, g, group))
    # Z, its trial points and Φ stay in G's layout, and so does msign's result
    # (Note [Accumulating into a column-major batch]): the sums and selections below
    # then read their operands in one order
    z = product_on(g, x, lam)
    t = dual_step * _frobenius(z, group) / m**0.5
    sign = dict(method=method, steps=_check(method, steps), engine="auto", group=group)
    sign["sharpen"] = _sharpened(method, sign["steps"])  # Note [A dead zone for the ...]
    phi = _msign(z, **sign)
    c = sym(gram(x, phi, group))
    if square:  # O(n), U(n): Φ(Λ₀) is optimal (Note [Dual of ...])
        return sub_product(phi, x, c)
    f = _real_trace(phi, z, group)
    slack = 8 * torch.finfo(f.dtype).eps
    for _ in range(inner_steps - 1):
        z_new = product_on(z, x, t.to(c.dtype) * c, alpha=-1)
        phi_new = _msign(z_new, **sign)
        f_new = _real_trace(phi_new, z_new, group)
        ok = f_new <= f + slack * f.abs()
        z = torch.where(ok, z_new, z)
        phi = torch.where(ok, phi_new, phi)
        f = torch.where(ok, f_new, f)
        c = torch.where(ok, sym(gram(x, phi_new, group)), c)
        t = torch.where(ok, t, 0.5 * t)
    return _within_ball(sub_product(phi, x, c), group)


def _within_ball(phi: torch.Tensor, group) -> torch.Tensor:
    """Φ / max(1, √‖ΦᴴΦ‖_∞): a tangent Φ brought into the spectral unit ball.

    Note [The tangent direction within the ball]
    Before the dual residual vanishes, msign(G + XΛ) is not tangent, and its
    projection onto the tangent space, Φ − X sym(XᴴΦ), can leave the ball by up
    to ‖sym(XᴴΦ)‖ (where 1 ≤ N − M < M slows the descent, or after one inner
    step): a step longer than the ``lr`` it promises. The tangent space is a
    linear subspace, so dividing by a bound on the spectral norm keeps Φ tangent
    and brings it into the ball. The bound is √‖ΦᴴΦ‖_∞, the largest absolute row
    sum of the M×M Gram (summed over the rows of ``group``): no eigenvalue
    exceeds it (Gershgorin), and it is exact where ΦᴴΦ = I, the Gram of a
    converged msign, which is then left as it is to rounding. The exact norm
    would take an eigenvalue solver per matrix and step (a LAPACK call per
    matrix of a CPU batch) to shorten steps that are approximate anyway.
    """
    bound = gram(phi, phi, group).abs().sum(-1, keepdim=True).amax(-2, keepdim=True)
    return phi / bound.clamp_min(1.0).sqrt().to(phi.dtype)

r"""The two engines of msign's polynomial iterations: on the matrix, or on its Gram.

Every iterative `msign` method applies odd polynomials p_k(x) = a_k x + b_k x³ +
c_k x⁵ to the singular values of a tall N×M matrix X (N ≥ M):

    X_{k+1} = X_k W_k,   W_k = a_k I + b_k R_k + c_k R_k²,   R_k = X_kᴴ X_k  (M×M).

Both engines compute this composition; they differ in which products they form.

- ``"direct"``: each step forms R_k from X_k (2NM² flops), W_k (2M³) and X_k W_k
  (2NM²): steps × (4NM² + 2M³).
- ``"gram"`` (J. Zhang, N. Amsel, B. Chen & T. Dao 2026, "Gram Newton–Schulz"):
  the N×M matrix is touched only at the start (R_0), at a restart and at the end.
  Between, R and the accumulated factor Q (X_k = X_r Q) are updated in the M×M
  space, Q ← Q W_k and R ← W_k R W_k (Note [The Gram iteration]): 2NM² at the start
  and the end, 4NM² per restart, and at most 8M³ per step. For N > 1.5M it needs
  fewer flops than the direct engine at every number of steps (`engine_flops`).

Note [The Gram iteration]
Between two restarts every R_k, W_k and Q_k is a polynomial in the same Hermitian
R_r, so they commute: X_{k+1}ᴴX_{k+1} = W_kᴴ R_k W_k = W_k R_k W_k, and
X_{k+1} = X_r Q_k W_k. So R_{k+1} = W_k (R_k W_k) and Q_{k+1} = Q_k W_k are two and
one M×M products, W_k one (R_k², none for the cubic), and X_r Q one N×M product at
the end. In exact arithmetic the result is the direct engine's.

Note [Restart every third step]
The direct engine loses nothing to the accumulation: every step recomputes R from
X. The Gram engine's R and Q carry the rounding of every step since the last
restart, amplified by Q: X_r Q with ‖Q‖₂ ≈ 1/σ_min(X_r) (the smallest singular value
grows by the slope a_k per step). A restart (X_r ← X_r Q, R ← X_rᴴX_r) bounds that
growth; Polar Express grows the smallest singular value by 8.2 × 4.1 × 3.9 ≈ 130 in
its first three steps and Muon's quintic by 3.4³ ≈ 41. Restarting after every third
step keeps the float32 result as accurate as the direct engine's, measured against
the SVD polar factor (1024×256 and 768×384, Gaussian and singular values log-spaced
over 10³, 5–12 steps); restarting after the second step only (the package's
schedule for its five steps) leaves a κ = 10³ input 30× less accurate at ten steps.
Each restart costs two N×M products and saves three M×M ones, so for every number
of steps the Gram engine is the cheaper one exactly when N > 1.5M.

Note [Products in the layout of X]
X·W = (Wᴴ·Xᴴ)ᴴ. When X is stored as the conjugate transpose of a row-major matrix
(a wide or square input, transposed to run tall), X·W is formed as (Wᴴ·Xᴴ)ᴴ: the
BLAS then multiplies the row-major Xᴴ from the left, and every iterate keeps that
layout, so each Gram is A·Aᴴ of a row-major A (the products torch.optim.Muon forms).
Using W for Wᴴ (equal in exact arithmetic: W is a polynomial in a Hermitian R)
would save the transposed read of an M×M operand but let the rounding asymmetry of
the Gram engine's accumulated Q into the result (complex64: 5× the direct
engine's error), so the identity is used as it stands.

Note [The identity term as a scale]
W = aI + V with V = bR + cR², so a product by W is Y·W = aY + Y·V: one ``baddbmm``
with β = a (torch.optim.Muon's X ← aX + BX, B = bA + cA²), where forming W takes a
diagonal view and an add per step before its product: two launches more per step
for the same flops. The Gram engine updates Q and R this way; its result is as
accurate as with W formed (float32, against the SVD polar factor: within 8 % at
κ = 1 and as accurate or better at κ ≥ 10, real and complex). The direct engine
keeps W whole: near convergence W ≈ I while a ≈ 1.9 and V ≈ −0.9I, so aX + XV
rounds each entry at the scale |a| + |b + c| rather than |a + b + c| = 1, and a
well-conditioned float32 input came out 4× less accurate. W is also formed whole
where it starts a product, at the first step (it carries the normalization) and
after a restart (Q starts as W).

Note [Normalization on the Gram]
The iteration starts from X / ‖X‖_F (times a safety factor for Polar Express).
‖X‖²_F = tr(XᴴX) is the trace of the first Gram, which both engines form anyway; so
the first Gram is divided by c = (safety · ‖X‖_F)² and the factor c^{-1/2} is put
into W_0 (M×M): no N×M pass computes the norm or divides by it. X itself is first
divided exactly by a power of two (Note [msign at any scale]) so that the Gram
neither overflows nor underflows.

Example:
```python
import torch
from stiefel.manifolds.kernels.polynomial_sign import engine_flops, iterate

x = torch.randn(200, 10, dtype=torch.float64)
quintic = [(1.875, -1.25, 0.375)] * 30  # converges to the polar factor
direct = iterate(x, quintic, 1.0, "direct")
gram = iterate(x, quintic, 1.0, "gram")
assert torch.allclose(direct, gram, atol=1e-12)
assert engine_flops(200, 10, 30, True, "gram") < engine_flops(200, 10, 30, True, "direct")
```
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .reduce import flat, gram, product, rows_absmax

__all__ = ["ENGINES", "RESTART_EVERY", "exact_scale", "iterate", "engine_flops", "restarts"]

#: ``"auto"`` is resolved by `msign` (the cheaper of the two by `engine_flops`)
ENGINES = ("auto", "direct", "gram")

#: the Gram engine restarts before steps 3, 6, 9, ... (Note [Restart every third step])
RESTART_EVERY = 3


def exact_scale(a: torch.Tensor, group=None) -> torch.Tensor:
    """The power of two nearest below max|a_ij| per matrix (1 for a zero matrix), (..., 1, 1).

    Dividing by it is exact (Note [msign at any scale]): the entries of ``a / s`` lie
    in [1, 2) at most, so ‖a / s‖²_F is in [1, 4NM) and neither overflows nor
    underflows. On row-sharded points (rows split over ``group``) the maximum is
    all-reduced.
    """
    big = rows_absmax(a, group)
    return torch.exp2(torch.floor(torch.log2(big))).where(big > 0, 1.0)


def restarts(steps: int, tail: int = 0) -> int:
    """Restarts of the Gram engine in ``steps`` steps (before steps 3, 6, ...), none in the tail."""
    return (steps - tail - 1) // RESTART_EVERY


def _part(r: torch.Tensor, b: float, c: float) -> torch.Tensor:
    # V = bR + cR², so that W = aI + V (Note [The identity term as a scale]); a new
    # M×M tensor (R² by one product; none when c = 0), R a (batch, M, M) tensor
    return r * b if c == 0.0 else torch.baddbmm(r, r, r, beta=b, alpha=c)


def _whole(v: torch.Tensor, a: float) -> torch.Tensor:
    # W = aI + V, written over V
    v.diagonal(dim1=-2, dim2=-1).add_(a)
    return v


def _times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # X·W in X's layout (Note [Products in the layout of X])
    if x.mH.is_contiguous():
        return product(w.mH, x.mH).mH
    return product(x, w)


def _start(x: torch.Tensor, safety: float, group) -> tuple[torch.Tensor, ...]:
    # (X / s, its Gram normalised to unit trace / safety², the factor 1/(safety·‖X/s‖_F))
    # (Note [Normalization on the Gram]); a zero matrix keeps R = 0 and the factor 1
    if x.mH.is_contiguous() and not x.is_contiguous():  # the pass over its storage order
        x = (x.mH / exact_scale(x.mH, group)).mH
    else:
        x = x / exact_scale(x, group)
    r = gram(x, x, group)
    trace = r.diagonal(dim1=-2, dim2=-1).real.sum(-1)[..., None, None]
    c = (safety * safety * trace).where(trace > 0, 1.0)
    return x, r.div_(c.to(r.dtype)), c.rsqrt().to(r.dtype)


def iterate(
    x: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]],
    safety: float,
    engine: str,
    group=None,
    tail: int = 0,
) -> torch.Tensor:
    """X_s = X_0 W_0 ⋯ W_{s−1} from X_0 = X / (safety·‖X‖_F) by the ``"direct"``/``"gram"`` engine.

    Args:
        x: tall matrices (..., N, M), or the local rows of row-sharded ones (every
            product over the rows goes through `gram` over ``group``).
        coefficients: (a_k, b_k, c_k) per step.
        safety: the factor ≥ 1 the Frobenius norm is multiplied by.
        engine: ``"direct"`` or ``"gram"`` (see the module docstring).
        group: the process group the rows are split over, or None.
        tail: the last steps, whose W has ‖W‖₂ ≤ 1.05 on singular values in [0, 1]: the
            Gram engine runs them without a restart (nothing to bound; Note [Restart
            every third step]).

    Returns:
        X_s, shape of ``x``.
    """
    shape = x.shape
    x, r, inv = _start(flat(x), safety, group)  # one batch dimension
    steps = len(coefficients)

    def restart(k: int) -> bool:  # Note [Restart every third step]
        return 0 < k < steps - tail and k % RESTART_EVERY == 0

    q = None
    for k, (a, b, c) in enumerate(coefficients):
        if engine == "direct":
            if k:
                r = gram(x, x, group)
            # W whole (Note [The identity term as a scale]); the first carries the
            # normalization
            w = _whole(_part(r, b, c), a)
            x = _times(x, w.mul_(inv) if k == 0 else w)
            continue
        if restart(k):
            x = _times(x, q)
            r, q = gram(x, x, group), None
        v = _part(r, b, c)
        if k == 0 or q is None:  # the first W of a product: formed whole
            w = _whole(v, a)
            q = w.mul(inv) if k == 0 else w
            if k + 1 < steps and not restart(k + 1):  # R is needed again
                r = product(w, product(r, w))
            continue
        q = torch.baddbmm(q, q, v, beta=a)  # Q ← QW = aQ + QV
        if k + 1 < steps and not restart(k + 1):  # R ← W(RW), RW = aR + RV
            rw = torch.baddbmm(r, r, v, beta=a)
            r = torch.baddbmm(rw, v, rw, beta=a)
    return (x if engine == "direct" else _times(x, q)).reshape(shape)


def engine_flops(n: int, m: int, steps: int, quintic: bool, engine: str, tail: int = 0) -> float:
    """Real flops of ``steps`` steps on a real N×M matrix (N ≥ M, else swapped), with the scaling.

    Direct: steps × (4NM² + 2M³ for a quintic). Gram: (4 + 4·restarts)NM² and
    2M³ × (steps for a quintic + 3 × (steps − 1 − restarts)), ``tail`` of the steps
    without restarts (`iterate`). Both add 2NM for the scaling (maximum and exact
    division).
    """
    big, small = max(n, m), min(n, m)
    if engine == "direct":
        per = 4.0 * big * small**2 + (2.0 * small**3 if quintic else 0.0)
        return steps * per + 2.0 * big * small
    rho = restarts(steps, tail)
    products = (steps if quintic else 0) + 3 * (steps - 1 - rho)
    return (4.0 + 4.0 * rho) * big * small**2 + 2.0 * small**3 * products + 2.0 * big * small

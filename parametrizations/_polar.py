r"""Initial points: the nearest point by a scaled Newton iteration, and geotorch's torus.

Note [Nearest point by the scaled Newton iteration]
The nearest point of St(n, m) to a tall A = UΣVᴴ is its polar factor UVᴴ. The
SVD computes it in O(n³) with a large constant: its bidiagonalisation is
memory bound (matrix-vector products), where LU and GEMM run at the machine's
matrix-matrix speed. For a square A, the scaled Newton iteration (Higham,
"Functions of Matrices", §8.6)

    X₀ = A,   X_{k+1} = ½(ζ_k X_k + ζ_k⁻¹ X_k⁻ᴴ)

keeps the singular vectors (X_k = U f_k(Σ) Vᴴ, f_k odd and positive) and maps
each singular value σ to ½(ζσ + 1/(ζσ)). Byers and Xu's scaling (SIAM J.
Matrix Anal. Appl. 30(2), 2008) needs two numbers only, α ≈ ‖A‖₂ and
β ≈ 1/‖A⁻¹‖₂: ζ₀ = (αβ)^{-1/2} maps [β, α] into [1, b₁] with
b₁ = (α + β)/(2√(αβ)), and ζ_k = b_k^{-1/2} maps [1, b_k] into [1, b_{k+1}],
b_{k+1} = ½(√b_k + 1/√b_k): κ = α/β = 10⁴ gives b = 50, 3.6, 1.21, 1.0047. On a
spectrum that fills its interval (a random or trained weight) this matches the
optimal scaling ζ_k = (‖X_k⁻¹‖₂/‖X_k‖₂)^{1/2}, at the price of two spectral
norm estimates (three steps of block power iteration on A and on A⁻¹, O(n²)
each) instead of two per step; an estimate only changes the speed, never the
limit. Each step is one inverse, 2n³ flops at the GEMM-like speed of LU.

Once b_k ≤ 1 + min(SWITCH, √(2/n)) the last Newton step also centres the
spectrum ([1, b] scaled into [2/(1+b), 2b/(1+b)]) and Newton–Schulz steps of
order 3 take over, the degree-2 Taylor polynomial of (I + D)^{-1/2}
(Higham §8.3, the [2/0] Padé iteration):

    D = XᴴX − I,   X ← X(I − ½D + ⅜D²) = X − ½X(D − ¾D²).

With σ² = 1 + d, d goes to (5/8)d³ + O(d⁴) and shrinks for −1 < d ≤ 1; the
factor 1 − d/2 + ⅜d² is positive for every d, so no singular value changes
sign (the polar factor is kept even where a step overshoots). A step costs
the Gram and two products (an inverse costs about two GEMMs) and ends with
the √n·eps rounding of a GEMM, where an LU inverse leaves ~n·eps. The
Frobenius norm e = ‖D‖_F ≥ ‖D‖₂ is known at each step: the step is the last
when (5/8)e³ ≤ √n·eps, and the cheaper X(I − ½D) when ¾e² ≤ √n·eps already.
A D spread over [−(b − 1), b − 1] has e ≈ (b − 1)√(n/2), hence the √(2/n)
in the switch. If e > 1 (a norm estimate far off) the step is not taken: a
Newton step with the Frobenius scaling (‖X⁻¹‖_F/‖X‖_F)^{1/2}, accurate for
such a concentrated spectrum, goes first.

On a CPU with AMX bfloat16 tiles (``torch.cpu.get_capabilities``) the two
products of a Newton–Schulz step may take bfloat16 operands (ε = 2⁻⁷): the
result is X·q + F with ‖F‖_F ≲ ε·‖q‖_F ≈ ε·e/2 (q = D − ¾D²), an error
relative to the correction, not to X. The next Gram sees F: its
non-orthogonal part goes with the next step, its skew part moves the polar
factor by up to ~ε·e/2 in Frobenius norm. The float32 polar factor of A is
itself only determined to ~κ·eps (κ = α/β), so a step rounds its products to
bfloat16 when ε·e ≤ κ·eps, the last step only when ε·e ≤ 4√n·eps (the
orthogonality left stays at the float32 rounding); a well-conditioned A keeps
float32 products. The Gram always stays in A's precision: XᴴX rounded to
bfloat16 would lose D under the rounding of I.
A tall A goes through its thin QR first: polar(QR) = Q·polar(R), R square.

Every float32 result is checked in float64 before use: ‖(XᴴX − I)Z‖_F for
eight Gaussian probes Z (an unbiased estimate of ‖XᴴX − I‖_F·√8, O(nm) per
probe instead of a float64 n×n Gram), and the iteration falls back to the
SVD when the check fails, an LU pivot is zero (a singular A), a value is not
finite or 20 steps do not converge. For an ill-conditioned A the polar factor
is itself ill-conditioned (a relative perturbation ε of A moves it by up to
~κ·ε), so both algorithms agree to about κ·eps, not to eps.
"""

from __future__ import annotations

import math

import torch

from ..manifolds.kernels import polar

__all__ = ["nearest_point", "newton_polar", "torus"]

MAX_STEPS = 20
SWITCH = 0.1
SCHULZ_MAX = 1.0
BF16_EPS = torch.finfo(torch.bfloat16).eps


def newton_polar(a: torch.Tensor) -> torch.Tensor | None:
    """The polar factor of square matrices (…, n, n) by scaled Newton, then Newton–Schulz, or None.

    None when an inverse fails, a value is not finite or the iteration does not
    converge (Note [Nearest point by the scaled Newton iteration]).
    """
    n = a.shape[-1]
    eps = torch.finfo(a.dtype).eps
    tol = math.sqrt(n) * eps
    low = _fast_bfloat16(a)
    x, bound, kappa, newton = a, None, 1.0, True
    for _ in range(MAX_STEPS):
        if newton:
            inv, info = torch.linalg.inv_ex(x)
            if bool((info != 0).any()):
                return None
            inv = inv.mH.resolve_conj()  # X⁻ᴴ, row-major (LAPACK's inverse is column-major)
            if bound is None:  # Byers–Xu: ‖A‖₂ and ‖A⁻¹‖₂ once, then the bound's recursion
                alpha, beta = _norm2(x), _norm2(inv).reciprocal()
                kappa = float((alpha / beta).min())  # the best conditioned of a batch
                zeta = (alpha * beta).rsqrt()
                bound = 0.5 * (alpha + beta) * zeta
            elif math.isfinite(float(bound.max())):
                zeta = bound.rsqrt()
                bound = 0.5 * (zeta + zeta.reciprocal())
            else:  # after a Schulz test failed: Frobenius scaling, then Schulz again
                zeta = (_frobenius(inv) / _frobenius(x)).sqrt()
                bound = torch.ones_like(zeta)
            newton = float(bound.max()) > 1 + min(SWITCH, math.sqrt(2 / n))
            # ½(ζX + X⁻ᴴ/ζ); before Schulz also centred: [1, b] into [2/(1+b), 2b/(1+b)]
            scale = 0.5 / zeta if newton else (zeta * (1 + bound)).reciprocal()
            x = inv.addcmul_(x, zeta.square().to(x.dtype)).mul_(scale.to(x.dtype))
            continue
        gram = _gram(x)
        gram.diagonal(dim1=-2, dim2=-1).sub_(1)  # D = XᴴX − I
        err = float(torch.linalg.matrix_norm(gram).max())  # ‖D‖_F ≥ ‖D‖₂
        if not math.isfinite(err):
            return None
        if err > SCHULZ_MAX:  # a spread spectrum: a Newton step first
            newton, bound = True, torch.full_like(gram[..., :1, :1].real, math.inf)
            continue
        cubic = 0.75 * err**2 <= tol  # the ⅜D² term is below the rounding
        last = cubic or 0.625 * err**3 <= tol
        limit = 4 * tol if last else max(4 * tol, kappa * eps)
        d = gram.bfloat16() if low and BF16_EPS * err <= limit else gram
        q = d if cubic else (d @ d).mul_(-0.75).add_(d)  # D − ¾D²
        x.sub_(x.to(d.dtype) @ q, alpha=0.5)  # X(I − ½D + ⅜D²)
        if last:
            return x
    return None


def _fast_bfloat16(x: torch.Tensor) -> bool:
    """Whether X's products may be rounded to bfloat16: a real float32 X on a CPU with AMX.

    ``torch.cpu.get_capabilities`` reports the instruction sets (an older torch
    without it keeps float32 products).
    """
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return False
    caps = getattr(torch.cpu, "get_capabilities", None)
    return caps is not None and bool(caps().get("amx_bf16", False))


def _gram(x: torch.Tensor, blocks: int = 4, least: int = 512) -> torch.Tensor:
    """XᴴX by block rows of its upper triangle, the rest mirrored: (k+1)/2k of the GEMM flops.

    Row block i is X_iᴴ[X_i … X_k] (one GEMM per block, large enough for GEMM speed
    from ``least`` columns on); the blocks left of the diagonal are the adjoints
    of those above it.
    """
    n = x.shape[-1]
    if n < least:
        return x.mH @ x
    cut = [i * n // blocks for i in range(blocks + 1)]
    gram = x.new_empty(*x.shape[:-2], n, n)
    for lo, hi in zip(cut[:-1], cut[1:], strict=True):
        gram[..., lo:hi, lo:] = x[..., lo:hi].mH @ x[..., lo:]
        gram[..., lo:hi, :lo] = gram[..., :lo, lo:hi].mH
    return gram


def _frobenius(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(x, keepdim=True)


def _norm2(x: torch.Tensor, steps: int = 3, width: int = 16) -> torch.Tensor:
    """‖X‖₂ (shape (…, 1, 1), real) estimated by block power iteration on XᴴX (``width`` vectors).

    Each step reads X twice (memory bound, O(n²)); a block of 16 vectors costs
    about the same passes as one and catches a cluster of top singular values
    (the edge of a random matrix's spectrum) in fewer steps.
    """
    gen = torch.Generator(device=x.device).manual_seed(0)
    real = x.real.dtype if x.is_complex() else x.dtype
    v = torch.randn(*x.shape[:-2], x.shape[-1], width, generator=gen, dtype=real, device=x.device)
    v = v.to(x.dtype)
    for _ in range(steps):
        v = torch.linalg.qr(x.mH @ (x @ v))[0]
    return torch.linalg.matrix_norm(x @ v, ord=2, keepdim=True)


def _orthonormal(x: torch.Tensor, probes: int = 8) -> bool:
    """The float64 check: ‖(XᴴX − I)Z‖_F/√probes ≤ 100·√m·eps(X), Z Gaussian (n·m work)."""
    hi = torch.complex128 if x.is_complex() else torch.float64
    x64 = x.to(hi)
    gen = torch.Generator(device=x.device).manual_seed(0)
    z = torch.randn(*x.shape[:-2], x.shape[-1], probes, generator=gen, dtype=hi, device=x.device)
    err = torch.linalg.matrix_norm(x64.mH @ (x64 @ z) - z) / math.sqrt(probes)
    tol = 100 * math.sqrt(x.shape[-1]) * torch.finfo(x.dtype).eps
    return bool(torch.isfinite(err).all()) and float(err.max()) <= tol


def _power_of_two_scaled(a: torch.Tensor) -> torch.Tensor:
    """A·2⁻ᵉ per matrix, with e such that its largest |entry| lands in [½, 1).

    Note [Nearest point of a scaled matrix]
    The polar factor is invariant under positive scaling, polar(cA) = polar(A), but
    its kernels are not: the norm estimates form AᴴA (entries ~1e19 overflow float32,
    ~1e-19 underflow it) and the SVD refuses the infinities that follow. Each matrix
    is therefore scaled first by a power of two, exact (every rounding of the
    iteration scales with it, so an ordinary A gives the same bits), into entries of
    magnitude below 1. The factor 2⁻ᵉ is applied in two halves, each a normal
    number even where 2⁻ᵉ itself is not (a subnormal A). A zero or non-finite
    matrix is left as it is, for the kernels' own handling.
    """
    amax = a.detach().abs().amax(dim=(-2, -1), keepdim=True)
    usable = torch.isfinite(amax) & (amax > 0)
    _, e = torch.frexp(torch.where(usable, amax, torch.ones_like(amax)))
    half = torch.div(e, 2, rounding_mode="floor")
    real = amax.dtype
    return a * torch.exp2(-half.to(real)) * torch.exp2((half - e).to(real))


def nearest_point(a: torch.Tensor) -> torch.Tensor:
    """The polar factor of tall A (…, n, m), n ≥ m: Newton in A's precision, SVD as fallback.

    Note [Nearest point by the scaled Newton iteration], Note [Nearest point of a
    scaled matrix].
    """
    if a.dtype not in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        return polar(a)
    a = _power_of_two_scaled(a)
    r, q = a, None
    if a.shape[-2] > a.shape[-1]:
        q, r = torch.linalg.qr(a)
    x = newton_polar(r)
    if x is not None and q is not None:
        x = q @ x
    if x is None or not _orthonormal(x):
        return polar(a)
    return x


def torus(
    n: int,
    m: int,
    *batch: int,
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""geotorch's ``sample("torus")`` point: a block diagonal of 2×2 rotations, first m columns.

    Angles θ_j ~ Uniform(−π, π), j < ⌊n/2⌋, drawn as geotorch's ``torus_init_``
    draws them (one ``uniform_`` of shape (*batch, ⌊n/2⌋), in ``dtype``'s real
    part, on the CPU); block j is expm([[0, −θ_j], [θ_j, 0]]) =
    [[cos θ_j, −sin θ_j], [sin θ_j, cos θ_j]] and an odd n ends with a 1. The
    closed form replaces geotorch's expm of the block-diagonal skew matrix
    (the same matrix). Used by expRNN's examples for recurrent kernels: the
    eigenvalues e^{±iθ_j} are spread uniformly on the unit circle.
    """
    real = torch.empty((), dtype=dtype).real.dtype
    theta = torch.empty(*batch, n // 2, dtype=real).uniform_(-math.pi, math.pi, generator=generator)
    c, s = theta.cos(), theta.sin()
    q = torch.zeros(*batch, n, n, dtype=real)
    idx = torch.arange(n // 2)
    q[..., 2 * idx, 2 * idx] = c
    q[..., 2 * idx + 1, 2 * idx + 1] = c
    q[..., 2 * idx, 2 * idx + 1] = -s
    q[..., 2 * idx + 1, 2 * idx] = s
    if n % 2:
        q[..., n - 1, n - 1] = 1
    return q[..., :m].to(dtype)

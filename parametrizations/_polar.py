r"""Initial points: the nearest point by a scaled Newton iteration, and geotorch's torus.

Note [Nearest point by the scaled Newton iteration]
The nearest point of St(n, m) to a tall A = UΣVᴴ is its polar factor UVᴴ. The
SVD computes it in O(n³) with a large constant: its bidiagonalisation is
memory bound (matrix-vector products), where LU and GEMM run at the machine's
matrix-matrix speed. For a square A, the scaled Newton iteration (Higham, "Functions of Matrices",
§8.6)

    X₀ = A,   X_{k+1} = ½(μ_k X_k + μ_k⁻¹ X_k⁻ᴴ),   μ_k = (‖X_k⁻¹‖₂ / ‖X_k‖₂)^{1/2}

keeps the singular vectors (X_k = U f_k(Σ) Vᴴ, f_k odd and positive) and maps
each singular value σ to ½(μσ + 1/(μσ)): with μ = (σ_max σ_min)^{-1/2} the
spectrum is centred on 1 in the geometric sense and the condition number
drops from κ to (√κ + 1/√κ)/2 per step (10⁴ → 50 → 3.6 → 1.06), until the
quadratic convergence of the unscaled step takes over: about four inverses
for κ = 10⁴, each 2n³ flops at the GEMM-like speed of ``getrf``/``getri``. The
two spectral norms come from six steps of block power iteration each (O(n²)
per step but memory bound; an estimate only changes the speed, never the
limit). The Frobenius norms (Higham's cheaper choice, one pass) mis-scale by
about (√n/2)^{1/2} for a random square A, which cost two more inverses at
n = 2048 (8–10 inverses in all, no faster than the SVD); after two steps
(κ ≲ 5, a concentrated spectrum) they are as good, and are used.

Near convergence the change δ = ‖X_{k+1} − X_k‖_F is the error E_k of X_k
(X_k = U(I + E_k)Vᴴ). Once δ ≤ 10⁻²·√n (singular values within about 1%),
the steps become Newton–Schulz steps X(3I − XᴴX)/2 (two GEMMs, about the cost
of one inverse): they converge quadratically too (e → 3e²/2) and leave the
√n·eps rounding of a GEMM, where an LU inverse leaves ~n·eps.
The iteration stops when δ ≤ (2√n·eps)^{1/2}: the error left is then √n·eps
(a last Newton step is followed by one Newton–Schulz step for the rounding).
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
SWITCH = 1e-2
SPECTRAL_STEPS = 2


def newton_polar(a: torch.Tensor) -> torch.Tensor | None:
    """The polar factor of square matrices (…, n, n) by the scaled Newton iteration, or None.

    None when an inverse fails, a value is not finite or the iteration does not
    converge (Note [Nearest point by the scaled Newton iteration]).
    """
    n = a.shape[-1]
    done = math.sqrt(2 * math.sqrt(n) * torch.finfo(a.dtype).eps)
    x, newton = a, True
    for step in range(MAX_STEPS):
        if newton:
            inv, info = torch.linalg.inv_ex(x)
            if bool((info != 0).any()):
                return None
            norm = _norm2 if step < SPECTRAL_STEPS else _frobenius
            mu = (norm(inv) / norm(x)).sqrt().to(x.dtype)
            new = 0.5 * (mu * x + inv.mH / mu)
        else:  # Newton–Schulz: X(3I − XᴴX)/2
            new = 1.5 * x - 0.5 * (x @ (x.mH @ x))
        delta = float(torch.linalg.matrix_norm(new - x).max())
        x = new
        if not math.isfinite(delta):
            return None
        if delta <= done:  # converged; a Newton result gets one Newton–Schulz polish
            return 1.5 * x - 0.5 * (x @ (x.mH @ x)) if newton else x
        newton = newton and delta > SWITCH * math.sqrt(n)
    return None


def _frobenius(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(x, keepdim=True)


def _norm2(x: torch.Tensor, steps: int = 6, width: int = 4) -> torch.Tensor:
    """‖X‖₂ (shape (…, 1, 1)) estimated by block power iteration on XᴴX (``width`` vectors).

    Each step reads X twice (memory bound, O(n²)); a block of a few vectors
    costs the same passes and catches a cluster of top singular values better.
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


def nearest_point(a: torch.Tensor) -> torch.Tensor:
    """The polar factor of tall A (…, n, m), n ≥ m: Newton in A's precision, SVD as fallback.

    Note [Nearest point by the scaled Newton iteration].
    """
    if a.dtype not in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        return polar(a)
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

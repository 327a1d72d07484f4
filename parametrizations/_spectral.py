r"""exp(A) and the Cayley transform of a skew-Hermitian A through its eigendecomposition.

Used by the ``exp``, ``cayley`` and ``scaled_cayley`` maps when ‖A‖₁ is large
(Note [Large skew-Hermitian matrices go through eigh]); for ordinary sizes they
use the Padé / LU kernels, which are cheaper.

Note [Large skew-Hermitian matrices go through eigh]
Both maps are unitary for every skew-Hermitian A, but their usual kernels lose
orthogonality in proportion to ‖A‖: scaling and squaring doubles the
orthogonality error of the Padé approximant at each of its s ≈ log₂(‖A‖₁/θ₁₃)
squarings (error ≈ 2^s·eps, measured 1.3e-3 in float32 at entries 1e3, NaN at
1e10), and the LU solve of (I + A)X = (I − A)B has a forward error
≈ cond(I + A)·eps ≈ ‖A‖₂·eps. Above a threshold on ‖A‖₁ (`spectral_needed`) we
instead write iA = VΛVᴴ (Hermitian; ``eigh`` of iA/c with c = max|aᵢⱼ|, so that
LAPACK never sees an overflowing norm, Λ scaled back by c), i.e.
A = V diag(aₖ) Vᴴ with aₖ = −iλₖ, and return f(A) = V diag(f(aₖ)) Vᴴ with

    exp:    f(aₖ) = e^{−iλₖ},
    Cayley: f(aₖ) = (1 − aₖ)/(1 + aₖ) = (1 + iλₖ)/(1 − iλₖ) = e^{2i·atan λₖ}.

V is unitary to O(n·eps) (``eigh`` is backward stable) and |f(aₖ)| = 1 exactly,
so f(A) is unitary to O(n·eps) whatever ‖A‖. Only the skew-Hermitian part
S(A) = (A − Aᴴ)/2 of the input is read, so the function is f(S(A)).

Backward (Daleckii–Krein): for a normal A = V diag(a) Vᴴ, the Fréchet derivative
is L(A, E) = V (F ∘ VᴴEV) Vᴴ with the divided differences
F_ij = (f(aᵢ) − f(aⱼ))/(aᵢ − aⱼ) (f′(aᵢ) when equal). Its adjoint under Re tr(XᴴY)
is G ↦ V (F̄ ∘ VᴴGV) Vᴴ, followed by S (self-adjoint). Written without
cancellation, with δ = λᵢ − λⱼ:

    exp:    F_ij = e^{−i(λᵢ+λⱼ)/2} · sin(δ/2)/(δ/2),
    Cayley: F_ij = −2/((1 + aᵢ)(1 + aⱼ)) = −2 rᵢrⱼ, rₖ = 1/(1 − iλₖ) = cos θₖ·e^{iθₖ},
            θₖ = atan λₖ,

both bounded for every λ (no λ² that could overflow). Equal or clustered
eigenvalues (real skew A has ±λ pairs and, for odd n, a zero) are harmless:
F stays smooth, unlike the backward of ``eigh`` itself, which is never used.
"""

from __future__ import annotations

import math

import torch

from .._core import checks as _checks
from .._core.first_order import first_order

__all__ = [
    "SPECTRAL_THRESHOLD",
    "one_norm",
    "LazyNorm",
    "spectral_needed",
    "spectral_for",
    "skew_spectral",
]

#: ‖A‖₁ above max(SPECTRAL_THRESHOLD, SPECTRAL_PER_ROW·n) goes through ``eigh``.
SPECTRAL_THRESHOLD = 64.0
SPECTRAL_PER_ROW = 4.0


def one_norm(a: torch.Tensor) -> float | None:
    """max over the batch of ‖A‖₁ of a skew-Hermitian A, or None where A has no values to read.

    Read as ‖A‖∞ (max row sum of |aᵢⱼ|), equal to ‖A‖₁ since |A| is symmetric: the
    row sums run along memory, where the column sums of ‖A‖₁ stride across it.
    None for an empty or meta tensor and under ``torch.func.vmap`` (which cannot
    read a value back to Python); the callers then keep their usual kernels.
    """
    if a.numel() == 0 or a.device.type == "meta":
        return None
    try:
        return float(a.detach().abs().sum(-1).max())
    except RuntimeError:  # vmap: "calling .item() on a Tensor" is not supported
        return None


class LazyNorm:
    """`one_norm` of one A, read on the first call and kept: a map's dispatcher reads it
    only for the paths that need it, and the chosen kernel reuses the value (one host
    synchronisation per call at most)."""

    __slots__ = ("_a", "_value", "_read")

    def __init__(self, a: torch.Tensor):
        self._a, self._value, self._read = a, None, False

    def __call__(self) -> float | None:
        if not self._read:
            self._value, self._read = one_norm(self._a), True
        return self._value


def spectral_needed(a: torch.Tensor) -> bool:
    """Whether max over the batch of ‖A‖₁ exceeds max(64, 4n) (and is finite).

    `spectral_for` of n and `one_norm`; a caller that needs ‖A‖₁ for more calls those.

    Note [Where the eigh path starts]
    Measured in float32 on random skew A (n = 6, 64, 256), the orthogonality error
    of the Padé and LU kernels is about (1–3)·‖A‖₁·eps, that of the ``eigh`` path
    about n·eps whatever ‖A‖. Below ‖A‖₁ = max(64, 4n) the cheap kernels stay
    within ~10·n·eps (the error every map is held to); above, ``eigh`` is more
    accurate. Ordinary training (‖A‖₁ of order one to n) never leaves the cheap
    path. A non-finite A stays on it too, so NaN propagates instead of raising
    inside LAPACK, and so does an A without values (`one_norm` is None). One host
    synchronisation (``expm`` already needs one).
    """
    return spectral_for(a.shape[-1], one_norm(a))


def spectral_for(n: int, norm: float | None) -> bool:
    """Whether ‖A‖₁ = ``norm`` of an n×n A takes the ``eigh`` path (None: not read, no)."""
    limit = max(SPECTRAL_THRESHOLD, SPECTRAL_PER_ROW * n)
    return norm is not None and math.isfinite(norm) and norm > limit


def _eigh_skew(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(λ, V) with i·S(A) = V diag(λ) Vᴴ, computed on iS(A)/c (c = max|aᵢⱼ|)."""
    c = a.abs().amax(dim=(-2, -1), keepdim=True)
    c = torch.where(c > 0, c, torch.ones_like(c))
    h = (a / c).to(torch.promote_types(a.dtype, torch.complex64)) * 1j
    h = 0.5 * (h + h.mH)  # i·S(A)/c: Hermitian
    lam, v = torch.linalg.eigh(h)
    if not a.is_complex():
        lam = 0.5 * (lam - lam.flip(-1))  # real A: the spectrum is exactly ±-symmetric
    return lam * c.squeeze(-1), v


def _values(kind: str, lam: torch.Tensor) -> torch.Tensor:
    angle = -lam if kind == "exp" else 2 * torch.atan(lam)
    return torch.polar(torch.ones_like(lam), angle)


def _divided_differences(kind: str, lam: torch.Tensor) -> torch.Tensor:
    li, lj = lam.unsqueeze(-1), lam.unsqueeze(-2)
    if kind == "exp":
        mid = torch.polar(torch.ones_like(li + lj), -0.5 * (li + lj))
        return mid * torch.sinc((li - lj) / (2 * math.pi))
    theta = torch.atan(lam)
    r = torch.polar(torch.cos(theta), theta)  # 1/(1 − iλ)
    return -2 * r.unsqueeze(-1) * r.unsqueeze(-2)


class _SkewSpectral(torch.autograd.Function):
    # batched tensor code both ways: vmap's rule (torch.func.vmap, jacrev) is generated
    generate_vmap_rule = True

    @staticmethod
    def forward(a: torch.Tensor, kind: str) -> torch.Tensor:  # type: ignore[override]
        lam, v = _eigh_skew(a)
        y = (v * _values(kind, lam).unsqueeze(-2)) @ v.mH
        return y if a.is_complex() else y.real

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        a, kind = inputs
        ctx.kind = kind
        ctx.real = not a.is_complex()
        ctx.save_for_backward(a)

    @staticmethod
    @first_order("the spectral path of the exp and Cayley maps (‖A‖₁ above its threshold)")
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (a,) = ctx.saved_tensors
        lam, v = _eigh_skew(a)
        f = _divided_differences(ctx.kind, lam)
        inner = f.conj() * (v.mH @ g.to(v.dtype) @ v)
        grad = v @ inner @ v.mH
        grad = 0.5 * (grad - grad.mH)
        return (grad.real if ctx.real else grad), None


def skew_spectral(a: torch.Tensor, kind: str) -> torch.Tensor:
    r"""exp(S(A)) (``kind="exp"``) or (I + S(A))⁻¹(I − S(A)) (``kind="cayley"``), S(A) = (A − Aᴴ)/2.

    Unitary (orthogonal for real A) to O(n·eps) for every finite A; see
    Note [Large skew-Hermitian matrices go through eigh]. Costs one complex
    ``eigh`` forward and one more in the backward (recomputed, not stored).

    Args:
        a: real or complex (…, n, n); only its skew-Hermitian part is read.
        kind: ``"exp"`` or ``"cayley"``.

    Returns:
        f(S(A)), same shape and dtype as ``a``.

    Raises:
        ValueError: ``kind`` is not one of the two.

    Example:
        ```python
        import torch
        from stiefel.parametrizations._spectral import skew_spectral

        a = torch.randn(5, 5, dtype=torch.float64)
        a = a - a.mT
        assert torch.allclose(skew_spectral(a, "exp"), torch.linalg.matrix_exp(a))
        eye = torch.eye(5, dtype=torch.float64)
        cay = torch.linalg.solve(eye + a, eye - a)
        assert torch.allclose(skew_spectral(a, "cayley"), cay)
        ```
    """
    _checks.choice("kind", kind, ("exp", "cayley"))
    return _SkewSpectral.apply(a, kind)

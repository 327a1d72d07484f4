r"""Maps built from Householder reflections: ``householder``, ``cwy`` and ``tcwy``.

All three compute the same function of the same parameters,

    Q = H(v₁)⋯H(v_L)·[diag(d); 0] ∈ St(n, m),   H(v) = I − 2vvᴴ/‖v‖²,

with V = [v₁ … v_L] the trainable original (shape (…, n, L)) and d a diagonal
of m signs (real: a non-trainable buffer) or phases e^{iθ} (complex: θ trainable,
the Ĥ₁(θ) of §4.3 of the Householder paper). They differ in how Q is computed:
``householder`` applies the reflections one block after another with the
paper's O(nL)-per-column backward (Algorithm 1), ``cwy`` and ``tcwy`` use the
compact WY form I − US⁻¹Uᴴ and a triangular solve.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._core import checks as _checks
from .._core.checks import int_in_range
from . import kernels
from ._diagonal import SignPhaseDiagonal
from ._householder import default_block
from ._inverse import Unreachable, reflections_from_point
from ._precision import high
from .base import OrthogonalMap, register

__all__ = ["Householder", "CWY", "TCWY"]


class _Reflections(SignPhaseDiagonal, OrthogonalMap):
    r"""Shared state of the reflection maps: V (the original) and the sign/phase diagonal.

    Note [How many reflections reach every point]
    Householder elimination writes every point of St(n, m) as m reflections
    times [diag(d); 0] (Note [Reflections from LAPACK's QR]); a square matrix
    needs L = n (the last one is the H₁ sign). With fewer, the image is a
    lower-dimensional set: ``init`` defaults to random reflections and
    ``right_inverse`` raises ValueError for a point outside it. With more than
    m on St(n, m) the extra ones act on the last n − m rows only. Complex
    T-CWY needs the phases (Note [Signs live in a buffer, phases in a
    parameter]): a complex reflection maps x to y only when xᴴy is real, so
    without them the first entry of every column of Q would be real.
    """

    domain = "O_L(n); O(n) at L = n"

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        reflections: int | None = None,
    ):
        super().__init__(shape, dtype, device)
        if reflections is None:
            reflections = self.m
        int_in_range("reflections", reflections, 1, self.n, where=f" for {self.manifold!r}")
        self.reflections = reflections
        self.reaches_every_point = reflections >= self.m
        real = torch.empty((), dtype=dtype).real.dtype
        self._init_diagonal(torch.ones(*self.batch, self.m, dtype=real, device=device))

    def check_original(self, original: torch.Tensor) -> str | None:
        """A zero reflection vector has no reflection (H(0) is 0/0): refused."""
        norms = torch.linalg.vector_norm(original, dim=-2)
        zero = int((norms == 0).sum())
        if zero:
            return (
                f"{zero} of its reflection vectors (columns of the free parameter, shape "
                f"{tuple(original.shape)}) are zero, and H(0) = I − 2·0·0ᴴ/0 is undefined"
            )
        return None

    def random_original(self, generator: torch.Generator | None, like: torch.Tensor):
        """Random unit-variance reflection vectors and d = 1 (``init="random"``)."""
        shape = (*self.batch, self.n, self.reflections)
        v = torch.randn(shape, generator=generator, dtype=like.dtype, device="cpu")
        self.set_diagonal(torch.ones(*self.batch, self.m, dtype=torch.float64))
        return v.to(like.device)

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        # full: the point's own precision (Note [Initialisation in the weight's precision]);
        # fewer reflections: rank decisions need float64
        diagonal = None
        if not self.reaches_every_point:
            diagonal = high(self.diagonal().detach())
            if not bool(torch.isfinite(diagonal).all()):  # never initialised (to_empty): d = 1
                diagonal = torch.ones_like(diagonal)
        try:
            v, d = reflections_from_point(
                q if self.reaches_every_point else high(q),
                self.reflections,
                self.tolerance(q.dtype),
                diagonal=diagonal,
            )
        except Unreachable as err:  # the diagonal is the map's own: say so
            kind = "phases (trained with the vectors)" if q.is_complex() else "signs"
            raise Unreachable(
                f"{err}; with this few reflections a point is sought first with this "
                f"map's current {kind}: to copy a weight of another module built so, load "
                "that module's state_dict (its diagonal included), not its weight alone"
            ) from None
        self.set_diagonal(d)
        return v.to(dtype=q.dtype, device=q.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", reflections={self.reflections}"


@register("householder")
class Householder(_Reflections):
    r"""Q = H(v₁)⋯H(v_L)·[diag(d); 0]: reflections applied one after another (the oRNN map).

    The backward pass is Algorithm 1 of Mhammedi et al. (2017), run by blocks
    of ``block`` reflections and recomputing the intermediates from the output
    (O(nLp) time for p columns, O(np) memory); by default a block holds p/2
    reflections, 64 to 256 (Note [Block size]). ``reflections=L`` (1 ≤ L ≤ n,
    default m, i.e. n on O(n)/U(n)) trades capacity for speed; ``linear`` applies
    Q to a batch of vectors in O(nL) without forming it.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        w = orthogonalize(torch.randn(8, 8, dtype=torch.float64), method="householder")
        q = w()
        assert torch.allclose(q.mT @ q, torch.eye(8, dtype=torch.float64))
        ```
    """

    formula = "L n² (L sequential reflections)"

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        reflections: int | None = None,
        block: int | None = None,
    ):
        super().__init__(shape, dtype, device, reflections=reflections)
        self.block = _checks.positive_int("block", block, none_ok=True)

    @classmethod
    def flops(cls, n: int, m: int, reflections: int | None = None) -> float:
        """4·n·m·L + (2·n + m)·Σ_k b_k², b_k the sizes of the blocks of b = `default_block` (m).

        The L reflections applied to the n×m matrix [diag(d); 0] by blocks of b:
        per block its Gram V_bᴴV_b (2·n·b²), V_bᴴY and Y − V_b h̃ (2·n·b·m each)
        and the triangular solve h̃ = T_b⁻¹(V_bᴴY) (b²·m) (Note [Householder
        FLOPs], Note [Block size]). The backward pass does 10·n·m·L + (3·m +
        2·n)·Σ_k b_k² less the innermost block's 4·n·b·m, 1.6× to 2.5× this, so
        forward+backward does 2.6× to 3.5× this where it is charged 3×.
        """
        L = m if reflections is None else reflections
        b = default_block(m)
        full, rest = divmod(L, b)
        return 4.0 * n * m * L + (2.0 * n + m) * (full * b * b + rest * rest)

    @classmethod
    def bytes(cls, n: int, m: int, reflections: int | None = None, itemsize: int = 4) -> float:
        """(n·L + 3·n·m·⌈L/b⌉ + 4·L·m)·itemsize, b = `default_block` (m) (Note [Bytes model]).

        Each block of b reflections is two thin products over the n×m matrix Y:
        VᵦᴴY reads Y, then Y − Vᵦh̃ reads it again and writes it; the b×m VᵦᴴY
        and h̃ = Tᵦ⁻¹VᵦᴴY are written and read once each; V is read once.
        """
        L = m if reflections is None else reflections
        return (n * L + 3.0 * n * m * -(-L // default_block(m)) + 4.0 * L * m) * itemsize

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        return kernels.householder_matrix(original, self.diagonal(), self.m, self.block)

    def operator(self, original: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return kernels.householder_linear(original, x, self.diagonal(), self.transposed, self.block)


@register("cwy")
class CWY(_Reflections):
    r"""Q = (I − U S⁻¹ Uᴴ)·[diag(d); 0], S = ½I + striu(UᴴU), U = V column-normalised.

    The compact WY form of the same product of reflections as ``householder``
    (CWY paper, Theorem 2), computed with one triangular solve. On a tall
    weight it is the truncated form T-CWY and never forms an n×n matrix.
    ``linear`` is the rollout form of §3.1 (u = Uᴴh, v = S⁻¹u, h − Uv), O(nL).

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        lin = orthogonalize(torch.nn.Linear(6, 6), method="cwy")
        w = lin.weight
        assert torch.allclose(w @ w.mT, torch.eye(6), atol=1e-5)
        ```
    """

    formula = "L n² + L² n + L³ (GEMMs + triangular solve)"

    @classmethod
    def flops(cls, n: int, m: int, reflections: int | None = None) -> float:
        """2·n·m·L + 3·n·L² + L³/3: UᴴU, the triangular solve and U·(S⁻¹U₁ᴴ)."""
        L = m if reflections is None else reflections
        return 2.0 * n * m * L + 3.0 * n * L * L + L**3 / 3

    @classmethod
    def bytes(cls, n: int, m: int, reflections: int | None = None, itemsize: int = 4) -> float:
        """(3·n·L + n·m + 2·L² + 2·L·m)·itemsize (Note [Bytes model]).

        U = V column-normalised (read V, write U), its Gram UᴴU (read U), the
        triangular solve (read S, read and write the L×m right-hand side), then
        E_d − U·(S⁻¹U₁ᴴ) (read U, write the n×m Q).
        """
        L = m if reflections is None else reflections
        return (3.0 * n * L + n * m + 2.0 * L * L + 2.0 * L * m) * itemsize

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        return kernels.cwy_matrix(original, self.diagonal(), self.m)

    def operator(self, original: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return kernels.cwy_linear(original, x, self.diagonal(), self.transposed)

    def prepare_operator(self, original: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        # Note [Factors once per rollout]: U and S once, O(nL) per application.
        u, s = kernels.cwy_factors(original)
        d, transposed = self.diagonal(), self.transposed
        return kernels.cwy_operator(u, s, d, transposed)  # Note [Operator with S⁻¹ folded in]


@register("tcwy")
class TCWY(CWY):
    r"""Truncated CWY onto St(N, M): γ(V) = [I; 0] − U S⁻¹ U₁ᴴ (CWY paper, Theorem 3).

    O(NM² + M³) with M reflections, never N×N; complex points carry the phase
    diagonal (Note [Signs live in a buffer, phases in a parameter]). On a
    square weight it coincides with ``cwy``.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        w = orthogonalize(torch.randn(1000, 3), method="tcwy")
        assert tuple(w().shape) == (1000, 3) and w.manifold.m == 3
        ```
    """

    formula = "N M² + M³ (GEMMs + triangular solve, never N×N)"
    domain = "St(N, M)"

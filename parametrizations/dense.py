r"""Maps through an n×n skew-Hermitian matrix: ``exp``, ``cayley`` and ``scaled_cayley``.

The original is a free (…, n, n) tensor X of which only the strict upper
triangle (and, if complex, the imaginary part of the diagonal) is used:
A = X₊ − X₊ᴴ (+ i·Im diag X) is skew-symmetric (real) or skew-Hermitian
(complex). On St(N, M) these maps return the first M columns of an N×N
orthogonal or unitary matrix, so they cost O(N³) whatever M is (prefer
``tcwy`` for thin matrices).
"""

from __future__ import annotations

import math

import torch

from .._core.checks import int_in_range
from . import kernels
from ._diagonal import SignPhaseDiagonal
from ._inverse import Unreachable, cayley_scaling, complete
from ._precision import high
from .base import OrthogonalMap, register

__all__ = ["Exp", "Cayley", "ScaledCayley"]


class _Based(OrthogonalMap):
    r"""A map A ↦ f(A)·B (or B·f(A)) with a fixed base point B in a buffer.

    Note [The base point makes every point reachable]
    expm is onto SO(n) but not onto O(n) (det expm(A) = 1), and the Cayley
    transform misses every matrix with eigenvalue −1 (−I included). Writing
    Q = B·f(A) with B = Q at assignment and A = 0 reaches every Q, det −1 and
    −I included, and starts training where f is best conditioned (A = 0: the
    differential of f is the identity). ``right_inverse`` therefore re-bases:
    it stores B (the target, completed to N×N if needed) and returns A = 0.
    B is a persistent buffer, saved in the ``state_dict``.

    Note [Changing the dtype of a based map]
    ``module.to(dtype)`` converts B like any buffer. Down to float16/bfloat16
    the stored weight stays within √m·eps of that dtype (B is used in float32,
    Note [Maps compute in float32 or wider]); up (e.g. ``.double()`` of a
    float32 module) B keeps its float32 rounding, ~1e-6 off in float64, until
    ``module.weight = module.weight`` re-stores it (accepted as the float32
    point it is, Note [Tolerance of right inverses], then projected in float64).
    The reflection maps have no such buffer: any V maps onto the manifold.
    """

    base_columns_full = True
    formula = "n³"

    def __init__(self, shape, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__(shape, dtype, device)
        cols = self.n if self.base_columns_full else self.m
        eye = torch.eye(self.n, cols, dtype=dtype, device=device)
        self.register_buffer("base", eye.expand(*self.batch, self.n, cols).clone())

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        p = complete(high(q)) if self.base_columns_full else high(q)
        with torch.no_grad():
            self.base.copy_(p.to(self.base.dtype))
        return torch.zeros(*self.batch, self.n, self.n, dtype=q.dtype, device=q.device)

    def _base_error(self) -> tuple[float, float]:
        r"""‖BᴴB − I‖_F and the tolerance of a base point (finite B).

        Note [Which base points are accepted]
        A base rounded to a lower precision (``module.bfloat16()``, a bfloat16
        checkpoint loaded into a float32 module) is repaired (Note [The base
        point is repaired after a round trip]); anything else off the manifold
        (uninitialised memory, a state dict of random numbers) is refused. So
        B is judged as a point of the coarsest precision that holds it exactly
        (bfloat16 and float16 included, Note [Tolerance of right inverses]),
        and never beyond ‖BᴴB − I‖_F = 0.5, inside the region where the
        repair's Newton–Schulz steps converge (bfloat16 rounding gives 0.075
        at n = 1024).
        """
        b = self.base
        err, tol = self.point_error(b)
        if not b.is_complex():
            for low in (torch.bfloat16, torch.float16):
                if b.dtype != low and torch.equal(b.to(low).to(b.dtype), b):
                    eps = torch.finfo(low).eps
                    tol = max(tol, 100 * self.n * eps, math.sqrt(eps))
                    break
        return err, min(tol, 0.5)

    def check_state(self) -> str | None:
        """The base must be a point (within the tolerance of a right inverse) to be usable."""
        why = super().check_state()
        b = self.base
        if why is not None or b.device.type == "meta":
            return why
        if not bool(torch.isfinite(b).all()):
            return "buffer 'base' is not finite"
        err, tol = self._base_error()
        if not err <= tol:
            return (
                f"buffer 'base' is not a point (‖BᴴB − I‖_F = {err:.3e} > {tol:.3e}; it must "
                "have orthonormal columns)"
            )
        return None

    def changed_outside(self) -> None:
        r"""Put the base back on the manifold after a conversion or a load.

        Note [The base point is repaired after a round trip]
        A product B·f(A) is only as orthonormal as B. ``module.bfloat16()``
        rounds B to bfloat16 (8 bits of mantissa), and ``.float()`` afterwards
        (or a bfloat16 checkpoint loaded into a float32 module) keeps that
        rounding: the weight was 9e-3 off the manifold where the reflection
        maps (whose buffers are exact ±1) are at float32 rounding. A (the
        skew part of the original) needs no repair: `skew_from_raw` makes it
        exactly skew from any tensor. So whenever the buffers are rewritten
        from outside (``_apply``, ``load_state_dict``), B is replaced by the
        nearest point, computed in float64 (Newton–Schulz steps, B is within
        rounding of it) and rounded once to B's dtype, when it is off by more
        than 10·n·eps of its dtype (a B of its dtype's precision is kept bit
        for bit): within a few n·eps of
        the manifold for a float32 B, the change being the size of the
        rounding it removes. Buffers without values (meta) or not finite
        (``to_empty``) are left for the first-use check.
        """
        super().changed_outside()
        b = self.base
        if b.device.type == "meta" or not bool(torch.isfinite(b).all()):
            return
        with torch.no_grad():
            x = high(b)
            gram = x.mH @ x
            err = float(torch.linalg.matrix_norm(gram - torch.eye(gram.shape[-1]).to(gram)).max())
            if err <= 10 * self.n * torch.finfo(b.dtype).eps:
                return  # already a point of B's precision (a load keeps it bit for bit)
            if not err <= self._base_error()[1]:
                return  # not a rounded point: refused by the first-use check (check_state)
            for _ in range(4):
                x = 1.5 * x - 0.5 * (x @ (x.mH @ x))
            b.copy_(x.to(b.dtype))


@register("exp")
class Exp(_Based):
    r"""Q = (B·expm(A))[:, :m], A skew-symmetric / skew-Hermitian, B a fixed base (buffer).

    O(n³) per call (Padé with the adjoint-Fréchet backward, `_expm.expm`; ``eigh``
    when ‖A‖₁ is large), also on St(n, m).

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        q = -torch.eye(3, dtype=torch.float64)  # det −1, not reachable by expm alone
        w = orthogonalize(q.clone(), method="exp")
        assert torch.allclose(w(), q)
        ```
    """

    domain = "O(n) with the base buffer"

    @classmethod
    def flops(cls, n: int, m: int, reflections: int | None = None) -> float:
        """24n³: about 12 n×n products (Padé degree 13 and squarings, at the norms
        that need squarings; 2–5 products and the solve below them, Note [Padé degree
        by the dtype's unit roundoff])."""
        return 24.0 * n**3

    @classmethod
    def bytes(cls, n: int, m: int, reflections: int | None = None, itemsize: int = 4) -> float:
        """(39n² + 2nm)·itemsize (Note [Bytes model]): A from the raw original (2n²), the
        ~12 n×n products of the Padé approximant and squarings (each reads two, writes
        one: 36n²), then B·expm(A)[:, :m] (read B and n×m, write n×m)."""
        return (39.0 * n * n + 2.0 * n * m) * itemsize

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        return kernels.exp_map(kernels.skew_from_raw(original), self.base, self.m)


@register("cayley")
class Cayley(_Based):
    r"""Q = (I + A)⁻¹(I − A)·B through one solve, B a fixed base (buffer).

    O(n³) per call, also on St(n, m) (B then has m columns). The solve is block
    elimination without pivoting while ‖A‖₁ is small (Note [Elimination without
    pivoting for I + A]), LU with partial pivoting beyond, ``eigh`` for large ‖A‖₁.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        w = orthogonalize(torch.randn(5, 3, dtype=torch.complex128), method="cayley")
        assert (w.manifold.n, w.manifold.m) == (5, 3)
        ```
    """

    base_columns_full = False
    domain = "O(n) without eigenvalue −1 (base buffer)"

    @classmethod
    def flops(cls, n: int, m: int, reflections: int | None = None) -> float:
        """2n³/3 + 2n²m: the elimination of I + A, then the solve with the m columns of B.

        Both as for LU (`_cayley.cayley_solve`): the factors cost 2n³/3 (by blocks
        without pivoting, or LAPACK's partial pivoting), applying them 2n²m.
        """
        return 2 * n**3 / 3 + 2 * n**2 * m

    @classmethod
    def bytes(cls, n: int, m: int, reflections: int | None = None, itemsize: int = 4) -> float:
        """(8n² + 9nm)·itemsize (Note [Bytes model]): A from the raw original (read, write),
        ‖A‖₁ (read A), I + A (read, write), its factors in place (read, write), the copy of B
        (read, write), the solve (read the factors; read and write the n×m columns twice)
        and 2(I + A)⁻¹B − B (read two n×m, write one)."""
        return (8.0 * n * n + 9.0 * n * m) * itemsize

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        return kernels.cayley_map(kernels.skew_from_raw(original), self.base)


@register("scaled_cayley")
class ScaledCayley(SignPhaseDiagonal, OrthogonalMap):
    r"""W = ((I + A)⁻¹(I − A)·D)[:, :m]: scoRNN (real) and scuRNN (complex).

    Real: D = diag(±1) is a fixed buffer. With ``negatives=ρ`` it holds ρ
    entries −1 (the last ones), as in scoRNN, and ``right_inverse`` raises
    ValueError when a point is not reachable with that D; by default
    (``negatives=None``) ``right_inverse`` chooses D so that every point is
    reachable (Note [Choosing the scaling D of the scaled Cayley transform]).
    Complex: D = diag(e^{iθ}) with θ a trainable parameter (scuRNN); its
    gradient is the closed form of Theorem 2 of the scaled Cayley paper,
    ∂L/∂θ = 2 Re(i((∂L/∂W)ᵀK) ⊙ I)d, K = (I + A)⁻¹(I − A). O(n³) per call.

    Example:
        ```python
        import torch
        from stiefel.parametrizations import orthogonalize

        w = orthogonalize(torch.eye(4), method="scaled_cayley", negatives=2, init="random")
        assert w.map.scaling.tolist() == [1.0, 1.0, -1.0, -1.0]
        assert torch.allclose(w() @ w().T, torch.eye(4), atol=1e-6)
        ```
    """

    diagonal_buffer = "scaling"
    formula = "n³"
    domain = "O(n) with D = diag(±1)"
    flops = Cayley.flops
    bytes = Cayley.bytes

    def __init__(
        self,
        shape,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        negatives: int | None = None,
    ):
        super().__init__(shape, dtype, device)
        if negatives is not None:
            if self.is_complex:
                raise ValueError(
                    f"negatives={negatives!r} is a real-only option (scoRNN's fixed ±1 scaling); "
                    "complex weights train the phases of D; allowed for complex: negatives=None"
                )
            int_in_range("negatives", negatives, 0, self.m, none_ok=True)
        self.negatives = negatives
        real = torch.empty((), dtype=dtype).real.dtype
        d = torch.ones(*self.batch, self.m, dtype=real, device=device)
        if negatives:
            d[..., self.m - negatives :] = -1
        self._init_diagonal(d)

    def matrix(self, original: torch.Tensor) -> torch.Tensor:
        return kernels.scaled_cayley_map(kernels.skew_from_raw(original), self.diagonal())

    def random_original(self, generator: torch.Generator | None, like: torch.Tensor):
        """A Haar point with the determinant this map reaches, then its parameters.

        Note [Random points of a fixed real scaling]
        A real Cayley factor (I + A)⁻¹(I − A) has determinant +1, so a square
        W = K·D has det W = det D: with ``negatives`` fixed, half of O(n) is out
        of reach. Flipping the first column of a Haar point whose determinant
        is the other one keeps it Haar on the reachable coset.
        """
        q = self._haar(like, generator)
        if self.negatives is not None and self.n == self.m:
            sign = torch.linalg.det(q).sign() * self.scaling.to(q.dtype).prod(-1)
            q = q.clone()
            q[..., :, 0] *= sign.unsqueeze(-1)
        return self.inverse(q)

    def inverse(self, q: torch.Tensor) -> torch.Tensor:
        p = complete(high(q))
        d = cayley_scaling(p)
        if self.negatives is not None:
            d[..., : self.m] = self.scaling.to(device=d.device, dtype=d.dtype)
        eye = torch.eye(self.n, dtype=p.dtype, device=p.device)
        k = p * d.conj().unsqueeze(-2)  # K = P D⁻¹
        a, info = torch.linalg.solve_ex(eye + k, eye - k)
        if bool((info != 0).any()):
            a = torch.full_like(a, float("nan"))
        a = 0.5 * (a - a.mH)
        raw = kernels.raw_from_skew(a)
        check = kernels.scaled_cayley_map(kernels.skew_from_raw(raw), d[..., : self.m])
        err = float(torch.linalg.matrix_norm(check - p[..., : self.m]).max())
        if not err <= self.tolerance(q.dtype) or not torch.isfinite(a).all():
            hint = (  # Kahan: every point is reached with a D chosen for it
                "the round trip missed the point at this precision (an error of the size "
                "of its distance to the manifold: project it with manifold.projx first)"
                if self.negatives is None
                else "use negatives=None"
            )
            raise Unreachable(
                f"the point is not reachable with negatives={self.negatives} (I + QD⁻¹ is "
                f"singular or ill-conditioned; error {err:.3e}); {hint}"
            )
        self.set_diagonal(d[..., : self.m])
        return raw.to(dtype=q.dtype, device=q.device)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", negatives={self.negatives}"

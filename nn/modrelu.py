r"""modReLU, the nonlinearity of the orthogonal / unitary recurrent cells, and the cast rule
of modules that hold real and complex tensors side by side."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from .._core import checks as _checks

__all__ = ["ModReLU", "keeping_kind"]

Cast = Callable[[torch.Tensor], torch.Tensor]


def _kept_dtype(fn: Cast, t: torch.Tensor) -> torch.dtype:
    """The dtype of ``t`` after the cast ``fn`` under Note [A cast keeps each tensor's kind]."""
    real = t.dtype.to_real() if t.is_complex() else t.dtype
    asked = fn(torch.empty(0, dtype=real, device=t.device)).dtype
    if not (asked.is_floating_point or asked.is_complex):
        return asked  # a cast to an integer type (``Module.type``): torch's own result
    asked = asked.to_real() if asked.is_complex else asked
    if not t.is_complex():
        return asked
    return torch.complex64 if asked in _checks.LOW_PRECISION else asked.to_complex()


def keeping_kind(fn: Cast) -> Cast:
    """``fn`` of ``Module._apply`` (``.to``, ``.double()``, ``.half()``, …), each tensor keeping
    its kind.

    Note [A cast keeps each tensor's kind]
    torch casts real and complex tensors apart: ``.double()``, ``.half()`` and
    ``.bfloat16()`` change only the real floating tensors (a complex one is left
    as it is), and ``.to(torch.complex128)`` turns the real ones complex. A
    complex recurrent cell holds both kinds (U, W's original and h₀ complex; the
    modReLU bias, W's phases and the readout real), so ``.double()`` left its
    complex tensors at complex64 beside float64 real ones, and a cast to
    complex128 made the bias and the readout complex: the next forward failed on
    a dtype mismatch. Here the precision follows the cast and the kind is kept:
    each tensor gets the precision the cast gives a real tensor of its own
    precision (``.double()``: float64 stays real, complex64 becomes complex128;
    ``.to(torch.complex128)``: a real tensor becomes float64). A complex tensor is
    complex64 at least: torch has no complex-half products (``addmm`` is not
    implemented for ComplexHalf), and the maps compute half precision in float32
    anyway (Note [Maps compute in float32 or wider]). The rule of a `Rotation`
    (Note [Q keeps its precision]) is the same, with float32 as its floor for
    real tensors too.
    """
    if getattr(fn, "keeps_kind", False):  # a parent's cast, already wrapped
        return fn

    def apply(t: torch.Tensor) -> torch.Tensor:
        if not (t.is_floating_point() or t.is_complex()):
            return fn(t)
        want = _kept_dtype(fn, t)
        with warnings.catch_warnings():  # an empty probe's complex → real cast warns
            warnings.simplefilter("ignore", UserWarning)
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        if probe.dtype == want:
            return fn(t)
        return t.to(device=probe.device, dtype=want)

    apply.keeps_kind = True  # type: ignore[attr-defined]
    return apply


class ModReLU(nn.Module):
    r"""modReLU σ(z) = relu(|z| + b)·z/|z|: (|z| + b)·z/|z| if |z| + b ≥ 0, else 0.

    With the smoothing ε (``eps``) in the quotient: relu(m + b)·z/m with m = √(|z|² + ε)
    for complex z, and relu(|z| + b)·z/(|z| + ε) for real z (sign(z)·relu(|z| + b) up to
    a relative ε/|z|). The bias b is real: a cast of the module keeps it real (Note [A
    cast keeps each tensor's kind]).

    Note [modReLU singularity]
    For b > 0 the derivative blows up as z → 0 (scaled Cayley paper, §4, Theorems
    3–4), even with |z| smoothed as √(|z|² + ε). Two guards: ``nonpositive_bias``
    keeps b ≤ 0 (the derivative is then bounded, Theorem 3), and the recurrent
    layers start from h₀ away from zero; |z| is smoothed with ε = 1e-5 as in
    uRNN/scuRNN.

    Note [modReLU at zero]
    σ(z) = z·s(z) with s(z) = relu(|z| + b)/|z|. With ``eps=0`` the quotient is
    0/0 at z = 0 (and the gradient of |z| there is 0·∞), which gave NaN in the
    value and the gradient. There s is replaced by its limit: 0 for b < 0
    (σ ≡ 0 near 0), 1 for b = 0 (σ(z) = z) and, for b > 0, the 1 of the
    continuous part of σ(z) = z + b·sgn(z) (torch's convention that sgn has a
    zero derivative). So σ(0) = 0, ∂σ/∂z(0) = 1[b ≥ 0] and ∂σ/∂b(0) = 0, all finite;
    the division itself reads a safe |z| = 1 there, so no NaN reaches the
    backward pass. With ε > 0 nothing divides by zero and the formula is used as is.

    Args:
        n: number of features (one bias each).
        nonpositive_bias: use min(b, 0) as the bias (bounded derivative).
        eps: the smoothing ε ≥ 0 of |z| (see above; 0: the exact quotient).

    Raises:
        ValueError: ``n`` not a positive int, a negative or non-finite ``eps``; in
            ``forward``, an input whose last dimension is not ``n``.
        TypeError: ``eps`` not a real number, ``nonpositive_bias`` not a bool.

    Example:
        ```python
        import torch
        from stiefel.nn import ModReLU

        act = ModReLU(4)
        z = torch.randn(2, 4, dtype=torch.complex64)
        assert act(z).shape == (2, 4)
        assert torch.isfinite(ModReLU(4, eps=0.0)(torch.zeros(1, 4))).all()
        assert ModReLU(4).to(torch.complex128).bias.dtype == torch.float64
        ```
    """

    def __init__(self, n: int, nonpositive_bias: bool = False, eps: float = 1e-5):
        super().__init__()
        n = _checks.positive_int("n", n)
        _checks.flag("nonpositive_bias", nonpositive_bias)
        eps = _checks.number("eps", eps, low=0.0)
        self.bias = nn.Parameter(torch.full((n,), -0.01 if nonpositive_bias else 0.0))
        self.nonpositive_bias = nonpositive_bias
        self.eps = eps

    def _apply(self, fn, recurse=True):
        """``Module._apply``, the bias staying real (Note [A cast keeps each tensor's kind])."""
        return super()._apply(keeping_kind(fn), recurse)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """σ(z), elementwise over the last dimension (of size n), in the dtype of ``z``."""
        n = self.bias.shape[0]
        _checks.tensor("z", z)
        if z.dim() < 1 or z.shape[-1] != n:
            raise ValueError(f"z has shape {tuple(z.shape)}; allowed: (..., {n}), n = {n} features")
        b = -torch.relu(-self.bias) if self.nonpositive_bias else self.bias
        b = b.to(z.real.dtype if z.is_complex() else z.dtype)  # the output follows z
        zero = None
        if self.eps == 0:  # Note [modReLU at zero]
            zero = z == 0
            z_safe = torch.where(zero, torch.ones_like(z), z)
        else:
            z_safe = z
        if z.is_complex():
            mod = torch.sqrt(z_safe.real**2 + z_safe.imag**2 + self.eps)
            scale = torch.relu(mod + b) / mod
        else:
            mod = z_safe.abs()
            scale = torch.relu(mod + b) / (mod + self.eps)
        if zero is not None:
            scale = torch.where(zero, (b >= 0).to(scale.dtype), scale)
        return z * scale

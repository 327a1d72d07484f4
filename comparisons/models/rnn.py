"""Recurrent models whose transition matrix comes from any strategy.

h_t = σ(U x_t + W h_{t−1}),  y_t = V h_t + c,  with W on O(n) (real) or U(n)
(complex, scuRNN) given by a parametrization or kept as a manifold parameter.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...parametrizations import orthogonalize

__all__ = ["ModReLU", "OrthogonalRNN", "LSTMBaseline", "henaff_init"]


class ModReLU(nn.Module):
    r"""modReLU σ(z) = (|z| + b)·z/|z| if |z| + b ≥ 0, else 0 (real: sign(z)·relu(|z| + b)).

    Note [modReLU singularity]
    For b > 0 the derivative blows up as z → 0 (scaled Cayley paper, §4, Theorems
    3–4), even with |z| smoothed as √(|z|² + ε). Two guards: ``nonpositive_bias``
    keeps b ≤ 0 (the derivative is then bounded, Theorem 3), and the models start
    from h₀ away from zero; |z| is smoothed with ε = 1e-5 as in uRNN/scuRNN.
    """

    def __init__(self, n: int, nonpositive_bias: bool = False, eps: float = 1e-5):
        super().__init__()
        self.bias = nn.Parameter(torch.full((n,), -0.01 if nonpositive_bias else 0.0))
        self.nonpositive_bias = nonpositive_bias
        self.eps = eps

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b = -torch.relu(-self.bias) if self.nonpositive_bias else self.bias
        mod = torch.sqrt(z.real**2 + z.imag**2 + self.eps) if z.is_complex() else z.abs()
        scale = torch.relu(mod + b) / (mod + (0 if z.is_complex() else self.eps))
        return z * scale


def henaff_init(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Block-diagonal 2×2 rotations with angles in U[−π, π] (Henaff et al. 2016)."""
    w = torch.zeros(n, n)
    angles = (torch.rand(n // 2, generator=generator) * 2 - 1) * math.pi
    for i, a in enumerate(angles):
        c, s = math.cos(a), math.sin(a)
        w[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, -s], [s, c]])
    if n % 2:
        w[-1, -1] = 1.0
    return w


class OrthogonalRNN(nn.Module):
    """An RNN with an orthogonal (real) or unitary (complex) transition matrix.

    Args:
        n_in, n_hidden, n_out: sizes.
        method, method_options: the strategy's map (``stiefel.orthogonalize``).
        complex: a complex cell (scuRNN-style) with W ∈ U(n).
        dtype: the real floating dtype of the weights (float32 or float64); a
            complex cell uses the matching complex dtype.
        init: ``"henaff"`` (block rotations), ``"haar"`` or ``"identity"``.
        operator: ``"auto"`` (default), ``True`` or ``False``: apply W at each step
            in the map's operator form ``W.linear`` (O(n·L) per vector, no n×n
            matrix) where the map has one; otherwise W is formed once per
            sequence. See Note [Operator form or matrix].
    """

    def __init__(
        self,
        n_in: int,
        n_hidden: int,
        n_out: int,
        method: str = "cwy",
        method_options: dict | None = None,
        complex: bool = False,
        init: str = "henaff",
        operator: bool | str = "auto",
        nonpositive_bias: bool = False,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype={dtype}; allowed: torch.float32, torch.float64")
        self.n, self.complex = n_hidden, complex
        if init == "henaff":
            w0 = henaff_init(n_hidden, generator)
        elif init == "identity":
            w0 = torch.eye(n_hidden)
        else:
            w0 = torch.linalg.qr(torch.randn(n_hidden, n_hidden, generator=generator))[0]
        cdtype = dtype.to_complex() if complex else dtype
        w0 = w0.to(cdtype)
        self.transition = orthogonalize(w0, method=method, **(method_options or {}))
        self.use_operator = _use_operator(operator, self.transition, n_hidden)
        scale = 1 / math.sqrt(n_in)
        self.inp = nn.Parameter(torch.randn(n_hidden, n_in, generator=generator).to(cdtype) * scale)
        self.act = ModReLU(n_hidden, nonpositive_bias).to(dtype)
        width = 2 * n_hidden if complex else n_hidden
        self.out = nn.Linear(width, n_out, dtype=dtype)
        # h₀ away from zero (Note [modReLU singularity])
        h0 = torch.rand(n_hidden, generator=generator) * 0.1 + 0.05
        self.register_buffer("h0", h0.to(cdtype))

    def transition_matrix(self) -> torch.Tensor:
        return self.transition()

    def forward(self, x: torch.Tensor, all_steps: bool = False) -> torch.Tensor:
        """x: (batch, T, n_in) → (batch, T, n_out) if ``all_steps`` else (batch, n_out)."""
        b, t, _ = x.shape
        x = x.to(self.inp.dtype)
        drive = x @ self.inp.T  # (b, T, n)
        if self.use_operator:  # factors once per sequence (Note [Factors once per rollout])
            step = self.transition.operator()
        else:
            w = self.transition()
            step = lambda h: h @ w.T  # noqa: E731
        h = self.h0.expand(b, self.n)
        outs = []
        for i in range(t):
            h = self.act(drive[:, i] + step(h))
            if all_steps or i == t - 1:
                outs.append(h)
        hs = torch.stack(outs, 1)
        if self.complex:
            hs = torch.cat((hs.real, hs.imag), -1)
        y = self.out(hs)
        return y if all_steps else y[:, -1]


#: maps whose ``W.linear`` applies W without forming it (O(n·L) per vector)
OPERATOR_METHODS = ("householder", "cwy", "tcwy")


def _use_operator(operator: bool | str, w: nn.Module, n: int) -> bool:
    """Note [Operator form or matrix]

    For a sequence of length T and batch B, the operator form costs about
    4·T·B·n·L flops; forming Q once (2n²L) and multiplying by it costs about
    2n²L + 2·T·B·n². For long sequences the operator form wins exactly when
    2L < n, so ``"auto"`` takes it for maps that have one with fewer than n/2
    reflections, and forms the matrix otherwise.
    """
    if operator not in (True, False, "auto"):
        raise ValueError(f"operator={operator!r}; allowed: True, False, 'auto'")
    if getattr(w, "method", None) not in OPERATOR_METHODS:
        return False
    if operator == "auto":
        fmap = getattr(w, "map", None)
        L = getattr(fmap, "reflections", n) or n
        return 2 * L < n
    return bool(operator)


class LSTMBaseline(nn.Module):
    """The LSTM baseline (forget-gate bias 1, as in the scaled Cayley paper's settings)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lstm = nn.LSTM(n_in, n_hidden, batch_first=True, dtype=dtype)
        with torch.no_grad():
            for name, p in self.lstm.named_parameters():
                if name.startswith("bias"):
                    p.zero_()
                    p[n_hidden : 2 * n_hidden] = 0.5  # two biases add up to 1
        self.out = nn.Linear(n_hidden, n_out, dtype=dtype)

    def forward(self, x: torch.Tensor, all_steps: bool = False) -> torch.Tensor:
        hs, _ = self.lstm(x.to(self.out.weight.dtype))
        y = self.out(hs)
        return y if all_steps else y[:, -1]

r"""Recurrent layers with an orthogonal (real) or unitary (complex) transition matrix.

h_t = σ(U x_t + W h_{t−1}),  y_t = V h_t + c,  with W on O(n) (real) or U(n)
(complex, scuRNN) given by any map of `stiefel.orthogonalize` or kept as
a manifold parameter (``method="riemannian"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._core import checks as _checks
from .._core.autocast import autocast_off, autocast_on
from ..manifolds import Orthogonal, Unitary
from ..parametrizations import OrthogonalMap, orthogonalize
from .modrelu import ModReLU, keeping_kind

__all__ = ["ModReLU", "OrthogonalRNNCell", "OrthogonalRNN", "henaff_init"]

INITS = ("henaff", "haar", "identity")


def _in_cell_dtype(name: str, t: object, dtype: torch.dtype, shape: str) -> torch.Tensor:
    """``t`` cast to the cell's ``dtype``, refused where the cast would drop an imaginary part."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}; allowed: a tensor {shape}")
    if t.is_complex() and not dtype.is_complex:
        raise TypeError(
            f"{name} has dtype {t.dtype} and the cell is real ({dtype}), so the cast would "
            f"drop its imaginary part; allowed: a real tensor {shape}, or a cell built with "
            "complex=True"
        )
    return t.to(dtype)


def henaff_init(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Block-diagonal 2×2 rotations with angles in U[−π, π] (Henaff et al. 2016).

    Args:
        n: size of the n×n matrix (odd n: the last diagonal entry is 1).
        generator: random generator of the angles.

    Returns:
        An n×n float32 orthogonal matrix.
    """
    w = torch.zeros(n, n)
    angles = (torch.rand(n // 2, generator=generator) * 2 - 1) * math.pi
    for i, a in enumerate(angles):
        c, s = math.cos(a), math.sin(a)
        w[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, -s], [s, c]])
    if n % 2:
        w[-1, -1] = 1.0
    return w


def has_operator(fmap: object) -> bool:
    """Whether ``fmap`` is a map with an operator form (its class's ``has_operator()``)."""
    return isinstance(fmap, OrthogonalMap) and type(fmap).has_operator()


def _check_operator(operator: object) -> None:
    # not `operator in (True, False, "auto")`: 1 == True and 0 == False would pass
    if not (isinstance(operator, bool) or (isinstance(operator, str) and operator == "auto")):
        raise ValueError(f"operator={operator!r}; allowed: True, False, 'auto'")


def _check_build(method_options: object, generator: object) -> None:
    """The options and the generator of a recurrent layer (the rest have helpers)."""
    if method_options is not None and not isinstance(method_options, Mapping):
        raise TypeError(
            f"method_options={method_options!r}; allowed: None or a dict of the map's options"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator={generator!r}; allowed: None or a torch.Generator")


def use_operator(operator: bool | str, w: nn.Module, n: int) -> bool:
    """Whether a rollout applies W in its operator form.

    Note [Operator form or matrix]
    For a sequence of length T and batch B, the operator form costs about
    4·T·B·n·L flops; forming Q once (2n²L) and multiplying by it costs about
    2n²L + 2·T·B·n². For long sequences the operator form wins exactly when
    2L < n, so ``"auto"`` takes it for maps that have one with fewer than n/2
    reflections, and forms the matrix otherwise.
    """
    _check_operator(operator)
    fmap = getattr(w, "map", None)
    if not has_operator(fmap):
        return False
    if operator == "auto":
        L = getattr(fmap, "reflections", n) or n
        return 2 * L < n
    return bool(operator)


class OrthogonalRNNCell(nn.Module):
    r"""One step h' = σ(U x + W h) with W on O(n) (real) or U(n) (complex), σ = modReLU.

    Reading the transition matrix recomputes its map (an O(n²L) or O(n³)
    computation): call the cell inside ``torch.nn.utils.parametrize.cached()``
    or pass the ``step`` function of `rollout_step` (the operator form,
    factored once per sequence) when running it over a sequence.

    Args:
        n_in: input features.
        n_hidden: hidden features n (W is n×n).
        method: the map of W, any name of ``stiefel.parametrizations.available()``.
        method_options: the map's options (e.g. ``{"reflections": 8}``).
        complex: a complex cell (scuRNN-style) with W ∈ U(n).
        init: ``"henaff"`` (block rotations), ``"haar"`` or ``"identity"``.
        nonpositive_bias: the modReLU guard (Note [modReLU singularity]).
        generator: random generator of the initial values.
        dtype: the real floating dtype (float32 or float64); a complex cell
            uses the matching complex dtype.

    Raises:
        TypeError: for a dtype other than float32/float64, a ``complex`` or
            ``nonpositive_bias`` that is not a bool, ``method_options`` not a dict or
            ``generator`` not a torch.Generator.
        ValueError: for an unknown ``init``, ``n_in``/``n_hidden`` not a positive int,
            or a build under ``torch.device("meta")``.

    A cast keeps each tensor's kind (Note [A cast keeps each tensor's kind]):
    ``.double()`` or ``.to(torch.complex128)`` makes a complex cell complex128 with
    float64 real parts, a real one float64; ``.half()`` makes a real cell float16 and
    leaves a complex one's complex tensors complex64.

    Example:
        ```python
        import torch
        from torch.nn.utils import parametrize
        from stiefel.nn import OrthogonalRNNCell

        cell = OrthogonalRNNCell(3, 8, method="cwy")
        x = torch.randn(5, 2, 3)  # (T, batch, n_in)
        h = torch.zeros(2, 8)
        with parametrize.cached():  # W is computed once for the sequence
            for x_t in x:
                h = cell(x_t, h)
        assert h.shape == (2, 8)
        ```
    """

    def __init__(
        self,
        n_in: int,
        n_hidden: int,
        method: str = "cwy",
        method_options: dict[str, Any] | None = None,
        complex: bool = False,
        init: str = "henaff",
        nonpositive_bias: bool = False,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        n_in = _checks.positive_int("n_in", n_in)
        n_hidden = _checks.positive_int("n_hidden", n_hidden)
        _check_build(method_options, generator)
        if torch.empty(0).device.type == "meta":  # `with torch.device("meta")`
            raise ValueError(
                "OrthogonalRNNCell is built from drawn values (its init) and has no "
                "reset_parameters to draw them again after to_empty: build it on a real "
                "device (it is n_hidden² + n_hidden·n_in values) and move it; the meta "
                "recipe is for orthogonalize and the convolution layers (docs/scaling.md)"
            )
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype={dtype}; allowed: torch.float32, torch.float64")
        _checks.choice("init", init, INITS)
        _checks.flag("complex", complex)
        _checks.flag("nonpositive_bias", nonpositive_bias)
        self.n, self.complex = n_hidden, complex
        cdtype = dtype.to_complex() if complex else dtype
        group = (Unitary if complex else Orthogonal)(n_hidden)  # init="haar": Haar on it
        w0 = {
            "henaff": lambda: henaff_init(n_hidden, generator),
            "identity": lambda: torch.eye(n_hidden),
            "haar": lambda: group.random(dtype=cdtype, generator=generator),
        }[init]()
        self.transition = orthogonalize(w0.to(cdtype), method=method, **(method_options or {}))
        # complex Gaussian input weights for a complex cell (E|w|² = 1, as the real ones)
        inp = torch.randn(n_hidden, n_in, generator=generator, dtype=cdtype) / math.sqrt(n_in)
        self.inp = nn.Parameter(inp)
        self.act = ModReLU(n_hidden, nonpositive_bias).to(dtype)

    def _apply(self, fn, recurse=True):
        """``Module._apply`` (``.to``, ``.double()``, …) by Note [A cast keeps each tensor's
        kind]: a complex cell stays complex, its real parts real, at the cast's precision."""
        return super()._apply(keeping_kind(fn), recurse)

    def transition_matrix(self) -> torch.Tensor:
        """W, n×n (recomputed by the map at every call outside ``parametrize.cached()``)."""
        return self.transition()

    def rollout_step(self, operator: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function h ↦ W h (on rows: h @ Wᵀ) for one sequence.

        Args:
            operator: apply W in the map's operator form (factors once, O(n·L) per
                vector) instead of forming W once.

        Returns:
            The function; build it once per sequence, not once per step.
        """
        _checks.flag("operator", operator)
        # Note [Recurrence in float32 under autocast]
        # Under torch.autocast(dtype=bfloat16) the product W h would run in
        # bfloat16. The gradient of W is a sum over T·B outer products that
        # largely cancel; with 8-bit mantissas it loses its direction (cosine
        # 0.1–0.3 with the float32 gradient once the easy part of the copying
        # task is learned, measured), and the memory is never learned: copying
        # T = 100, n = 128, 200 steps ended at 0.31 (above the 0.17 baseline)
        # against 0.029 in float32. The recurrence therefore runs in the cell's
        # dtype, like the map; the input drive, the nonlinearity's inputs and
        # the output layer keep autocast's precision.
        if not autocast_on(self.inp):
            if operator:
                return self.transition.operator()
            w = self.transition()
            return lambda h: h @ w.T
        dtype, inp = self.inp.dtype, self.inp
        with autocast_off(inp):
            step = self.transition.operator() if operator else None
            w = None if operator else self.transition()

        def full_precision(h: torch.Tensor) -> torch.Tensor:
            with autocast_off(inp):
                return step(h.to(dtype)) if step is not None else h.to(dtype) @ w.T

        return full_precision

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        step: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """h' = σ(U x + W h).

        Args:
            x: input (batch, n_in), cast to the cell's dtype; complex only for a complex
                cell.
            h: hidden state (batch, n), cast to the cell's dtype (so real zeros start a
                complex cell); complex only for a complex cell.
            step: h ↦ W h from `rollout_step`; by default W is read
                (and its map recomputed) now.

        Returns:
            The next hidden state (batch, n).

        Raises:
            TypeError: ``x`` or ``h`` not a tensor, or complex for a real cell.
            ValueError: ``x`` not (batch, n_in), ``h`` not (batch, n), or their batches
                differ.
        """
        dtype, (n, n_in) = self.inp.dtype, self.inp.shape
        x = _in_cell_dtype("x", x, dtype, "(batch, n_in)")
        h = _in_cell_dtype("h", h, dtype, "(batch, n_hidden)")
        for name, t, width in (("x", x, n_in), ("h", h, n)):
            if t.dim() != 2 or t.shape[1] != width:
                allowed = f"(batch, {'n_in' if name == 'x' else 'n_hidden'} = {width})"
                raise ValueError(f"{name} has shape {tuple(t.shape)}; allowed: {allowed}")
        if x.shape[0] != h.shape[0]:
            raise ValueError(f"x has batch {x.shape[0]}, h {h.shape[0]}; allowed: the same batch")
        step = step or self.rollout_step()
        return self.act(x @ self.inp.T + step(h))


class OrthogonalRNN(nn.Module):
    """An RNN with an orthogonal (real) or unitary (complex) transition matrix and a readout.

    Runs an `OrthogonalRNNCell` over the sequence from a fixed h₀ away
    from zero (Note [modReLU singularity]) and reads y = V h (+ c); a complex
    cell is read through [Re h, Im h]. W is formed, or its operator form
    factored, once per sequence (Note [Factors once per rollout]).

    Args:
        n_in: input features.
        n_hidden: hidden features.
        n_out: output features.
        method: the map of W (``stiefel.parametrizations.available()``).
        method_options: its options.
        complex: a complex cell with W ∈ U(n).
        init: ``"henaff"`` (block rotations), ``"haar"`` or ``"identity"``.
        operator: ``"auto"`` (default), ``True`` or ``False``: apply W at each step
            in the map's operator form where the map has one; otherwise W is
            formed once per sequence. See Note [Operator form or matrix].
        nonpositive_bias: the modReLU guard.
        generator: random generator of the initial values.
        dtype: the real floating dtype (float32 or float64).

    Raises:
        ValueError: ``n_in``, ``n_hidden`` or ``n_out`` not a positive int, an unknown
            ``init`` or ``operator``, a build under ``torch.device("meta")``.
        TypeError: as `OrthogonalRNNCell`.

    A cast keeps each tensor's kind, as the cell's (the readout and h₀ included).

    Example:
        ```python
        import torch
        from stiefel.nn import OrthogonalRNN

        rnn = OrthogonalRNN(2, 16, 3, method="cwy", method_options={"reflections": 4})
        y = rnn(torch.randn(4, 10, 2))  # (batch, T, n_in) -> (batch, n_out)
        assert y.shape == (4, 3)
        ```
    """

    def __init__(
        self,
        n_in: int,
        n_hidden: int,
        n_out: int,
        method: str = "cwy",
        method_options: dict[str, Any] | None = None,
        complex: bool = False,
        init: str = "henaff",
        operator: bool | str = "auto",
        nonpositive_bias: bool = False,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        n_out = _checks.positive_int("n_out", n_out)
        _check_operator(operator)
        self.cell = OrthogonalRNNCell(
            n_in,
            n_hidden,
            method,
            method_options,
            complex,
            init,
            nonpositive_bias,
            generator,
            dtype,
        )
        self.n, self.complex = n_hidden, complex
        self.use_operator = use_operator(operator, self.cell.transition, n_hidden)
        width = 2 * n_hidden if complex else n_hidden
        self.out = nn.Linear(width, n_out, dtype=dtype)
        h0 = torch.rand(n_hidden, generator=generator) * 0.1 + 0.05
        self.register_buffer("h0", h0.to(self.cell.inp.dtype))

    def _apply(self, fn, recurse=True):
        """``Module._apply`` by Note [A cast keeps each tensor's kind] (the readout stays real)."""
        return super()._apply(keeping_kind(fn), recurse)

    @property
    def transition(self) -> nn.Module:
        """The `stiefel.parametrizations.OrthogonalMatrix` of W."""
        return self.cell.transition

    @property
    def inp(self) -> nn.Parameter:
        """The input matrix U (n × n_in)."""
        return self.cell.inp

    @property
    def act(self) -> ModReLU:
        """The modReLU nonlinearity."""
        return self.cell.act

    def transition_matrix(self) -> torch.Tensor:
        """W, n×n."""
        return self.cell.transition_matrix()

    def forward(self, x: torch.Tensor, all_steps: bool = False) -> torch.Tensor:
        """Run the sequence.

        Args:
            x: inputs (batch, T, n_in).
            all_steps: return every step's output instead of the last one.

        Returns:
            (batch, T, n_out) if ``all_steps`` else (batch, n_out).

        Raises:
            TypeError: ``x`` not a tensor, or complex for a real cell.
            ValueError: ``x`` not of shape (batch, T ≥ 1, n_in).
        """
        _checks.flag("all_steps", all_steps)
        n_in = self.cell.inp.shape[1]
        x = _in_cell_dtype("x", x, self.cell.inp.dtype, "(batch, T, n_in)")
        if x.dim() != 3 or x.shape[1] < 1 or x.shape[2] != n_in:
            shape = tuple(x.shape)
            raise ValueError(
                f"x has shape {shape}; allowed: (batch, T, n_in) with T ≥ 1 and n_in = {n_in} "
                "(batch first; a single sequence is x[None])"
            )
        b, t, _ = x.shape
        drive = x @ self.cell.inp.T  # (b, T, n), one matmul for the whole sequence
        step = self.cell.rollout_step(self.use_operator)  # Note [Factors once per rollout]
        h = self.h0.expand(b, self.n)
        outs = []
        for i in range(t):
            h = self.cell.act(drive[:, i] + step(h))
            if all_steps or i == t - 1:
                outs.append(h)
        hs = torch.stack(outs, 1)
        if self.complex:
            hs = torch.cat((hs.real, hs.imag), -1)
        # a complex cell stays complex64 under .half() (Note [A cast keeps each tensor's
        # kind]) while its real readout is float16: the readout reads its own dtype
        y = self.out(hs.to(self.out.weight.dtype))
        return y if all_steps else y[:, -1]

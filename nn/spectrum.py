r"""Operator norms of layers: exact singular values and a power-iteration estimate.

A layer with a bias is affine; its singular values are those of its linear
part A x = layer(x) − layer(0), a map of inputs of shape ``input_shape``
(one image, no batch dimension) to outputs of the layer's output shape.

Note [Singular values of a circular convolution by impulse responses]
A linear map A of c-channel images that commutes with circular shifts is a
multichannel circular convolution: x = Σ_{j,p} x_j(p)·S_p e_j (e_j the unit
impulse of channel j at position 0), so A x = Σ_{j,p} x_j(p)·S_p h_j with
h_j = A e_j. The DFT, unitary up to a factor that cancels, block-diagonalises
it: ŷ(ω) = Ĥ(ω) x̂(ω), Ĥ(ω) the matrix whose column j is the DFT of h_j at ω,
and the singular values of A are those of all the Ĥ(ω) together (Sedghi,
Gupta & Long 2019). A strided layer commutes with shifts by its stride s: a
shift of the input by s moves the output by one position (a transposed
layer: by one input position and s output positions). Reading the image on
its coarser grid, with the s² phases of each s×s block as channels (the
polyphase components), it is again a circular convolution, of c·s² channels,
whose transfer matrices come from the impulses at the s² phases of the
first block. One forward of those impulses (and of the zero image) gives
every singular value, exact up to the layer's own rounding. Whether the
layer does commute with these shifts is not assumed: its response to a
random image is compared with the one the transfer matrices predict, and a
layer that does not (zero padding, a padding that wraps around unevenly) is
measured by its dense matrix instead (one forward per input value).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .._core import checks as _checks

__all__ = ["singular_values", "lipschitz_bound"]

METHODS = ("auto", "fft", "dense")
#: the largest number of input values whose dense matrix ``method="auto"`` forms
DENSE_LIMIT = 4096


def _shape(input_shape: object) -> tuple[int, ...]:
    if (
        not isinstance(input_shape, Sequence)
        or len(input_shape) < 1
        or not all(_checks.integer(s) and s > 0 for s in input_shape)
    ):
        raise ValueError(
            f"input_shape={input_shape!r}; allowed: the shape of one input without the batch "
            "dimension, positive ints, e.g. (channels, height, width)"
        )
    return tuple(map(int, input_shape))


def _like(layer: Callable, dtype: torch.dtype | None, device) -> tuple[torch.dtype, object]:
    """The dtype and device of the inputs: given, else the layer's first tensor's, else float32."""
    tensor = None
    if isinstance(layer, nn.Module):
        tensor = next((t for t in (*layer.parameters(), *layer.buffers())), None)
    if dtype is None:
        dtype = tensor.dtype if tensor is not None and tensor.is_floating_point() else None
        dtype = dtype or torch.get_default_dtype()
    if device is None and tensor is not None:
        device = tensor.device
    return dtype, device


def _linear_part(layer: Callable, batch: torch.Tensor) -> torch.Tensor:
    """layer(x) − layer(0) for every x of the batch (one call with the zero image appended)."""
    zero = torch.zeros_like(batch[:1])
    out = layer(torch.cat([batch, zero]))
    return out[:-1] - out[-1:]


def _check_affine(layer: Callable, shape: tuple[int, ...], dtype, device) -> None:
    """ValueError unless A(a + b) = Aa + Ab for A x = layer(x) − layer(0), on two random inputs.

    A nonlinear layer (a ReLU network) has no singular values: its impulse responses
    and its power iteration would give numbers with no meaning, without an error.
    """
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(1, *shape, dtype=torch.float64, generator=gen) for _ in range(2))
    with torch.no_grad():  # one input per call, as `lipschitz_bound` calls the layer
        inputs = [t.to(dtype=dtype, device=device) for t in (a, b, a + b, torch.zeros_like(a))]
        ya, yb, yab, y0 = (_high(layer(t)) for t in inputs)
        ya, yb, yab = ya - y0, yb - y0, yab - y0
    gap = float((ya + yb - yab).norm())  # each difference rounds at the size of layer(0) too
    scale = float(ya.norm() + yb.norm() + yab.norm() + 4 * y0.norm())
    if not gap <= 100 * math.sqrt(math.prod(shape)) * torch.finfo(dtype).eps * scale:
        raise ValueError(
            f"the layer is not affine on inputs of shape {shape}: A(a + b) differs from "
            f"Aa + Ab by {gap / max(scale, 1e-300):.1e} of their size on random inputs "
            "(A x = layer(x) − layer(0)); allowed: an affine layer (convolutions, linear "
            "layers and their compositions); for a nonlinear network pass its "
            "Jacobian-vector product at a point"
        )


def _grid(n: int, m: int) -> tuple[int, int, int] | None:
    """(grid, input phases, output phases) of an axis of n inputs and m outputs, or None."""
    if n % m == 0:
        return m, n // m, 1
    if m % n == 0:
        return n, 1, m // n
    return None


def _polyphase(x: torch.Tensor, phases: Sequence[int]) -> torch.Tensor:
    """(B, c, g₁p₁, g₂p₂, …) → (B, c·p₁·p₂⋯, g₁, g₂, …): position g·p + a to channel (c, a)."""
    b, c = x.shape[:2]
    d = len(phases)
    grid = [s // p for s, p in zip(x.shape[2:], phases, strict=True)]
    split = [v for g, p in zip(grid, phases, strict=True) for v in (g, p)]
    x = x.reshape(b, c, *split)
    order = [0, 1, *(3 + 2 * i for i in range(d)), *(2 + 2 * i for i in range(d))]
    return x.permute(order).reshape(b, c * math.prod(phases), *grid)


def _transfer(layer: Callable, shape: tuple[int, ...], dtype, device):
    """The transfer matrices Ĥ(ω) (…grid, rows, cols) in float64/complex128, or None.

    None when the output's spatial shape does not divide (or is not divided by)
    the input's, or when the layer does not commute with the shifts
    (Note [Singular values of a circular convolution by impulse responses]).
    """
    c, spatial = shape[0], shape[1:]
    d = len(spatial)
    if d == 0:
        return None
    with torch.no_grad():
        zero = torch.zeros(1, *shape, dtype=dtype, device=device)
        out_shape = tuple(layer(zero).shape[1:])
        if len(out_shape) != d + 1:
            return None
        axes = [_grid(n, m) for n, m in zip(spatial, out_shape[1:], strict=True)]
        if any(a is None for a in axes):
            return None
        pin, pout = [a[1] for a in axes], [a[2] for a in axes]
        cols = c * math.prod(pin)
        # the impulses: channel j at phase position a of the first block, ordered (j, a)
        impulses = torch.eye(cols, dtype=dtype, device=device).reshape(cols, c, *pin)
        x = torch.zeros(cols, *shape, dtype=dtype, device=device)
        x[(slice(None), slice(None), *(slice(0, p) for p in pin))] = impulses
        # a random image checks that the layer commutes with the shifts
        probe = torch.randn(
            1, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
        ).to(dtype=dtype, device=device)
        y = _linear_part(layer, torch.cat([x, probe]))
        responses, reply = y[:cols], y[cols:]
        dims = tuple(range(-d, 0))
        h = torch.fft.fftn(_polyphase(_high(responses), pout), dim=dims)  # (cols, rows, grid)
        transfer = h.movedim(0, -1).movedim(0, -2)  # (grid…, rows, cols)
        xp = torch.fft.fftn(_polyphase(_high(probe), pin), dim=dims)[0]  # (cols, grid)
        yp = (transfer @ xp.movedim(0, -1).unsqueeze(-1)).squeeze(-1).movedim(-1, 0)
        predicted = torch.fft.ifftn(yp, dim=dims).real
        actual = _polyphase(_high(reply), pout)[0]
    eps = torch.finfo(dtype).eps
    scale = float(actual.norm()) + float(predicted.norm())
    if not float((predicted - actual).norm()) <= 100 * math.sqrt(max(cols, 1)) * eps * scale:
        return None
    return transfer


def _high(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.complex128 if x.is_complex() else torch.float64)


def _dense(layer: Callable, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """The layer's linear part as a dense float64 matrix (outputs × inputs), by batches."""
    numel = math.prod(shape)
    columns = []
    with torch.no_grad():
        for start in range(0, numel, 1024):
            stop = min(numel, start + 1024)
            basis = torch.zeros(stop - start, numel, dtype=dtype, device=device)
            basis[:, start:stop] = torch.eye(stop - start, dtype=dtype, device=device)
            y = _linear_part(layer, basis.reshape(-1, *shape))
            columns.append(_high(y.reshape(stop - start, -1)).cpu())
    return torch.cat(columns).mT


def singular_values(
    layer: Callable[[torch.Tensor], torch.Tensor],
    input_shape: Sequence[int],
    *,
    method: str = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""Every singular value of a layer's linear part on inputs of ``input_shape``, descending.

    The layer is read as the linear map A x = layer(x) − layer(0) of one input
    of shape ``input_shape`` (no batch dimension; the layer is called on a
    batch). ``method="fft"`` computes them from the layer's impulse responses
    and a DFT, for layers that commute with circular shifts (circular
    convolutions, strided or transposed, of any channel counts): one batch of
    c·s² impulses and per frequency the SVD of a small matrix (Note [Singular
    values of a circular convolution by impulse responses]); ``"dense"`` forms
    A (one forward per input value) and takes its SVD; ``"auto"`` uses the
    first where the layer commutes with the shifts (checked on a random
    image), else the second where the input has at most 4096 values. Both are
    exact up to the rounding of the layer's own arithmetic; the SVDs run in
    float64 on the CPU. min(inputs, outputs) values are returned.

    Args:
        layer: an affine map of batches (an ``nn.Module`` or any callable).
        input_shape: the shape of one input, e.g. (channels, height, width).
        method: "auto", "fft" or "dense".
        dtype: of the inputs (default: the layer's first parameter's dtype).
        device: of the inputs (default: the layer's first parameter's device).

    Returns:
        The singular values, a float64 CPU tensor in descending order.

    Raises:
        ValueError: a bad ``input_shape`` or ``method``; ``method="fft"`` for a
            layer that does not commute with circular shifts; ``"auto"`` when
            it does not and the input has more than 4096 values (use
            `lipschitz_bound`); a layer that is not affine.

    Example:
        ```python
        import torch
        from stiefel.nn import OrthoConv2d, singular_values

        conv = OrthoConv2d(4, 8, 3, stride=2, dtype=torch.float64)
        sv = singular_values(conv, (4, 8, 8))  # the bias does not count
        assert sv.numel() == 8 * 4 * 4 and torch.allclose(sv, torch.ones_like(sv))
        free = torch.nn.Conv2d(2, 2, 3, padding=1, dtype=torch.float64)  # zeros: dense
        assert singular_values(free, (2, 5, 5)).numel() == 50
        ```
    """
    shape = _shape(input_shape)
    if method not in METHODS:
        raise ValueError(f"method={method!r}; allowed: {', '.join(METHODS)}")
    dtype, device = _like(layer, dtype, device)
    numel = math.prod(shape)
    if method != "dense":
        transfer = _transfer(layer, shape, dtype, device)
        if transfer is not None:
            sv = torch.linalg.svdvals(transfer.cpu()).flatten()
            return sv.sort(descending=True).values
        if method == "fft":
            raise ValueError(
                f"method='fft': the layer does not commute with circular shifts on inputs of "
                f"shape {shape} (zero padding, a padding or size the stride does not tile, or "
                "a nonlinear layer); allowed: method='dense' or 'auto'"
            )
        if numel > DENSE_LIMIT:
            raise ValueError(
                f"the layer does not commute with circular shifts on inputs of shape {shape}, "
                f"and its dense matrix would have {numel} columns (> {DENSE_LIMIT}); use a "
                "smaller input_shape, method='dense' explicitly, or lipschitz_bound"
            )
    _check_affine(layer, shape, dtype, device)
    return torch.linalg.svdvals(_dense(layer, shape, dtype, device))


def lipschitz_bound(
    layer: Callable[[torch.Tensor], torch.Tensor],
    input_shape: Sequence[int],
    *,
    iterations: int = 100,
    rtol: float = 1e-7,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> float:
    r"""σ_max of a layer's linear part by power iteration on AᵀA, with autograd.

    A v = layer(v) − layer(0) and Aᵀu is the gradient of ⟨A v, u⟩ with respect
    to v, so any affine, differentiable layer works, on inputs too large for
    `singular_values`' dense path (for a nonlinear network, pass its
    Jacobian-vector product at a point, a linear map). The iteration stops
    after ``iterations`` steps or when the estimate changes by less than
    ``rtol`` relative to it. The value, ‖A v‖ for the last unit v, is a lower
    bound of σ_max that converges to it at the rate (σ₂/σ₁)^{2k}: it reaches
    (1 − δ)σ_max, it never exceeds σ_max beyond rounding. Where a certified
    value is needed, `singular_values` (its first entry) is exact.

    Args:
        layer: an affine map of batches (an ``nn.Module`` or any callable).
        input_shape: the shape of one input (no batch dimension).
        iterations: at most this many steps (≥ 1).
        rtol: stop when the estimate changes by less than this (0: never early).
        generator: of the random start, drawn on the CPU and moved.
        dtype: of the inputs (default: the layer's first parameter's dtype).
        device: of the inputs (default: the layer's first parameter's device).

    Returns:
        The estimate of the largest singular value.

    Raises:
        ValueError: a bad ``input_shape``, ``iterations`` or ``rtol``; a layer that
            is not affine.

    Example:
        ```python
        import torch
        from stiefel.nn import lipschitz_bound, singular_values

        conv = torch.nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
        top = float(singular_values(conv, (3, 6, 6))[0])
        assert 0.999 * top <= lipschitz_bound(conv, (3, 6, 6), iterations=500) <= top * (1 + 1e-12)
        ```
    """
    shape = _shape(input_shape)
    if not _checks.integer(iterations) or iterations < 1:
        raise ValueError(f"iterations={iterations!r}; allowed: a positive int")
    if not (isinstance(rtol, int | float) and 0 <= rtol < 1):
        raise ValueError(f"rtol={rtol!r}; allowed: a number in [0, 1)")
    dtype, device = _like(layer, dtype, device)
    _check_affine(layer, shape, dtype, device)
    with torch.no_grad():
        offset = layer(torch.zeros(1, *shape, dtype=dtype, device=device))
    v = torch.randn(1, *shape, generator=generator, dtype=dtype).to(device)
    v = v / v.norm()
    sigma = 0.0
    for _ in range(iterations):
        v = v.detach().requires_grad_(True)
        with torch.enable_grad():
            u = layer(v) - offset
            (w,) = torch.autograd.grad(u, v, u.detach())
        last, sigma = sigma, float(u.detach().norm())
        norm = w.norm()
        if not float(norm) > 0:
            return sigma  # A v = 0 or Aᵀ A v = 0: v in the null space, σ_max reached as 0
        v = w / norm
        if abs(sigma - last) <= rtol * sigma:
            break
    with torch.no_grad():
        return float((layer(v.detach()) - offset).norm())

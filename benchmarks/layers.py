"""Norm preservation of the stiefel.nn layers, and the cost of the FFT orthogonal convolution.

Run from a checkout: ``python -m benchmarks.layers`` (``--quick`` for tiny sizes).

Part 1 prints min/max of ‖y‖/‖x‖ over random inputs for each layer (and for an
unconstrained ``nn.Conv2d`` as the anchor): a Stiefel kernel
(``orthogonalize(conv, conv_kernel=True)``) must stay ≤ 1, an orthogonal layer
at 1. Part 2 times forward+backward of ``OrthogonalConv2d(c, 3)`` on c×n×n
images against, in the same run, an unconstrained circular ``nn.Conv2d`` and a
dense-per-frequency Cayley reference: the full spectrum (n² frequencies, no
conjugate symmetry), A(ω) = P̂ − P̂ᴴ and Q(ω) = (I + A)⁻¹(I − A) by
``torch.linalg.solve`` at each frequency, output ``Re ifft2``. Timings are the
fastest of several runs; on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from stiefel import orthogonalize
from stiefel.nn import ConvNERUCell, OrthogonalConv2d, OrthogonalRNN


def _ratios(layer: Callable[[torch.Tensor], torch.Tensor], shape, draws: int):
    """min and max of ‖y‖/‖x‖ over random x, and ‖layer‖₂ by power iteration on layerᵀlayer."""
    x = torch.randn(draws, *shape, dtype=torch.float64)
    with torch.no_grad():
        r = layer(x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    v = torch.randn(1, *shape, dtype=torch.float64)
    for _ in range(100):
        v = v.requires_grad_(True)
        y = layer(v)
        (g,) = torch.autograd.grad(y, v, y.detach())
        v = (g / g.norm()).detach()
    with torch.no_grad():
        op = float(layer(v).norm())
    return float(r.min()), float(r.max()), op


def norm_table(draws: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    rows = []
    dt = torch.float64
    free = nn.Conv2d(8, 8, 3, padding=1, bias=False, dtype=dt)
    rows.append(
        ("nn.Conv2d 8→8, k=3, zeros (unconstrained anchor)", *_ratios(free, (8, 12, 12), draws))
    )
    for method in ("tcwy", "cwy", "cayley", "riemannian"):
        conv = orthogonalize(
            nn.Conv2d(8, 8, 3, padding=1, bias=False, dtype=dt), method=method, conv_kernel=True
        )
        rows.append(
            (f"conv_kernel {method}: Conv2d 8→8, k=3, zeros", *_ratios(conv, (8, 12, 12), draws))
        )
    wide = orthogonalize(nn.Conv2d(2, 16, 2, bias=False, dtype=dt), method="tcwy", conv_kernel=True)
    rows.append(("conv_kernel tcwy: Conv2d 2→16, k=2 (wide)", *_ratios(wide, (2, 12, 12), draws)))
    circ = nn.Conv2d(8, 8, 1, bias=False, padding_mode="circular", dtype=dt)
    circ = orthogonalize(circ, method="tcwy", conv_kernel=True)
    rows.append(("conv_kernel tcwy: Conv2d 8→8, k=1, circular", *_ratios(circ, (8, 12, 12), draws)))
    conv3 = orthogonalize(
        nn.Conv3d(3, 4, 3, padding=1, bias=False, dtype=dt), method="tcwy", conv_kernel=True
    )
    rows.append(("conv_kernel tcwy: Conv3d 3→4, k=3, zeros", *_ratios(conv3, (3, 6, 6, 6), draws)))
    for method in ("cayley", "exp", "cwy"):
        fft = OrthogonalConv2d(8, 3, method=method, dtype=dt)
        rows.append((f"OrthogonalConv2d {method}: 8 ch, k=3", *_ratios(fft, (8, 12, 12), draws)))
    rnn = OrthogonalRNN(2, 16, 1, method="cwy", dtype=dt)
    w = rnn.transition_matrix().detach()
    rows.append(
        ("OrthogonalRNN transition W h (cwy, n=16)", *_ratios(lambda h: h @ w.T, (16,), draws))
    )
    cell = ConvNERUCell(1, 4, 3, dtype=dt)
    with torch.no_grad(), parametrize.cached():
        g0 = torch.randn(draws, 4, 8, 8, dtype=dt)
        g, top = g0, torch.zeros(draws, dtype=dt)
        for _ in range(1000):  # zero input and bias: max over t of ‖G_t‖/‖G_0‖
            g = cell(torch.zeros(draws, 1, 8, 8, dtype=dt), g)
            top = torch.maximum(top, g.flatten(1).norm(dim=1) / g0.flatten(1).norm(dim=1))
    rows.append(
        ("ConvNERUCell tcwy: max over 1000 steps of ‖G_t‖/‖G_0‖", *top.aminmax(), float("nan"))
    )
    return rows


def _fastest(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def dense_cayley_conv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The reference: full spectrum, one dense (I + A)⁻¹(I − A) solve per frequency."""
    b, c, h, w = x.shape
    k = weight.shape[-1]
    p = (k - 1) // 2
    g = nn.functional.pad(weight, (0, w - k, 0, h - k)).roll((-p, -p), (-2, -1))
    pf = torch.fft.fft2(g).conj().permute(2, 3, 0, 1).reshape(h * w, c, c)
    a = pf - pf.mH
    eye = torch.eye(c, dtype=a.dtype)
    q = torch.linalg.solve(eye + a, eye - a)
    xf = torch.fft.fft2(x).permute(2, 3, 1, 0).reshape(h * w, c, b)
    yf = (q @ xf).reshape(h, w, c, b).permute(3, 2, 0, 1)
    return torch.fft.ifft2(yf).real


def timing(c: int, n: int, batch: int, repeats: int) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    x = torch.randn(batch, c, n, n, requires_grad=True)
    layer = OrthogonalConv2d(c, 3)
    free = nn.Conv2d(c, c, 3, padding=1, bias=False, padding_mode="circular")
    weight = layer.weight.detach().clone().requires_grad_(True)
    with torch.no_grad():  # same function as the layer: the reference is correct
        err = float((dense_cayley_conv(weight, x) - layer(x)).abs().max())
    assert err < 1e-3, err

    def fb(f):
        return lambda: f().sum().backward()

    return [
        ("nn.Conv2d (circular, unconstrained)", _fastest(fb(lambda: free(x)), repeats)),
        ("OrthogonalConv2d cayley (half spectrum)", _fastest(fb(lambda: layer(x)), repeats)),
        (
            "dense per-frequency Cayley reference",
            _fastest(fb(lambda: dense_cayley_conv(weight, x)), repeats),
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.quick:
        args.channels, args.size, args.batch, args.repeats = 8, 8, 2, 2
    draws = 8 if args.quick else 64
    print(f"## ‖y‖/‖x‖ over {draws} random inputs (float64)\n")
    print("| layer | min ‖y‖/‖x‖ | max ‖y‖/‖x‖ | ‖layer‖₂ (power iteration) |\n|---|---|---|---|")
    for name, lo, hi, op in norm_table(draws):
        print(f"| {name} | {float(lo):.6f} | {float(hi):.6f} | {op:.6f} |")
    c, n, b = args.channels, args.size, args.batch
    print(
        f"\n## forward+backward, c = {c}, {n}×{n}, k = 3, batch {b}, float32, "
        f"{torch.get_num_threads()} threads (fastest of {args.repeats})\n"
    )
    rows = timing(c, n, b, args.repeats)
    anchor = rows[0][1]
    print("| layer | time | / nn.Conv2d |\n|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t * 1e3:.2f} ms | {t / anchor:.2f} |")


if __name__ == "__main__":
    main()

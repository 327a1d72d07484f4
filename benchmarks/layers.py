"""Norm preservation of the stiefel.nn layers, and the cost of the orthogonal convolutions.

Run from a checkout: ``python -m benchmarks.layers`` (``--quick`` for tiny sizes).

Part 1 prints min/max of ‖y‖/‖x‖ over random inputs for each layer (and for an
unconstrained ``nn.Conv2d`` as the anchor): a Stiefel kernel
(``orthogonalize(conv, conv_kernel=True)``) must stay ≤ 1, an orthogonal layer
at 1. Part 2 times forward+backward (float32) of the orthogonal convolutions at
three settings (c = 64 on 32×32; c = 256 on 16×16; c = 64 on 32×32 with
stride 2), k = 3, batch 16, all in one process: an unconstrained circular
``nn.Conv2d`` (the anchor), ``OrthoConv2d`` (explicit kernel from exact maps),
``OrthogonalConv2d`` (FFT, Cayley; stride 1 only) and orthogonium's
``AdaptiveOrthoConv2d`` (AOC, Björck; imported lazily; a layer that cannot
run says why in the table); ``--compiled`` adds this package's two layers under
``torch.compile`` (the kernel's construction and the convolution as one
program per forward, compiled during the warm-up call). The layers run in
interleaved rounds (the order rotates each round); the table gives the median
time and the median over rounds of the time divided by the anchor's in the same
round. ``--clock thread`` (the
default on a CPU) times the calling thread's CPU time with one intra-op thread
(Note [Thread CPU time on a shared machine]); ``--clock wall`` (the default and
the only clock on CUDA, synchronised after every call) the wall time with the
current threads. ``--device cuda`` (or ``cuda:k``) runs everything on that GPU:
inputs and modules are drawn on the CPU as with ``--device cpu`` and moved.
Before the timing, the FFT layer is checked against a dense-per-frequency Cayley
reference (full spectrum, (I + A)⁻¹(I − A) solved at each frequency).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from stiefel import orthogonalize
from stiefel.comparisons.cost import timed
from stiefel.nn import (
    ConvNERUCell,
    OrthoConv2d,
    OrthogonalConv2d,
    OrthogonalRNN,
    lipschitz_bound,
)

from ._timing import device_of, header, rounds, thread_timed


def _ratios(layer: Callable[[torch.Tensor], torch.Tensor], shape, draws: int, device):
    """min and max of ‖y‖/‖x‖ over random x, and ‖layer‖₂ (`stiefel.nn.lipschitz_bound`).

    A module is moved to ``device``; the inputs are drawn on the CPU and moved.
    """
    if isinstance(layer, nn.Module):
        layer = layer.to(device)
    x = torch.randn(draws, *shape, dtype=torch.float64).to(device)
    with torch.no_grad():
        r = layer(x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    op = lipschitz_bound(layer, shape, iterations=100, rtol=0, dtype=torch.float64, device=device)
    return float(r.min()), float(r.max()), op


def norm_table(draws: int, device=None) -> list[tuple[str, float, float]]:
    """One row per layer: (name, min ‖y‖/‖x‖, max ‖y‖/‖x‖, ‖layer‖₂); built on the CPU, moved."""
    torch.manual_seed(0)
    rows = []
    dt = torch.float64
    device = torch.device(device or "cpu")
    free = nn.Conv2d(8, 8, 3, padding=1, bias=False, dtype=dt)
    rows.append(
        (
            "nn.Conv2d 8→8, k=3, zeros (unconstrained anchor)",
            *_ratios(free, (8, 12, 12), draws, device),
        )
    )
    for method in ("tcwy", "cwy", "cayley", "riemannian"):
        conv = orthogonalize(
            nn.Conv2d(8, 8, 3, padding=1, bias=False, dtype=dt), method=method, conv_kernel=True
        )
        rows.append(
            (
                f"conv_kernel {method}: Conv2d 8→8, k=3, zeros",
                *_ratios(conv, (8, 12, 12), draws, device),
            )
        )
    wide = orthogonalize(nn.Conv2d(2, 16, 2, bias=False, dtype=dt), method="tcwy", conv_kernel=True)
    rows.append(
        ("conv_kernel tcwy: Conv2d 2→16, k=2 (wide)", *_ratios(wide, (2, 12, 12), draws, device))
    )
    circ = nn.Conv2d(8, 8, 1, bias=False, padding_mode="circular", dtype=dt)
    circ = orthogonalize(circ, method="tcwy", conv_kernel=True)
    rows.append(
        ("conv_kernel tcwy: Conv2d 8→8, k=1, circular", *_ratios(circ, (8, 12, 12), draws, device))
    )
    conv3 = orthogonalize(
        nn.Conv3d(3, 4, 3, padding=1, bias=False, dtype=dt), method="tcwy", conv_kernel=True
    )
    rows.append(
        ("conv_kernel tcwy: Conv3d 3→4, k=3, zeros", *_ratios(conv3, (3, 6, 6, 6), draws, device))
    )
    for method in ("cayley", "exp", "cwy"):
        fft = OrthogonalConv2d(8, 3, method=method, dtype=dt)
        rows.append(
            (f"OrthogonalConv2d {method}: 8 ch, k=3", *_ratios(fft, (8, 12, 12), draws, device))
        )
    for mode, stride in (("circular", 1), ("zeros", 1), ("circular", 2)):
        ortho = OrthoConv2d(8, 8, 3, stride=stride, padding_mode=mode, bias=False, dtype=dt)
        rows.append(
            (
                f"OrthoConv2d cwy: 8 ch, k=3, {mode}, stride {stride}",
                *_ratios(ortho, (8, 12, 12), draws, device),
            )
        )
    rnn = OrthogonalRNN(2, 16, 1, method="cwy", dtype=dt)
    w = rnn.to(device).transition_matrix().detach()
    rows.append(
        (
            "OrthogonalRNN transition W h (cwy, n=16)",
            *_ratios(lambda h: h @ w.T, (16,), draws, device),
        )
    )
    cell = ConvNERUCell(1, 4, 3, dtype=dt).to(device)
    with torch.no_grad(), parametrize.cached():
        g0 = torch.randn(draws, 4, 8, 8, dtype=dt).to(device)
        g, top = g0, torch.zeros(draws, dtype=dt, device=device)
        zero = torch.zeros(draws, 1, 8, 8, dtype=dt, device=device)
        for _ in range(1000):  # zero input and bias: max over t of ‖G_t‖/‖G_0‖
            g = cell(zero, g)
            top = torch.maximum(top, g.flatten(1).norm(dim=1) / g0.flatten(1).norm(dim=1))
    rows.append(
        ("ConvNERUCell tcwy: max over 1000 steps of ‖G_t‖/‖G_0‖", *top.aminmax(), float("nan"))
    )
    return rows


def dense_cayley_conv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The reference: full spectrum, one dense (I + A)⁻¹(I − A) solve per frequency."""
    b, c, h, w = x.shape
    k = weight.shape[-1]
    p = (k - 1) // 2
    g = nn.functional.pad(weight, (0, w - k, 0, h - k)).roll((-p, -p), (-2, -1))
    pf = torch.fft.fft2(g).conj().permute(2, 3, 0, 1).reshape(h * w, c, c)
    a = pf - pf.mH
    eye = torch.eye(c, dtype=a.dtype, device=a.device)
    q = torch.linalg.solve(eye + a, eye - a)
    xf = torch.fft.fft2(x).permute(2, 3, 1, 0).reshape(h * w, c, b)
    yf = (q @ xf).reshape(h, w, c, b).permute(3, 2, 0, 1)
    return torch.fft.ifft2(yf).real


#: (channels, image size, stride) of the timed settings
SETTINGS = ((64, 32, 1), (256, 16, 1), (64, 32, 2))


def _aoc(c: int, stride: int) -> nn.Module | str:
    """orthogonium's AdaptiveOrthoConv2d (AOC), or why not (orthogonium is not installed)."""
    try:
        from orthogonium.layers.conv.AOC import AdaptiveOrthoConv2d
    except ImportError as err:
        return f"not run: orthogonium not importable ({err})"
    padding = "same" if stride == 1 else 1  # nn.Conv2d refuses "same" with a stride
    return AdaptiveOrthoConv2d(c, c, 3, stride=stride, padding=padding, bias=False)


def layers_for(c: int, stride: int, compiled: bool = False) -> dict[str, nn.Module | str]:
    """The timed layers of one setting (the anchor first); a string says why a layer is absent.

    ``compiled`` adds each of this package's layers under ``torch.compile`` (default
    backend): kernel construction and convolution as one program per forward.
    """
    out = {
        "nn.Conv2d (circular, unconstrained)": nn.Conv2d(
            c, c, 3, stride=stride, padding=1, padding_mode="circular", bias=False
        ),
        "OrthoConv2d (explicit kernel, cwy)": OrthoConv2d(c, c, 3, stride=stride, bias=False),
    }
    fft = OrthogonalConv2d(c, 3) if stride == 1 else "not run: stride 1 only"
    out["OrthogonalConv2d (FFT, cayley)"] = fft
    out["orthogonium AdaptiveOrthoConv2d (AOC)"] = _aoc(c, stride)
    if compiled:
        ours = [k for k in out if k.startswith(("OrthoConv2d", "OrthogonalConv2d"))]
        for name in ours:
            layer = out[name]
            out[f"{name}, torch.compile"] = (
                layer if isinstance(layer, str) else torch.compile(copy.deepcopy(layer))
            )
    return out


def interleaved(
    calls: dict[str, Callable[[], object]], count: int, clock: Callable
) -> dict[str, tuple[float, float]]:
    """(median seconds, median ratio to the first call) over interleaved `rounds`.

    The ratio is taken within a round, so a load change between rounds cancels.
    """
    times = rounds(calls, count, clock)
    anchor = times[next(iter(calls))]
    return {
        k: (
            statistics.median(v),
            statistics.median(t / a for t, a in zip(v, anchor, strict=True)),
        )
        for k, v in times.items()
    }


def check_fft_layer(device=None) -> float:
    """Largest difference of the FFT layer from the dense Cayley reference (c = 8, 8×8)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 8, 8).to(device)
    layer = OrthogonalConv2d(8, 3).to(device)
    with torch.no_grad():
        err = float((dense_cayley_conv(layer.weight, x) - layer(x)).abs().max())
    assert err < 1e-4, err
    return err


def timing(
    c: int,
    n: int,
    stride: int,
    batch: int,
    count: int,
    clock: Callable,
    device=None,
    compiled: bool = False,
) -> dict[str, tuple[float, float] | str]:
    """Forward+backward of each layer of `layers_for` on a (batch, c, n, n) input on ``device``.

    Layers and input are drawn on the CPU and moved; a layer that is absent or fails its
    first call on the device maps to the reason (reported in the table, not timed).
    """
    torch.manual_seed(0)
    x = torch.randn(batch, c, n, n).to(device).requires_grad_(True)

    def fb(layer: nn.Module) -> Callable[[], None]:
        return lambda: layer(x).sum().backward()

    layers = layers_for(c, stride, compiled)
    calls: dict[str, Callable[[], None]] = {}
    absent: dict[str, str] = {}
    for name, layer in layers.items():
        if isinstance(layer, str):
            absent[name] = layer
            continue
        try:
            call = fb(layer.to(device))
            call()
        except (RuntimeError, TypeError, ValueError) as err:
            if not calls:  # the anchor: every ratio needs it
                raise
            absent[name] = f"failed: {type(err).__name__}: {err}"
            continue
        calls[name] = call
    medians = interleaved(calls, count, clock)
    return {k: medians[k] if k in medians else absent[k] for k in layers}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default=None,
        help="thread (default on cpu: CPU time of one thread) or wall (default, and only, on cuda)",
    )
    ap.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    ap.add_argument("--skip-norms", action="store_true", help="only the timing table")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="also time this package's layers under torch.compile (compiled at the warm-up)",
    )
    args = ap.parse_args(argv)
    device = device_of(args.device, ap)
    if args.clock is None:
        args.clock = "thread" if device.type == "cpu" else "wall"
    if args.clock == "thread" and device.type != "cpu":
        ap.error(f"--clock thread with --device {args.device}: allowed with --device cpu only")
    settings = [(8, 8, 1), (8, 8, 2)] if args.quick else list(SETTINGS)
    if args.quick:
        args.batch, args.rounds = 2, 2
    if not args.skip_norms:
        draws = 8 if args.quick else 64
        print(f"## ‖y‖/‖x‖ over {draws} random inputs (float64, {device})\n")
        print("| layer | min ‖y‖/‖x‖ | max ‖y‖/‖x‖ | ‖layer‖₂ (power iteration) |")
        print("|---|---|---|---|")
        for name, lo, hi, op in norm_table(draws, device):
            shown = "—" if op != op else f"{op:.6f}"  # NaN: no operator norm to take
            print(f"| {name} | {float(lo):.6f} | {float(hi):.6f} | {shown} |")
    clock = timed  # the wall time of a call, its CUDA kernels included
    if args.clock == "thread":  # Note [Thread CPU time on a shared machine] (benchmarks._timing)
        torch.set_num_threads(1)
        clock = thread_timed

    err = check_fft_layer(device)
    print(f"\nFFT layer against the dense Cayley reference: max |Δ| = {err:.1e}")
    title = header(f"forward+backward, k = 3, batch {args.batch}", device, peers=("orthogonium",))
    print(f"\n## {title}; {args.clock} clock, {args.rounds} interleaved rounds\n")
    print("| setting | layer | median time | × nn.Conv2d (median of per-round ratios) |")
    print("|---|---|---|---|")
    for c, n, stride in settings:
        rows = timing(c, n, stride, args.batch, args.rounds, clock, device, args.compiled)
        for name, row in rows.items():
            setting = f"c = {c}, {n}×{n}, stride {stride}"
            if isinstance(row, str):
                print(f"| {setting} | {name} | {row} | — |")
            else:
                print(f"| {setting} | {name} | {row[0] * 1e3:.2f} ms | {row[1]:.2f} |")


if __name__ == "__main__":
    main()

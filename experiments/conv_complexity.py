"""Complexity rows of the orthogonal convolution layers: time against channels and kernel size.

Three layers on a batch of B images of n×n, c channels in and out, kernel k:

- ``nn.Conv2d``: the unconstrained convolution (the reference);
- ``conv_kernel=True`` (``orthogonalize(conv, method, conv_kernel=True)``): the
  kernel as a tall c·k²×c matrix on the Stiefel manifold, then the same
  convolution;
- ``OrthogonalConv2d`` (Cayley, FFT): an exactly orthogonal circular convolution.

Note [FLOP models of the convolution layers]
A direct convolution costs 2·B·c²·k²·n² (one multiply-add per tap, input
channel, output channel and pixel). ``conv_kernel=True`` adds its map's cost
on St(c·k², c) (the registry's FLOP model, once per call). The FFT layer
costs the real FFTs of the input and output, 2·(5/2)·B·c·n²·log₂ n² (the
classical 5N log₂ N of a complex FFT, halved for a real one), a complex c×c
Cayley solve at each of the F = n·(n/2 + 1) half-spectrum frequencies,
4·(8/3)·c³ (an LU with c right-hand sides, 8/3·c³ multiply-adds of complex
numbers, 4 real flops each), and the complex c×c by c×B products, 8·B·c²
per frequency. The models count the forward pass; the backward pass of each
costs about twice its forward, so fwd+bwd ≈ 3× the model.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from stiefel.comparisons.complexity import FIT_MIN_N, register_part
from stiefel.comparisons.cost import map_flops, measure_many
from stiefel.comparisons.sections import flag_note, time_cell
from stiefel.comparisons.writers import md_table
from stiefel.nn import OrthogonalConv2d
from stiefel.parametrizations import maps, orthogonalize

__all__ = ["conv_costs", "conv_table", "CONV_PLAN", "QUICK_CONV_PLAN"]

#: (channels, kernel size) measured: channels at k = 3, kernel sizes at c = 32
CONV_PLAN = [(16, 3), (32, 3), (64, 3), (32, 1), (32, 5)]
#: the plan of small complexity runs (the quick preset): a few seconds
QUICK_CONV_PLAN = [(8, 3), (16, 3), (16, 1), (16, 5)]
_BATCH, _SIZE, _MAP = 8, 32, "tcwy"


def _flops(layer: str, b: int, c: int, k: int, n: int) -> float:
    direct = 2.0 * b * c * c * k * k * n * n
    if layer == "nn.Conv2d":
        return direct
    if layer.startswith("conv_kernel"):
        reflections = c if maps()[_MAP].takes_reflections() else None
        return direct + map_flops(_MAP, c * k * k, c, reflections)
    freqs = n * (n // 2 + 1)
    fft = 2 * 2.5 * b * c * n * n * math.log2(n * n)
    return fft + freqs * (4 * 8 / 3 * c**3 + 8 * b * c * c)


def conv_costs(repeats: int, device="cpu", plan=None) -> list[dict]:
    """Forward+backward time of each layer at each (c, k) of ``plan`` (default `CONV_PLAN`)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for c, k in plan or CONV_PLAN:
        x = torch.randn(_BATCH, c, _SIZE, _SIZE, generator=gen).to(device).requires_grad_(True)
        plain = nn.Conv2d(c, c, k, padding=k // 2, bias=False).to(device)
        ck = orthogonalize(
            nn.Conv2d(c, c, k, padding=k // 2, bias=False), method=_MAP, conv_kernel=True
        ).to(device)
        fft = OrthogonalConv2d(c, k, "cayley").to(device)
        layers = {
            "nn.Conv2d": plain,
            f"conv_kernel=True ({_MAP})": ck,
            "OrthogonalConv2d (cayley)": fft,
        }

        def fwd_bwd(layer, x=x):
            layer(x).square().sum().backward()

        # the three layers of one (c, k) in interleaved rounds (Note [Timed blocks])
        times = measure_many({k_: partial(fwd_bwd, m) for k_, m in layers.items()}, repeats, device)
        for label, t in times.items():
            rows.append(
                {
                    "layer": label,
                    "channels": c,
                    "kernel": k,
                    "batch": _BATCH,
                    "size": _SIZE,
                    "forward_backward_s": t["s"],
                    "forward_backward_flag": t["flag"],
                    "flops": _flops(label, _BATCH, c, k, _SIZE),
                }
            )
    return rows


def conv_table(rows: list[dict], rate: float) -> list[str]:
    """The markdown section of `conv_costs`' rows (time beside the FLOP model's roofline)."""
    body = [
        [r["layer"], r["channels"], r["kernel"], r["flops"], 3 * r["flops"] / rate]
        + [time_cell(r, "forward_backward"), r["forward_backward_s"] * rate / (3 * r["flops"])]
        for r in rows
    ]
    head = ["layer", "c", "k", "FLOP model (fwd)", "roofline fwd+bwd [s]", "fwd+bwd [s]"]
    head += ["time / roofline"]
    return [
        f"\n### Convolution layers, batch {_BATCH}, {_SIZE}×{_SIZE} images, forward + backward\n",
        "FLOP models: see `experiments/conv_complexity.py` (direct 2·B·c²·k²·n²; "
        f"conv_kernel=True adds the {_MAP} map on St(c·k², c); the FFT layer adds FFTs and a "
        "c×c complex Cayley solve per frequency); the roofline is 3× the forward model "
        "at the measured GEMM rate: a time / roofline below 1 is a layer faster than the "
        "GEMM rate (a direct convolution kernel can be), not a bound broken. Times as in the "
        "table above, the three layers of one (c, k) in interleaved rounds.\n",
        md_table(head, body),
        *flag_note(
            [
                f"{r['layer']} c={r['channels']} k={r['kernel']}"
                for r in rows
                if r.get("forward_backward_flag")
            ],  # fmt: skip
            then="shown as measured",
        ),
    ]


def _measure(opts: dict) -> list[dict]:
    """The complexity section's part: the small plan at the quick preset's sizes."""
    small = max(opts["sizes"]) < FIT_MIN_N
    return conv_costs(opts["repeats"], opts["device"], QUICK_CONV_PLAN if small else CONV_PLAN)


register_part("conv_layers", _measure, conv_table)

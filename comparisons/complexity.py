"""Time and memory of every map and optimizer step against size, beside the FLOP models.

The tables follow the papers' layouts: the CWY paper's Table 1 (maps, serial
complexity) and Table 2 (one optimizer step on St(N, M), FLOPs), and the
Householder paper's Table 2 (one recurrent step, forward and backward FLOPs),
each with measured columns and the time the FLOP model predicts at this
machine's measured GEMM rate (the roofline).
"""

from __future__ import annotations

import math

import geoopt
import torch

from .. import optimizers
from ..manifolds import Stiefel, kernels
from ..parametrizations import orthogonalize
from .bench._timing import median_time

__all__ = ["gemm_rate", "map_costs", "optimizer_costs", "recurrent_step_costs", "fit_exponent"]

#: forward FLOPs of materializing each map's n×n matrix with L reflections
MAP_FLOPS = {
    "householder": lambda n, L: 4 * n * n * L,
    "cwy": lambda n, L: 2 * n * n * L + 3 * n * L * L + L**3 / 3,
    "exp": lambda n, L: 24 * n**3,  # ≈ 12 n×n products (Padé degree 13 + squarings)
    "cayley": lambda n, L: 8 * n**3 / 3 + 2 * n**3,
    "scaled_cayley": lambda n, L: 8 * n**3 / 3 + 2 * n**3,
}
#: serial complexity and domain, as in the CWY paper's Table 1 (per map, for the matrix)
MAP_FORMULAS = {
    "householder": ("L n² (L sequential reflections)", "O_L(n); O(n) at L = n"),
    "cwy": ("L n² + L² n + L³ (GEMMs + triangular solve)", "O_L(n); O(n) at L = n"),
    "exp": ("n³", "O(n) with the det buffer"),
    "cayley": ("n³", "O(n) without eigenvalue −1 (base buffer)"),
    "scaled_cayley": ("n³", "O(n) with D = diag(±1)"),
}
#: FLOPs of one optimizer step on St(N, M) (CWY paper Table 2 where it has the row)
STEP_FLOPS = {
    "rgd(metric=canonical,retraction=qr)": lambda n, m: 10 * n * m * m - 2 * m**3 / 3,
    "rgd(metric=euclidean,retraction=qr)": lambda n, m: 14 * n * m * m - 2 * m**3 / 3,
    # our fused Cayley step: six N×M×M products and a 2M×2M solve, either metric
    "rgd(metric=canonical,retraction=cayley)": lambda n, m: 12 * n * m * m + 6 * m**3,
    "rgd(metric=euclidean,retraction=cayley)": lambda n, m: 12 * n * m * m + 6 * m**3,
    "radam(retraction=cayley)": lambda n, m: 16 * n * m * m + 6 * m**3,
    "landing": lambda n, m: 8 * n * m * m,
}
PAPER_STEP_FLOPS = {
    "rgd(metric=canonical,retraction=cayley)": "28NM² + 16M³ (2M×2M)",
    "rgd(metric=euclidean,retraction=cayley)": "72NM² + 25M³ in the paper (3M×3M); 2M×2M here",
    "rgd(metric=canonical,retraction=qr)": "10NM² − 2M³/3",
    "rgd(metric=euclidean,retraction=qr)": "14NM² − 2M³/3",
}


def gemm_rate(n: int = 512, dtype=torch.float32, device="cpu", repeats: int = 5) -> float:
    """Measured FLOP/s of an n×n GEMM: the roofline the FLOP models are divided by."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = median_time(lambda: a @ b, repeats)
    return 2 * n**3 / t


def fit_exponent(sizes: list[float], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(size)."""
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(v, 1e-12)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def _saved_bytes(fn) -> int:
    """Bytes autograd saves for the backward of ``fn()`` (the activation memory)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def map_costs(
    methods: list[str], sizes: list[int], fractions: list[float], repeats: int, device="cpu"
) -> list[dict]:
    """Forward and forward+backward of every map's matrix, against n and L = fraction·n."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for method in methods:
        for frac in fractions if method in ("householder", "cwy") else [1.0]:
            for n in sizes:
                L = max(1, int(round(frac * n)))
                opts = {"reflections": L} if method in ("householder", "cwy") else {}
                x0 = kernels.haar(n, n, generator=gen).to(device)
                w = orthogonalize(x0, method=method, **opts)
                c = torch.randn(n, n, generator=gen).to(device)

                def fwd(w=w):
                    with torch.no_grad():
                        return w()

                def fwd_bwd(w=w, c=c):
                    (w() * c).sum().backward()

                rows.append(
                    {
                        "method": method,
                        "n": n,
                        "L": L,
                        "fraction": frac,
                        "forward_s": median_time(fwd, repeats),
                        "forward_backward_s": median_time(fwd_bwd, repeats),
                        "saved_bytes": _saved_bytes(lambda w=w, c=c: (w() * c).sum()),
                        "flops": MAP_FLOPS.get(method, lambda n, L: float("nan"))(n, L),
                    }
                )
    return rows


def optimizer_costs(shapes: list[tuple[int, int]], repeats: int, device="cpu") -> list[dict]:
    """One step of every Riemannian optimizer (and geoopt's) on St(N, M), float32."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n, m in shapes:
        man = Stiefel(n, m)
        x0 = man.random(generator=gen).to(device)
        g = torch.randn(n, m, generator=gen).to(device)
        canon, eucl = geoopt.CanonicalStiefel(), geoopt.EuclideanStiefel()
        setups = {name: ("stiefel", name) for name in STEP_FLOPS}
        setups["geoopt RiemannianSGD CanonicalStiefel"] = ("geoopt_rsgd", canon)
        setups["geoopt RiemannianSGD EuclideanStiefel"] = ("geoopt_rsgd", eucl)
        setups["geoopt RiemannianAdam CanonicalStiefel"] = ("geoopt_radam", canon)
        for label, (kind, spec) in setups.items():
            if kind == "stiefel":
                from .strategies import parse

                s = parse("riemannian+" + spec)
                p = geoopt.ManifoldParameter(x0.clone(), manifold=man)
                opt = optimizers.create(s.optimizer, [p], lr=1e-3, **s.optimizer_options)
            else:
                p = geoopt.ManifoldParameter(x0.clone(), manifold=spec)
                opt = optimizers.create(kind, [p], lr=1e-3)
            p.grad = g.clone()
            t = median_time(opt.step, repeats)
            flops = STEP_FLOPS[label](n, m) if label in STEP_FLOPS else float("nan")
            rows.append({"optimizer": label, "N": n, "M": m, "step_s": t, "flops": flops})
    return rows


def recurrent_step_costs(sizes: list[int], fraction: float, repeats: int) -> list[dict]:
    """One recurrent step h ↦ Qh (batch 1) forward and backward: oRNN operator form vs dense.

    The Householder paper's Table 2: oRNN(n, m) FP (4n − m + 2)m, BP (7n − 2m + 3)m;
    sRNN(n) FP 2n² − n, BP 3n² − n.
    """
    rows = []
    gen = torch.Generator().manual_seed(1)
    for n in sizes:
        L = max(1, int(round(fraction * n)))
        for method in ("householder", "cwy"):
            w = orthogonalize(kernels.haar(n, n, generator=gen), method=method, reflections=L)
            h = torch.randn(1, n, generator=gen, requires_grad=True)
            rows.append(_step_row(f"{method} operator (n, L={L})", n, L, w.linear, h, repeats))
        dense = torch.randn(n, n, generator=gen, requires_grad=True)
        h = torch.randn(1, n, generator=gen, requires_grad=True)
        rows.append(_step_row("sRNN dense", n, n, lambda x, d=dense: x @ d.T, h, repeats))
    return rows


def _step_row(label, n, L, fn, h, repeats) -> dict:
    def fwd():
        with torch.no_grad():
            fn(h)

    def fwd_bwd():
        fn(h).sum().backward()

    if label.startswith("sRNN"):
        fp, bp = 2 * n * n - n, 3 * n * n - n
    else:
        fp, bp = (4 * n - L + 2) * L, (7 * n - 2 * L + 3) * L
    t_f = median_time(fwd, repeats)
    t_fb = median_time(fwd_bwd, repeats)
    return {
        "model": label,
        "n": n,
        "L": L,
        "fp_flops": fp,
        "bp_flops": bp,
        "forward_s": t_f,
        "backward_s": max(t_fb - t_f, 0.0),
    }

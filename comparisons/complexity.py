"""Time and memory of every map and optimizer step against size, beside the FLOP models.

The tables follow the papers' layouts: the CWY paper's Table 1 (maps, serial
complexity) and Table 2 (one optimizer step on St(N, M), FLOPs), and the
Householder paper's Table 2 (one recurrent step, forward and backward FLOPs),
each with measured columns and the time the FLOP model predicts at this
machine's measured GEMM rate (the roofline).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import geoopt
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import optimizers
from ..manifolds import Stiefel, kernels
from ..parametrizations import orthogonalize
from . import registry
from .timing import fastest_time

__all__ = [
    "gemm_rate",
    "map_costs",
    "optimizer_costs",
    "recurrent_step_costs",
    "fit_exponent",
    "check_options",
    "peak_bytes",
    "map_plan",
    "step_plan",
    "GEOOPT_STEPS",
]

#: geoopt's steps measured beside ours (the canonical ones form and solve an N×N system)
GEOOPT_STEPS = (
    "geoopt RiemannianSGD CanonicalStiefel",
    "geoopt RiemannianSGD EuclideanStiefel",
    "geoopt RiemannianAdam CanonicalStiefel",
)
#: below these sizes per-call overhead and a still-rising GEMM efficiency flatten
#: log–log slopes on a CPU (n = 256–2048 fitted 2.0–2.7 against 3; steps on
#: N = 1024–4096 fitted 0.5–0.9 against 1): no exponent is fitted under them
FIT_MIN_N = 512
FIT_MIN_STEP_N = 8192


def gemm_rate(n: int = 1024, dtype=torch.float32, device="cpu", repeats: int = 7) -> float:
    """Measured FLOP/s of an n×n GEMM (n >= 512): the roofline the FLOP models are divided by.

    The fastest of ``repeats`` runs (Note [Fastest run for cost models]): a
    roofline is the rate the machine reaches; a product smaller than 512×512
    measures call overhead, not the rate.
    """
    n = max(int(n), 512)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = fastest_time(lambda: a @ b, repeats, warmup=1)
    return 2 * n**3 / t


def check_options(opts: Mapping) -> None:
    """Raise ValueError naming the option if sizes, fractions, repeats, shapes or limits are bad.

    ``limits`` maps a map method or optimizer label to the largest n (or N) it is
    measured at: the dense anchors (``exp``'s backward, geoopt's N×N canonical
    step) would take minutes or gigabytes beyond it.
    """
    sizes = opts.get("sizes", [])
    if not sizes or not all(isinstance(n, int) and n >= 2 for n in sizes):
        raise ValueError(f"sizes={sizes!r}; allowed: a non-empty list of integers >= 2")
    fractions = opts.get("fractions", [])
    if not fractions or not all(isinstance(f, (int, float)) and 0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions={fractions!r}; allowed: a non-empty list of L/n in (0, 1]")
    repeats = opts.get("repeats")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}; allowed: an integer >= 1")
    for shape in opts.get("shapes", []):
        ok = isinstance(shape, (list, tuple)) and len(shape) == 2
        if not (ok and all(isinstance(k, int) for k in shape) and shape[0] >= shape[1] >= 1):
            raise ValueError(f"shapes: {shape!r}; allowed: [N, M] with integers N >= M >= 1")
    known = [*registry.maps(), *registry.optimizer_steps(), *GEOOPT_STEPS]
    for label, size in (opts.get("limits") or {}).items():
        if label not in known:
            raise ValueError(f"limits: unknown name {label!r}; available: {', '.join(known)}")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"limits[{label!r}]={size!r}; allowed: an integer >= 1 (largest size)")


def fit_exponent(sizes: list[float], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(size).

    Example:
        ```python
        from stiefel.comparisons.complexity import fit_exponent

        assert round(fit_exponent([1, 2, 4], [3.0, 24.0, 192.0]), 6) == 3.0
        ```
    """
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(v, 1e-12)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


class _HeldBytes(TorchDispatchMode):
    """Counts the bytes of the storages torch ops create, until each is freed.

    An op's output whose storage is one of its inputs' (a view, an in-place
    op) allocates nothing; a new storage is counted from the op's return until
    its finalizer runs (torch keeps a storage's Python object as long as the
    storage lives, so the finalizer runs when the memory is released).
    """

    def __init__(self) -> None:
        super().__init__()
        self.held = self.peak = 0
        self.live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.held -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(t.untyped_storage())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, size = id(st), st.nbytes()
            if key in inputs or key in self.live or not size:
                continue
            self.live[key] = size
            self.held += size
            self.peak = max(self.peak, self.held)
            weakref.finalize(st, self._free, key)
        return out


def peak_bytes(fn, device="cpu") -> int:
    """Peak of the bytes that torch ops allocate during ``fn()`` and still hold.

    CUDA: the caching allocator's peak statistic above what was allocated
    before. CPU, which keeps no such statistic: every op's new output storages
    are counted from their creation until they are freed (kernel-internal
    workspaces, e.g. LAPACK's, are not seen).

    Example:
        ```python
        import torch
        from stiefel.comparisons.complexity import peak_bytes

        a = torch.randn(256, 256)
        assert peak_bytes(lambda: a @ a) == 256 * 256 * 4  # the 256 KiB result
        ```
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    with _HeldBytes() as mode:
        fn()
    return mode.peak


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


def map_plan(
    methods: list[str],
    sizes: list[int],
    fractions: list[float],
    limits: Mapping[str, int] | None = None,
) -> list[tuple[str, float, int]]:
    """The (method, L/n, n) measured by `map_costs`: ``limits`` caps a method's n.

    Maps that take ``reflections`` are measured at every fraction L/n.
    """
    limits = limits or {}
    return [
        (method, frac, n)
        for method in methods
        for frac in (fractions if registry.map_info(method).reflections else [1.0])
        for n in sizes
        if n <= limits.get(method, n)
    ]


def step_plan(
    shapes: list[tuple[int, int]], limits: Mapping[str, int] | None = None
) -> list[tuple[str, int, int]]:
    """The (optimizer, N, M) measured by `optimizer_costs`: ``limits`` caps N."""
    limits = limits or {}
    labels = [*registry.optimizer_steps(), *GEOOPT_STEPS]
    return [(label, n, m) for n, m in shapes for label in labels if n <= limits.get(label, n)]


def _tick(bar, text: str) -> None:
    if bar is not None:
        bar.set_postfix_str(text)
        bar.update(1)


def map_costs(
    methods: list[str],
    sizes: list[int],
    fractions: list[float],
    repeats: int,
    device="cpu",
    limits: Mapping[str, int] | None = None,
    bar=None,
) -> list[dict]:
    """Forward and forward+backward of every map's matrix, against n and L = fraction·n.

    A method named in ``limits`` is measured only up to its size there; ``bar``
    (a tqdm bar, optional) advances by one per row.
    """
    rows = []
    gen = torch.Generator().manual_seed(0)
    for method, frac, n in map_plan(methods, sizes, fractions, limits):
        info = registry.map_info(method)
        reflections = info.reflections
        L = max(1, int(round(frac * n)))
        x0 = kernels.haar(n, n, generator=gen).to(device)
        # Note [Random reflectors for timing]: the time of a reflection map does
        # not depend on its vectors, and init="nearest" would first run the O(n³)
        # sequential inverse (minutes at n = 4096).
        opts = {"reflections": L, "init": "random"} if reflections else {}
        w = orthogonalize(x0, method=method, **opts)
        if not reflections:
            # Note [Exp timing at a typical norm]: dense maps re-base at registration,
            # so A = 0 there and torch.matrix_exp takes its degree-1 shortcut (one
            # product instead of ~12). Time every map at ‖A‖₂ ≈ 2, a rotation by
            # angles up to ~2 radians, as after training.
            with torch.no_grad():
                for p in w.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(n))
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
                "forward_s": fastest_time(fwd, repeats),
                "forward_backward_s": fastest_time(fwd_bwd, repeats),
                "saved_bytes": _saved_bytes(lambda w=w, c=c: (w() * c).sum()),
                "peak_bytes": peak_bytes(fwd_bwd, device),
                "flops": info.flops(n, n, L if reflections else None),
            }
        )
        _tick(bar, f"{method} n={n} L={L}")
    return rows


def optimizer_costs(
    shapes: list[tuple[int, int]],
    repeats: int,
    device="cpu",
    limits: Mapping[str, int] | None = None,
    bar=None,
) -> list[dict]:
    """One step of every Riemannian optimizer (and geoopt's) on St(N, M), float32.

    An optimizer named in ``limits`` is measured only up to its N there; ``bar``
    (a tqdm bar, optional) advances by one per row.
    """
    steps = registry.optimizer_steps()
    rows = []
    gen = torch.Generator().manual_seed(0)
    geoopt_setups = {
        GEOOPT_STEPS[0]: ("geoopt_rsgd", geoopt.CanonicalStiefel()),
        GEOOPT_STEPS[1]: ("geoopt_rsgd", geoopt.EuclideanStiefel()),
        GEOOPT_STEPS[2]: ("geoopt_radam", geoopt.CanonicalStiefel()),
    }
    shape = x0 = g = None  # the plan is grouped by shape: one point and gradient at a time
    for label, n, m in step_plan(shapes, limits):
        if shape != (n, m):
            shape = (n, m)
            x0 = Stiefel(n, m).random(generator=gen).to(device)
            g = torch.randn(n, m, generator=gen).to(device)
        if label in steps:
            info, variant = steps[label]
            p = geoopt.ManifoldParameter(x0.clone(), manifold=Stiefel(n, m))
            opt = optimizers.create(info.name, [p], lr=1e-3, **variant)
        else:
            kind, manifold = geoopt_setups[label]
            p = geoopt.ManifoldParameter(x0.clone(), manifold=manifold)
            opt = optimizers.create(kind, [p], lr=1e-3)
        p.grad = g.clone()
        t = fastest_time(opt.step, repeats)
        peak = peak_bytes(opt.step, device)
        flops = steps[label][0].flops(n, m, **steps[label][1]) if label in steps else math.nan
        rows.append(
            {"optimizer": label, "N": n, "M": m, "step_s": t, "peak_bytes": peak, "flops": flops}
        )
        _tick(bar, f"{label} N={n}")
    return rows


def recurrent_step_costs(sizes: list[int], fraction: float, repeats: int, bar=None) -> list[dict]:
    """One recurrent step h ↦ Qh (batch 1) forward and backward: oRNN operator form vs dense.

    The Householder paper's Table 2: oRNN(n, m) FP (4n − m + 2)m, BP (7n − 2m + 3)m;
    sRNN(n) FP 2n² − n, BP 3n² − n.
    """
    rows = []
    gen = torch.Generator().manual_seed(1)
    operators = [name for name in registry.maps() if registry.map_info(name).operator]
    for n in sizes:
        L = max(1, int(round(fraction * n)))
        for method in operators:
            opts = {"reflections": L} if registry.map_info(method).reflections else {}
            w = orthogonalize(kernels.haar(n, n, generator=gen), method=method, **opts)
            h = torch.randn(1, n, generator=gen, requires_grad=True)
            label = f"{method} operator (n, L={L})" if opts else f"{method} operator (n)"
            rows.append(_step_row(label, n, L if opts else n, w.linear, h, repeats))
        dense = torch.randn(n, n, generator=gen, requires_grad=True)
        h = torch.randn(1, n, generator=gen, requires_grad=True)
        rows.append(_step_row("sRNN dense", n, n, lambda x, d=dense: x @ d.T, h, repeats))
        _tick(bar, f"recurrent step n={n}")
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
    t_f = fastest_time(fwd, repeats)
    t_fb = fastest_time(fwd_bwd, repeats)
    return {
        "model": label,
        "n": n,
        "L": L,
        "fp_flops": fp,
        "bp_flops": bp,
        "forward_s": t_f,
        "backward_s": max(t_fb - t_f, 0.0),
    }

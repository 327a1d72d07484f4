"""The complexity section: time and memory of every map and optimizer step against size.

The tables follow the papers' layouts: the CWY paper's Table 1 (maps, serial
complexity) and Table 2 (one optimizer step on St(N, M), FLOPs), and the
Householder paper's Table 2 (one recurrent step, forward and backward FLOPs),
each with measured columns (`stiefel.comparisons.cost`) and the time the FLOP
model predicts at this machine's measured GEMM rate (the roofline). Other
measurements (the convolution layers of ``experiments/``) join through
`register_part`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import geoopt
import torch

from .. import optimizers, parametrizations
from ..manifolds import Stiefel, kernels
from ..parametrizations import orthogonalize
from . import plots
from .cost import (
    FWD_BWD_FACTOR,
    GEOOPT_STEPS,
    fastest_time,
    fit_exponent,
    forward_backward_flops,
    gemm_multiple,
    gemm_rate,
    map_flops,
    optimizer_steps,
    peak_bytes,
    saved_bytes,
)
from .store import run_key
from .writers import md_table, write_csv, write_json, write_text

__all__ = [
    "map_plan",
    "step_plan",
    "map_costs",
    "optimizer_costs",
    "recurrent_step_costs",
    "with_gemm_multiples",
    "register_part",
    "complexity_section",
    "FIT_MIN_N",
    "FIT_MIN_STEP_N",
]

#: below these sizes per-call overhead and a still-rising GEMM efficiency flatten
#: log–log slopes on a CPU (n = 256–2048 fitted 2.0–2.7 against 3; steps on
#: N = 1024–4096 fitted 0.5–0.9 against 1): no exponent is fitted under them
FIT_MIN_N = 512
FIT_MIN_STEP_N = 8192

Measure = Callable[[dict], list[dict]]
Table = Callable[[list[dict], float], list[str]]
#: further measurements of the section, name → (measure(options) → rows, table(rows, rate))
PARTS: dict[str, tuple[Measure, Table]] = {}


def register_part(name: str, measure: Measure, table: Table) -> None:
    """Add a measurement to the complexity section (stored as ``complexity_<name>.csv``).

    ``measure(options)`` returns rows (dicts) from the section's checked options;
    ``table(rows, gemm_rate)`` returns the markdown lines of its part of the report.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"part name={name!r}; allowed: a Python identifier string")
    PARTS[name] = (measure, table)


def _reflections(method: str) -> bool:
    return parametrizations.maps()[method].takes_reflections()


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
        for frac in (fractions if _reflections(method) else [1.0])
        for n in sizes
        if n <= limits.get(method, n)
    ]


def step_plan(
    shapes: list[tuple[int, int]], limits: Mapping[str, int] | None = None
) -> list[tuple[str, int, int]]:
    """The (optimizer, N, M) measured by `optimizer_costs`: ``limits`` caps N."""
    limits = limits or {}
    labels = [*optimizer_steps(), *GEOOPT_STEPS]
    return [(label, n, m) for n, m in shapes for label in labels if n <= limits.get(label, n)]


def map_costs(
    methods: list[str],
    sizes: list[int],
    fractions: list[float],
    repeats: int,
    device="cpu",
    limits: Mapping[str, int] | None = None,
) -> list[dict]:
    """Forward and forward+backward of every map's matrix, against n and L = fraction·n.

    A method named in ``limits`` is measured only up to its size there.
    """
    rows = []
    gen = torch.Generator().manual_seed(0)
    for method, frac, n in map_plan(methods, sizes, fractions, limits):
        reflections = _reflections(method)
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
                "saved_bytes": saved_bytes(lambda w=w, c=c: (w() * c).sum()),
                "peak_bytes": peak_bytes(fwd_bwd, device),
                "flops": map_flops(method, n, n, L if reflections else None),
            }
        )
    return rows


def optimizer_costs(
    shapes: list[tuple[int, int]],
    repeats: int,
    device="cpu",
    limits: Mapping[str, int] | None = None,
) -> list[dict]:
    """One step of every Riemannian optimizer (and geoopt's) on St(N, M), float32.

    An optimizer named in ``limits`` is measured only up to its N there.
    """
    steps = optimizer_steps()
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
    return rows


def recurrent_step_costs(sizes: list[int], fraction: float, repeats: int) -> list[dict]:
    """One recurrent step h ↦ Qh (batch 1) forward and backward: oRNN operator form vs dense.

    The Householder paper's Table 2: oRNN(n, m) FP (4n − m + 2)m, BP (7n − 2m + 3)m;
    sRNN(n) FP 2n² − n, BP 3n² − n.
    """
    rows = []
    gen = torch.Generator().manual_seed(1)
    operators = [name for name, cls in parametrizations.maps().items() if cls.has_operator()]
    for n in sizes:
        L = max(1, int(round(fraction * n)))
        for method in operators:
            opts = {"reflections": L} if _reflections(method) else {}
            w = orthogonalize(kernels.haar(n, n, generator=gen), method=method, **opts)
            h = torch.randn(1, n, generator=gen, requires_grad=True)
            label = f"{method} operator (n, L={L})" if opts else f"{method} operator (n)"
            rows.append(_step_row(label, n, L if opts else n, w.linear, h, repeats))
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


def with_gemm_multiples(
    maps: list[dict], steps: list[dict], rate: float
) -> tuple[list[dict], list[dict]]:
    """Copies of the rows of `map_costs` and `optimizer_costs` with the GEMM-multiple columns.

    Maps gain ``forward_backward_flops``, ``forward_backward_basis``,
    ``forward_x_gemm`` and ``forward_backward_x_gemm``; steps gain
    ``step_x_gemm`` (a step has no backward: its gradient is given), each
    `stiefel.comparisons.cost.gemm_multiple` of the row's time and FLOP model.
    """
    out_maps = []
    for r in maps:
        reflections = r["L"] if _reflections(r["method"]) else None
        fb, basis = forward_backward_flops(r["method"], r["n"], r["n"], reflections)
        out_maps.append(
            dict(
                r,
                forward_backward_flops=fb,
                forward_backward_basis=basis,
                forward_x_gemm=gemm_multiple(r["forward_s"], r["flops"], rate),
                forward_backward_x_gemm=gemm_multiple(r["forward_backward_s"], fb, rate),
            )
        )
    out_steps = [dict(r, step_x_gemm=gemm_multiple(r["step_s"], r["flops"], rate)) for r in steps]
    return out_maps, out_steps


def _fits(rows: list[dict], size: str, keys: tuple[str, ...], min_size: int) -> list[float | None]:
    """Fitted log–log exponents of ``keys`` against ``size`` over the sizes >= ``min_size``."""
    rows = [r for r in rows if r[size] >= min_size]
    if len({r[size] for r in rows}) < 2:
        return [None for _ in keys]
    out = []
    for k in keys:
        vals = [r[k] for r in rows]
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in vals)
        out.append(fit_exponent([r[size] for r in rows], vals) if ok else None)
    return out


def _span(rows: list[dict], size: str, min_size: int) -> str:
    sizes = sorted({r[size] for r in rows if r[size] >= min_size})
    return f"{sizes[0]}–{sizes[-1]}" if len(sizes) > 1 else "–"


def _within(pairs: list[tuple[float | None, float | None]], tol: float = 0.3) -> str:
    """ "k of K": how many fitted exponents lie within ``tol`` of their model's."""
    fitted = [(f, m) for f, m in pairs if f is not None and m is not None and math.isfinite(m)]
    if not fitted:
        return "none fitted (sizes too small, or no FLOP model declared)"
    return f"{sum(abs(f - m) <= tol for f, m in fitted)} of {len(fitted)}"


def _measure(store, part: str, fn) -> Any:
    key = run_key(part=part)
    done = store.load_run("complexity", key)
    if done is not None:
        return done["value"]
    value = fn()
    store.save_run("complexity", key, {"value": value})
    return value


def complexity_section(store, opts: dict) -> dict:
    """Measure the maps, the optimizer steps, one recurrent step and the registered parts."""
    store.begin_section("complexity", opts)
    device, repeats = opts["device"], opts["repeats"]
    limits = opts.get("limits") or {}
    sizes, fractions = opts["sizes"], opts["fractions"]
    methods = list(parametrizations.maps())
    shapes = [tuple(s) for s in opts["shapes"]]
    rate = _measure(store, "gemm", lambda: gemm_rate(n=min(max(sizes), 2048), device=device))
    maps = _measure(
        store, "maps", lambda: map_costs(methods, sizes, fractions, repeats, device, limits)
    )
    steps = _measure(store, "steps", lambda: optimizer_costs(shapes, repeats, device, limits))
    rec = _measure(store, "recurrent", lambda: recurrent_step_costs(sizes, 1 / 8, repeats))
    parts = {name: _measure(store, name, lambda m=m: m(opts)) for name, (m, _) in PARTS.items()}
    maps, steps = with_gemm_multiples(maps, steps, rate)
    result = {
        "gemm_flops_per_s": rate,
        "maps": maps,
        "optimizer_steps": steps,
        "recurrent_steps": rec,
        **parts,
        "options": opts,
    }
    write_json(store.path("complexity.json"), result)
    write_csv(store.path("complexity_maps.csv"), maps)
    write_csv(store.path("complexity_optimizers.csv"), steps)
    write_csv(store.path("complexity_recurrent.csv"), rec)
    for name, rows in parts.items():
        write_csv(store.path(f"complexity_{name}.csv"), rows)
    text = [_intro(rate, opts, sizes, shapes)]
    text += _map_table(maps, methods, rate)
    text += _step_table(steps, rate)
    text.append("\n### One recurrent step, batch 1 (Householder paper Table 2 layout)\n")
    text.append(
        md_table(
            ["model", "n", "FP flops", "BP flops", "FP [s]", "BP [s]"],
            [
                [r["model"], r["n"], r["fp_flops"], r["bp_flops"], r["forward_s"], r["backward_s"]]
                for r in rec
            ],
        )
    )
    for name, rows in parts.items():
        text += PARTS[name][1](rows, rate)
    write_text(store.path("complexity.md"), "\n".join(text))
    maps_fig = [dict(r, series=f"{r['method']} L={r['fraction']:g}n") for r in maps]
    figs = plots.save(
        store,
        plots.complexity_figure(
            maps_fig,
            "n",
            "forward_backward_s",
            "series",
            "Maps: forward + backward",
            rate,
            FIT_MIN_N,
            flops_key="forward_backward_flops",
        ),
        "complexity_maps",
    )
    figs += plots.save(
        store,
        plots.complexity_figure(
            steps, "N", "step_s", "optimizer", "Optimizer step on St(N, M)", rate, FIT_MIN_STEP_N
        ),
        "complexity_optimizers",
    )
    store.end_section("complexity", ["complexity.md", *figs])
    return result


def _intro(rate: float, opts: dict, sizes: list[int], shapes: list) -> str:
    text = (
        f"Measured GEMM rate (the roofline): {rate / 1e9:.1f} GFLOP/s (the fastest of several "
        f"products of size ≥ 512). Times are the fastest of {opts['repeats']} runs. Exponents are "
        f"least-squares slopes of log time against log size over the sizes ≥ {FIT_MIN_N} "
        f"(maps) and N ≥ {FIT_MIN_STEP_N} (steps), column *fitted over*; the model exponent "
        "is that of the FLOP model over the same sizes.\n"
    )
    if max(sizes) < FIT_MIN_N or max(s[0] for s in shapes) < FIT_MIN_STEP_N:
        text += (
            "\n**These sizes are too small to show how cost grows**: below them per-call "
            "overhead dominates, so the exponents are not fitted (–). For the paper-scale "
            "measurement run `python -m stiefel.comparisons complexity --config "
            "configs/complexity.toml`.\n"
        )
    return text


def _map_table(maps: list[dict], methods: list[str], rate: float) -> list[str]:
    rows, pairs, bases = [], [], set()
    registered = parametrizations.maps()
    for method in methods:
        cls = registered[method]
        for frac in sorted({r["fraction"] for r in maps if r["method"] == method}):
            rs = [r for r in maps if r["method"] == method and r["fraction"] == frac]
            big = max(rs, key=lambda r: r["n"])
            fit_f, fit_fb, model = _fits(
                rs, "n", ("forward_s", "forward_backward_s", "flops"), FIT_MIN_N
            )
            pairs += [(fit_f, model), (fit_fb, model)]
            rows.append(
                [method, f"L = {frac:g}·n" if cls.takes_reflections() else "–"]
                + [cls.formula or "–", cls.domain or "–", big["n"], big["flops"], big["forward_s"]]
                + [big["flops"] / rate, big["forward_backward_s"], big["saved_bytes"] / 2**20]
                + [big["peak_bytes"] / 2**20, fit_f, fit_fb, model, _span(rs, "n", FIT_MIN_N)]
                + [big["forward_x_gemm"], big["forward_backward_x_gemm"]]
            )
            bases.add(big["forward_backward_basis"])
    head = ["method", "L", "serial complexity", "domain", "n", "FLOP model", "forward [s]"]
    head += ["roofline [s]", "fwd+bwd [s]", "saved [MiB]", "peak fwd+bwd [MiB]"]
    head += ["exponent fwd", "exponent fwd+bwd", "model exponent", "fitted over n"]
    head += ["fwd × FLOPs at GEMM rate", "fwd+bwd × FLOPs at GEMM rate"]
    return [
        "### Maps (CWY paper Table 1 layout), measured at the largest n\n",
        md_table(head, rows),
        f"\nFitted exponents within 0.3 of the FLOP model's (maps, forward and forward+backward): "
        f"{_within(pairs)}.\n",
        "\n*× FLOPs at GEMM rate* = measured time / (FLOP model / measured GEMM rate): how "
        "many times slower than running the modelled FLOPs at the GEMM rate. Forward+backward "
        f"FLOPs here: {' and '.join(sorted(bases)) or '–'} (the class's forward + backward "
        f"model where it declares one, else {FWD_BWD_FACTOR:g}× the forward model: the "
        "backward of each product is two products of its size).\n",
    ]


def _step_table(steps: list[dict], rate: float) -> list[str]:
    known = optimizer_steps()
    rows, pairs = [], []
    for label in dict.fromkeys(r["optimizer"] for r in steps):
        rs = [r for r in steps if r["optimizer"] == label]
        big = max(rs, key=lambda r: r["N"])
        fit, model = _fits(rs, "N", ("step_s", "flops"), FIT_MIN_STEP_N)
        modelled = math.isfinite(big["flops"])
        pairs.append((fit, model if modelled else None))
        formula = known[label][0].formula if label in known else ""
        rows.append(
            [label, formula or "–", big["N"], big["M"], big["flops"] if modelled else "–"]
            + [big["step_s"], big["flops"] / rate if modelled else "–", big["peak_bytes"] / 2**20]
            + [fit, model if modelled else "–", _span(rs, "N", FIT_MIN_STEP_N)]
            + [big["step_x_gemm"] if modelled else "–"]
        )
    head = ["optimizer", "FLOPs (formula)", "N", "M", "FLOP model", "step [s]", "roofline [s]"]
    head += ["peak [MiB]", "exponent in N", "model exponent", "fitted over N"]
    head += ["step × FLOPs at GEMM rate"]
    return [
        "\n### One optimizer step on St(N, M) (CWY paper Table 2 layout)\n",
        md_table(head, rows),
        f"\nFitted exponents within 0.3 of the FLOP model's (optimizer steps): {_within(pairs)}.\n",
        "\n*step × FLOPs at GEMM rate* = step time / (FLOP model / measured GEMM rate); a step "
        "has no backward (its gradient is given); – where the optimizer declares no FLOP model.\n",
    ]

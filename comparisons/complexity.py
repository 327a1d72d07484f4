"""The complexity plans: time and memory of every map and optimizer step against size.

The tables (`stiefel.comparisons.sections`) follow the CWY paper's Tables 1 (maps) and 2
(one step on St(N, M)), with measured columns (`stiefel.comparisons.cost`) and the roofline
(Note [Roofline]); other measurements (``experiments/``) join through `register_part`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import geoopt
import torch

from .. import optimizers, parametrizations
from ..manifolds import Stiefel, kernels
from ..parametrizations import orthogonalize
from . import cost
from .cost import GEOOPT_STEPS, measure_many, optimizer_steps, peak_bytes, saved_bytes

__all__ = [
    "map_plan", "step_plan", "map_costs", "optimizer_costs", "left_out_steps", "LEFT_OUT",
    "with_multiples", "register_part", "FIT_MIN_N", "FIT_MIN_STEP_N", "STEP_NOTES",
]  # fmt: skip

LEFT_OUT = "not declared riemannian=True"  # why `left_out_steps` are not stepped
#: below these sizes per-call overhead and a still-rising GEMM efficiency flatten
#: log–log slopes on a CPU (n = 256–2048 fitted 2.0–2.7 against 3; steps on
#: N = 1024–4096 fitted 0.5–0.9 against 1): no exponent is fitted under them
FIT_MIN_N = 512
FIT_MIN_STEP_N = 8192

_OURS = ("no FLOP model; geoopt's {} on this package's `Stiefel(N, M)`: Euclidean metric, a Cayley "
         "retraction through a 2M×2M Woodbury solve (never N×N), O(NM²) a step")  # fmt: skip
_CANONICAL = ("no FLOP model; geoopt's `CanonicalStiefel`: canonical metric, a Cayley retraction "
              "that forms and solves an N×N system, O(N³) a step: far slower than geoopt_radam "
              "and geoopt_rsgd, the same optimizers on `Stiefel(N, M)`, at large N")  # fmt: skip
#: the step table's note (key, text) of a step with no formula: the manifold and retraction it
#: steps on; another step's note is its optimizer's formula, keyed by its name
STEP_NOTES = {
    "geoopt_rsgd": ("geoopt_rsgd", _OURS.format("RiemannianSGD")),
    "geoopt_radam": ("geoopt_radam", _OURS.format("RiemannianAdam")),
    GEOOPT_STEPS[0]: ("CanonicalStiefel", _CANONICAL),
    GEOOPT_STEPS[1]: ("EuclideanStiefel", "no FLOP model; geoopt's `EuclideanStiefel`: Euclidean "
                      "metric, a QR retraction of X + U, O(NM²) a step"),
    GEOOPT_STEPS[2]: ("CanonicalStiefel", _CANONICAL),
}  # fmt: skip
Limits = Mapping[str, int] | None  # largest n (or N) per map or optimizer label
Measure = Callable[[dict], list[dict]]
Table = Callable[[list[dict], float], list[str]]  # (rows, GEMM rate) → markdown lines
#: further measurements of the section, name → (measure(options) → rows, table(rows, rate))
PARTS: dict[str, tuple[Measure, Table]] = {}


def register_part(name: str, measure: Measure, table: Table) -> None:
    """Add a measurement to the complexity section (its rows stored with the section's runs).

    ``measure(options)`` returns rows (dicts) from the section's checked options;
    ``table(rows, gemm_rate)`` returns the markdown lines of its part of the report.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"part name={name!r}; allowed: a Python identifier string")
    PARTS[name] = (measure, table)


def _reflections(method: str) -> bool:
    return parametrizations.maps()[method].takes_reflections()


def map_plan(
    methods: list[str], sizes: list[int], fractions: list[float], limits: Limits = None
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
    shapes: list[tuple[int, int]], limits: Limits = None, only: list[str] | None = None
) -> list[tuple[str, int, int]]:
    """The (optimizer, N, M) measured by `optimizer_costs`: ``limits`` caps N; ``only``
    (optimizer names, ``geoopt`` for its anchors) selects the rows."""
    limits = limits or {}
    labels = [k for k, (info, _) in optimizer_steps().items() if not only or info.name in only]
    labels += [*GEOOPT_STEPS] if not only or "geoopt" in only else []
    return [(label, n, m) for n, m in shapes for label in labels if n <= limits.get(label, n)]


def timing(t: str, m: dict) -> dict:
    """The columns of time ``t`` from `cost.measure`: ``<t>_s`` (the trusted clock's median,
    Note [Trusted times]), ``<t>_cpu_s``, ``<t>_wall_s``, ``<t>_mad_s``, ``<t>_flag``,
    ``<t>_calls`` (per timed block, Note [Timed blocks])."""
    return {f"{t}_{k}" if k != "s" else f"{t}_s": v for k, v in m.items() if k != "fastest_s"}


def left_out_steps() -> list[str]:
    """The registered optimizers `optimizer_costs` does not step: those not declared
    ``riemannian=True`` (`stiefel.optimizers.info`; a Euclidean step would leave St)."""
    return [n for n in optimizers.available() if not optimizers.info(n).riemannian]


def map_costs(
    methods: list[str], sizes: list[int], fractions: list[float], repeats: int, device="cpu",
    limits: Limits = None, progress=None,
) -> list[dict]:  # fmt: skip
    """Forward and forward+backward of every map's matrix, against n and L = fraction·n.

    The maps at one n are timed together (`cost.measure_many`: their ratios come from
    interleaved rounds). A method named in ``limits`` is measured only up to its size
    there; ``progress`` (`stiefel.comparisons.writers.Progress`) hears of each finished row.
    """
    rows, plan = [], map_plan(methods, sizes, fractions, limits)
    gen = torch.Generator().manual_seed(0)
    for size in dict.fromkeys(n for _, _, n in plan):
        c, calls, group = torch.randn(size, size, generator=gen).to(device), {}, []
        for method, frac, n in [p for p in plan if p[2] == size]:
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
            # the label names the series: one per method and, where it takes reflections, L/n
            label = f"{method} L={frac:g}n" if reflections else method
            model = (method, n, n, L if reflections else None)
            row = dict(label=label, method=method, n=n, L=L, fraction=frac)
            row.update(flops=cost.map_flops(*model), bytes=cost.map_bytes(*model, x0.itemsize))
            calls[label, "forward"] = torch.no_grad()(w)
            calls[label, "forward_backward"] = lambda w=w, c=c: (w() * c).sum().backward()
            group.append((row, w))
        times = measure_many(calls, repeats, device)
        for row, w in group:
            for t in ("forward", "forward_backward"):
                row.update(timing(t, times[row["label"], t]))
            row.update(saved_bytes=saved_bytes(lambda w=w, c=c: (w() * c).sum()))
            row.update(peak_bytes=peak_bytes(calls[row["label"], "forward_backward"], device))
            rows.append(row)
            _ = progress and progress.finished(f"{row['label']} at n = {size}", 1)
    return rows


def optimizer_costs(
    shapes: list[tuple[int, int]], repeats: int, device="cpu", limits: Limits = None,
    only: list[str] | None = None, progress=None,
) -> list[dict]:  # fmt: skip
    """One step of every Riemannian optimizer (and geoopt's) on St(N, M), float32.

    The steps on one shape are timed together (`cost.measure_many`, as in `map_costs`).
    An optimizer named in ``limits`` is measured only up to its N there; ``only``
    selects the optimizers (`step_plan`); ``progress`` as in `map_costs`.
    """
    steps = optimizer_steps()
    rows, plan = [], step_plan(shapes, limits, only)
    gen = torch.Generator().manual_seed(0)
    geoopt_setups = {
        GEOOPT_STEPS[0]: ("geoopt_rsgd", geoopt.CanonicalStiefel()),
        GEOOPT_STEPS[1]: ("geoopt_rsgd", geoopt.EuclideanStiefel()),
        GEOOPT_STEPS[2]: ("geoopt_radam", geoopt.CanonicalStiefel()),
    }
    for shape in dict.fromkeys((n, m) for _, n, m in plan):  # one point and gradient a shape
        n, m = shape
        x0 = Stiefel(n, m).random(generator=gen).to(device)
        g = torch.randn(n, m, generator=gen).to(device)
        group = {}
        for label in [label for label, *s in plan if tuple(s) == shape]:
            if label in steps:
                info, variant = steps[label]
                p = geoopt.ManifoldParameter(x0.clone(), manifold=Stiefel(n, m))
                opt = optimizers.create(info.name, [p], lr=1e-3, **variant)
                flops = info.flops(n, m, **variant)
                nbytes = info.bytes(n, m, x0.element_size(), **variant)
            else:
                kind, manifold = geoopt_setups[label]
                p = geoopt.ManifoldParameter(x0.clone(), manifold=manifold)
                opt = optimizers.create(kind, [p], lr=1e-3)
                flops = nbytes = math.nan  # geoopt's steps: no models
            p.grad = g.clone()
            group[label] = (opt.step, {"flops": flops, "bytes": nbytes})
        times = measure_many({k: step for k, (step, _) in group.items()}, repeats, device)
        for label, (step, models) in group.items():
            row = {"label": f"{label} M={m}", "optimizer": label, "N": n, "M": m, **models}
            row["peak_bytes"] = peak_bytes(step, device)
            rows.append(row | timing("step", times[label]))
            _ = progress and progress.finished(f"{label} on St({n}, {m})", 1)
    return rows


def with_multiples(
    maps: list[dict], steps: list[dict], rate: float, bandwidth: float
) -> tuple[list[dict], list[dict]]:
    """Copies of the rows of `map_costs` and `optimizer_costs` with their roofline columns.

    Each time ``<t>_s`` (``forward``, ``forward_backward`` whose models are `FWD_BWD_FACTOR` ×
    the forward's, ``step``) gains ``<t>_roofline_s``, ``<t>_bound`` (`cost.roofline`),
    ``<t>_x_roofline`` and ``<t>_x_gemm`` (`cost.roofline_multiple` with and without bytes).
    """

    def multiples(r: dict, t: str, flops: float, nbytes: float) -> dict:
        at, bound = cost.roofline(flops, rate, nbytes, bandwidth)
        x_gemm = cost.roofline_multiple(r[f"{t}_s"], flops, rate)
        x_roof = cost.roofline_multiple(r[f"{t}_s"], flops, rate, nbytes, bandwidth)
        names, values = ("roofline_s", "bound", "x_gemm", "x_roofline"), (at, bound, x_gemm, x_roof)
        return {f"{t}_{k}": v for k, v in zip(names, values, strict=True)}

    out_maps = []
    for r in maps:
        fb = {f"forward_backward_{k}": cost.FWD_BWD_FACTOR * r[k] for k in ("flops", "bytes")}
        out = r | fb | multiples(r, "forward", r["flops"], r["bytes"])
        out_maps.append(out | multiples(r, "forward_backward", *fb.values()))
    return out_maps, [r | multiples(r, "step", r["flops"], r["bytes"]) for r in steps]

"""Measured time as a multiple of the FLOP model at the measured GEMM rate.

The complexity section divides every map's and step's FLOP model by the GEMM
rate `stiefel.comparisons.complexity.gemm_rate` measures (the roofline) and
reports the measured time as a multiple of that ideal time: the column
"× FLOPs at GEMM rate" of its tables, computed here once for the JSON, CSV and
markdown outputs.

Note [Forward+backward FLOP convention]
A map whose class declares no ``backward_flops`` is charged 3× its forward
FLOPs for forward+backward: the backward of a product C = AB is two products
of the same size (∂A = ∂C·Bᴴ, ∂B = Aᴴ·∂C), so a map built of products costs
twice its forward again. A class whose backward is not built that way (an
adjoint Fréchet derivative, re-used LU factors) declares
``backward_flops(n, m, reflections)``, the backward alone, and is charged
forward + backward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from . import registry

__all__ = [
    "GEMM_GOAL",
    "FWD_BWD_FACTOR",
    "gemm_multiple",
    "forward_backward_flops",
    "with_gemm_multiples",
    "gemm_goal_text",
    "map_caption",
    "STEP_CAPTION",
]

#: the goal of the "× FLOPs at GEMM rate" column: every map and step within this multiple
GEMM_GOAL = 2.0
#: forward+backward FLOPs of a map without a backward model, in forward FLOPs
#: (Note [Forward+backward FLOP convention])
FWD_BWD_FACTOR = 3.0
#: the sizes the goal is stated at (issue 16): maps at n = 1024, steps on St(4096, ·);
#: below them per-call overhead dominates and the goal is not judged
GOAL_MAP_N, GOAL_STEP_N = 1024, 4096


def gemm_multiple(seconds: float, flops: float, rate: float) -> float:
    """``seconds / (flops / rate)``: how many times slower than the modelled FLOPs at the GEMM rate.

    1 is a computation that runs its FLOP model at the measured GEMM rate;
    above 1 it loses time to lower-rate kernels (triangular solves,
    memory-bound updates, Python loops); below 1 the model over-counts.

    Args:
        seconds: the measured time.
        flops: the FLOP model's count (NaN or <= 0: no model).
        rate: the measured GEMM rate in FLOP/s.

    Returns:
        The multiple, NaN when there is no FLOP model.

    Example:
        ```python
        import math
        from stiefel.comparisons.roofline import gemm_multiple

        assert gemm_multiple(0.2, 1e9, 1e10) == 2.0  # 0.1 s ideal, 0.2 s measured
        assert math.isnan(gemm_multiple(0.2, float("nan"), 1e10))
        ```
    """
    if not (math.isfinite(flops) and flops > 0):
        return math.nan
    return seconds / (flops / rate)


def forward_backward_flops(
    method: str, n: int, m: int, reflections: int | None
) -> tuple[float, str]:
    """FLOPs charged to forward+backward of map ``method``, and their basis.

    Note [Forward+backward FLOP convention].

    Args:
        method: a registered map.
        n: rows of the tall matrix.
        m: its columns.
        reflections: L for the reflection maps, else None.

    Returns:
        ``(forward + backward model, "backward model")`` when the class
        declares ``backward_flops``, else ``(3 × forward, "3× forward")``.
    """
    info = registry.map_info(method)
    fwd = info.flops(n, m, reflections)
    bwd = info.backward_flops(n, m, reflections)
    if math.isfinite(bwd):
        return fwd + bwd, "backward model"
    return FWD_BWD_FACTOR * fwd, f"{FWD_BWD_FACTOR:g}× forward"


def with_gemm_multiples(
    maps: list[dict], steps: list[dict], rate: float
) -> tuple[list[dict], list[dict]]:
    """Copies of the rows of `map_costs` and `optimizer_costs` with the GEMM-multiple columns.

    Maps gain ``forward_backward_flops``, ``forward_backward_basis``,
    ``forward_x_gemm`` and ``forward_backward_x_gemm``; steps gain
    ``step_x_gemm`` (a step has no backward: its gradient is given). Each is
    `gemm_multiple` of the row's time and FLOP model at ``rate``.

    Args:
        maps: rows of `stiefel.comparisons.complexity.map_costs` (square n×n maps).
        steps: rows of `stiefel.comparisons.complexity.optimizer_costs`.
        rate: the measured GEMM rate in FLOP/s.

    Returns:
        The map rows and the step rows, extended (the inputs are not modified).
    """
    out_maps = []
    for r in maps:
        reflections = r["L"] if registry.map_info(r["method"]).reflections else None
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


def gemm_goal_text(
    multiples: Mapping[str, float], what: str, size: int | None = None, goal_size: int = 0
) -> str:
    """A line: how many of ``multiples`` (label → multiple) are within `GEMM_GOAL`, which not.

    ``size`` is the largest size measured; below ``goal_size`` (`GOAL_MAP_N`,
    `GOAL_STEP_N`) the line says the goal is not judged instead of a verdict.
    """
    known = {k: v for k, v in multiples.items() if math.isfinite(v)}
    head = f"\nWithin {GEMM_GOAL:g}× of the FLOP model at the GEMM rate ({what}): "
    if not known:
        return head + "no FLOP model.\n"
    if size is not None and size < goal_size:
        return head + (
            f"not judged at size {size} (the goal is stated at {goal_size}; below it "
            "per-call overhead dominates).\n"
        )
    over = ", ".join(f"{k} ({v:.3g}×)" for k, v in known.items() if v > GEMM_GOAL)
    within = sum(v <= GEMM_GOAL for v in known.values())
    return head + f"{within} of {len(known)}" + (f"; above: {over}" if over else "") + ".\n"


def map_caption(bases: set[str]) -> str:
    """The map table's definition of the column; ``bases``: the fwd+bwd FLOP bases in use."""
    return (
        "\n*× FLOPs at GEMM rate* = measured time / (FLOP model / measured GEMM rate): how "
        "many times slower than running the modelled FLOPs at the GEMM rate. Forward+backward "
        f"FLOPs here: {' and '.join(sorted(bases)) or '–'} (the class's forward + backward "
        f"model where it declares one, else {FWD_BWD_FACTOR:g}× the forward model: the "
        "backward of each product is two products of its size).\n"
    )


#: the step table's definition of the column
STEP_CAPTION = (
    "\n*step × FLOPs at GEMM rate* = step time / (FLOP model / measured GEMM rate); a step "
    "has no backward (its gradient is given); – where the optimizer declares no FLOP model.\n"
)

"""Init time of ``orthogonalize(nn.Linear(n, n), method="householder")`` per ``init``.

The default init ("nearest") is the polar factor of the weight (the SVD polar
factor UVᴴ of ``stiefel.parametrizations._polar.nearest_point``) followed by the
map's right inverse (for the reflection maps, LAPACK geqrf: the reflections
part). Printed per n, float32: the whole call for ``init="nearest"`` with its
polar and reflections parts, the whole call for ``init="haar"`` and
``init="identity"``, and the anchor measured in the same run:
``torch.nn.init.orthogonal_`` on an n×n tensor (QR of a Gaussian), with the
ratio of each init to it. One run each by default (these are seconds-long calls),
``--rounds k`` the median of k rounds, each timing every column once in turn; wall
clock. Timings on a shared machine are noisy; the header names the torch version,
the CPU and the thread count.

Run: ``python -m benchmarks.init`` (n = 1024, 2048, 4096), ``--sizes 2048,4096``,
or ``--quick`` (n = 128, 256); ``--inits haar,identity`` leaves out the nearest
point (left-out columns print as "—").
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from stiefel.parametrizations import orthogonalize
from stiefel.parametrizations._polar import nearest_point

from ._timing import fmt_time, header

INITS = ("nearest", "haar", "identity")


def _time(f: Callable[..., object], *args: object, **kwargs: object) -> tuple[float, object]:
    start = time.perf_counter()
    out = f(*args, **kwargs)
    return time.perf_counter() - start, out


def _linear(n: int) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(n, n)


def measure(n: int, method: str, inits: tuple[str, ...] = INITS) -> dict[str, float]:
    """Seconds of each part for one n (float32 weights).

    Args:
        n: the size of the square weight.
        method: the map (a reflection map splits into polar and reflections).
        inits: the inits to time ("nearest" adds its polar and reflections parts).

    Returns:
        ``torch`` and, per init in ``inits``, its time (``nearest`` with
        ``polar`` and ``reflections``); NaN for the inits left out.
    """
    nan = float("nan")
    out = dict(nearest=nan, polar=nan, reflections=nan, haar=nan, identity=nan)
    out["torch"], _ = _time(nn.init.orthogonal_, torch.empty(n, n))
    if "nearest" in inits:
        lin = _linear(n)
        w = lin.weight.detach().clone()
        out["nearest"], _ = _time(orthogonalize, lin, "weight", method=method)
        out["polar"], q = _time(nearest_point, w)
        out["reflections"], _ = _time(lin.parametrizations.weight[0].inverse, q)
    for init in ("haar", "identity"):
        if init in inits:
            out[init], _ = _time(orthogonalize, _linear(n), "weight", method=method, init=init)
    return out


def measured(n: int, method: str, inits: tuple[str, ...], rounds: int) -> dict[str, float]:
    """The median over ``rounds`` calls of `measure` of each part (NaN stays NaN)."""
    runs = [measure(n, method, inits) for _ in range(rounds)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}×" if math.isfinite(a / b) else "—"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 128, 256")
    parser.add_argument("--sizes", default=None, help="comma-separated n (default 1024,2048,4096)")
    parser.add_argument("--method", default="householder", help="the map (default householder)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="median of this many runs (1)")
    parser.add_argument(
        "--inits",
        default=",".join(INITS),
        help=f"comma-separated inits to time, of {', '.join(INITS)} (default all)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads={args.threads} is not allowed; allowed: an int >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} is not allowed; allowed: an int >= 1")
    torch.set_num_threads(args.threads)
    default = "128,256" if args.quick else "1024,2048,4096"
    try:
        sizes = [int(s) for s in (args.sizes or default).split(",")]
    except ValueError:
        parser.error(f"--sizes={args.sizes!r} is not allowed; allowed: comma-separated ints")
    if any(n < 1 for n in sizes):
        parser.error(f"--sizes={args.sizes!r} is not allowed; allowed: ints >= 1")
    inits = tuple(args.inits.split(","))
    if not inits or any(i not in INITS for i in inits):
        parser.error(f"--inits={args.inits!r} is not allowed; allowed: some of {', '.join(INITS)}")
    runs = "one run each" if args.rounds == 1 else f"median of {args.rounds} rounds"
    lines = [
        header(f"orthogonalize(Linear(n, n), method={args.method!r})"),
        f"{runs}, wall clock; anchor: torch.nn.init.orthogonal_",
        "| n | nearest (default) | polar part | reflections part | haar | identity "
        "| torch orthogonal_ | nearest / torch | haar / torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for n in sizes:
        t = measured(n, args.method, inits, args.rounds)
        cells = [fmt_time(t[k]).strip() for k in ("nearest", "polar", "reflections")]
        cells += [fmt_time(t[k]).strip() for k in ("haar", "identity", "torch")]
        cells += [_ratio(t["nearest"], t["torch"]), _ratio(t["haar"], t["torch"])]
        row = f"| {n} | " + " | ".join(cells) + " |"
        print(row, flush=True)
        lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    main()

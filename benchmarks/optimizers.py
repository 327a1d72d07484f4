"""Step time of our Riemannian optimizers against geoopt's, on St(N, M) and O(n).

Run ``python -m benchmarks.optimizers`` (``--quick`` for a short
run, ``--json PATH`` to keep the numbers). For each shape (default St(4096, 64),
St(1024, 256) and O(512), float32) and each optimizer, a
``geoopt.ManifoldParameter`` starts at the same Haar-random point with the
same fixed random ``.grad`` (set once), and only ``opt.step()`` is timed, in
the same run for everyone:

- ours, through ``stiefel.optimizers.create`` on ``stiefel.manifolds.Stiefel``
  (``Orthogonal`` for a square shape): ``rgd`` with metric euclidean /
  canonical × retraction cayley / qr, ``radam`` (cayley, qr) and ``landing``;
- geoopt's ``RiemannianSGD`` and ``RiemannianAdam`` on ``geoopt.CanonicalStiefel``
  (Cayley transform of an N×N matrix) and ``geoopt.EuclideanStiefel`` (QR).

Ratios are "geoopt canonical SGD step / this step" (> 1: faster than geoopt)
and "this / rgd (euclidean, cayley)". The number of runs follows the cost of a
step (``--budget`` seconds per measurement; a slower step is timed once).
``--device cuda`` (or ``cuda:k``) steps on that GPU (points and gradients drawn
on the CPU as with ``--device cpu``, then moved; every timed step synchronised);
``--clock thread`` is for the CPU only.

Example:

```text
python -m benchmarks.optimizers --quick --json /tmp/opt.json
python -m benchmarks.optimizers --shapes 4096x64,512x512 --repeats 20
python -m benchmarks.optimizers --device cuda --json /tmp/opt_cuda.json
```
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import geoopt
import torch

from stiefel import optimizers
from stiefel.manifolds import Orthogonal, Stiefel

from ._timing import (
    device_of,
    fmt_ratio,
    fmt_time,
    header,
    measure,
    parse_shape,
    ratio,
    table,
    target,
    targets_table,
    write_json,
)

SHAPES = [(4096, 64), (1024, 256), (512, 512)]
QUICK_SHAPES = [(64, 4), (32, 8), (16, 16)]
LR = 1e-3

RGD_E_C = "rgd (euclidean, cayley)"
RGD_C_C = "rgd (canonical, cayley)"
RGD_E_QR = "rgd (euclidean, qr)"
RADAM_C = "radam (cayley)"
GEO_SGD_CANON = "geoopt RiemannianSGD, CanonicalStiefel"
GEO_SGD_EUCL = "geoopt RiemannianSGD, EuclideanStiefel"

Build = Callable[[torch.nn.Parameter], torch.optim.Optimizer]

OURS: dict[str, Build] = {
    RGD_E_C: lambda p: optimizers.create(
        "rgd", [p], lr=LR, metric="euclidean", retraction="cayley"
    ),
    RGD_C_C: lambda p: optimizers.create(
        "rgd", [p], lr=LR, metric="canonical", retraction="cayley"
    ),
    RGD_E_QR: lambda p: optimizers.create("rgd", [p], lr=LR, metric="euclidean", retraction="qr"),
    "rgd (canonical, qr)": lambda p: optimizers.create(
        "rgd", [p], lr=LR, metric="canonical", retraction="qr"
    ),
    RADAM_C: lambda p: optimizers.create("radam", [p], lr=LR, retraction="cayley"),
    "radam (qr)": lambda p: optimizers.create("radam", [p], lr=LR, retraction="qr"),
    "landing": lambda p: optimizers.create("landing", [p], lr=LR),
}

GEOOPT: dict[str, tuple[type, Build]] = {
    GEO_SGD_CANON: (geoopt.CanonicalStiefel, lambda p: geoopt.optim.RiemannianSGD([p], lr=LR)),
    GEO_SGD_EUCL: (
        geoopt.EuclideanStiefel,
        lambda p: geoopt.optim.RiemannianSGD([p], lr=LR),
    ),
    "geoopt RiemannianAdam, CanonicalStiefel": (
        geoopt.CanonicalStiefel,
        lambda p: geoopt.optim.RiemannianAdam([p], lr=LR),
    ),
    "geoopt RiemannianAdam, EuclideanStiefel": (
        geoopt.EuclideanStiefel,
        lambda p: geoopt.optim.RiemannianAdam([p], lr=LR),
    ),
}


def _label(n: int, m: int) -> str:
    return f"O({n})" if n == m else f"St({n}, {m})"


def _our_manifold(n: int, m: int) -> Stiefel:
    return Orthogonal(n) if n == m else Stiefel(n, m)


def step_time(
    manifold: geoopt.Manifold,
    build: Build,
    x0: torch.Tensor,
    grad: torch.Tensor,
    repeats: int,
    budget: float,
    clock: str | None = None,
):
    """Median time of ``opt.step()`` on a fresh parameter at ``x0`` with a fixed ``.grad``."""
    p = geoopt.ManifoldParameter(x0.clone(), manifold=manifold)
    opt = build(p)
    p.grad = grad.clone()
    t = measure(opt.step, repeats, budget, clock=clock)
    eye = torch.eye(x0.shape[-1], dtype=x0.dtype, device=x0.device)
    err = float(torch.linalg.matrix_norm(p.detach().mT @ p.detach() - eye))
    return t, err


def run(
    shapes: list[tuple[int, int]],
    repeats: int,
    budget: float,
    verbose: bool = False,
    clock: str | None = None,
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """One row per (shape, optimizer); points and gradients drawn on the CPU, then moved."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n, m in shapes:
        ours = _our_manifold(n, m)
        x0 = ours.random(dtype=torch.float32, generator=gen).to(device)
        grad = torch.randn(n, m, generator=gen).to(device)
        cases: list[tuple[str, str, geoopt.Manifold, Build]] = [
            (name, "ours", ours, build) for name, build in OURS.items()
        ]
        cases += [(name, "geoopt", man(), build) for name, (man, build) in GEOOPT.items()]
        for name, family, manifold, build in cases:
            if verbose:
                print(f"  … {_label(n, m)} {name}", flush=True)
            t, err = step_time(manifold, build, x0, grad, repeats, budget, clock)
            rows.append(
                {
                    "shape": [n, m],
                    "manifold": _label(n, m),
                    "name": name,
                    "family": family,
                    "step_s": t.seconds,
                    "runs": t.runs,
                    "cold": t.cold,
                    "orthogonality_error": err,
                }
            )
    return rows


def _get(rows, manifold: str, name: str) -> float | None:
    for r in rows:
        if r["manifold"] == manifold and r["name"] == name:
            return r["step_s"]
    return None


def results_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for label in dict.fromkeys(r["manifold"] for r in rows):
        geo = _get(rows, label, GEO_SGD_CANON)
        rgd = _get(rows, label, RGD_E_C)
        body = [
            [
                r["name"],
                fmt_time(r["step_s"]),
                str(r["runs"]),
                fmt_ratio(ratio(geo, r["step_s"])),
                f"{ratio(r['step_s'], rgd) or float('nan'):.2f}",
                f"{r['orthogonality_error']:.1e}",
            ]
            for r in rows
            if r["manifold"] == label
        ]
        hdr = [
            "optimizer",
            "step",
            "runs",
            "geoopt canonical SGD / this",
            f"this / {RGD_E_C}",
            "‖XᵀX − I‖_F after",
        ]
        out += [label, table(hdr, body), ""]
    return "\n".join(out)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets on the first shape (St(4096, 64) by default)."""
    label = rows[0]["manifold"]
    geo = _get(rows, label, GEO_SGD_CANON)
    items = [
        (f"{label}: geoopt canonical step / {RGD_E_C}", ratio(geo, _get(rows, label, RGD_E_C))),
        (f"{label}: geoopt canonical step / {RGD_C_C}", ratio(geo, _get(rows, label, RGD_C_C))),
    ]
    out = [target(t, v, ">=", 150) for t, v in items]
    for lab in dict.fromkeys(r["manifold"] for r in rows):
        v = ratio(_get(rows, lab, RADAM_C), _get(rows, lab, RGD_E_C))
        out.append(target(f"{lab}: {RADAM_C} / {RGD_E_C}", v, "<=", 2))
    for lab in dict.fromkeys(r["manifold"] for r in rows):  # issue 16
        v = ratio(_get(rows, lab, RGD_E_QR), _get(rows, lab, GEO_SGD_EUCL))
        out.append(target(f"{lab}: {RGD_E_QR} / {GEO_SGD_EUCL}", v, "<=", 1))
    return out


def _shapes(text: str) -> list[tuple[int, int]]:
    return [parse_shape(item) for item in text.split(",")]


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (for tests)")
    p.add_argument(
        "--shapes", type=_shapes, default=None, help="NxM,... (default 4096x64,1024x256,512x512)"
    )
    p.add_argument("--repeats", type=int, default=None, help="most timed steps per measurement")
    p.add_argument("--budget", type=float, default=None, help="seconds per measurement (default 2)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--verbose", action="store_true", help="print progress")
    p.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time, or the CPU time of one thread (sets 1 thread; for a shared machine)",
    )
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = p.parse_args(argv)
    device = device_of(args.device, p)
    if args.clock == "thread" and device.type != "cpu":
        p.error(f"--clock thread with --device {args.device}: allowed with --device cpu only")
    clock = "thread" if args.clock == "thread" else None
    if clock:
        torch.set_num_threads(1)  # Note [Thread CPU time on a shared machine]
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    repeats = args.repeats or (3 if args.quick else 20)
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 2.0)
    torch.manual_seed(0)

    rows = run(shapes, repeats, budget, args.verbose, clock, device)
    tg = targets(rows)
    text = "\n".join(
        [
            header(
                "One optimizer step (opt.step() with a fixed gradient)", device, peers=("geoopt",)
            ),
            f"up to {repeats} steps, {budget:g} s per measurement, lr = {LR:g}, "
            f"clock: {'CPU time of the one thread' if clock else 'wall'}",
            "",
            results_table(rows),
            "Targets (issues 4 and 16)",
            targets_table(tg),
        ]
    )
    print(text)
    if args.json:
        write_json(
            args.json,
            {
                "config": {
                    "shapes": [list(s) for s in shapes],
                    "repeats": repeats,
                    "budget_s": budget,
                    "lr": LR,
                    "clock": args.clock,
                    "device": str(device),
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                },
                "results": rows,
                "targets": tg,
            },
        )
    return text


if __name__ == "__main__":
    main()

"""``torch.compile(fullgraph=True)`` against eager: every map's forward+backward, every step.

Run ``python -m benchmarks.compiled`` (``--quick`` for a short run, ``--json PATH``
to keep the numbers, ``--device cuda`` on a GPU). For every registered map
(`stiefel.parametrizations.maps`) on an n×n float32 weight (``--n``, default
256; 1024 for the issue's size) the timed call is one forward and backward,
``(map(X) * C).sum().backward()``; for every registered Riemannian optimizer
(`stiefel.optimizers.available`) it is one ``opt.step()`` with a fixed gradient
on St(N, M) (``--shape``, default 4096x64; ``--batch B`` steps B such matrices at
once, the batched regime of ``benchmarks.batched``). Each is run eagerly and compiled
with ``torch.compile(fn, fullgraph=True, backend=...)`` (default Inductor, in
``--mode`` when given, e.g. ``reduce-overhead`` for CUDA graphs; a
graph break raises), in the same run, from the same start. The table gives both
times, compiled / eager (< 1: the compiled call is faster), the first compiled
call (tracing and code generation) and the largest difference between the two
results after the same calls (the gradient of a map, the point after two steps),
which should be rounding. geoopt's optimizers (``geoopt_rsgd``, ``geoopt_radam``)
are left out unless named in ``--optimizers``: they compile, but Dynamo traces
their step to a different result (DESIGN.md, Clarification on torch.compile;
0.1 after one step, tests/test_compile.py) and ``geoopt_radam`` recompiles at
every call. Timings on a shared machine are noisy: compare
ratios measured in the same run only.

Example:

```text
python -m benchmarks.compiled --quick --backend aot_eager
python -m benchmarks.compiled --n 1024 --json /tmp/compiled.json
```
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import geoopt
import torch

from stiefel import optimizers
from stiefel.comparisons import cost
from stiefel.manifolds import Stiefel
from stiefel.parametrizations import build, maps

from ._timing import device_of, fmt_ratio, fmt_time, header, measure, parse_shape, table, write_json

N = 256
SHAPE = (4096, 64)
QUICK_N = 8
QUICK_SHAPE = (32, 4)


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compile(fn: Callable, options: dict) -> Callable:
    """``torch.compile(fn, fullgraph=True, **options)``: a graph break raises."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, **options)


def _row(kind, name, size, eager, compiled, first, diff) -> dict[str, Any]:
    return {
        "kind": kind,
        "name": name,
        "size": size,
        "eager_s": eager.seconds,
        "compiled_s": compiled.seconds,
        "ratio": compiled.seconds / eager.seconds,
        "first_compiled_call_s": first,
        "max_abs_diff": diff,
    }


def map_rows(n: int, device, options: dict, repeats: int, budget: float, names=None) -> list[dict]:
    """compiled / eager time of one forward+backward of every registered map on n×n."""
    rows = []
    for name in names or maps():
        gen = torch.Generator().manual_seed(0)
        fmap = build(name, (n, n), torch.float32, device)
        start = fmap.initial(torch.randn(n, n, generator=gen), "haar", gen).to(device).detach()
        c = torch.randn(n, n, generator=gen).to(device)

        def loss(x, fmap=fmap, c=c):
            return (fmap(x) * c).sum()

        def run(fn, x):
            x.grad = None
            fn(x).backward()
            return x.grad

        compiled = _compile(loss, options)
        xe, xc = start.clone().requires_grad_(), start.clone().requires_grad_()
        first = cost.timed(lambda xc=xc, compiled=compiled: run(compiled, xc))
        diff = float((run(loss, xe) - run(compiled, xc)).abs().max())
        t_eager = measure(lambda xe=xe, loss=loss: run(loss, xe), repeats, budget)
        t_comp = measure(lambda xc=xc, compiled=compiled: run(compiled, xc), repeats, budget)
        rows.append(_row("map fwd+bwd", name, f"{n}x{n}", t_eager, t_comp, first, diff))
        _progress(rows[-1])
    return rows


def _progress(row: dict) -> None:
    """One line per row as it is measured: a run stopped early keeps them."""
    print(f"  {row['kind']} {row['name']}: compiled / eager {fmt_ratio(row['ratio'])}", flush=True)


def _riemannian() -> list[str]:
    """Registered Riemannian optimizers, geoopt's left out (Dynamo traces them wrong)."""
    names = optimizers.available()
    return [n for n in names if optimizers.info(n).riemannian and not n.startswith("geoopt")]


def step_rows(
    shape, device, options: dict, repeats: int, budget: float, names=None, batch: int = 1
) -> list[dict]:
    """compiled / eager time of one step of every registered Riemannian optimizer on
    St(N, M), or on a batch of ``batch`` > 1 such matrices."""
    n, m = shape
    man = Stiefel(n, m)
    lead = (batch,) if batch > 1 else ()
    gen = torch.Generator().manual_seed(1)
    start = torch.linalg.qr(torch.randn(*lead, n, m, generator=gen, dtype=torch.float64))[0]
    start, grad = start.float().to(device), torch.randn(*lead, n, m, generator=gen).to(device)
    size = f"{batch} × St({n}, {m})" if batch > 1 else f"St({n}, {m})"
    rows = []
    for name in names or _riemannian():

        def make(name=name):
            p = geoopt.ManifoldParameter(start.clone(), manifold=man)
            p.grad = grad.clone()
            lr = optimizers.info(name).default_lr
            return p, optimizers.create(name, [p], lr=lr)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            pe, eager = make()
            pc, opt = make()
            compiled = _compile(opt.step, options)
            first = cost.timed(compiled)
            eager.step()
            eager.step()
            compiled()
            diff = float((pe - pc).detach().abs().max())
            t_eager = measure(eager.step, repeats, budget)
            t_comp = measure(compiled, repeats, budget)
        rows.append(_row("step", name, size, t_eager, t_comp, first, diff))
        _progress(rows[-1])
    return rows


def _names(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def results_table(rows: list[dict]) -> str:
    body = [
        [
            r["kind"],
            r["name"],
            r["size"],
            fmt_time(r["eager_s"]),
            fmt_time(r["compiled_s"]),
            fmt_ratio(r["ratio"]),
            f"{r['first_compiled_call_s']:.1f} s",
            f"{r['max_abs_diff']:.1e}",
        ]
        for r in rows
    ]
    heads = ["", "name", "size", "eager", "compiled", "compiled / eager", "first call", "max |Δ|"]
    return table(heads, body)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (for tests)")
    p.add_argument("--n", type=int, default=None, help=f"maps: n×n weights (default {N})")
    p.add_argument("--shape", type=parse_shape, default=None, help="steps: St(N, M) as NxM")
    p.add_argument("--batch", type=int, default=1, help="steps: this many matrices at once (1)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor)")
    p.add_argument("--mode", choices=MODES, default=None, help="Inductor's mode (its default)")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--repeats", type=int, default=None, help="most timed calls per measurement")
    p.add_argument("--budget", type=float, default=None, help="seconds per measurement (2)")
    p.add_argument("--maps", type=_names, default=None, help="a,b,...: these maps only")
    p.add_argument("--optimizers", type=_names, default=None, help="a,b,...: these only")
    p.add_argument("--skip-maps", action="store_true", help="time the steps only")
    p.add_argument("--skip-steps", action="store_true", help="time the maps only")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    device = device_of(args.device, p)
    if args.batch < 1:
        p.error(f"--batch {args.batch}: allowed: a positive integer")
    if args.mode is not None and args.backend != "inductor":
        p.error(f"--mode {args.mode}: allowed with --backend inductor only")
    options = {"backend": args.backend} | ({} if args.mode is None else {"mode": args.mode})
    n = args.n or (QUICK_N if args.quick else N)
    shape = args.shape or (QUICK_SHAPE if args.quick else SHAPE)
    repeats = args.repeats or (2 if args.quick else 20)
    budget = args.budget if args.budget is not None else (0.0 if args.quick else 2.0)
    rows = []
    if not args.skip_maps:
        rows += map_rows(n, device, options, repeats, budget, args.maps)
    if not args.skip_steps:
        rows += step_rows(shape, device, options, repeats, budget, args.optimizers, args.batch)
    title = f"torch.compile(fullgraph=True, {', '.join(f'{k}={v!r}' for k, v in options.items())})"
    title += " against eager"
    text = "\n".join(
        [
            header(title, device),
            f"device {device}, up to {repeats} calls, {budget:g} s per measurement",
            "",
            results_table(rows),
        ]
    )
    print(text)
    if args.json:
        config = {"n": n, "shape": list(shape), "batch": args.batch, "backend": args.backend,
                  "mode": args.mode,
                  "device": str(device),
                  "repeats": repeats, "budget_s": budget, "threads": torch.get_num_threads(),
                  "torch": torch.__version__}  # fmt: skip
        write_json(args.json, {"config": config, "results": rows})
    return text


if __name__ == "__main__":
    main()

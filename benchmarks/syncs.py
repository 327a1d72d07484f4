"""Host synchronisations per call: every map's forward+backward and every optimizer's step.

Run ``python -m benchmarks.syncs`` (``--device cuda`` on a GPU). Every registered
map (``stiefel.parametrizations.maps()``) and every registered optimizer
(``stiefel.optimizers.available()``) is run twice to warm up (as
``benchmarks.launch`` does: a step sizes its short paths by the last one), then once
under launch's `StepCounter` and once under ``torch.profiler``; the table counts, per
call:

- ``reads``: host reads of a tensor's value, counted as ``benchmarks.launch``
  counts them (its `StepCounter`: ``.item()``, ``float(t)``, ``bool(t)``,
  ``if t:``, ``torch.equal``, ``.tolist()``, a copy from CUDA to the CPU; an
  optimizer's CPU step counter is not counted); on a GPU each one waits for
  every queued kernel, and under ``torch.compile`` each one breaks the graph;
- ``D→H`` / ``H→D``: device-to-host and host-to-device copies (on CUDA: a
  result read back, or an operation that ran on the CPU);
- ``sync``: explicit stream or device synchronisations.

Maps run on an n×n weight (``--n``, default 256); optimizers on St(N, M)
(``--stiefel``, default 4096x64) with a fixed random gradient; ``--quick``: n = 16
and St(64, 8). A step of this package's optimizers reads once (the flags of every
parameter together, Note [One host read per step] in ``stiefel.optimizers.engine``),
with ``capturable=True`` not at all; torch's optimizers read nothing.

Example:

```text
python -m benchmarks.syncs --n 64 --stiefel 256x16
python -m benchmarks.syncs --device cuda
```
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

import geoopt
import torch
from torch.profiler import ProfilerActivity, profile

from stiefel import optimizers
from stiefel.manifolds import Stiefel
from stiefel.parametrizations import maps, orthogonalize

from ._timing import device_of, header, parse_shape, table
from .launch import StepCounter

#: the profiler's events counted per call (the host reads are `StepCounter`'s)
PROFILED = {
    "D→H": ("Memcpy DtoH",),
    "H→D": ("Memcpy HtoD",),
    "sync": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}
#: the table's columns
COUNTED = ("reads", *PROFILED)


def counts(
    fn: Callable[[], object], device: torch.device, opt: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """The host reads and each `PROFILED` event of one call ``fn()``, after two warm-up calls.

    The reads are counted by ``benchmarks.launch``'s `StepCounter` (``opt``: the
    optimizer whose CPU step counters are not counted), the rest by the profiler in a
    further call, less what it records around an empty call (its own stream
    synchronisation on CUDA).
    """
    fn()
    fn()
    with StepCounter(opt) as counter:
        fn()
    seen = _profiled(fn, device)
    empty = _profiled(lambda: None, device)
    return {"reads": counter.reads} | {k: max(seen[k] - empty[k], 0) for k in PROFILED}


def _profiled(fn: Callable[[], object], device: torch.device) -> collections.Counter[str]:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seen: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        for key, names in PROFILED.items():
            if any(event.name.startswith(name) for name in names):
                seen[key] += 1
    return seen


Call = tuple[Callable[[], object], torch.optim.Optimizer | None]


def map_call(name: str, n: int, device: torch.device) -> Call:
    """Forward+backward of map ``name`` on an n×n float32 weight (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(0)
    w = orthogonalize(torch.randn(n, n, generator=gen), method=name).to(device)

    def call() -> None:
        w.zero_grad(set_to_none=True)
        w().sum().backward()

    return call, None


def step_call(name: str, shape: tuple[int, int], device: torch.device) -> Call:
    """One ``step()`` of optimizer ``name`` (defaults, lr 1e-3) on St(N, M), fixed gradient."""
    gen = torch.Generator().manual_seed(0)
    manifold = Stiefel(*shape)
    x0 = manifold.random(dtype=torch.float32, generator=gen).to(device)
    p = geoopt.ManifoldParameter(x0, manifold=manifold)
    opt = optimizers.create(name, [p], lr=1e-3)
    p.grad = torch.randn(shape, generator=gen).to(device) * 1e-2
    return opt.step, opt


def rows(n: int, shape: tuple[int, int], device: torch.device) -> list[list[Any]]:
    out = []
    cases = [(f"map {m}", lambda m=m: map_call(m, n, device)) for m in maps()]
    cases += [
        (f"step {o}", lambda o=o: step_call(o, shape, device)) for o in optimizers.available()
    ]
    for label, build in cases:
        try:
            fn, opt = build()
            c = counts(fn, device, opt)
            out.append([label] + [str(c[k]) for k in COUNTED] + [""])
        except Exception as err:  # a row says why it could not run; the others go on
            out.append([label] + ["—"] * len(COUNTED) + [f"{type(err).__name__}: {err}"[:120]])
    return out


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="n = 16 and St(64, 8) (a smoke run)")
    p.add_argument("--n", type=int, default=None, help="maps: n×n weight (default 256)")
    p.add_argument("--stiefel", type=parse_shape, default=None, help="steps: St(N, M) (4096x64)")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = p.parse_args(argv)
    n = args.n if args.n is not None else (16 if args.quick else 256)
    shape = tuple(args.stiefel or ((64, 8) if args.quick else (4096, 64)))
    if n < 1:
        p.error(f"--n {n}: allowed: a positive integer")
    device = device_of(args.device, p)
    body = rows(n, shape, device)
    text = "\n".join(
        [
            header("Host synchronisations per call", device, peers=("geoopt",)),
            f"maps: forward+backward on {n}×{n}; steps: St{shape}",
            "",
            table(["call"] + list(COUNTED) + ["error"], body),
        ]
    )
    print(text)
    return text


if __name__ == "__main__":
    main()

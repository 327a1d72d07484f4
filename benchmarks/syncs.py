"""Host synchronisations per call: every map's forward+backward and every optimizer's step.

Run ``python -m benchmarks.syncs`` (``--device cuda`` on a GPU). Every registered
map (``stiefel.parametrizations.maps()``) and every registered optimizer
(``stiefel.optimizers.available()``) is run once to warm up, then once under
``torch.profiler``; the table counts, for that one call:

- ``item``: ``aten::_local_scalar_dense``, a tensor read on the host
  (``.item()``, ``float(t)``, ``bool(t)``, ``if t:``); on a GPU each one waits
  for every queued kernel, and under ``torch.compile`` each one breaks the graph;
- ``D→H`` / ``H→D``: device-to-host and host-to-device copies (on CUDA: a
  result read back, or an operation that ran on the CPU);
- ``sync``: explicit stream or device synchronisations.

Maps run on an n×n weight (``--n``, default 256); optimizers on St(N, M)
(``--stiefel``, default 4096x64) with a fixed random gradient. The default path
of every map and step should read nothing on the host (DESIGN, "Performance").

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

COUNTED = {
    "item": ("aten::_local_scalar_dense",),
    "D→H": ("Memcpy DtoH",),
    "H→D": ("Memcpy HtoD",),
    "sync": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
}


def counts(fn: Callable[[], object], device: torch.device) -> dict[str, int]:
    """How many of each `COUNTED` event one call ``fn()`` makes (after one warm-up call).

    What the profiler itself records around an empty call (its own stream
    synchronisation on CUDA) is subtracted.
    """
    seen = _profiled(fn, device)
    empty = _profiled(lambda: None, device)
    return {key: max(seen[key] - empty[key], 0) for key in COUNTED}


def _profiled(fn: Callable[[], object], device: torch.device) -> collections.Counter[str]:
    fn()
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
        for key, names in COUNTED.items():
            if any(event.name.startswith(name) for name in names):
                seen[key] += 1
    return seen


def map_call(name: str, n: int, device: torch.device) -> Callable[[], object]:
    """Forward+backward of map ``name`` on an n×n float32 weight (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(0)
    w = orthogonalize(torch.randn(n, n, generator=gen), method=name).to(device)

    def call() -> None:
        w.zero_grad(set_to_none=True)
        w().sum().backward()

    return call


def step_call(name: str, shape: tuple[int, int], device: torch.device) -> Callable[[], object]:
    """One ``step()`` of optimizer ``name`` (defaults, lr 1e-3) on St(N, M), fixed gradient."""
    gen = torch.Generator().manual_seed(0)
    manifold = Stiefel(*shape)
    x0 = manifold.random(dtype=torch.float32, generator=gen).to(device)
    p = geoopt.ManifoldParameter(x0, manifold=manifold)
    opt = optimizers.create(name, [p], lr=1e-3)
    p.grad = torch.randn(shape, generator=gen).to(device) * 1e-2
    return opt.step


def rows(n: int, shape: tuple[int, int], device: torch.device) -> list[list[Any]]:
    out = []
    cases = [(f"map {m}", lambda m=m: map_call(m, n, device)) for m in maps()]
    cases += [
        (f"step {o}", lambda o=o: step_call(o, shape, device)) for o in optimizers.available()
    ]
    for label, build in cases:
        try:
            c = counts(build(), device)
            out.append([label] + [str(c[k]) for k in COUNTED] + [""])
        except Exception as err:  # a row says why it could not run; the others go on
            out.append([label] + ["—"] * len(COUNTED) + [f"{type(err).__name__}: {err}"[:120]])
    return out


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256, help="maps: n×n weight (default 256)")
    p.add_argument("--stiefel", type=parse_shape, default=(4096, 64), help="steps: St(N, M)")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n {args.n}: allowed: a positive integer")
    device = device_of(args.device, p)
    body = rows(args.n, tuple(args.stiefel), device)
    text = "\n".join(
        [
            header("Host synchronisations per call", device),
            f"maps: forward+backward on {args.n}×{args.n}; steps: St{tuple(args.stiefel)}",
            "",
            table(["call"] + list(COUNTED) + ["error"], body),
        ]
    )
    print(text)
    return text


if __name__ == "__main__":
    main()

"""bfloat16 against float32: map forward+backward and Riemannian optimizer steps.

For every registered map (`stiefel.parametrizations.maps()`), the forward and
backward of the weight of ``orthogonalize(nn.Linear(n, n), method=...)``
(loss ⟨C, W⟩) with the module in float32 and in bfloat16 (the map computes in
float32 either way, Note [Maps compute in float32 or wider], so bfloat16 adds
the casts); for every Riemannian optimizer of the registry
(`stiefel.optimizers.info(name).riemannian`) and each of its declared
variants, one ``opt.step()`` on an n×n manifold parameter (O(n)) in float32 and
in bfloat16 (the optimizer steps a float32 master copy and stores its rounding
in the parameter). Printed: median times and the ratio bf16 / float32 (> 1:
bfloat16 slower), and the orthogonality error of the bfloat16 result. On a
CPU bfloat16 brings no faster products, so ratios ≥ 1 are expected; timings
on a shared machine are noisy.

Run: ``python -m benchmarks.precision`` (n = 1024) or ``--quick`` (n = 32);
``--device cuda`` on a GPU, where bfloat16 products are faster.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import geoopt
import torch
from torch import nn

from stiefel import optimizers
from stiefel.manifolds import Orthogonal, kernels
from stiefel.parametrizations import maps, orthogonalize

from ._timing import device_of, fmt_ratio, fmt_time, header, measure, ratio, table

__all__ = ["main", "map_time", "step_time", "riemannian_optimizers"]

LOW = torch.bfloat16


def riemannian_optimizers() -> list[tuple[str, dict]]:
    """(name, hyper-parameters) of every Riemannian optimizer variant in the registry."""
    out = []
    for name in optimizers.available():
        info = optimizers.info(name)
        if info.riemannian:
            out += [(name, dict(v)) for v in info.variants]
    return out


def _label(name: str, hyper: dict) -> str:
    return name + (f"({', '.join(f'{k}={v}' for k, v in hyper.items())})" if hyper else "")


def _error(w: torch.Tensor) -> float:
    return float(kernels.orthogonality_error(w.detach().double()).max())


def map_time(method: str, n: int, dtype: torch.dtype, repeats: int, budget: float, device="cpu"):
    """(median seconds of forward + backward of the map's weight, error of the weight)."""
    torch.manual_seed(0)
    lin = orthogonalize(nn.Linear(n, n, bias=False), method=method).to(device, dtype)
    c = torch.randn(n, n).to(device, dtype)

    def step() -> None:
        lin.zero_grad(set_to_none=True)
        (lin.weight * c).sum().backward()

    return measure(step, repeats, budget).seconds, _error(lin.weight)


def step_time(
    name: str, hyper: dict, n: int, dtype: torch.dtype, repeats: int, budget: float, device="cpu"
):
    """(median seconds of one ``opt.step()`` on an O(n) parameter of ``dtype``, its error)."""
    gen = torch.Generator().manual_seed(0)
    manifold = Orthogonal(n)
    x = manifold.random(dtype=torch.float32, generator=gen).as_subclass(torch.Tensor)
    w = geoopt.ManifoldParameter(x.to(device, dtype), manifold=manifold)
    w.grad = (1e-2 * torch.randn(n, n, generator=gen)).to(device, dtype)
    lr = optimizers.info(name).default_lr
    opt = optimizers.create(name, [w], lr=lr, **hyper)
    return measure(opt.step, repeats, budget).seconds, _error(w)


def _row(label: str, timed) -> dict:
    out: dict = {"name": label}
    for key, dtype in (("float32", torch.float32), ("bfloat16", LOW)):
        try:
            out[key], out[f"{key}_error"] = timed(dtype)
        except (RuntimeError, TypeError, ValueError) as err:  # reported in the table
            out[key], out[f"{key}_error"] = None, f"{type(err).__name__}: {err}"
    out["ratio"] = ratio(out["bfloat16"], out["float32"])
    return out


def _table(rows: list[dict], first: str) -> str:
    body = []
    for r in rows:
        err = r["bfloat16_error"]
        err = f"{err:.2e}" if isinstance(err, float) else f"failed: {err}"
        body.append(
            [r["name"], fmt_time(r["float32"]), fmt_time(r["bfloat16"]), fmt_ratio(r["ratio"]), err]
        )
    return table([first, "float32", "bfloat16", "bf16 / float32", "‖WᵀW − I‖_F (bf16)"], body)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="n = 32, few repeats (for tests)")
    p.add_argument("--n", type=int, default=None, help="matrix size (default 1024)")
    p.add_argument("--repeats", type=int, default=None, help="most timed runs (median)")
    p.add_argument("--budget", type=float, default=None, help="seconds per measurement")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the rows here")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = p.parse_args(argv)
    device = device_of(args.device, p)
    n = args.n or (32 if args.quick else 1024)
    if n < 2:
        raise ValueError(f"--n {n}; allowed: an integer >= 2")
    repeats = args.repeats or (2 if args.quick else 7)
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 3.0)
    maps_rows = [
        _row(m, lambda dt, m=m: map_time(m, n, dt, repeats, budget, device)) for m in maps()
    ]
    opt_rows = [
        _row(
            _label(name, h),
            lambda dt, name=name, h=h: step_time(name, h, n, dt, repeats, budget, device),
        )
        for name, h in riemannian_optimizers()
    ]
    ratios = [r["ratio"] for r in maps_rows + opt_rows if r["ratio"] is not None]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    text = "\n".join(
        [
            header(f"bfloat16 against float32 at n = {n}", device),
            f"median of up to {repeats} runs, {budget:g} s per measurement; "
            "ratio = bf16 time / float32 time (> 1: bfloat16 slower)",
            "",
            f"Map forward + backward, the weight of Linear({n}, {n})",
            "",
            _table(maps_rows, "map"),
            f"One optimizer step on O({n}) (bfloat16: float32 master copy)",
            "",
            _table(opt_rows, "optimizer"),
            f"geometric mean of the ratios: {fmt_ratio(geo)}",
        ]
    )
    print(text)
    if args.json is not None:
        payload = {
            "n": n,
            "device": str(device),
            "maps": maps_rows,
            "optimizers": opt_rows,
            "geomean_ratio": geo,
        }
        args.json.write_text(json.dumps(payload, indent=1))
    return text


if __name__ == "__main__":
    main()

r"""The Cayley map's solve (I + A)X = B: elimination without pivoting against the pivoted LU.

Run from a checkout: ``python -m benchmarks.cayley_solve`` (``--quick``: small sizes;
``--device cuda`` on a GPU). For each order n it times Q·B = 2(I + A)⁻¹B − B, with
B = I (the ``cayley`` map of O(n)), forward alone and forward+backward, by

- ``unpivoted``: the elimination without pivoting of `stiefel.parametrizations._cayley`
  with its own backward: the block elimination on the CPU (Note [Elimination without
  pivoting for I + A]), torch's ``lu_factor_ex(pivot=False)`` on CUDA (Note
  [Unpivoted LU by device type]);
- ``pivoted``: ``torch.linalg.solve_ex`` (LU with partial pivoting), autograd's backward.

A is a random skew matrix with ‖A‖₁ just under the limit of the unpivoted path
(0.99·``UNPIVOTED_PER_ROOT``·√n), where its growth bound is largest. Rounds are
interleaved, median; column "used" names the path `cayley_solve` takes on this
device for that A, and the errors are max-entry distances from a float64 pivoted
solve. These are the measurements behind both Notes.
"""

from __future__ import annotations

import argparse
import math

import torch

from stiefel.parametrizations import _cayley, kernels
from stiefel.parametrizations._spectral import LazyNorm

from ._timing import device_of, fmt_ratio, fmt_time, header, interleaved, rounds_line, table

SIZES = "256,512,1024,2048,4096"


def _skew(n: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(n, n, generator=gen, device=device, dtype=torch.float64)
    a = x - x.mT
    a *= 0.99 * _cayley.UNPIVOTED_PER_ROOT * math.sqrt(n) / torch.linalg.matrix_norm(a, ord=1)
    return a.to(dtype)


ARMS = {  # name → f(a, b) = Q·B, each a path of the solve
    "unpivoted": lambda a, b: _cayley.cayley_solve(a, b, _unpivoted(a)),
    "pivoted": lambda a, b: _cayley.cayley_solve(a, b, "solve"),
}


def _unpivoted(a: torch.Tensor) -> str:
    """The elimination without pivoting of ``a``'s device (`_cayley.PATHS`)."""
    return "unpivoted_lu" if a.device.type == "cuda" else "unpivoted_blocks"


def _call(f, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None):
    """f(a, b) alone (``g`` None), or with its backward against the cotangent ``g``."""
    if g is None:
        return lambda: f(a, b)
    leaf = a.clone().requires_grad_()
    return lambda: torch.autograd.grad(f(leaf, b), leaf, g)


def run(sizes: list[int], dtype: torch.dtype, rounds: int, device: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        a = _skew(n, device, dtype, gen)
        b = torch.eye(n, dtype=dtype, device=device)
        g = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
        eye64 = torch.eye(n, dtype=torch.float64, device=device)
        ref = torch.linalg.solve(eye64 + a.double(), eye64 - a.double())
        path = kernels.cayley_path(a, LazyNorm(a))  # the dispatcher's choice here
        row: dict = {"n": n, "used": "pivoted" if path == "solve" else "unpivoted"}
        for mode in ("forward", "fwd+bwd"):
            fns = {
                name: _call(f, a, b, g if mode == "fwd+bwd" else None) for name, f in ARMS.items()
            }
            med = interleaved(fns, rounds)
            for name in fns:
                row[f"{mode} {name}"] = med[name]
        for name, f in ARMS.items():
            row[f"{name} err"] = float((f(a, b).double() - ref).abs().max())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes; 3 rounds")
    ap.add_argument("--sizes", default=SIZES, help="orders n, comma-separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    ap.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = ap.parse_args(argv)
    device = device_of(args.device, ap)
    try:
        sizes = [int(s) for s in ("160,256" if args.quick else args.sizes).split(",")]
        if min(sizes) <= _cayley.BLOCK:
            raise ValueError
    except ValueError:
        ap.error(f"--sizes={args.sizes!r}: allowed: orders above {_cayley.BLOCK}, comma-separated")
    dtype = getattr(torch, args.dtype)
    rows = run(sizes, dtype, 3 if args.quick else args.rounds, device)
    names = list(ARMS)
    title = "Cayley solve (I + A)X = B, B = I: each path / the pivoted LU"
    print(header(f"{title}, ‖A‖₁ = 0.99·{_cayley.UNPIVOTED_PER_ROOT}·√n", device, dtype))
    print(rounds_line(3 if args.quick else args.rounds, device))
    others = [m for m in names if m != "pivoted"]
    cols = ["n", "mode"] + names + [f"{m} / pivoted" for m in others]
    body = []
    for r in rows:
        for mode in ("forward", "fwd+bwd"):
            times = [r[f"{mode} {m}"] for m in names]
            ratios = [fmt_ratio(r[f"{mode} {m}"] / r[f"{mode} pivoted"]) for m in others]
            body.append([r["n"], mode] + [fmt_time(t) for t in times] + ratios)
    print(table(cols, body))
    print(
        table(
            ["n", "used here"] + [f"{m} err" for m in names],
            [[r["n"], r["used"]] + [f"{r[f'{m} err']:.1e}" for m in names] for r in rows],
        )
    )
    return rows


if __name__ == "__main__":
    main()

r"""Cayley(K) − I of skew K: Euler's product against the LU solve, batches of n×n.

Run from a checkout: ``python -m benchmarks.skew_cayley`` (``--quick``: small sizes).
For each order n (with a batch that keeps n³·batch fixed) and each ‖K‖_F = r it
times `cayley_delta` through Euler's product (the bound r given: the number of
factors that r needs in the dtype) and through the solve (no bound), in
interleaved rounds, median, and prints the ratio series / solve with both
relative errors against the float64 solve. This is the measurement behind the
device type's ``SERIES_LIMITS`` (Note [Inverse of I + K by Euler's product] in
`stiefel.manifolds.kernels.euler`): a row where the series would need more
factors than allowed, or n is above the limit, is timed through the factors it
would take all the same, marked "not used".
"""

from __future__ import annotations

import argparse

import torch

from stiefel.manifolds.kernels import euler, skew_cayley

from ._timing import device_of, fmt_ratio, fmt_time, header, interleaved, rounds_line, table


def _needed(r: float, dtype: torch.dtype) -> int:
    """Euler factors that r needs in dtype (no limit)."""
    unit, j = torch.finfo(dtype).eps / 2, 1
    while r ** (2 ** (j + 1)) > unit:
        j += 1
    return j


def run(sizes, radii, rounds: int, device: torch.device, work: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        batch = max(1, work // n**3)
        a = torch.randn(batch, n, n, generator=gen, device=device, dtype=torch.float64)
        s = (a - a.mT) / torch.linalg.matrix_norm(a - a.mT, keepdim=True)
        for r in radii:
            k64 = r * s
            k = k64.float()
            j = _needed(r, k.dtype)
            used = euler.series_factors(r, k) is not None
            ref = torch.linalg.solve(torch.eye(n, dtype=k64.dtype, device=device) + k64, -2 * k64)
            fns = {
                "series": lambda k=k, j=j: skew_cayley.euler_delta(k, j),
                "solve": lambda k=k: skew_cayley.cayley_delta(k, None),
            }
            with torch.no_grad():
                med = interleaved(fns, rounds)
                errs = {}
                for name, fn in fns.items():
                    d = fn().double()
                    errs[name] = float(
                        (torch.linalg.matrix_norm(d - ref) / torch.linalg.matrix_norm(ref)).max()
                    )
            rows.append(
                {
                    "n": n,
                    "batch": batch,
                    "r": r,
                    "factors": j,
                    "used": used,
                    "series": med["series"],
                    "solve": med["solve"],
                    "ratio": med["series"] / med["solve"],
                    "series_err": errs["series"],
                    "solve_err": errs["solve"],
                }
            )
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 16, 64; 3 rounds")
    ap.add_argument("--sizes", default="32,64,128,256,512", help="orders n, comma-separated")
    ap.add_argument("--radii", default="0.01,0.1,0.3", help="‖K‖_F values, comma-separated")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds")
    ap.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = ap.parse_args(argv)
    device = device_of(args.device, ap)
    sizes = [16, 64] if args.quick else [int(v) for v in args.sizes.split(",")]
    rounds = 3 if args.quick else args.rounds
    work = 2**18 if args.quick else 2**28  # n³·batch: 1024 × 64³ by default
    radii = [float(v) for v in args.radii.split(",")]
    rows = run(sizes, radii, rounds, device, work)
    print(header("Cayley(K) − I: Euler's product / LU solve", device))
    print(rounds_line(rounds, device))
    print(
        table(
            [
                "n",
                "batch",
                "‖K‖_F",
                "factors",
                "used",
                "series",
                "solve",
                "series / solve",
                "series err",
                "solve err",
            ],
            [
                [
                    r["n"],
                    r["batch"],
                    f"{r['r']:g}",
                    r["factors"],
                    "yes" if r["used"] else "not used",
                    fmt_time(r["series"]),
                    fmt_time(r["solve"]),
                    fmt_ratio(r["ratio"]),
                    f"{r['series_err']:.1e}",
                    f"{r['solve_err']:.1e}",
                ]
                for r in rows
            ],
        )
    )
    return rows


if __name__ == "__main__":
    main()

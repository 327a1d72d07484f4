r"""The Woodbury Cayley system: block elimination against the 2M×2M LU, per shape.

Run from a checkout: ``python -m benchmarks.woodbury`` (``--quick``: small sizes).
For each shape (a batch of St(N, M) points) it times `solve_step_system` by block
elimination (its default, with the host read of its test) and with ``lu=True``
(the 2M×2M LU), without and with a transported vector, in interleaved
rounds, median, and prints elimination / LU with both results' largest difference
from the float64 LU, relative to its largest entry. Two step lengths (``--betas``,
the largest |β| = lr·‖Pd‖_F of the batch): ½, inside both bounds of Note [Woodbury
system by block elimination], the measurement behind that Note's choice; and
1/16, where the bounds of Note [Near-identity blocks of the elimination] let
both M×M blocks take Euler's product (the column "series" names the blocks
that did, on this device type).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from stiefel.manifolds.kernels import euler, woodbury

from ._timing import device_of, fmt_ratio, fmt_time, header, interleaved, table

SHAPES = (
    (4096, 64, 16),
    (1024, 128, 32),
    (64, 512, 64),
    (1, 4096, 64),
    (1, 4096, 256),
    (1, 8192, 512),
)
QUICK = ((256, 64, 16), (1, 1024, 64))


def _data(batch: int, n: int, m: int, device) -> list[torch.Tensor]:
    """XᴴPd, XᴴX, PdᴴPd, Xᴴv, Pdᴴv in float64 for a point, a step with a part along X, and v."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(batch, *shape, generator=gen, device=device, dtype=torch.float64)

    x = torch.linalg.qr(randn(n, m))[0]
    d = randn(n, m)
    pd = d - x @ (x.mT @ d) + 0.1 * x @ randn(m, m)
    v = randn(n, m)
    return [x.mT @ pd, x.mT @ x, pd.mT @ pd, x.mT @ v, pd.mT @ v]


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max())


def _solve(data, lr, eliminate: bool):
    return woodbury.solve_step_system(*data[:3], lr, *data[3:], lu=not eliminate)


def _series(data, lr) -> str:
    """The blocks (T, S) whose bound lets them take Euler's product, as the solve decides."""
    xpd, g, pdpd = data[:3]
    bounds = woodbury.elimination_bounds(xpd, g, woodbury.norm_from_gram(pdpd), lr)
    if bounds is None:
        return "LU"
    pairs = zip("TS", bounds, strict=True)
    used = [name for name, r in pairs if euler.series_factors(r, xpd) is not None]
    return ", ".join(used) or "–"


def run(shapes, rounds: int, device: torch.device, betas=(0.5, 1 / 16)) -> list[dict]:
    rows = []
    for (batch, n, m), beta in itertools.product(shapes, betas):
        wide = _data(batch, n, m, device)
        t = woodbury.norm_from_gram(wide[2]).amax()
        lr = beta / float(t)  # |β| ≤ beta for every matrix
        for transport in (False, True):
            data64 = wide if transport else wide[:3]
            data = [a.float() for a in data64]
            ref = _solve(data64, lr, False)
            fns = {
                on: (lambda on=on, data=data, lr=lr: _solve(data, lr, on)) for on in (True, False)
            }
            with torch.no_grad():
                med = interleaved(fns, rounds)
                errs = {
                    on: max(_relative(a, b) for a, b in zip(fn(), ref, strict=True))
                    for on, fn in fns.items()
                }
            rows.append(
                {
                    "batch": batch,
                    "n": n,
                    "m": m,
                    "transport": transport,
                    "beta": beta,
                    "series": _series(data, lr),
                    "elimination": med[True],
                    "lu": med[False],
                    "ratio": med[True] / med[False],
                    "elimination_err": errs[True],
                    "lu_err": errs[False],
                }
            )
    return rows


def _betas(text: str, ap: argparse.ArgumentParser) -> tuple[float, ...]:
    try:
        betas = tuple(float(b) for b in text.split(","))
    except ValueError:
        betas = ()
    if not betas or not all(0 < b <= 4 for b in betas):
        ap.error(f"--betas: expected comma-separated numbers in (0, 4] (|β| ≤ 4), got {text!r}")
    return betas


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small shapes; 3 rounds")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds")
    ap.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    ap.add_argument(
        "--betas", default="0.5,0.0625", help="largest |β| of the batch, comma-separated, in (0, 4]"
    )
    args = ap.parse_args(argv)
    device = device_of(args.device, ap)
    betas = _betas(args.betas, ap)
    shapes = QUICK if args.quick else SHAPES
    rows = run(shapes, 3 if args.quick else args.rounds, device, betas)
    print(header("Woodbury Cayley system: block elimination / 2M×2M LU (float32)", device))
    print(
        table(
            [
                "batch",
                "St(N, M)",
                "|β|",
                "v",
                "series",
                "elimination",
                "LU",
                "elim. / LU",
                "elim. err",
                "LU err",
            ],
            [
                [
                    r["batch"],
                    f"St({r['n']}, {r['m']})",
                    f"{r['beta']:g}",
                    "yes" if r["transport"] else "no",
                    r["series"],
                    fmt_time(r["elimination"]),
                    fmt_time(r["lu"]),
                    fmt_ratio(r["ratio"]),
                    f"{r['elimination_err']:.1e}",
                    f"{r['lu_err']:.1e}",
                ]
                for r in rows
            ],
        )
    )
    return rows


if __name__ == "__main__":
    main()

r"""A·R⁻¹ of the QR step: the triangular solve against the M×M inverse and a product.

Run from a checkout: ``python -m benchmarks.right_solve`` (``--quick``: small sizes).
For each shape (``[B*]NxM``: a batch of B matrices N×M, float32, A stored by
rows or by columns) it times `torch.linalg.solve_triangular` on the right and
R⁻¹ (one solve against I) followed by a product, in interleaved rounds, median,
and prints the ratio inverse / solve with both errors against a float64 solve
(relative, max over the batch). This is the measurement behind
`kernels.factor.right_solve_by_inverse` (Note [Right triangular solves] in
`stiefel.manifolds.kernels.factor`): column "used" names the form the QR step
takes for that shape. The solve is also timed with R stored by rows, as the
square QR step takes it (Note [The square step's Cholesky factor stored by
rows]): column "R by rows / by columns".
"""

from __future__ import annotations

import argparse

import torch

from stiefel.manifolds.kernels import factor

from ._timing import device_of, fmt_ratio, fmt_time, header, interleaved, parse_shape, table

SHAPES = "65536x64,4096x64,64*1024x16,4096*64x16,1024*64x64"


def _shapes(text: str, parser: argparse.ArgumentParser) -> list[tuple[int, int, int]]:
    """``"4096*64x16,65536x64"`` → [(4096, 64, 16), (1, 65536, 64)]: a batch and NxM."""
    out = []
    for item in text.split(","):
        batch, _, shape = item.strip().rpartition("*")
        try:
            n, m = parse_shape(shape)
            b = int(batch or 1)
            if min(b, n, m) < 1:
                raise ValueError(f"shape {item!r}; allowed: positive sizes")
        except ValueError as err:
            parser.error(f"--shapes={text!r}: {err} (each shape [B*]NxM)")
        out.append((b, n, m))
    return out


def run(shapes, layouts, rounds: int, device: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for b, n, m in shapes:
        for layout in layouts:
            a = torch.randn(b, n, m, generator=gen, device=device)
            a = a if layout == "row" else a.mT.contiguous().mT
            # the R of a Cholesky-QR step: well conditioned (κ(R)² ≤ 3 on the Gram path)
            eye = torch.eye(m, device=device)
            r = torch.linalg.cholesky(a.mH @ a / n + eye, upper=True)  # by columns (LAPACK)
            ref = torch.linalg.solve_triangular(r.double(), a.double(), upper=True, left=False)
            r_rows = r.contiguous()  # the same R stored by rows
            fns = {
                "solve": lambda a=a, r=r: torch.linalg.solve_triangular(
                    r, a, upper=True, left=False
                ),
                "inverse": lambda a=a, r=r: factor.times_inverse(a, r),
                "solve_r_rows": lambda a=a, r=r_rows: torch.linalg.solve_triangular(
                    r, a, upper=True, left=False
                ),
            }
            med = interleaved(fns, rounds)
            errs = {
                name: float(
                    (
                        torch.linalg.matrix_norm(fn().double() - ref)
                        / torch.linalg.matrix_norm(ref)
                    ).max()
                )
                for name, fn in fns.items()
            }
            rows.append(
                {"batch": b, "n": n, "m": m, "layout": layout}
                | {"used": "inverse" if factor.right_solve_by_inverse(n, m) else "solve"}
                | {name: med[name] for name in fns}
                | {"ratio": med["inverse"] / med["solve"]}
                | {"r_rows_ratio": med["solve_r_rows"] / med["solve"]}
                | {f"{name}_err": errs[name] for name in fns}
            )
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes; 3 rounds")
    ap.add_argument("--shapes", default=SHAPES, help="[B*]NxM shapes, comma-separated")
    ap.add_argument("--layouts", default="row,column", help="row, column or both (how A is stored)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds")
    ap.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = ap.parse_args(argv)
    device = device_of(args.device, ap)
    shapes = _shapes("512x16,64*32x8" if args.quick else args.shapes, ap)
    layouts = [v.strip() for v in args.layouts.split(",") if v.strip()]
    if not layouts or set(layouts) - {"row", "column"}:
        ap.error(f"--layouts={args.layouts!r}: allowed: row, column (comma-separated)")
    rows = run(shapes, layouts, 3 if args.quick else args.rounds, device)
    print(header("A·R⁻¹: the M×M inverse and a product / the triangular solve", device))
    print(
        table(
            ["batch", "N", "M", "A stored by", "solve", "inverse", "inverse / solve"]
            + ["used", "solve err", "inverse err", "R by rows / by columns"],
            [
                [r["batch"], r["n"], r["m"], r["layout"] + "s", fmt_time(r["solve"])]
                + [fmt_time(r["inverse"]), fmt_ratio(r["ratio"]), r["used"]]
                + [f"{r['solve_err']:.1e}", f"{r['inverse_err']:.1e}"]
                + [fmt_ratio(r["r_rows_ratio"])]
                for r in rows
            ],
        )
    )
    return rows


if __name__ == "__main__":
    main()

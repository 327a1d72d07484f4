r"""exp map forward and forward+backward: our adjoint-Fréchet expm against torch's autograd.

Run from a checkout: ``python -m benchmarks.expm`` (``--quick``: small sizes; ``--device
cuda`` on a GPU). For each order n and each ‖A‖₁ (``--norms``, a random skew A scaled to
it) it times ``stiefel.parametrizations._expm.expm`` (handed ‖A‖₁, as the exp map
calls it) and ``torch.linalg.matrix_exp``
(forward: a Taylor polynomial of degree up to 18, chosen by norm, with squarings;
backward: a 2n×2n block exponential), forward alone (no autograd) and forward+backward,
in interleaved rounds (median), and prints the ratios ours / torch, the Padé degree,
squarings and solve our forward takes (Note [Padé degree by the dtype's unit roundoff]
and Note [The Padé solve of a skew-Hermitian A by device type] in
`stiefel.parametrizations._expm`) and both forwards' max-entry errors against a float64
``matrix_exp``.
"""

from __future__ import annotations

import argparse
import functools

import torch

from stiefel.parametrizations import kernels
from stiefel.parametrizations._expm import _plan, expm
from stiefel.parametrizations._spectral import LazyNorm

from ._timing import device_of, fmt_ratio, fmt_time, header, interleaved, rounds_line, table

NORMS = "0.3,1.5,3.5,36"


def _timed(fn, a: torch.Tensor, g: torch.Tensor | None):
    if g is None:
        return lambda: fn(a)
    leaf = a.clone().requires_grad_()
    return lambda: torch.autograd.grad(fn(leaf), leaf, g)


def run(
    sizes: list[int], norms: list[float], dtype: torch.dtype, rounds: int, device: torch.device
) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        x = torch.randn(n, n, generator=gen, device=device, dtype=torch.float64)
        skew = x - x.mT
        g = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
        for norm in norms:
            a64 = skew * (norm / torch.linalg.matrix_norm(skew, ord=1))
            a = a64.to(dtype)  # skew-Hermitian exactly: rounding keeps −aᵢⱼ = aⱼᵢ
            ref = torch.linalg.matrix_exp(a64)
            # as the exp map calls it: ‖A‖₁ read once and handed over
            read = float(torch.linalg.matrix_norm(a, ord=1).amax())
            route = kernels.exp_path(a, LazyNorm(a))  # the dispatcher's Padé solve
            ours = functools.partial(expm, skew_norm=read, cholesky=route == "pade_cholesky")
            fns = {"ours": ours, "torch": torch.linalg.matrix_exp}
            row: dict = {"n": n, "norm": norm, "plan": (*_plan(a, read), route == "pade_cholesky")}
            for mode, cot in (("forward", None), ("fwd+bwd", g)):
                med = interleaved({k: _timed(f, a, cot) for k, f in fns.items()}, rounds)
                row |= {f"{mode} {k}": med[k] for k in fns}
            for k, f in fns.items():
                row[f"{k} err"] = float((f(a).double() - ref).abs().max())
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 64; 3 rounds")
    ap.add_argument("--sizes", default="256,1024", help="orders n, comma-separated")
    ap.add_argument("--norms", default=NORMS, help="‖A‖₁ values, comma-separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = ap.parse_args(argv)
    device = device_of(args.device, ap)
    try:
        sizes = [int(v) for v in ("64" if args.quick else args.sizes).split(",")]
        norms = [float(v) for v in args.norms.split(",")]
        if min(sizes) < 1 or min(norms) <= 0:
            raise ValueError
    except ValueError:
        ap.error(
            f"--sizes={args.sizes!r} --norms={args.norms!r}: allowed: positive orders and "
            "positive norms, comma-separated"
        )
    dtype = getattr(torch, args.dtype)
    rows = run(sizes, norms, dtype, 3 if args.quick else args.rounds, device)
    print(header("exp of a skew A: our Padé expm / torch.linalg.matrix_exp", device, dtype))
    print(rounds_line(3 if args.quick else args.rounds, device))
    cols = ["n", "‖A‖₁", "degree, squarings, solve", "ours fwd", "fwd ours / torch"]
    cols += ["ours fwd+bwd", "fwd+bwd ours / torch", "ours err", "torch err"]
    body = [
        [
            r["n"],
            r["norm"],
            "{}, {}, {}".format(*r["plan"][:2], "cholesky" if r["plan"][2] else "lu"),
            fmt_time(r["forward ours"]),
        ]
        + [fmt_ratio(r["forward ours"] / r["forward torch"]), fmt_time(r["fwd+bwd ours"])]
        + [fmt_ratio(r["fwd+bwd ours"] / r["fwd+bwd torch"])]
        + [f"{r['ours err']:.1e}", f"{r['torch err']:.1e}"]
        for r in rows
    ]
    print(table(cols, body))
    return rows


if __name__ == "__main__":
    main()

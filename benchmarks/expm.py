r"""exp map forward and forward+backward: our adjoint-Fréchet expm against torch's autograd.

Run from a checkout: ``python -m benchmarks.expm`` (``--sizes 256 1024``,
``--dtype float32``). Prints, per n, the time of the forward and of
forward+backward for ``stiefel.parametrizations._expm.expm`` and for
``torch.linalg.matrix_exp`` (whose backward is a 2n×2n block exponential),
measured in the same run (best of ``--repeats``), and the ratios. Timings on a
shared machine are noisy.
"""

from __future__ import annotations

import argparse
import time

import torch

from stiefel.parametrizations._expm import expm


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(f"{'n':>6} {'fn':>18} {'fwd s':>9} {'fwd+bwd s':>10} {'(f+b)/f':>8}")
    for n in args.sizes:
        a = torch.randn(n, n, dtype=dtype, generator=torch.Generator().manual_seed(n))
        a = (a - a.mT) / (2 * n**0.5)
        g = torch.randn(n, n, dtype=dtype)
        res = {}
        for name, fn in (("stiefel expm", expm), ("torch.matrix_exp", torch.linalg.matrix_exp)):
            x = a.clone().requires_grad_()

            def fwd(fn=fn, x=x):
                with torch.no_grad():
                    fn(x)

            def fwd_bwd(fn=fn, x=x, g=g):
                torch.autograd.grad(fn(x), x, g)

            tf, tfb = best(fwd, args.repeats), best(fwd_bwd, args.repeats)
            res[name] = (tf, tfb)
            print(f"{n:>6} {name:>18} {tf:>9.4f} {tfb:>10.4f} {tfb / tf:>8.2f}")
        ours, ref = res["stiefel expm"], res["torch.matrix_exp"]
        print(
            f"{n:>6} ratios: fwd+bwd ours/torch = {ours[1] / ref[1]:.2f}, "
            f"ours fwd+bwd / torch fwd = {ours[1] / ref[0]:.2f}, fwd ours/torch = "
            f"{ours[0] / ref[0]:.2f}"
        )


if __name__ == "__main__":
    main()

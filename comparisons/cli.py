"""Command line of the comparison harness: ``python -m stiefel.comparisons``."""

from __future__ import annotations

import argparse

import torch

from ..manifolds import Stiefel


def quick(args: argparse.Namespace) -> int:
    """A few Riemannian gradient steps per retraction, printing the loss and the drift."""
    torch.manual_seed(args.seed)
    n, m = 256, 16
    man = Stiefel(n, m)
    a = torch.randn(n, n, dtype=torch.float32)
    a = a @ a.T / n  # Brockett / PCA cost −tr(XᵀAX): optimum = top-m eigenvalues
    best = float(torch.linalg.eigvalsh(a.double())[-m:].sum())
    print(f"maximize tr(XᵀAX) on {man!r}, optimum {best:.4f}")
    for method in ("cayley", "qr", "polar"):
        x = man.random(dtype=torch.float32)
        for _ in range(args.steps):
            g = -2 * a @ x
            x = man.retr(x, -0.2 * man.egrad2rgrad(x, g), method=method)
        value = float(torch.trace(x.T @ a @ x))
        err = float(man.orthogonality_error(x))
        print(
            f"  {method:7s} {args.steps} steps: tr = {value:.4f} (gap {best - value:.2e}), "
            f"‖XᵀX − I‖_F = {err:.2e}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stiefel-compare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quick", help="a small run of everything, in seconds")
    q.add_argument("--steps", type=int, default=300)
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=quick)
    args = parser.parse_args(argv)
    return args.func(args)

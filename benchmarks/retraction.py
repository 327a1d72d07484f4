"""One Riemannian gradient step on St(N, M): our Cayley-SMW and QR against geoopt.

Run ``python -m benchmarks.retraction`` (``--quick`` for a short run).
Prints step times with ratios measured in the same run, then the orthogonality
drift after many random-gradient steps in float32. "stiefel cayley" and
"stiefel qr" are ``egrad2rgrad`` + ``retr`` through the manifold class (argument
checks included); "stiefel cayley_gradient_step" is the fused kernel the ``rgd``
optimizer uses (the Riemannian gradient is never formed).
"""

from __future__ import annotations

import argparse

import geoopt
import torch

from stiefel.manifolds import Stiefel, kernels

from ._timing import fmt_ratio, fmt_time, header, median_time, table

SHAPES = [(4096, 64), (1024, 16), (1024, 64), (1024, 256)]


def _steppers(n: int, m: int):
    ours = Stiefel(n, m)
    canon, eucl = geoopt.CanonicalStiefel(), geoopt.EuclideanStiefel()
    return {
        "stiefel cayley_gradient_step": lambda x, g, lr: kernels.cayley_gradient_step(x, g, lr),
        "stiefel cayley": lambda x, g, lr: ours.retr(x, -lr * ours.egrad2rgrad(x, g), "cayley"),
        "stiefel qr": lambda x, g, lr: ours.retr(x, -lr * ours.egrad2rgrad(x, g), "qr"),
        "geoopt canonical (cayley, NxN)": lambda x, g, lr: canon.retr(
            x, -lr * canon.egrad2rgrad(x, g)
        ),
        "geoopt euclidean (qr)": lambda x, g, lr: eucl.retr(x, -lr * eucl.egrad2rgrad(x, g)),
    }


def step_times(shapes, repeats: int, dtype=torch.float32) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    for n, m in shapes:
        x = Stiefel(n, m).random(dtype=dtype, generator=gen)
        g = torch.randn(n, m, dtype=dtype, generator=gen)
        row = {"shape": f"St({n}, {m})"}
        with torch.no_grad():
            for name, step in _steppers(n, m).items():
                row[name] = median_time(lambda s=step, x=x, g=g: s(x, g, 1e-3), repeats)
        results.append(row)
    return results


def drift(n: int, m: int, steps: int, lr: float = 1e-3, dtype=torch.float32) -> dict[str, float]:
    """‖XᴴX − I‖_F after ``steps`` random-gradient steps (same gradients for everyone)."""
    out = {}
    man = Stiefel(n, m)
    for name, step in _steppers(n, m).items():
        gen = torch.Generator().manual_seed(1)
        x = man.random(dtype=dtype, generator=gen)
        with torch.no_grad():
            for _ in range(steps):
                x = step(x, torch.randn(n, m, dtype=dtype, generator=gen), lr)
        out[name] = float(man.orthogonality_error(x))
    return out


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repeats and drift steps")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--drift-steps", type=int, default=None)
    args = p.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 20)
    steps = args.drift_steps or (200 if args.quick else 1000)
    torch.manual_seed(0)

    res = step_times(SHAPES, repeats)
    names = list(_steppers(2, 1))
    rows = []
    for r in res:
        fused, cay, qr = r["stiefel cayley_gradient_step"], r["stiefel cayley"], r["stiefel qr"]
        geo = r["geoopt canonical (cayley, NxN)"]
        rows.append(
            [r["shape"]]
            + [fmt_time(r[k]) for k in names]
            + [fmt_ratio(geo / fused), fmt_ratio(geo / cay), fmt_ratio(fused / qr)]
            + [fmt_ratio(cay / qr)]
        )
    out = [
        header("One RGD step", peers=("geoopt",)),
        f"median of up to {repeats} runs (wall clock) per cell",
        table(
            ["shape"]
            + names
            + [
                "geoopt canonical / our fused step",
                "geoopt canonical / our retr",
                "fused / our qr",
                "retr / our qr",
            ],
            rows,
        ),
        "",
        f"Orthogonality error ‖XᴴX − I‖_F after {steps} random-gradient steps, "
        "float32, St(1024, 64)",
    ]
    d = drift(1024, 64, steps)
    out.append(table(["method", "error"], [[k, f"{v:.2e}"] for k, v in d.items()]))
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()

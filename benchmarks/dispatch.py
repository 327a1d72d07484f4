"""Each parametrization kernel dispatcher's chosen path against its reference path.

Run from a checkout: ``python -m benchmarks.dispatch`` (``--quick``: small sizes, 3
rounds). One torch thread; for every dispatcher of `stiefel.parametrizations.kernels`
(``skew_from_raw``, ``exp_map``, ``cayley_map``) and its named workload (a random
float32 raw weight of order n, the map's forward, then forward+backward with a random
cotangent) the path the policy picks is timed against the same call under
``stiefel.dispatch.policy(reference=True)``, in interleaved rounds (median), by the
thread's CPU clock and the wall clock around the same calls (`benchmarks._timing.both_clocks`).
"ref / path" > 1 means the chosen path is faster. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch

from stiefel import dispatch
from stiefel.parametrizations import _cayley
from stiefel.parametrizations import kernels as K
from stiefel.parametrizations._spectral import LazyNorm

from ._timing import both_clocks, fmt_ratio, fmt_time, header, table

SIZES = (64, 256, 1024)


def _raw(n: int, norm1: float, gen: torch.Generator, batch: tuple[int, ...] = ()):
    """A float32 raw weight whose skew part A has ‖A‖₁ = norm1 (max over the batch)."""
    x = torch.triu(torch.randn(*batch, n, n, generator=gen), 1)
    a = x - x.mT
    return x * (norm1 / float(torch.linalg.matrix_norm(a, ord=1).amax()))


def workloads(sizes: tuple[int, ...], gen: torch.Generator) -> list[tuple[str, str, Callable]]:
    """(dispatcher, workload, make) with make() -> (op, raw, chosen path)."""
    out = []
    for n in sizes:
        for batch in ((), (8,)) if n <= 256 else ((),):
            shape = "×".join(map(str, (*batch, n, n)))

            def skew(n=n, batch=batch):
                raw = torch.randn(*batch, n, n, generator=gen)
                return K.skew_from_raw, raw, K.skew_from_raw_path(raw)

            def exp(n=n, batch=batch):
                raw = _raw(n, 1.5, gen, batch)
                base = torch.eye(n)
                a = K.skew_from_raw(raw)
                op = lambda r: K.exp_map(K.skew_from_raw(r), base)  # noqa: E731
                return op, raw, K.exp_path(a, LazyNorm(a))

            def cayley(n=n, batch=batch):  # ‖A‖₁ just within the unpivoted range
                raw = _raw(n, 0.99 * _cayley.UNPIVOTED_PER_ROOT * math.sqrt(n), gen, batch)
                a = K.skew_from_raw(raw)
                op = lambda r: K.cayley_map(K.skew_from_raw(r))  # noqa: E731
                return op, raw, K.cayley_path(a, LazyNorm(a))

            out += [
                ("skew_from_raw", f"{shape} raw", skew),
                ("exp_map", f"{shape}, ‖A‖₁ = 1.5", exp),
                ("cayley_map", f"{shape}, ‖A‖₁ = 0.99·4√n", cayley),
            ]
    return out


def _forward_backward(op: Callable, raw: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    leaf = raw.clone().requires_grad_()
    return lambda: torch.autograd.grad((op(leaf) * w).sum(), leaf)


def measure(op: Callable, raw: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median thread and wall seconds of the chosen path and the reference, interleaved."""
    w = torch.randn(raw.shape)
    calls: dict[tuple[str, str], Callable[[], object]] = {
        ("path", "forward"): lambda: op(raw),
        ("path", "fwd+bwd"): _forward_backward(op, raw, w),
    }
    calls[("reference", "forward")] = calls[("path", "forward")]
    calls[("reference", "fwd+bwd")] = calls[("path", "fwd+bwd")]
    times: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in calls}
    for r in range(rounds + 1):  # the first round warms up
        for key, fn in calls.items():
            with dispatch.policy(reference=key[0] == "reference"):
                t = both_clocks(fn)
            if r:
                times[key].append(t)
    out = {}
    for (arm, mode), ts in times.items():
        out[f"{mode} {arm}"] = statistics.median(t for t, _ in ts)
        out[f"{mode} {arm} wall"] = statistics.median(w for _, w in ts)
    return out


def run(sizes: tuple[int, ...], rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, workload, make in workloads(sizes, gen):
        op, raw, path = make()
        reference = dispatch.dispatchers()[name].reference
        row = {"dispatcher": name, "workload": workload, "path": path, "reference": reference}
        if path != reference:
            row |= measure(op, raw, rounds)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 32, 160; 3 rounds")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="orders n, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (5)")
    args = ap.parse_args(argv)
    try:
        sizes = tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        ap.error(f"--sizes={args.sizes!r} is not allowed; allowed: comma-separated ints")
    if any(n < 2 for n in sizes):
        ap.error(f"--sizes={args.sizes!r} is not allowed; allowed: ints >= 2")
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds} is not allowed; allowed: an int >= 1")
    if args.quick:
        sizes, args.rounds = (32, 160), 3
    torch.set_num_threads(1)
    rows = run(sizes, args.rounds)
    print(header("Kernel dispatchers, chosen path against the reference path"))
    print(f"{args.rounds} interleaved rounds, median; thread CPU time (wall in brackets)")
    body = []
    for r in rows:
        cells = [r["dispatcher"], r["workload"], r["path"], r["reference"]]
        if r["path"] == r["reference"]:
            body.append([*cells, "—", "—", "—", "—"])
            continue
        for mode in ("forward", "fwd+bwd"):
            p, ref = r[f"{mode} path"], r[f"{mode} reference"]
            cells.append(f"{fmt_time(p).strip()} ({fmt_time(r[f'{mode} path wall']).strip()})")
            cells.append(fmt_ratio(ref / p if p > 0 else None))
        body.append(cells)
    cols = ["dispatcher", "workload", "path", "reference", "fwd", "ref / path", "fwd+bwd"]
    print(table([*cols, "ref / path"], body))
    return rows


if __name__ == "__main__":
    main()

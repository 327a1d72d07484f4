"""CWY against sequential Householder reflections: the CWY paper's Table 4 claim.

Run ``python -m benchmarks.cwy`` (``--device cuda`` on a GPU, ``--quick`` for
tiny sizes, ``--json PATH`` to keep the numbers). For each n in ``--sizes``
(default 1024, 2048, 4096, 8192) and L in n/8, n/2, n, float32, it times the
forward and the forward+backward of Q = H(v₁)⋯H(v_L) (``W().sum().backward()``)
computed four ways from the same reflections:

- ``cwy``: the compact WY form I − U S⁻¹ Uᵀ (one triangular solve, GEMMs);
- ``householder, block 1``: the reflections applied one after another, the
  explicit Householder series (HR) the CWY paper compares against in its Table 4
  (about 20× slower than CWY on a TPU in training time);
- ``householder`` with its default block: our oRNN map, reflections applied by
  blocks (the default way ``method="householder"`` runs);
- ``torch householder`` (``torch.nn.utils.parametrizations.orthogonal``,
  ``torch.linalg.householder_product``) at L = n, the only length it builds,
  and n ≤ 2048 (its backward takes minutes beyond).

Ratios are "this / cwy" (> 1: CWY is faster). A measurement whose first call
takes longer than ``--budget`` seconds is that call alone ("cold" in the JSON),
so the slow sequential rows at n = 8192 cost seconds, not minutes.

Example:

```text
python -m benchmarks.cwy --quick
python -m benchmarks.cwy --device cuda --sizes 1024,8192 --json /tmp/cwy.json
```
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ._maps_common import Fns, _progress, _row, _time_pair, ours, torch_map
from ._timing import device_of, fmt_ratio, fmt_time, header, ratio, table, write_json

SIZES = [1024, 2048, 4096, 8192]
QUICK_SIZES = [16, 32]
FRACTIONS = [(1, 8), (1, 2), (1, 1)]  # L = n/8, n/2, n
TORCH_HH_MAX = 2048  # its backward is O(n) sequential steps of O(n²): 85 s at n = 8192 on a GPU
PAPER_CLAIM = 20.0  # CWY paper, Table 4 (TPU): CWY ≈ 20× faster than HR

CWY, SEQUENTIAL, BLOCKED, TORCH_HH = (
    "cwy",
    "householder, block 1",
    "householder",
    "torch householder",
)


def measure_all(
    sizes: list[int], repeats: int, budget: float, device: torch.device, verbose: bool = False
) -> list[dict[str, Any]]:
    """One row per (n, L, method), every method built from the same random seed."""
    rows = []
    for n in sizes:
        for a, b in FRACTIONS:
            L = max(1, n * a // b)
            cases: list[tuple[str, Callable[[torch.Generator], Fns]]] = [
                (CWY, partial(ours, "cwy", (n, n), L, device=device)),
                (SEQUENTIAL, partial(ours, "householder", (n, n), L, device=device, block=1)),
                (BLOCKED, partial(ours, "householder", (n, n), L, device=device)),
            ]
            if L == n and n <= TORCH_HH_MAX:
                cases.append((TORCH_HH, partial(torch_map, "householder", (n, n), device=device)))
            for name, build in cases:
                _progress(verbose, f"n={n} L={L} {name}")
                fwd, bwd = _time_pair(build(torch.Generator().manual_seed(n)), repeats, budget)
                family = "torch" if name == TORCH_HH else "ours"
                rows.append(_row("cwy", name, family, fwd, bwd, n=n, L=L))
                # one line per row as it is measured: a run stopped early keeps them
                print(
                    f"  n={n} L={L} {name}: {fmt_time(rows[-1]['fwd_s'])} fwd, "
                    f"{fmt_time(rows[-1]['fwd_bwd_s'])} fwd+bwd",
                    flush=True,
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def cwy_table(rows: list[dict[str, Any]]) -> str:
    """Times and "this / cwy" ratios, one block of rows per (n, L)."""
    body = []
    for key in sorted({(r["n"], r["L"]) for r in rows}):
        at = [r for r in rows if (r["n"], r["L"]) == key]
        base = next(r for r in at if r["name"] == CWY)
        for r in at:
            body.append(
                [
                    str(key[0]),
                    str(key[1]),
                    r["name"],
                    fmt_time(r["fwd_s"]),
                    fmt_time(r["fwd_bwd_s"]),
                    fmt_ratio(ratio(r["fwd_s"], base["fwd_s"])),
                    fmt_ratio(ratio(r["fwd_bwd_s"], base["fwd_bwd_s"])),
                ]
            )
    hdr = ["n", "L", "method", "fwd", "fwd+bwd", "this / cwy (fwd)", "this / cwy (fwd+bwd)"]
    return table(hdr, body)


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive integers") from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive integers")
    return values


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (for tests)")
    p.add_argument("--sizes", type=_ints, default=None, help="comma-separated n (1024,...,8192)")
    p.add_argument("--repeats", type=int, default=None, help="most timed runs per measurement")
    p.add_argument("--budget", type=float, default=None, help="seconds per measurement (default 1)")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--verbose", action="store_true", help="print progress")
    args = p.parse_args(argv)
    device = device_of(args.device, p)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    repeats = args.repeats or (2 if args.quick else 10)
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 1.0)
    rows = measure_all(sizes, repeats, budget, device, args.verbose)
    top = max(sizes)
    seq = next(r for r in rows if r["n"] == top and r["L"] == top and r["name"] == SEQUENTIAL)
    cwy = next(r for r in rows if r["n"] == top and r["L"] == top and r["name"] == CWY)
    measured = ratio(seq["fwd_bwd_s"], cwy["fwd_bwd_s"])
    text = "\n".join(
        [
            header("CWY against sequential Householder reflections, O(n)", device),
            f"up to {repeats} runs, {budget:g} s per measurement; ratios: this method / cwy",
            "",
            cwy_table(rows),
            "",
            f"At n = L = {top}: sequential Householder / CWY, forward+backward = "
            f"{fmt_ratio(measured)} (the CWY paper's Table 4: about {PAPER_CLAIM:g}× on a TPU, "
            "measured in training time).",
        ]
    )
    print(text)
    if args.json:
        config = {"sizes": sizes, "repeats": repeats, "budget_s": budget}
        write_json(args.json, {"config": config, "device": str(device), "rows": rows})
    return text


if __name__ == "__main__":
    main()

"""Forward and forward+backward time of the maps onto O(n) and St(N, M), against torch and geotorch.

Run ``python -m benchmarks.maps`` (``--quick`` for a short run,
``--json PATH`` to keep the numbers). Everything is float32 and measured in the
same run:

1. O(n) for n in ``--sizes`` (default 64, 256, 1024): our ``householder`` and
   ``cwy`` with L = n/16, n/4, n reflections, our ``exp`` and ``cayley``, and
   the anchors ``torch.nn.utils.parametrizations.orthogonal`` (householder,
   matrix_exp, cayley) and ``geotorch.orthogonal`` (expm, its default, and
   cayley). "fwd" evaluates the matrix under ``torch.no_grad()``; "fwd+bwd" is
   ``W().sum().backward()``. Ratios are anchor time / our time (> 1: ours is
   faster), printed as "fwd / fwd+bwd".
2. T-CWY on St(4096, 64) against geotorch's Stiefel (``geotorch.orthogonal`` on
   a 4096×64 weight, an expm or Cayley map of a 4096×4096 skew matrix) and
   torch's householder map. geotorch's default (expm) fwd+bwd takes minutes on
   a CPU: it is measured only with ``--slow``; its cayley map is measured always.
3. An RNN rollout (T = 100, n = 1024, batch 1, L = n/8 reflections, forward +
   backward of the sum of the last state): the operator form ``W.linear(h)``
   of ``cwy`` and ``householder`` against an unconstrained RNN
   (h ← tanh(h Wᵀ + x_t) with a free W), plus two variants for reference:
   Q = W() formed once per rollout, and the operator form with U and S
   computed once per rollout from the kernels (what ``W.linear`` would cost if
   it did not recompute them at every step). Every row runs in each of
   ``--repeats`` interleaved rounds, timed on the wall and the thread CPU clock.

Every free parameter is set to random values (scale 1/√n) before timing, so
that no map runs at a special point (``matrix_exp`` of 0 is much cheaper).
The number of runs of each measurement follows its cost (``--budget`` seconds
each; a call slower than that is timed once, marked "cold" in the JSON).

Example:

```text
python -m benchmarks.maps --quick --json /tmp/maps.json
python -m benchmarks.maps --sizes 256,1024 --repeats 5
```
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from ._maps_common import Fns, _progress, _row, _time_pair, geotorch, geotorch_map, ours, torch_map
from ._rollout import rollout, rollout_table
from ._timing import (
    device_name,
    device_of,
    fmt_ratio,
    fmt_time,
    header,
    parse_shape,
    ratio,
    table,
    target,
    targets_table,
    write_json,
)

SIZES = [64, 256, 1024]
QUICK_SIZES = [16, 32]
REFLECTION_FRACTIONS = [(1, 16), (1, 4), (1, 1)]  # L = n/16, n/4, n
TCWY_SHAPE = (4096, 64)
QUICK_TCWY_SHAPE = (128, 8)
ROLLOUT = (100, 1024)  # T, n
QUICK_ROLLOUT = (5, 32)

# anchor rows of the O(n) table, and the column labels of their ratios
TORCH_HH, TORCH_EXP, TORCH_CAY = "torch householder", "torch matrix_exp", "torch cayley"
GEO_EXP, GEO_CAY = "geotorch expm (default)", "geotorch cayley"
ANCHORS = [TORCH_HH, TORCH_EXP, TORCH_CAY, GEO_EXP, GEO_CAY]


# --------------------------------------------------------------------------- sections
def square_maps(
    sizes: list[int], repeats: int, budget: float, gen, verbose: bool = False, device="cpu"
) -> list[dict[str, Any]]:
    """Rows for O(n): our maps (per L) and the torch / geotorch anchors, per n."""
    rows = []
    for n in sizes:
        shape = (n, n)
        ls = sorted({max(1, n * a // b) for a, b in REFLECTION_FRACTIONS})
        cases: list[tuple[str, str, int | None, Callable[[], Fns | None]]] = []
        for method in ("householder", "cwy"):
            for L in ls:
                cases.append(
                    (method, "ours", L, lambda m=method, L=L, s=shape: ours(m, s, L, gen, device))
                )
        for method in ("exp", "cayley"):
            cases.append(
                (method, "ours", None, lambda m=method, s=shape: ours(m, s, None, gen, device))
            )
        for name, om in (
            (TORCH_HH, "householder"),
            (TORCH_EXP, "matrix_exp"),
            (TORCH_CAY, "cayley"),
        ):
            cases.append(
                (name, "torch", None, lambda om=om, s=shape: torch_map(om, s, gen, device))
            )
        for name, triv in ((GEO_EXP, "expm"), (GEO_CAY, "cayley")):
            cases.append(
                (name, "geotorch", None, lambda t=triv, s=shape: geotorch_map(t, s, gen, device))
            )
        for name, family, L, build in cases:
            _progress(verbose, f"O({n}) {name}" + (f" L={L}" if L else ""))
            fwd, bwd = _time_pair(build(), repeats, budget)
            rows.append(_row("square", name, family, fwd, bwd, n=n, L=L))
    return rows


def square_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for n in sorted({r["n"] for r in rows}):
        at_n = [r for r in rows if r["n"] == n]
        anchors = {r["name"]: r for r in at_n if r["family"] != "ours"}
        body = []
        for r in at_n:
            cells = [r["name"], str(r["L"]) if r["L"] else "—"]
            cells += [fmt_time(r["fwd_s"]), fmt_time(r["fwd_bwd_s"])]
            for a in ANCHORS:
                ar = anchors.get(a)
                if r["family"] != "ours" or ar is None:
                    cells.append("—")
                    continue
                f = fmt_ratio(ratio(ar["fwd_s"], r["fwd_s"]))
                b = fmt_ratio(ratio(ar["fwd_bwd_s"], r["fwd_bwd_s"]))
                cells.append(f"{f} / {b}")
            body.append(cells)
        hdr = ["method", "L", "fwd", "fwd+bwd"] + [f"{a} / ours (fwd / fwd+bwd)" for a in ANCHORS]
        out += [f"O({n})", table(hdr, body), ""]
    return "\n".join(out)


def stiefel_maps(
    shape: tuple[int, int],
    repeats: int,
    budget: float,
    slow: bool,
    gen,
    verbose: bool = False,
    device="cpu",
) -> list[dict[str, Any]]:
    """Rows for St(N, M): our T-CWY against geotorch's Stiefel and torch's householder map."""
    n, m = shape
    # geotorch's expm backward on a 4096×4096 skew matrix takes minutes: opt-in beyond n=1024
    geo_exp_bwd = slow or n <= 1024
    cases: list[tuple[str, str, Callable[[], Fns | None], bool]] = [
        ("tcwy", "ours", lambda: ours("tcwy", shape, m, gen, device), True),
        ("householder", "ours", lambda: ours("householder", shape, m, gen, device), True),
        (TORCH_HH, "torch", lambda: torch_map("householder", shape, gen, device), True),
        (GEO_EXP, "geotorch", lambda: geotorch_map("expm", shape, gen, device), geo_exp_bwd),
        (GEO_CAY, "geotorch", lambda: geotorch_map("cayley", shape, gen, device), True),
    ]
    rows = []
    for name, family, build, backward in cases:
        _progress(verbose, f"St{shape} {name}")
        fwd, bwd = _time_pair(build(), repeats, budget, backward)
        rows.append(_row("stiefel", name, family, fwd, bwd, n=n, m=m, L=m))
    return rows


def stiefel_table(rows: list[dict[str, Any]]) -> str:
    ours_row = next(r for r in rows if r["name"] == "tcwy")
    body = []
    for r in rows:
        cells = [r["name"], fmt_time(r["fwd_s"]), fmt_time(r["fwd_bwd_s"])]
        cells.append(fmt_ratio(ratio(r["fwd_s"], ours_row["fwd_s"])))
        cells.append(fmt_ratio(ratio(r["fwd_bwd_s"], ours_row["fwd_bwd_s"])))
        body.append(cells)
    n, m = rows[0]["n"], rows[0]["m"]
    hdr = ["method", "fwd", "fwd+bwd", "this / tcwy (fwd)", "this / tcwy (fwd+bwd)"]
    return f"St({n}, {m}), L = {m}\n" + table(hdr, body)


# --------------------------------------------------------------------------- targets
def _find(rows, **match) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def targets(square: list[dict], stiefel: list[dict], roll: list[dict]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured ratio (None where not measured)."""
    n = max(r["n"] for r in square)
    cwy = _find(square, n=n, name="cwy", L=n) or {}
    hh = _find(square, n=n, name="householder", L=n) or {}
    t_hh = _find(square, n=n, name=TORCH_HH) or {}
    t_cay = _find(square, n=n, name=TORCH_CAY) or {}
    g_exp = _find(square, n=n, name=GEO_EXP) or {}
    tc = _find(stiefel, name="tcwy") or {}
    g_st = _find(stiefel, name=GEO_EXP) or {}
    g_st_cay = _find(stiefel, name=GEO_CAY) or {}
    cw_op = _find(roll, name="cwy step = W.operator() once per rollout") or {}
    fb = "fwd_bwd_s"
    st = f"St({stiefel[0]['n']}, {stiefel[0]['m']})" if stiefel else "St"
    st_bwd = g_st.get(fb)
    out = [
        (
            f"cwy fwd+bwd, O({n}), L=n: torch householder / cwy",
            ratio(t_hh.get(fb), cwy.get(fb)),
            ">=",
            12,
        ),
        (
            f"cwy fwd+bwd, O({n}), L=n: geotorch default / cwy",
            ratio(g_exp.get(fb), cwy.get(fb)),
            ">=",
            12,
        ),
        (
            f"cwy fwd+bwd, O({n}), L=n: cwy / torch cayley",
            ratio(cwy.get(fb), t_cay.get(fb)),
            "<=",
            1.2,
        ),
        (
            f"householder fwd+bwd, O({n}), L=n: torch householder / ours",
            ratio(t_hh.get(fb), hh.get(fb)),
            ">=",
            5,
        ),
        (
            f"T-CWY {st}: geotorch default (expm) / tcwy, "
            + ("fwd+bwd" if st_bwd is not None else "fwd (expm fwd+bwd needs --slow)"),
            ratio(st_bwd, tc.get(fb))
            if st_bwd is not None
            else ratio(g_st.get("fwd_s"), tc.get("fwd_s")),
            ">=",
            500,
        ),
        (
            f"T-CWY {st}: geotorch cayley / tcwy, fwd+bwd (cheaper than geotorch's default)",
            ratio(g_st_cay.get(fb), tc.get(fb)),
            ">=",
            500,
        ),
        (
            "rollout fwd+bwd: cwy W.operator() / unconstrained",
            ratio(cw_op.get(fb), roll[0].get(fb)),
            "<=",
            0.6,
        ),
    ]
    return [target(*row) for row in out]


# --------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (for tests)")
    p.add_argument(
        "--sizes", type=_ints, default=None, help="comma-separated n (default 64,256,1024)"
    )
    p.add_argument("--repeats", type=int, default=None, help="most timed runs per measurement")
    p.add_argument("--budget", type=float, default=None, help="seconds per measurement (default 2)")
    p.add_argument(
        "--stiefel", type=parse_shape, default=None, help="St(N, M) shape as NxM (4096x64)"
    )
    p.add_argument("--rollout", type=_ints, default=None, help="T,n of the rollout (100,1024)")
    p.add_argument("--slow", action="store_true", help="also geotorch expm fwd+bwd on St(N, M)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--verbose", action="store_true", help="print progress")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:<k>")
    args = p.parse_args(argv)
    device = device_of(args.device, p)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    repeats = args.repeats or (2 if args.quick else 10)
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 2.0)
    st_shape = args.stiefel or (QUICK_TCWY_SHAPE if args.quick else TCWY_SHAPE)
    steps, rn = args.rollout or (QUICK_ROLLOUT if args.quick else ROLLOUT)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    square = square_maps(sizes, repeats, budget, gen, args.verbose, device)
    stiefel = stiefel_maps(st_shape, repeats, budget, args.slow, gen, args.verbose, device)
    roll = rollout(steps, rn, repeats, budget, gen, args.verbose, device)
    tg = targets(square, stiefel, roll)
    text = "\n".join(
        [
            header("Maps onto O(n) and St(N, M)", device, peers=("geotorch",)),
            f"up to {repeats} runs, {budget:g} s per measurement; ratios: anchor time / our time",
            "",
            square_table(square),
            stiefel_table(stiefel),
            "",
            rollout_table(roll),
            "",
            "Targets (issue 3)",
            targets_table(tg),
        ]
    )
    if geotorch is None:
        text += "\n(geotorch is not installed: its anchors are missing; pip install geotorch)"
    print(text)
    if args.json:
        write_json(
            args.json,
            {
                "config": {
                    "sizes": sizes,
                    "repeats": repeats,
                    "budget_s": budget,
                    "stiefel": list(st_shape),
                    "rollout": [steps, rn],
                    "threads": torch.get_num_threads(),
                    "device": device_name(device),
                    "torch": torch.__version__,
                },
                "square": square,
                "stiefel": stiefel,
                "rollout": roll,
                "targets": tg,
            },
        )
    return text


if __name__ == "__main__":
    main()

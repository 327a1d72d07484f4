"""Forward and forward+backward time of the maps onto O(n) and St(N, M), against torch and geotorch.

Run ``python -m stiefel.comparisons.bench.maps`` (``--quick`` for a short run,
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
   it did not recompute them at every step).

Every free parameter is set to random values (scale 1/√n) before timing, so
that no map runs at a special point (``matrix_exp`` of 0 is much cheaper).
The number of runs of each measurement follows its cost (``--budget`` seconds
each; a call slower than that is timed once, marked "cold" in the JSON).

Example::

    python -m stiefel.comparisons.bench.maps --quick --json /tmp/maps.json
    python -m stiefel.comparisons.bench.maps --sizes 256,1024 --repeats 5
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import orthogonal as torch_orthogonal

from ...parametrizations import orthogonalize
from ._timing import (
    fmt_ratio,
    fmt_time,
    header,
    measure,
    parse_shape,
    ratio,
    table,
    target,
    targets_table,
    write_json,
)

try:  # geotorch is an optional dependency (extra [compare])
    import geotorch
except ImportError:  # pragma: no cover - exercised only without geotorch
    geotorch = None

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

Fns = tuple[Callable[[], object], Callable[[], object]]


# --------------------------------------------------------------------------- helpers
def _randomize(module: nn.Module, scale: float, gen: torch.Generator) -> None:
    """Set every parametrized original of ``module`` to scale·N(0, 1)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def _fns(module: nn.Module, get: Callable[[], torch.Tensor]) -> Fns:
    """(forward under no_grad, forward + backward of the sum) of a matrix-valued call."""

    def fwd() -> object:
        with torch.no_grad():
            return get()

    def fwd_bwd() -> object:
        module.zero_grad(set_to_none=True)
        get().sum().backward()
        return None

    return fwd, fwd_bwd


def ours(method: str, shape: tuple[int, int], reflections: int | None, gen) -> Fns:
    """Our map from ``orthogonalize(tensor, method)``, W() timed."""
    options: dict[str, Any] = {}
    if reflections is not None:
        options = {"reflections": reflections, "init": "random"}
    else:
        options = {"init": "identity"}
    w = orthogonalize(torch.randn(shape, generator=gen), method=method, generator=gen, **options)
    _randomize(w, 1 / math.sqrt(max(shape)), gen)
    return _fns(w, w)


def torch_map(orthogonal_map: str, shape: tuple[int, int], gen) -> Fns:
    """``torch.nn.utils.parametrizations.orthogonal`` on a bias-free Linear of this shape."""
    lin = nn.Linear(shape[1], shape[0], bias=False)
    torch_orthogonal(lin, orthogonal_map=orthogonal_map)
    _randomize(lin, 1 / math.sqrt(max(shape)), gen)
    return _fns(lin, lambda: lin.weight)


def geotorch_map(triv: str, shape: tuple[int, int], gen) -> Fns | None:
    """``geotorch.orthogonal(..., triv=triv)`` on a bias-free Linear (None without geotorch)."""
    if geotorch is None:
        return None
    lin = nn.Linear(shape[1], shape[0], bias=False)
    geotorch.orthogonal(lin, triv=triv)
    _randomize(lin, 1 / math.sqrt(max(shape)), gen)
    return _fns(lin, lambda: lin.weight)


def _time_pair(fns: Fns | None, repeats: int, budget: float, backward: bool = True):
    if fns is None:
        return None, None
    fwd = measure(fns[0], repeats, budget)
    bwd = measure(fns[1], repeats, budget) if backward else None
    return fwd, bwd


def _row(section: str, name: str, family: str, fwd, bwd, **extra) -> dict[str, Any]:
    return {
        "section": section,
        "name": name,
        "family": family,
        "fwd_s": None if fwd is None else fwd.seconds,
        "fwd_bwd_s": None if bwd is None else bwd.seconds,
        "fwd": None if fwd is None else fwd.as_dict(),
        "fwd_bwd": None if bwd is None else bwd.as_dict(),
        **extra,
    }


def _progress(verbose: bool, msg: str) -> None:
    if verbose:
        print(f"  … {msg}", flush=True)


# --------------------------------------------------------------------------- sections
def square_maps(
    sizes: list[int], repeats: int, budget: float, gen, verbose: bool = False
) -> list[dict[str, Any]]:
    """Rows for O(n): our maps (per L) and the torch / geotorch anchors, per n."""
    rows = []
    for n in sizes:
        shape = (n, n)
        ls = sorted({max(1, n * a // b) for a, b in REFLECTION_FRACTIONS})
        cases: list[tuple[str, str, int | None, Callable[[], Fns | None]]] = []
        for method in ("householder", "cwy"):
            for L in ls:
                cases.append((method, "ours", L, lambda m=method, L=L, s=shape: ours(m, s, L, gen)))
        for method in ("exp", "cayley"):
            cases.append((method, "ours", None, lambda m=method, s=shape: ours(m, s, None, gen)))
        for name, om in (
            (TORCH_HH, "householder"),
            (TORCH_EXP, "matrix_exp"),
            (TORCH_CAY, "cayley"),
        ):
            cases.append((name, "torch", None, lambda om=om, s=shape: torch_map(om, s, gen)))
        for name, triv in ((GEO_EXP, "expm"), (GEO_CAY, "cayley")):
            cases.append((name, "geotorch", None, lambda t=triv, s=shape: geotorch_map(t, s, gen)))
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
    shape: tuple[int, int], repeats: int, budget: float, slow: bool, gen, verbose: bool = False
) -> list[dict[str, Any]]:
    """Rows for St(N, M): our T-CWY against geotorch's Stiefel and torch's householder map."""
    n, m = shape
    # geotorch's expm backward on a 4096×4096 skew matrix takes minutes: opt-in beyond n=1024
    geo_exp_bwd = slow or n <= 1024
    cases: list[tuple[str, str, Callable[[], Fns | None], bool]] = [
        ("tcwy", "ours", lambda: ours("tcwy", shape, m, gen), True),
        ("householder", "ours", lambda: ours("householder", shape, m, gen), True),
        (TORCH_HH, "torch", lambda: torch_map("householder", shape, gen), True),
        (GEO_EXP, "geotorch", lambda: geotorch_map("expm", shape, gen), geo_exp_bwd),
        (GEO_CAY, "geotorch", lambda: geotorch_map("cayley", shape, gen), True),
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


def _rollout_fn(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], params, xs, n):
    """Forward + backward of an RNN h_t = step(h_{t−1}, x_t) from h_0 = 0; loss = sum(h_T)."""

    def run() -> object:
        for p in params:
            p.grad = None
        h = torch.zeros(1, n)
        for x in xs:
            h = step(h, x)
        h.sum().backward()
        return None

    return run


def rollout(
    steps: int, n: int, repeats: int, budget: float, gen, verbose: bool = False
) -> list[dict[str, Any]]:
    """RNN rollouts (T = ``steps``, batch 1, L = n/8), forward + backward."""
    L = max(1, n // 8)
    xs = torch.randn(steps, 1, n, generator=gen)
    free = nn.Parameter(torch.randn(n, n, generator=gen) / math.sqrt(n))
    cases: list[tuple[str, Callable[[], object]]] = [
        (
            "unconstrained (tanh(h Wᵀ + x))",
            _rollout_fn(lambda h, x: torch.tanh(F.linear(h, free) + x), [free], xs, n),
        )
    ]
    for method in ("cwy", "householder"):
        w = orthogonalize(
            torch.randn(n, n, generator=gen),
            method=method,
            reflections=L,
            init="random",
            generator=gen,
        )
        _randomize(w, 1.0, gen)
        cases.append((f"{method} step = W.operator() once per rollout", _operator(w, xs, n)))
        cases.append(
            (
                f"{method} W.linear(h) at every step (factors recomputed)",
                _rollout_fn(
                    lambda h, x, w=w: torch.tanh(w.linear(h) + x), list(w.parameters()), xs, n
                ),
            )
        )
        if method == "cwy":
            cases.append((f"{method} Q = W() once per rollout", _materialized(w, xs, n)))
    rows = []
    for name, fn in cases:
        _progress(verbose, f"rollout {name}")
        t = measure(fn, repeats, budget)
        rows.append(_row("rollout", name, "ours", None, t, n=n, L=L, T=steps))
    return rows


def _materialized(w: nn.Module, xs: torch.Tensor, n: int) -> Callable[[], object]:
    params = list(w.parameters())

    def run() -> object:
        for p in params:
            p.grad = None
        q = w()
        h = torch.zeros(1, n)
        for x in xs:
            h = torch.tanh(F.linear(h, q) + x)
        h.sum().backward()
        return None

    return run


def _operator(w: nn.Module, xs: torch.Tensor, n: int) -> Callable[[], object]:
    """``step = W.operator()`` once per rollout (Note [Factors once per rollout]).

    For ``cwy`` the factors U and S are computed once; each step then costs
    two n×L products and one L×L triangular solve (§3.1 of the CWY paper).
    """
    params = list(w.parameters())

    def run() -> object:
        for p in params:
            p.grad = None
        step = w.operator()
        h = torch.zeros(1, n)
        for x in xs:
            h = torch.tanh(step(h) + x)
        h.sum().backward()
        return None

    return run


def rollout_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["fwd_bwd_s"]
    body = [
        [r["name"], fmt_time(r["fwd_bwd_s"]), f"{ratio(r['fwd_bwd_s'], base) or math.nan:.2f}"]
        for r in rows
    ]
    r0 = rows[0]
    title = f"RNN rollout, T = {r0['T']}, n = {r0['n']}, batch 1, L = {r0['L']}, forward + backward"
    return title + "\n" + table(["model", "fwd+bwd", "time / unconstrained"], body)


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
    args = p.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    repeats = args.repeats or (2 if args.quick else 10)
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 2.0)
    st_shape = args.stiefel or (QUICK_TCWY_SHAPE if args.quick else TCWY_SHAPE)
    steps, rn = args.rollout or (QUICK_ROLLOUT if args.quick else ROLLOUT)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    square = square_maps(sizes, repeats, budget, gen, args.verbose)
    stiefel = stiefel_maps(st_shape, repeats, budget, args.slow, gen, args.verbose)
    roll = rollout(steps, rn, repeats, budget, gen, args.verbose)
    tg = targets(square, stiefel, roll)
    text = "\n".join(
        [
            header("Maps onto O(n) and St(N, M)"),
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

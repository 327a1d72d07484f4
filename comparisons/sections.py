"""The three measured sections of the harness: drift, convergence, complexity.

Each takes its checked options and an open `stiefel.comparisons.store.RunStore`, stores every
run as it finishes, then writes ``<section>.md`` and its figures from the stored runs.
"""

from __future__ import annotations

import math
from typing import Any

from .. import parametrizations
from . import complexity as cx
from . import cost, plots
from .grid import run_grid
from .report import peak_drift, summarize_runs
from .store import RunStore, run_key
from .strategies import parse
from .task import BASELINE
from .task import get as get_task
from .writers import Progress, fmt, md_table, write_text

__all__ = [
    "drift_section",
    "convergence_section",
    "complexity_section",
    "SECTIONS",
    "time_cell",
    "flag_note",
]


def _skipped_text(skipped: list[str]) -> str:
    return "".join(f"- not run: {s}\n" for s in skipped) + ("\n" if skipped else "")


def _setup_text(opts: dict, runs: list[dict]) -> str:
    """Task sizes and learning rates, so a reader can tell what was run."""
    lines = []
    for task in opts["tasks"]:
        r = next((r for r in runs if r["task"] == task), None)
        if r is not None:
            lrs = {x["strategy"]: x["lr"] for x in runs if x["task"] == task}
            lines.append(f"- {task}: {_size(r)}; learning rates: "
                         + ", ".join(f"{s} {lr:g}" for s, lr in lrs.items()))  # fmt: skip
    lines.append("- a strategy that names no lr takes `--lr`, else its optimizer's lr on the task "
                 "in `configs/learning_rates.toml`, else the declared one")  # fmt: skip
    if any(get_task(t).kind == "sequence" for t in {r["task"] for r in runs}):
        lines.append(f"- other weights of the recurrent models: {opts['others']}")
    return "\n".join(lines) + "\n\n"


def _size(r: dict) -> str:  # a task's options: its size
    return ", ".join(f"{k}={fmt(v)}" for k, v in r["task_options"].items())


def drift_section(store: RunStore, opts: dict) -> list[dict]:
    runs, skipped = run_grid(store, "drift", opts)
    head = ["task", "strategy", "dtype", "lr", "steps", "final ‖XᴴX − I‖_F", "max ‖XᴴX − I‖_F"]
    body = [
        [r["task"], r["strategy"], r["dtype"], r["lr"], r["step"][-1] + 1, r["drift"][-1]]
        + [peak_drift(r)]
        for r in runs
        if r["drift"][-1] is not None
    ]
    figs = plots.save(store, plots.drift_figure(runs), "drift")
    text = (f"{opts['steps']} steps and {opts['seeds']} seed(s) per run on "
            f"{', '.join(opts['tasks'])} (sizes below); the drift of the constrained matrix "
            "after each recorded step, its maximum over every step.\n\n"
            + _setup_text(opts, runs))  # fmt: skip
    write_text(store.path("drift.md"), text + _skipped_text(skipped) + _lr_table(head, body, runs))
    store.end_section("drift", ["drift.md", *figs], skipped)
    return runs


def convergence_section(store: RunStore, opts: dict) -> list[dict]:
    runs, skipped = run_grid(store, "convergence", opts)
    summary = summarize_runs(runs)
    text = [
        f"{opts['steps']} steps, {opts['seeds']} seed(s); *(mean)*: the arithmetic mean over seeds "
        "(± its std); *geometric mean*: the statistic the figures plot on their log axes (a 0 "
        "among the seeds makes it 0). A run *diverged* "
        "when its loss became not finite; it *did not converge* when its final gap to a known "
        "optimum is above a declared fraction of its first (`Task.converged_fraction`), or, "
        "with no optimum, its final loss is above the baseline or a held-out accuracy at "
        "chance, or it ended *off the manifold*: its final ‖XᴴX − I‖_F above 100·n·eps of its "
        "dtype (the tolerance of `check_point_on_manifold`; 1e-3 at least for an optimizer that "
        "stays near it, landing, pogo), or its loss below the optimum. A "
        "gap within rounding of the optimum (10·n·eps·|optimum|, above or below) is 0.\n",
        _setup_text(opts, runs) + _skipped_text(skipped),
    ]
    figs = []
    for task in opts["tasks"]:
        rows = [s for s in summary if s["task"] == task]
        if not rows:
            continue
        extra = [k for k in get_task(task).table_metrics if k in rows[0]]
        r0, opt, frac = rows[0], rows[0]["optimum"], get_task(task).converged_fraction
        what = (f"mean optimum over seeds (each draws a problem) {opt:.6g}; not converged: gap "
                f"above {frac:g} of the first" if opt is not None else f"{BASELINE} "
                f"{r0['baseline']:.6g}" if r0["baseline"] else "no optimum")  # fmt: skip
        size = _size(next(r for r in runs if r["task"] == task))
        text.append(f"### {task}\n\n*{size}; {r0['seeds']} seed(s) × {opts['steps']} steps; "
                    f"{what}*\n")  # fmt: skip
        geo = ("gap to optimum", "gap_geo") if opt is not None else ("final loss", "final_loss_geo")
        gap = [] if opt is None else ["gap to optimum (mean)"]  # no optimum: no such column
        head = ["strategy", "dtype", "lr", "final loss (mean)", "± std", *gap]
        head += [f"{geo[0]} (geometric mean)", "max drift", "time [s]", "CPU [s]"]
        head += ["diverged / not finite", "did not converge"]
        body = [
            [s["strategy"], s["dtype"], s["lr"], s["final_loss"], s["final_loss_std"]]
            + [s.get("gap")] * len(gap)
            + [s.get(geo[1]), s["max_drift"], time_cell(s, "time"), s["cpu_s"]]
            + [f"{s['diverged']} of {s['seeds']}", f"{s['unconverged']} of {s['seeds']}"]
            + [f"{s['off_manifold']} of {s['seeds']}"]
            + [s[k] for k in extra]
            for s in rows
        ]
        task_runs = [r for r in runs if r["task"] == task]
        text.append(_lr_table(head + ["of them off the manifold", *extra], body, rows))
        text[-1] += _near_best(rows) + _off(task_runs) + _rose(task_runs)
        waited = [f"{s['strategy']} {s['time_flag']}" for s in rows if s["time_flag"]]
        text += flag_note(waited, "the wall time counts waits: compare the CPU column")
        flagged = {f"{s['strategy']} [{s['dtype']}]" for s in rows if s["time_flag"]}
        fig = plots.convergence_figure(task_runs, task, flagged)
        figs += plots.save(store, fig, f"convergence_{task}")
    write_text(store.path("convergence.md"), "\n".join(text))
    store.end_section("convergence", ["convergence.md", *figs], skipped)
    return runs


def _lr_table(head: list[str], body: list[list], rows: list[dict]) -> str:
    """`md_table`, without its lr column where every strategy names its lr (it would repeat it)."""
    if all("lr" in parse(r["strategy"]).optimizer_options for r in rows):
        i = head.index("lr")
        head, body = head[:i] + head[i + 1 :], [b[:i] + b[i + 1 :] for b in body]
    return md_table(head, body)


def _near_best(rows: list[dict]) -> str:
    """Which strategies end within 10 % of the best final gap (Note [Per-task learning rates]
    in ``configs/learning_rates.toml``); one with a run off the manifold or below the optimum
    beyond rounding is named, not ranked."""
    one = len({s["dtype"] for s in rows}) == 1
    gaps = [(s["strategy"] + ("" if one else f" [{s['dtype']}]"), s["gap"], s.get("off_manifold"))
            for s in rows if math.isfinite(s.get("gap", math.nan))]  # fmt: skip
    ok = [(k, g) for k, g, off in gaps if g >= 0 and not off]
    below = [f"{k} ({fmt(g)})" for k, g, off in gaps if g < 0 or off]
    if len(ok) < 2:
        return ""
    best, low = min(ok, key=lambda kg: kg[1])
    far = ", ".join(f"{k} ({fmt(g)})" for k, g in ok if g > 1.1 * low) or "none"
    off = (
        "; not ranked, off the manifold or below the optimum: " + ", ".join(below) if below else ""
    )
    return f"\nBest final gap: {best} ({fmt(low)}); not within 10 % of it: {far}{off}.\n"


def _off(runs: list[dict]) -> str:
    """The runs that ended off the manifold (`stiefel.comparisons.runner.off_manifold`), named."""
    said: dict[str, list[str]] = {}
    for r in (r for r in runs if r.get("off_manifold")):
        said.setdefault(f"{r['strategy']} [{r['dtype']}]", []).append(
            f"seed {r['seed']}: {r['off_manifold']}"
        )
    say = "; ".join(f"{k} ({', '.join(v)})" for k, v in said.items())
    return f"\nEnded off the manifold, not converged: {say}.\n" if said else ""


def _rose(runs: list[dict]) -> str:
    """The strategies whose final gap is over 10× their run's best (a run that reached the
    optimum and left it: the table's final columns do not show it)."""
    worst: dict[str, tuple[float, float, int]] = {}
    for r in runs:
        if r.get("optimum") is None or not math.isfinite(r.get("gap", math.nan)):
            continue
        if r.get("off_manifold"):  # its gap is no distance to the optimum: named apart
            continue
        low, at = min((v, k) for v, k in zip(r["loss"], r["step"], strict=True) if math.isfinite(v))
        best, rise = max(low - r["optimum"], 0.0), 1e-6 * max(1.0, abs(r["optimum"]))
        if r["gap"] > 10 * best + rise and r["gap"] > worst.get(r["strategy"], (0, 0, 0))[1]:
            worst[r["strategy"]] = (best, r["gap"], at)
    say = ", ".join(f"{k} (gap {fmt(b)} at step {at}, {fmt(g)} at the end)"
                    for k, (b, g, at) in worst.items())  # fmt: skip
    return f"\nRose after its best (a final gap over 10× the run's best): {say}.\n" if say else ""


def _fits(rows: list[dict], size: str, keys: tuple[str, ...], min_size: int, why: list[str]):
    """Fitted log–log exponents of ``keys`` against ``size`` over the sizes >= ``min_size``;
    a time with a flagged point there is refused ("refused"), its reason added to ``why``."""
    rows = [r for r in rows if r[size] >= min_size]
    if len({r[size] for r in rows}) < 2:
        return [None for _ in keys]
    out = []
    for k in keys:
        vals = [r[k] for r in rows]
        bad = [f"{r['label']} {k[:-2]} at {size} = {r[size]}: {r[k[:-2] + '_flag']}" for r in rows
               if r.get(k[:-2] + "_flag")]  # fmt: skip
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in vals)
        out.append("refused" if bad else cost.fit_exponent([r[size] for r in rows], vals) if ok
                   else None)  # fmt: skip
        why += bad
    return out


def time_cell(r: dict, t: str) -> Any:
    """Time cell ``<t>_s``, marked † when its measurement is flagged (Note [Trusted times])."""
    return f"{fmt(r[f'{t}_s'])} †" if r.get(f"{t}_flag") else r[f"{t}_s"]


def flag_note(why: list[str], then: str = "refused by the fits and the × columns") -> list[str]:
    """The one-line reason under a table for its flagged cells (and what ``then`` follows)."""
    if not why:
        return []
    why = "; ".join(dict.fromkeys(why))
    return [f"\n† flagged (repeats spread, MAD / median > {cost.SPREAD:g}, or wall > "
            f"{cost.CONTENTION:g} × CPU time): {then}. {why}.\n"]  # fmt: skip


def _span(rows: list[dict], size: str, min_size: int) -> str:
    sizes = sorted({r[size] for r in rows if r[size] >= min_size})
    return f"{sizes[0]}–{sizes[-1]}" if len(sizes) > 1 else "–"


def _within(pairs: list[tuple[float | None, float | None]], tol: float = 0.3) -> str:
    """ "k of K": how many fitted exponents lie within ``tol`` of their model's."""
    fitted = [
        (f, m) for f, m in pairs if isinstance(f, float) and m is not None and math.isfinite(m)
    ]
    if not fitted:
        return "none fitted (sizes too small, or no FLOP model declared)"
    return f"{sum(abs(f - m) <= tol for f, m in fitted)} of {len(fitted)}"


def _measure(store, part: str, fn) -> Any:
    key = run_key(part=part)
    done = store.load_run("complexity", key)
    if done is not None:
        return done["value"]
    value = fn()
    store.save_run("complexity", key, {"value": value})
    return value


def complexity_section(store, opts: dict) -> dict:
    """Measure the maps, the optimizer steps and the registered parts."""
    store.begin_section("complexity", opts)
    device, repeats = opts["device"], opts["repeats"]
    limits = opts.get("limits") or {}
    sizes, fractions = opts["sizes"], opts["fractions"]
    methods = opts.get("methods") or list(parametrizations.maps())
    shapes = [tuple(s) for s in opts["shapes"]]
    gemm = lambda: cost.gemm_rate(min(max(sizes), 2048), device=device)  # noqa: E731
    rate = _measure(store, "gemm", gemm)
    bandwidth = _measure(store, "bandwidth", lambda: cost.stream_bandwidth(device))
    run, only = (repeats, device, limits), opts.get("optimizers")
    plan = [*cx.map_plan(methods, sizes, fractions, limits), *cx.step_plan(shapes, limits, only)]
    bar = Progress(len(plan), "complexity", "measurements")
    maps = _measure(store, "maps", lambda: cx.map_costs(methods, sizes, fractions, *run, bar))
    steps = _measure(store, "steps", lambda: cx.optimizer_costs(shapes, *run, only, bar))
    bar.close()
    parts = {name: _measure(store, name, lambda m=m: m(opts)) for name, (m, _) in cx.PARTS.items()}
    # a row is its fastest run: divide by the fastest rate, before or after them (rates drift)
    rate = max(rate, _measure(store, "gemm_after", gemm))
    maps, steps = cx.with_multiples(maps, steps, rate, bandwidth)
    text = [_intro(rate, bandwidth, opts, sizes, shapes)]
    text += _map_table(maps, methods, repeats) + _step_table(steps, repeats)
    text += _roofline_table(maps, steps)
    if cx.left_out_steps():
        left_out = f"left out: {', '.join(cx.left_out_steps())} ({cx.LEFT_OUT})"
        print(f"complexity: {left_out}", flush=True)
        text.append(f"\nOptimizers {left_out}.\n")
    for name, rows in parts.items():
        text += cx.PARTS[name][1](rows, rate)
    write_text(store.path("complexity.md"), "\n".join(text))
    figs, fb, m = [], "forward_backward", "/".join(sorted({str(s[1]) for s in shapes}, key=int))
    for rows, x, y, group, title, fit, stem in (
        (maps, "n", fb, "label", "Maps: forward + backward", cx.FIT_MIN_N, "maps"),
        (steps, "N", "step", "optimizer", f"Optimizer step on St(N, {m})", cx.FIT_MIN_STEP_N,
         "optimizers"),
    ):  # fmt: skip
        fig = plots.complexity_figure(rows, x, f"{y}_s", group, title, fit, f"{y}_roofline_s")
        figs += plots.save(store, fig, f"complexity_{stem}")
    store.end_section("complexity", ["complexity.md", *figs])
    out = {"gemm_flops_per_s": rate, "bandwidth_bytes_per_s": bandwidth}
    return out | {"maps": maps, "optimizer_steps": steps, **parts}


def _intro(rate: float, bandwidth: float, opts: dict, sizes: list[int], shapes: list) -> str:
    clock = "thread CPU" if cost.one_thread(opts["device"]) else "wall"
    text = (
        f"Measured GEMM rate: {rate / 1e9:.1f} GFLOP/s (the fastest of several products of size "
        f"≥ 512, before and after the rows); memory bandwidth: {bandwidth / 1e9:.1f} GB/s (the "
        f"fastest of several STREAM triads on 256 MiB arrays). The roofline of a map or step "
        "is max(FLOP model / GEMM rate, bytes model / bandwidth). Times per call are the median "
        f"of {opts['repeats']} blocks of calls lasting ≥ {cost.BLOCK_S * 1e3:g} ms on the {clock} "
        "clock, the maps at one n and the steps on one shape in interleaved rounds, † where "
        "flagged (Notes [Trusted times], [Timed blocks] in `stiefel.comparisons.cost`). "
        "Exponents are least-squares slopes of log time "
        f"against log size over the sizes ≥ {cx.FIT_MIN_N} (maps) and N ≥ {cx.FIT_MIN_STEP_N} "
        "(steps), column *fitted over*; the model exponent is that of the FLOP model there.\n"
    )
    if max(sizes) < cx.FIT_MIN_N or max(s[0] for s in shapes) < cx.FIT_MIN_STEP_N:
        text += (
            "\n**These sizes are too small to show how cost grows**: per-call overhead dominates "
            "there; the exponents are not fitted (–). Paper scale, from the checkout's root: "
            "`python -m stiefel.comparisons complexity --config configs/complexity.toml`.\n"
        )
    return text


def _known(v: float) -> float | None:  # None ('–') where there is no model (NaN)
    return v if math.isfinite(v) else None


def _map_table(maps: list[dict], methods: list[str], repeats: int) -> list[str]:
    rows, pairs, why = [], [], []
    registered = parametrizations.maps()
    for method in methods:
        cls = registered[method]
        for frac in sorted({r["fraction"] for r in maps if r["method"] == method}):
            rs = [r for r in maps if r["method"] == method and r["fraction"] == frac]
            big = max(rs, key=lambda r: r["n"])
            keys = ("forward_s", "forward_backward_s", "flops")
            fit_f, fit_fb, model = _fits(rs, "n", keys, cx.FIT_MIN_N, why)
            pairs += [(fit_f, model), (fit_fb, model)]
            rows.append(
                [method, f"L = {frac:g}·n" if cls.takes_reflections() else "–"]
                + [cls.formula or "–", cls.domain or "–", big["n"], big["flops"]]
                + [
                    time_cell(big, "forward"),
                    time_cell(big, "forward_backward"),
                    big["saved_bytes"] / 2**20,
                ]
                + [big["peak_bytes"] / 2**20, fit_f, fit_fb, model, _span(rs, "n", cx.FIT_MIN_N)]
            )
    head = ["method", "L", "serial complexity", "domain", "n", "FLOP model", "forward [s]"]
    head += ["fwd+bwd [s]", "saved [MiB]", "peak fwd+bwd [MiB]"]
    head += ["exponent fwd", "exponent fwd+bwd", "model exponent", "fitted over n"]
    return [
        "### Maps (CWY paper Table 1 layout), measured at the largest n\n",
        f"*n = {', '.join(map(str, sorted({r['n'] for r in maps})))}; {repeats} blocks, median*\n",
        md_table(head, rows),
        "\n*saved*: the bytes autograd saves for the backward of (map() · C).sum(), summed over "
        "its saves: a tensor saved by k ops counts k times, the weights and C (there before the "
        "call) too. *peak fwd+bwd*: the most bytes of tensors created during forward + backward "
        "alive at once (on CUDA the allocator's peak above its start), not what was there before. "
        "So *saved* can exceed the peak: it bounds the activation memory, it is no part of it.\n",
        f"\nFitted exponents within 0.3 of the FLOP model's (maps, forward and forward+backward): "
        f"{_within(pairs)}.\n",
        *flag_note(why),
    ]


def _step_table(steps: list[dict], repeats: int) -> list[str]:
    known, rows, pairs, why, notes = cost.optimizer_steps(), [], [], [], {}
    shapes = dict.fromkeys(f"{r['N']}×{r['M']}" for r in steps)
    for label in dict.fromkeys(r["optimizer"] for r in steps):
        rs = [r for r in steps if r["optimizer"] == label]
        big = max(rs, key=lambda r: r["N"])
        fit, model = _fits(rs, "N", ("step_s", "flops"), cx.FIT_MIN_STEP_N, why)
        modelled = math.isfinite(big["flops"])
        pairs.append((fit, model if modelled else None))
        info = known.get(label, (None,))[0]  # None: no longer registered, no note
        mine = (getattr(info, "name", label), info and info.formula)
        key, note = cx.STEP_NOTES.get(label, mine)
        notes[key] = note
        rows.append(
            [label, f"[{key}]" if note else "–", big["N"], big["M"]]
            + [big["flops"] if modelled else "–", time_cell(big, "step"), big["peak_bytes"] / 2**20]
            + [fit, model if modelled else "–", _span(rs, "N", cx.FIT_MIN_STEP_N)]
        )
    head = ["optimizer", "FLOPs (formula) or manifold", "N", "M", "FLOP model", "step [s]"]
    head += ["peak [MiB]", "exponent in N", "model exponent", "fitted over N"]
    return [
        "\n### One optimizer step on St(N, M) (CWY paper Table 2 layout)\n",
        f"*N × M = {', '.join(shapes)}; median of {repeats} blocks*\n",
        md_table(head, rows),
        "\nEach formula or manifold once, keyed as in the table (an optimizer's variants share its "
        "formula; every row but geoopt's anchors steps on this package's `Stiefel(N, M)`):\n\n"
        + "".join(f"- [{k}] {v}\n" for k, v in notes.items() if v),
        f"\nFitted exponents within 0.3 of the FLOP model's (optimizer steps): {_within(pairs)}.\n",
        *flag_note(why),
    ]


def _roofline_table(maps: list[dict], steps: list[dict]) -> list[str]:
    """Every measured map (forward, forward+backward) and step against its roofline."""
    rows, registered = [], parametrizations.maps()
    for r in maps:
        L = f" L = {r['fraction']:g}·n" if registered[r["method"]].takes_reflections() else ""
        for t, name in (("forward", "fwd"), ("forward_backward", "fwd+bwd")):
            models = [r[k if t == "forward" else f"{t}_{k}"] for k in ("flops", "bytes")]
            rows.append([f"{r['method']}{L}, {name}", f"n = {r['n']}", *_cols(r, t, *models)])
    for r in steps:
        size = f"St({r['N']}, {r['M']})"
        rows.append([r["optimizer"], size, *_cols(r, "step", r["flops"], r["bytes"])])
    head = ["map / step", "size", "FLOP model", "bytes model", "time [s]", "roofline [s]"]
    head += ["× FLOPs at GEMM rate", "× roofline", "bound"]
    return [
        "\n### Time against the roofline\n",
        md_table(head, rows),
        "\n*× FLOPs at GEMM rate* = time / (FLOP model / GEMM rate); *roofline* = "
        "max(FLOP model / GEMM rate, bytes model / bandwidth), *bound* its larger term "
        "(Note [Roofline] in `stiefel.comparisons.cost`). Forward+backward is charged "
        f"{cost.FWD_BWD_FACTOR:g}× the forward's FLOPs and bytes (the backward of each product is "
        "two products of its size); a step has no backward (its gradient is given); – where "
        "no model is declared.\n",
        *flag_note([f"{r['label']} {t}: {r[t + '_flag']}" for r in [*maps, *steps]
                   for t in ("forward", "forward_backward", "step") if r.get(t + "_flag")]),
    ]  # fmt: skip


def _cols(r: dict, t: str, flops: float, nbytes: float) -> list:
    """The models, time, roofline time, × GEMM, × roofline and bound of time ``<t>_s``."""
    cols = [_known(r[f"{t}_{k}"]) for k in ("roofline_s", "x_gemm", "x_roofline")]
    if r.get(f"{t}_flag"):  # a flagged time has no trusted multiple
        cols[1:] = ["refused †", "refused †"]
    return [*map(_known, (flops, nbytes)), time_cell(r, t), *cols, r[f"{t}_bound"]]


SECTIONS = {
    "drift": drift_section,
    "convergence": convergence_section,
    "complexity": complexity_section,
}

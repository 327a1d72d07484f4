"""The three measured sections of the harness: drift, convergence, complexity.

Each takes the merged options of its subcommand and writes ``<section>.json``,
``<section>.csv``, ``<section>.md`` and its figures (PNG and SVG) into ``out``.
"""

from __future__ import annotations

import math
import pathlib

from . import complexity as cx
from . import plots
from .report import md_table, save_figure, summarize_runs, write_csv, write_json
from .runner import RunConfig, parse_strategy, run

__all__ = ["drift_section", "convergence_section", "complexity_section", "run_grid"]


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar then
        return None
    return tqdm(total=total, desc=desc, leave=False)


def run_grid(opts: dict, desc: str) -> list[dict]:
    """Every task × strategy × dtype × seed of ``opts``; LSTM only on sequence tasks."""
    from .cli import task_options  # the flags each task takes
    from .tasks import TASKS

    for name in opts["tasks"]:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    strategies = [parse_strategy(s) for s in opts["strategies"]]
    jobs = []
    for task in opts["tasks"]:
        sequence = TASKS[task].kind == "sequence"
        for s in strategies:
            if s.is_baseline and not sequence:
                continue  # the LSTM baseline has no matrix to constrain
            for dtype in opts["dtypes"]:
                if s.is_baseline and dtype.startswith("complex"):
                    continue
                for seed in range(opts["seeds"]):
                    jobs.append(
                        RunConfig(
                            task,
                            s.name,
                            seed,
                            opts["steps"],
                            dtype,
                            opts["device"],
                            opts["record_every"],
                            task_options(task, opts),
                            opts["others"],
                        )
                    )
    workers = opts.get("jobs")
    workers = 1 if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"jobs={workers!r}; allowed: an integer >= 1")
    bar = _progress(sum(j.steps for j in jobs), desc)
    try:
        if workers > 1 and len(jobs) > 1:
            return _run_parallel(jobs, workers, bar)
        runs = []
        for job in jobs:
            if bar is not None:
                bar.set_postfix_str(f"{job.task} {job.strategy} {job.dtype} seed {job.seed}")
            runs.append(run(job, bar))
        return runs
    finally:
        if bar is not None:
            bar.close()


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _run_parallel(jobs: list[RunConfig], workers: int, bar) -> list[dict]:
    """Note [Parallel runs]

    Runs are independent and seeded, so ``jobs=k`` spreads them over k worker
    processes of one torch thread each (small recurrent models use one core
    badly with more threads). Results come back in the serial order; the wall
    times of runs sharing the machine are only comparable with each other.
    """
    import concurrent.futures as cf
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # no fork of a process that holds torch threads
    with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_one_thread) as pool:
        futures = {pool.submit(run, job, None): i for i, job in enumerate(jobs)}
        runs: list[dict | None] = [None] * len(jobs)
        for fut in cf.as_completed(futures):
            i = futures[fut]
            runs[i] = fut.result()
            if bar is not None:
                bar.update(jobs[i].steps)
                bar.set_postfix_str(f"{jobs[i].task} {jobs[i].strategy} seed {jobs[i].seed} done")
    return runs  # type: ignore[return-value]


def _out(opts: dict) -> pathlib.Path:
    out = pathlib.Path(opts["out"])
    out.mkdir(parents=True, exist_ok=True)
    return out


def drift_section(opts: dict) -> list[dict]:
    out = _out(opts)
    runs = run_grid(opts, "drift")
    write_json(out / "drift.json", {"options": opts, "runs": runs})
    rows = [
        {
            "task": r["task"],
            "strategy": r["strategy"],
            "dtype": r["dtype"],
            "seed": r["seed"],
            "step": s,
            "drift": d,
            "loss": v,
        }
        for r in runs
        for s, d, v in zip(r["step"], r["drift"], r["loss"], strict=True)
    ]
    write_csv(out / "drift.csv", rows)
    table = md_table(
        ["task", "strategy", "dtype", "steps", "final ‖XᴴX − I‖_F", "max ‖XᴴX − I‖_F"],
        [
            [
                r["task"],
                r["strategy"],
                r["dtype"],
                r["step"][-1] + 1,
                r["drift"][-1],
                max(d for d in r["drift"] if d is not None),
            ]
            for r in runs
            if r["drift"][-1] is not None
        ],
    )
    save_figure(plots.drift_figure(runs), out, "drift")
    (out / "drift.md").write_text(
        f"{opts['steps']} steps per run on {', '.join(opts['tasks'])}; the drift of the "
        "constrained matrix after each recorded step.\n\n" + table
    )
    return runs


def convergence_section(opts: dict) -> list[dict]:
    out = _out(opts)
    runs = run_grid(opts, "convergence")
    summary = summarize_runs(runs)
    write_json(out / "convergence.json", {"options": opts, "runs": runs, "summary": summary})
    write_csv(out / "convergence.csv", summary)
    text = [f"{opts['steps']} steps, {opts['seeds']} seeds, mean ± std over seeds.\n"]
    for task in opts["tasks"]:
        rows = [s for s in summary if s["task"] == task]
        if not rows:
            continue
        extra = [k for k in rows[0] if k in ("test_accuracy",)]
        text.append(f"### {task}\n")
        if rows[0]["optimum"] is not None:
            text.append(
                f"mean optimum over seeds (each seed draws a problem): {rows[0]['optimum']:.6g}\n\n"
            )
        elif rows[0]["baseline"] is not None:
            text.append(f"baseline: {rows[0]['baseline']:.6g}\n\n")
        text.append(
            md_table(
                [
                    "strategy",
                    "dtype",
                    "final loss",
                    "± std",
                    "gap to optimum",
                    "max drift",
                    "time [s]",
                    "diverged",
                ]
                + extra,
                [
                    [
                        s["strategy"],
                        s["dtype"],
                        s["final_loss"],
                        s["final_loss_std"],
                        s.get("gap"),
                        s["max_drift"],
                        s["time_s"],
                        s["diverged"],
                    ]
                    + [s[k] for k in extra]
                    for s in rows
                ],
            )
        )
        task_runs = [r for r in runs if r["task"] == task]
        save_figure(plots.convergence_figure(task_runs, task), out, f"convergence_{task}")
    (out / "convergence.md").write_text("\n".join(text))
    return runs


def _fits(rows: list[dict], size: str, keys: tuple[str, ...]) -> list[float | None]:
    """Fitted log–log exponents of ``keys`` against ``size`` (None with one size only)."""
    sizes = [r[size] for r in rows]
    if len(set(sizes)) < 2:
        return [None for _ in keys]
    return [cx.fit_exponent(sizes, [r[k] for r in rows]) for k in keys]


def _span(rows: list[dict], size: str) -> str:
    sizes = sorted({r[size] for r in rows})
    return f"{sizes[0]}–{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])


def _within(pairs: list[tuple[float | None, float | None]], tol: float = 0.3) -> str:
    """ "k of K": how many fitted exponents lie within ``tol`` of their model's."""
    fitted = [(f, m) for f, m in pairs if f is not None and m is not None and math.isfinite(m)]
    return f"{sum(abs(f - m) <= tol for f, m in fitted)} of {len(fitted)}"


def complexity_section(opts: dict) -> dict:
    cx.check_options(opts)
    out = _out(opts)
    device, repeats = opts["device"], opts["repeats"]
    limits = opts.get("limits") or {}
    sizes, fractions = opts["sizes"], opts["fractions"]
    methods = list(cx.MAP_FLOPS)
    shapes = [tuple(s) for s in opts["shapes"]]
    total = len(cx.map_plan(methods, sizes, fractions, limits))
    bar = _progress(total + len(cx.step_plan(shapes, limits)) + len(sizes), "complexity")
    rate = cx.gemm_rate(n=min(max(sizes), 4096), device=device)
    maps = cx.map_costs(methods, sizes, fractions, repeats, device, limits, bar)
    steps = cx.optimizer_costs(shapes, repeats, device, limits, bar)
    rec = cx.recurrent_step_costs(sizes, 1 / 8, repeats, bar)
    if bar is not None:
        bar.close()
    result = {
        "gemm_flops_per_s": rate,
        "maps": maps,
        "optimizer_steps": steps,
        "recurrent_steps": rec,
        "options": opts,
    }
    write_json(out / "complexity.json", result)
    write_csv(out / "complexity_maps.csv", maps)
    write_csv(out / "complexity_optimizers.csv", steps)
    write_csv(out / "complexity_recurrent.csv", rec)

    text = [
        f"Measured GEMM rate (the roofline): {rate / 1e9:.1f} GFLOP/s. Times are the "
        f"fastest of {opts['repeats']} runs. Exponents are "
        "least-squares slopes of log time against log size over the sizes measured "
        "(column *fitted over*); the model exponent is that of the FLOP model over the "
        "same sizes.\n"
    ]
    rows, map_pairs = [], []
    for method in methods:
        for frac in sorted({r["fraction"] for r in maps if r["method"] == method}):
            rs = [r for r in maps if r["method"] == method and r["fraction"] == frac]
            big = max(rs, key=lambda r: r["n"])
            fit_f, fit_fb, model = _fits(rs, "n", ("forward_s", "forward_backward_s", "flops"))
            map_pairs += [(fit_f, model), (fit_fb, model)]
            formula, domain = cx.MAP_FORMULAS[method]
            rows.append(
                [
                    method,
                    f"L = {frac:g}·n",
                    formula,
                    domain,
                    big["n"],
                    big["flops"],
                    big["forward_s"],
                    big["flops"] / rate,
                    big["forward_backward_s"],
                    big["saved_bytes"] / 2**20,
                    big["peak_bytes"] / 2**20,
                    fit_f,
                    fit_fb,
                    model,
                    _span(rs, "n"),
                ]
            )
    text.append("### Maps (CWY paper Table 1 layout), measured at the largest n\n")
    text.append(
        md_table(
            [
                "method",
                "L",
                "serial complexity",
                "domain",
                "n",
                "FLOP model",
                "forward [s]",
                "roofline [s]",
                "fwd+bwd [s]",
                "saved [MiB]",
                "peak fwd+bwd [MiB]",
                "exponent fwd",
                "exponent fwd+bwd",
                "model exponent",
                "fitted over n",
            ],
            rows,
        )
    )
    rows, step_pairs = [], []
    for label in dict.fromkeys(r["optimizer"] for r in steps):
        rs = [r for r in steps if r["optimizer"] == label]
        big = max(rs, key=lambda r: r["N"])
        fit, model = _fits(rs, "N", ("step_s", "flops"))
        modelled = label in cx.STEP_FLOPS  # geoopt's steps have no FLOP model here
        step_pairs.append((fit, model if modelled else None))
        rows.append(
            [
                label,
                cx.PAPER_STEP_FLOPS.get(label, "–"),
                big["N"],
                big["M"],
                big["flops"] if modelled else "–",
                big["step_s"],
                big["flops"] / rate if modelled else "–",
                big["peak_bytes"] / 2**20,
                fit,
                model if modelled else "–",
                _span(rs, "N"),
            ]
        )
    text.append("\n### One optimizer step on St(N, M) (CWY paper Table 2 layout)\n")
    text.append(
        md_table(
            [
                "optimizer",
                "paper FLOPs",
                "N",
                "M",
                "FLOP model",
                "step [s]",
                "roofline [s]",
                "peak [MiB]",
                "exponent in N",
                "model exponent",
                "fitted over N",
            ],
            rows,
        )
    )
    text.append(
        f"\nFitted exponents within 0.3 of the FLOP model's: maps {_within(map_pairs)} "
        f"(forward and forward+backward), optimizer steps {_within(step_pairs)}.\n"
    )
    text.append("\n### One recurrent step, batch 1 (Householder paper Table 2 layout)\n")
    text.append(
        md_table(
            ["model", "n", "FP flops", "BP flops", "FP [s]", "BP [s]"],
            [
                [r["model"], r["n"], r["fp_flops"], r["bp_flops"], r["forward_s"], r["backward_s"]]
                for r in rec
            ],
        )
    )
    (out / "complexity.md").write_text("\n".join(text))
    maps_fig = [dict(r, series=f"{r['method']} L={r['fraction']:g}n") for r in maps]
    save_figure(
        plots.complexity_figure(
            maps_fig, "n", "forward_backward_s", "series", "Maps: forward + backward"
        ),
        out,
        "complexity_maps",
    )
    save_figure(
        plots.complexity_figure(steps, "N", "step_s", "optimizer", "Optimizer step on St(N, M)"),
        out,
        "complexity_optimizers",
    )
    return result

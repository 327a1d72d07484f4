"""The three measured sections of the harness: drift, convergence, complexity.

Each takes the checked options of its subcommand and an open
`stiefel.comparisons.store.RunStore`, stores every run as it finishes,
then writes ``<section>.json``, ``<section>.csv``, ``<section>.md`` and its
figures (PNG and SVG) from the stored runs and lists them in the manifest.
The complexity section lives in `stiefel.comparisons.complexity`.
"""

from __future__ import annotations

from . import plots
from .complexity import complexity_section
from .grid import run_grid
from .report import summarize_runs
from .store import RunStore
from .task import get as get_task
from .writers import md_table, write_csv, write_json, write_text

__all__ = ["drift_section", "convergence_section", "complexity_section", "SECTIONS"]


def _skipped_text(skipped: list[str]) -> str:
    return "".join(f"- not run: {s}\n" for s in skipped) + ("\n" if skipped else "")


def _setup_text(opts: dict, runs: list[dict]) -> str:
    """Task sizes and learning rates, so a reader can tell what was run."""
    lines = []
    for task in opts["tasks"]:
        r = next((r for r in runs if r["task"] == task), None)
        if r is not None:
            sizes = ", ".join(f"{k}={v}" for k, v in r["task_options"].items())
            lines.append(f"- {task}: {sizes}")
    lrs = {r["strategy"]: r["lr"] for r in runs}
    lines.append("- learning rates: " + ", ".join(f"{s}: {lr:g}" for s, lr in lrs.items()))
    if any(r["task"] in ("copying", "adding", "digits") for r in runs):
        lines.append(f"- other weights of the recurrent models: {opts['others']}")
    return "\n".join(lines) + "\n\n"


def drift_section(store: RunStore, opts: dict) -> list[dict]:
    runs, skipped = run_grid(store, "drift", opts)
    write_json(store.path("drift.json"), {"options": opts, "runs": runs})
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
    write_csv(store.path("drift.csv"), rows)
    table = md_table(
        ["task", "strategy", "dtype", "lr", "steps", "final ‖XᴴX − I‖_F", "max ‖XᴴX − I‖_F"],
        [
            [
                r["task"],
                r["strategy"],
                r["dtype"],
                r["lr"],
                r["step"][-1] + 1,
                r["drift"][-1],
                max(d for d in r["drift"] if d is not None),
            ]
            for r in runs
            if r["drift"][-1] is not None
        ],
    )
    figs = plots.save(store, plots.drift_figure(runs), "drift")
    text = (
        f"{opts['steps']} steps per run on {', '.join(opts['tasks'])}; the drift of the "
        "constrained matrix after each recorded step.\n\n"
        + _setup_text(opts, runs)
        + _skipped_text(skipped)
        + table
    )
    write_text(store.path("drift.md"), text)
    store.end_section("drift", ["drift.md", *figs], skipped)
    return runs


def convergence_section(store: RunStore, opts: dict) -> list[dict]:
    runs, skipped = run_grid(store, "convergence", opts)
    summary = summarize_runs(runs)
    write_json(store.path("convergence.json"), {"options": opts, "runs": runs, "summary": summary})
    write_csv(store.path("convergence.csv"), summary)
    text = [
        f"{opts['steps']} steps, {opts['seeds']} seeds, mean ± std over seeds. A run *failed* "
        "when it diverged or ended no better than chance (loss above the baseline, or a "
        "held-out accuracy at chance).\n",
        _setup_text(opts, runs) + _skipped_text(skipped),
    ]
    figs = []
    for task in opts["tasks"]:
        rows = [s for s in summary if s["task"] == task]
        if not rows:
            continue
        extra = [k for k in get_task(task).table_metrics if k in rows[0]]
        text.append(f"### {task}\n")
        if rows[0]["optimum"] is not None:
            text.append(
                f"mean optimum over seeds (each seed draws a problem): {rows[0]['optimum']:.6g}\n\n"
            )
        elif rows[0]["baseline"] is not None:
            text.append(f"baseline (chance level): {rows[0]['baseline']:.6g}\n\n")
        text.append(
            md_table(
                ["strategy", "dtype", "lr", "final loss", "± std", "gap to optimum"]
                + ["max drift", "time [s]", "failed"]
                + extra,
                [
                    [s["strategy"], s["dtype"], s["lr"], s["final_loss"], s["final_loss_std"]]
                    + [s.get("gap"), s["max_drift"], s["time_s"], f"{s['failed']} of {s['seeds']}"]
                    + [s[k] for k in extra]
                    for s in rows
                ],
            )
        )
        task_runs = [r for r in runs if r["task"] == task]
        figs += plots.save(store, plots.convergence_figure(task_runs, task), f"convergence_{task}")
    write_text(store.path("convergence.md"), "\n".join(text))
    store.end_section("convergence", ["convergence.md", *figs], skipped)
    return runs


SECTIONS = {
    "drift": drift_section,
    "convergence": convergence_section,
    "complexity": complexity_section,
}

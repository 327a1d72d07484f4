"""matplotlib figures of the harness (Agg backend, no screen needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .complexity import fit_exponent  # noqa: E402


def drift_figure(runs: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        steps = [s for s, d in zip(r["step"], r["drift"], strict=True) if d is not None]
        vals = [max(d, 1e-18) for d in r["drift"] if d is not None]
        if vals:
            ax.semilogy(steps, vals, label=f"{r['strategy']} [{r['dtype']}]")
    ax.set_xlabel("step")
    ax.set_ylabel("‖XᴴX − I‖_F")
    ax.set_title("Orthogonality drift")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def convergence_figure(runs: list[dict], task: str):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["strategy"], []).append(r)
    first = runs[0]
    optimum, baseline = first["optimum"], first["baseline"]
    # log scale whenever the plotted values are positive (a gap to the optimum,
    # cross-entropy, MSE): far below a baseline is only visible on a log axis
    logy = optimum is not None or all(min(r["loss"], default=1.0) > 0 for r in runs)
    for name, rs in groups.items():
        n = min(len(r["loss"]) for r in rs)
        steps = np.array(rs[0]["step"][:n])
        loss = np.array([r["loss"][:n] for r in rs])
        times = np.array([r["time"][:n] for r in rs]).mean(0)
        if optimum is not None:  # each seed has its own optimum
            loss = loss - np.array([[r["optimum"]] for r in rs])
        if logy:  # geometric mean and spread: a symmetric band on the log axis
            ly = np.log(np.maximum(loss, 1e-16))  # a gap of exactly 0 stays on the axis
            m, lo, hi = (np.exp(ly.mean(0) + k * ly.std(0)) for k in (0, -1, 1))
        else:
            m, sd = loss.mean(0), loss.std(0)
            lo, hi = m - sd, m + sd
        for ax, x in ((a1, steps), (a2, times)):
            ax.plot(x, m, label=name)
            ax.fill_between(x, lo, hi, alpha=0.2)
    for ax, xl in ((a1, "step"), (a2, "wall time [s]")):
        ax.set_xlabel(xl)
        ax.set_ylabel("loss − optimum" if optimum is not None else "loss")
        if logy:
            ax.set_yscale("log")
        if baseline is not None and optimum is None:
            ax.axhline(baseline, color="k", ls="--", lw=1, label="baseline")
        ax.grid(alpha=0.3)
    spread = "geometric mean ± std" if logy else "mean ± std"
    a1.set_title(f"{task}: {spread} over seeds")
    a1.legend(fontsize=7)
    return fig


def complexity_figure(rows: list[dict], x: str, y: str, group: str, title: str):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r[group]), []).append(r)
    for name, rs in groups.items():
        xs = [r[x] for r in rs]
        ys = [r[y] for r in rs]
        if len(xs) > 1:
            slope = fit_exponent(xs, ys)
            name = f"{name} (slope {slope:.2f})"
        ax.loglog(xs, ys, "o-", label=name)
    ax.set_xlabel(x)
    ax.set_ylabel(y.replace("_s", " [s]"))
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return fig

"""matplotlib figures of the harness (Agg backend, no screen needed).

Legends outside the axes, one title per figure, ticks at the measured sizes, axis labels in
words; complexity plots carry the roofline (Note [Roofline] in `stiefel.comparisons.cost`)
as dashed lines; losses are floored at the resolution of the run's dtype.

Note [One meaning per line style]
In a figure a line style means one thing, which its legend names: drift, the dtype; convergence,
dashed the baseline, dotted a run off the manifold, dash-dot (wall time) one that waited for a
core; complexity, dashed the roofline.
"""

from __future__ import annotations

try:
    import matplotlib
except ModuleNotFoundError as exc:  # the harness's figures: the [compare] extra
    raise ModuleNotFoundError(
        "stiefel.comparisons draws its figures with matplotlib: pip install 'stiefel[compare]'"
    ) from exc

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

from .cost import CONTENTION, fit_exponent  # noqa: E402
from .precision import precision  # noqa: E402
from .task import BASELINE  # noqa: E402
from .writers import save_figure  # noqa: E402

LABELS = {
    "forward_backward_s": "forward + backward time [s]",
    "forward_s": "forward time [s]",
    "step_s": "time of one step [s]",
    "n": "n (matrix size)",
    "N": "N (rows of St(N, M))",
}


#: tab10, then ten hues away from its own: the 15 series of a quick step figure get clearly
#: different colours; seven markers, a colour never back with the same one
COLOURS = [*plt.get_cmap("tab10").colors, "#000080", "#e6007e", "#e6b800", "#008080", "#556b2f",
           "#9acd32", "#4b0082", "#ff7f50", "#2f4f4f", "#d2b48c"]  # fmt: skip
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def style(i: int) -> dict:
    """The colour and marker of series ``i`` (distinct for up to 20 series); each series is drawn
    thinner, with a smaller marker, than those before it, so two that coincide both show."""
    return dict(color=COLOURS[i % len(COLOURS)], marker=MARKERS[i % len(MARKERS)],
                ms=max(4.0, 10 - 0.4 * i), lw=max(1.0, 3.0 - 0.13 * i))  # fmt: skip


def save(store, fig, stem: str) -> list[str]:
    """Save ``fig`` as ``stem.png`` and ``stem.svg`` in the open store's folder; the names."""
    store.path(stem + ".png")  # refused when it leads outside --out
    store.path(stem + ".svg")
    return save_figure(fig, store.root, stem)


def _legend(ax) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _resolution(dtype: str) -> float:
    """The smallest gap a loss of this precision can show: its weights' machine epsilon."""
    return float(torch.finfo(precision(dtype)[0]).eps)


_DTYPE_STYLES = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}  # and names


def drift_figure(runs: list[dict]):
    """One colour and marker per strategy (`style`), one line style per dtype."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    dtypes = list(dict.fromkeys(r["dtype"] for r in runs))
    for r in runs:
        steps = [s for s, d in zip(r["step"], r["drift"], strict=True) if d is not None]
        vals = [max(d, 1e-18) for d in r["drift"] if d is not None]
        if vals:
            kw = style(strategies.index(r["strategy"])) | dict(markevery=max(1, len(steps) // 10))
            ls = [*_DTYPE_STYLES][dtypes.index(r["dtype"]) % len(_DTYPE_STYLES)]
            ax.semilogy(steps, vals, ls=ls, label=f"{r['strategy']} [{r['dtype']}]", **kw)
    for i, d in enumerate(dtypes if len(dtypes) > 1 else []):  # Note [One meaning per line style]
        ls = [*_DTYPE_STYLES][i % len(_DTYPE_STYLES)]
        ax.plot([], [], "k", ls=ls, label=f"{_DTYPE_STYLES[ls]}: {d}")
    ax.set_xlabel("step")
    ax.set_ylabel(r"orthogonality error $\|X^H X - I\|_F$")
    ax.set_title("Orthogonality drift")
    _legend(ax)
    ax.grid(alpha=0.3)
    return fig


def convergence_figure(runs: list[dict], task: str, flagged: set[str] = frozenset()):
    """Loss (or |gap|) against step and wall time per ``strategy [dtype]``, the geometric mean over
    seeds on a log axis (band × or ÷ one geometric std), else the mean ± one std. One in
    ``flagged`` (it waited for a core) is dash-dot against wall time, ends hollow, its bar back to
    its CPU time; one with a run ``off_manifold`` (not converged) is dotted, its legend says so;
    the baseline is dashed (Note [One meaning per line style])."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(f"{r['strategy']} [{r['dtype']}]", []).append(r)
    first = runs[0]
    optimum, baseline = first["optimum"], first["baseline"]
    # log scale whenever the plotted values are positive (a gap to the optimum,
    # cross-entropy, MSE): far below a baseline is only visible on a log axis
    logy = optimum is not None or all(min(r["loss"], default=1.0) > 0 for r in runs)
    for i, (name, rs) in enumerate(groups.items()):
        n = min(len(r["loss"]) for r in rs)
        steps = np.array(rs[0]["step"][:n])
        loss = np.array([r["loss"][:n] for r in rs])
        times = np.array([r["time"][:n] for r in rs]).mean(0)
        if optimum is not None:  # each seed has its own optimum
            # Note [Loss floor]: a gap below eps·|optimum| is rounding noise of the
            # dtype; floor it there instead of plotting zig-zags down to 1e-16
            floor = _resolution(rs[0]["dtype"]) * max(1.0, abs(optimum))
            # |gap|: a loss below the optimum (off the manifold) is drawn as far as it is, never
            # floored as if it were at the optimum
            loss = np.maximum(np.abs(loss - np.array([[r["optimum"]] for r in rs])), floor)
        if logy:  # geometric mean and spread: a symmetric band on the log axis
            ly = np.log(np.maximum(loss, 1e-300))
            m, lo, hi = (np.exp(ly.mean(0) + k * ly.std(0)) for k in (0, -1, 1))
        else:
            m, sd = loss.mean(0), loss.std(0)
            lo, hi = m - sd, m + sd
        kw = style(i) | dict(markevery=max(1, n // 8), ms=4)
        off = sum(bool(r.get("off_manifold")) for r in rs)
        label = f"{name}: off the manifold in {off} of {len(rs)}" if off else name
        for ax, x in ((a1, steps), (a2, times)):
            waited = ax is a2 and name in flagged
            ax.plot(x, m, label=label, ls=":" if off else "-." if waited else "-", **kw)
            ax.fill_between(x, lo, hi, alpha=0.2, color=kw["color"])
        if name in flagged:
            cpu = np.mean([r["cpu_time"][n - 1] for r in rs])
            a2.errorbar([times[-1]], [m[-1]], xerr=[[times[-1] - cpu], [0]], fmt=kw["marker"],
                        ms=9, mfc="white", color=kw["color"], capsize=3, zorder=3)  # fmt: skip
    if flagged:
        a2.plot([], [], "k-.o", mfc="white", label="dash-dot, hollow end: waited for a core (wall "
                f"> {CONTENTION:g}× CPU time; bar: back to its CPU time)")  # fmt: skip
    if any(r.get("off_manifold") for r in runs):
        a2.plot([], [], "k:", label="dotted: ended off the manifold (not converged)")
    stat = "geometric mean" if logy else "mean"
    for ax, xl in ((a1, "step"), (a2, "wall time [s]")):
        ax.set_xlabel(xl)
        ax.set_ylabel(f"{'|loss − optimum|' if optimum is not None else 'loss'}, {stat} over seeds")
        if logy:
            ax.set_yscale("log")
        if baseline is not None and optimum is None:
            ax.axhline(baseline, color="k", ls="--", lw=1, label=f"dashed: {BASELINE}")
        ax.grid(alpha=0.3)
    band = "× or ÷ one geometric std" if logy else "± one std"
    fig.suptitle(f"{task}: {stat} over seeds, band {band}")
    _legend(a2)
    return fig


def complexity_figure(
    rows: list[dict], x: str, y: str, group: str, title: str, fit_min: int = 0, model: str = ""
):
    """Log–log time against size per series, ticks at the measured sizes.

    With ``model`` (the rows' key of the roofline of time ``y``), each series whose model
    is finite gets a dashed line there in its colour. Slopes are fitted over the sizes >=
    ``fit_min`` only (none with fewer than two), never through a flagged point, which is
    drawn hollow with its MAD as error bar (Note [Trusted times])."""
    modelled = flagged = False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r[group]), []).append(r)
    for i, (name, rs) in enumerate(groups.items()):
        xs = [r[x] for r in rs]
        ys = [r[y] for r in rs]
        fit = [(r[x], r[y]) for r in rs if r[x] >= fit_min and not r.get(y[:-2] + "_flag")]
        if len({a for a, _ in fit}) > 1:  # a slope of unflagged points only
            name = f"{name} (slope {fit_exponent(*zip(*fit, strict=True)):.2f})"
        marker = style(i)["marker"]
        (line,) = ax.loglog(xs, ys, ls="-", label=name, **style(i))
        bad = [r for r in rs if r.get(y[:-2] + "_flag")]  # Note [Trusted times]: hollow, ± MAD
        if bad:
            mad = [r.get(y[:-2] + "_mad_s", 0.0) for r in bad]
            ax.errorbar([r[x] for r in bad], [r[y] for r in bad], yerr=mad, fmt=marker, ms=9,
                        mfc="white", color=line.get_color(), capsize=3, zorder=3)  # fmt: skip
            flagged = True
        times = [r.get(model, float("nan")) for r in rs]
        if model and all(np.isfinite(times)):
            # a dash marker too, so the model shows at a single measured size
            ax.loglog(xs, times, "--", marker="_", ms=12, color=line.get_color(), lw=0.8)
            modelled = True
    if modelled:
        ax.plot([], [], "k--", marker="_", ms=12, lw=0.8, label="dashed: roofline (FLOPs or bytes)")
    if flagged:
        ax.plot([], [], "ko", mfc="white", label="flagged: spread or waited (± MAD)")
    sizes = sorted({r[x] for r in rows})
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(s) for s in sizes])
    ax.set_xlabel(LABELS.get(x, x))
    ax.set_ylabel(LABELS.get(y, y))
    ax.set_title(title)
    _legend(ax)
    ax.grid(alpha=0.3, which="both")
    return fig

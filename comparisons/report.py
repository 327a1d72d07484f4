"""Summaries of stored runs and ``report.md``, built from the manifest's runs only."""

from __future__ import annotations

import math
import os
import pathlib
import statistics

from . import cost
from .config import PRESETS
from .store import DAMAGED, RunStore
from .writers import write_text

__all__ = ["summarize_runs", "mean_std", "geo_mean", "write_report", "machine_line"]


def mean_std(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def geo_mean(values: list[float]) -> float | None:
    """The geometric mean of the finite ``values`` (what the log-axis figures plot): 0 with a 0
    among them, None with a negative one or none finite."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals or min(vals) < 0:
        return None
    return 0.0 if min(vals) == 0 else math.exp(statistics.fmean(map(math.log, vals)))


def peak_drift(run: dict) -> float | None:
    """A run's largest ‖XᴴX − I‖_F, of every step (of the recorded ones if stored before)."""
    recorded = (d for d in run["drift"] if d is not None)
    return run["max_drift"] if "max_drift" in run else max(recorded, default=None)


def summarize_runs(runs: list[dict]) -> list[dict]:
    """Group runs by (task, strategy, dtype): final loss, gap and metrics, mean ± std over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["strategy"], r["dtype"]), []).append(r)
    out = []
    for (task, strategy, dtype), rs in groups.items():
        loss_m, loss_s = mean_std([r["final_loss"] for r in rs])
        row = dict(task=task, strategy=strategy, dtype=dtype, seeds=len(rs), lr=rs[0].get("lr"))
        row.update(final_loss=loss_m, final_loss_std=loss_s, baseline=rs[0]["baseline"])
        row.update(final_loss_geo=geo_mean([r["final_loss"] for r in rs]))
        row.update(
            optimum=rs[0]["optimum"],
            max_drift=max((d for r in rs if (d := peak_drift(r)) is not None), default=None),
            time_s=statistics.fmean(r["time"][-1] for r in rs),
            cpu_s=statistics.fmean(r["cpu_time"][-1] for r in rs) if "cpu_time" in rs[0] else None,
            one_thread=all(r.get("threads") == 1 for r in rs),
            diverged=sum(r.get("failed") == "diverged" or bool(r["diverged"]) for r in rs),
        )
        row["unconverged"] = sum(bool(r.get("failed")) for r in rs) - row["diverged"]
        row["off_manifold"] = sum(bool(r.get("off_manifold")) for r in rs)  # of the unconverged
        waited = row["cpu_s"] and cost.flag([row["cpu_s"]], [row["time_s"]], row["one_thread"])
        row["time_flag"] = waited or None  # Note [Trusted times]: a run that waited for a core
        if rs[0]["optimum"] is not None:  # each seed draws its own problem and optimum
            row["optimum"], _ = mean_std([r["optimum"] for r in rs])
            row["gap"], row["gap_std"] = mean_std([r["gap"] for r in rs])
            row["gap_geo"] = geo_mean([abs(r["gap"]) for r in rs])  # the figures' |gap|
        for key in rs[0]["metrics"]:
            row[key], row[key + "_std"] = mean_std([r["metrics"][key] for r in rs])
        out.append(row)
    return out


def machine_line(m: dict) -> str:
    """What a section ran on (`stiefel.comparisons.cost.machine`), said before its tables."""
    busy = max(m["load"], m.get("load_end") or 0) > m["cores"]
    end = m.get("load_end")  # None: the measuring run stopped before its section ended
    return (
        f"*Machine*: {m['cpu']}, {m['cores']} cores, {m['threads']} torch thread(s) per worker, "
        f"{m['workers']} worker(s); load average {m['load']:g} at the start, "
        + ("none recorded at the end" if end is None else f"{end:g} at the end")
        + (" (above the cores: times that waited for a core are flagged †).\n" if busy else ".\n")
    )


TITLES = {"drift": "Orthogonality drift", "convergence": "Convergence"}
#: the full runs behind a smoke run's sections (each file's first lines give its command)
FULL = dict(drift=["drift"], convergence=["digits", "copying", "adding"], complexity=["complexity"])
SMOKE = ("A smoke run: tiny sizes, a few hundred steps and two seeds, times on whatever else the "
         "machine ran. It shows that every section runs end to end and how far each strategy "
         "gets on the matrix problems in a few hundred steps (the tables count the runs that "
         "did not converge); it cannot rank strategies, show how well the classifiers and "
         "recurrent models learn, or how costs grow with size. For those, run the full configs "
         "from the checkout's root (where `configs/` is): {}.\n")  # fmt: skip


def no_results(out) -> FileNotFoundError:
    """The error of a report asked of a folder that holds no results."""
    return FileNotFoundError(
        f"no results in {out}: run drift, convergence or complexity with --out {out} first"
    )


def _link(store: RunStore, config: str) -> str:
    """The path of ``configs/<config>.toml`` relative to the report, wherever ``--out`` is."""
    path = PRESETS / f"{config}.toml"
    try:
        return pathlib.Path(os.path.relpath(path, store.root)).as_posix()
    except ValueError:  # another drive (Windows): no relative path
        return path.as_uri()


def write_report(store: RunStore) -> str:
    """``report.md`` from the finished sections of the manifest and the files they list.

    Figures and tables of earlier runs that the manifest does not list are
    never picked up; a section that did not finish is named as such.
    """
    sections = store.manifest.get("sections", {})
    if not sections and store.damaged:
        raise FileNotFoundError(
            f"no readable manifest in {store.out} (kept as {store.out / DAMAGED}): "
            f"run the sections again with --out {store.out} --resume; their stored runs "
            "are reused, not trained again"
        )
    if not sections:
        raise no_results(store.out)
    v = store.manifest.get("versions", {})
    parts = [
        "# stiefel comparison report\n",
        f"python {v.get('python')}, torch {v.get('torch')}, stiefel {v.get('stiefel')}.\n",
    ]
    if store.manifest.get("preset") == "quick":
        runs = [f"`python -m stiefel.comparisons {k} --config configs/{c}.toml` ([configs/{c}.toml]"
                f"({_link(store, c)}))" for k in sections for c in FULL.get(k, [])]  # fmt: skip
        parts[0] = "# stiefel comparison report: `quick`, a smoke preset\n"
        parts.insert(1, SMOKE.format("; ".join(runs)))
    for key, sec in sections.items():
        title = TITLES.get(key, key.capitalize())
        if sec["state"] != "finished":
            parts.append(
                f"## {title}\n\n*{sec['state']}*: {len(sec['runs'])} runs stored; rerun the "
                f"subcommand with `--resume --out {store.out}` to finish it.\n"
            )
            continue
        parts.append(f"## {title}\n")
        if sec.get("machine"):
            parts.append(machine_line(sec["machine"]))
        for name in sec["outputs"]:
            if name.endswith(".md"):
                parts.append(store.inside(name).read_text())
            elif name.endswith(".png"):
                parts.append(f"![{name[:-4]}]({name})\n")
    write_text(store.path("report.md"), "\n".join(parts))
    return "report.md"

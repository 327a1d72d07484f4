"""Writing results: JSON, CSV, markdown tables, PNG/SVG figures and report.md."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import statistics

__all__ = ["write_json", "write_csv", "md_table", "save_figure", "summarize_runs", "write_report"]


def write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, default=str))


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.4g}"
    return str(v)


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save_figure(fig, out: pathlib.Path, stem: str) -> list[str]:
    """Save ``fig`` as ``stem.png`` and ``stem.svg`` in ``out``; return the file names."""
    import matplotlib.pyplot as plt

    names = []
    for ext in ("png", "svg"):
        name = f"{stem}.{ext}"
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        names.append(name)
    plt.close(fig)
    return names


def mean_std(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def summarize_runs(runs: list[dict]) -> list[dict]:
    """Group runs by (task, strategy, dtype): final loss, gap and metrics, mean ± std over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["strategy"], r["dtype"]), []).append(r)
    out = []
    for (task, strategy, dtype), rs in groups.items():
        loss_m, loss_s = mean_std([r["final_loss"] for r in rs])
        row = {
            "task": task,
            "strategy": strategy,
            "dtype": dtype,
            "seeds": len(rs),
            "final_loss": loss_m,
            "final_loss_std": loss_s,
            "optimum": rs[0]["optimum"],
            "baseline": rs[0]["baseline"],
            "max_drift": max((d for r in rs for d in r["drift"] if d is not None), default=None),
            "time_s": statistics.fmean(r["time"][-1] for r in rs),
            "diverged": sum(bool(r["diverged"]) for r in rs),
        }
        if rs[0]["optimum"] is not None:  # each seed draws its own problem and optimum
            row["optimum"], _ = mean_std([r["optimum"] for r in rs])
            row["gap"], row["gap_std"] = mean_std([r["final_loss"] - r["optimum"] for r in rs])
        for key in rs[0]["metrics"]:
            row[key], row[key + "_std"] = mean_std([r["metrics"][key] for r in rs])
        out.append(row)
    return out


SECTIONS = [
    ("drift", "Orthogonality drift"),
    ("convergence", "Convergence"),
    ("complexity", "Complexity"),
]


def write_report(out: pathlib.Path) -> pathlib.Path:
    """Gather every ``<section>.md`` and its figures in ``out`` into ``out/report.md``."""
    parts = ["# stiefel comparison report\n"]
    found = False
    for key, title in SECTIONS:
        md = out / f"{key}.md"
        if not md.exists():
            continue
        found = True
        parts.append(f"## {title}\n")
        parts.append(md.read_text())
        for png in sorted(out.glob(f"{key}*.png")):
            parts.append(f"![{png.stem}]({png.name})\n")
    if not found:
        raise FileNotFoundError(
            f"no results in {out}: run drift, convergence or complexity with --out {out} first"
        )
    path = out / "report.md"
    path.write_text("\n".join(parts))
    return path

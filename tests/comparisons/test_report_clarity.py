"""A report a reviewer cannot misread: each line style means one thing and the legend says which,
the tables give the figures' statistic beside their own, the step table says which manifold each
geoopt row steps on and each formula once, the memory columns are defined, no lr said twice."""

import itertools
import json
import math

import matplotlib.colors as mcolors
import numpy as np
from _tables import table_row

from stiefel.comparisons import cli, plots, sections
from stiefel.comparisons.complexity import map_costs
from stiefel.comparisons.cost import GEOOPT_STEPS, optimizer_steps

TINY = ["--steps", "30", "--seeds", "2", "--jobs", "1", "--n", "5", "--m", "2"]


def _run(loss, **kw) -> dict:
    return dict(task="digits", strategy="s", dtype="float32", optimum=None, baseline=2.3,
                step=[0, 5], loss=loss, time=[0.1, 4.0], cpu_time=[0.1, 1.0]) | kw  # fmt: skip


def test_each_line_style_means_one_thing_named_in_the_legend():
    runs = [_run([3.0, 1.0]), _run([3.0, 1.2], strategy="t")]
    fig = plots.convergence_figure(runs, "digits", flagged={"s [float32]"})
    time_axis = fig.axes[1]
    waited = next(ln for ln in time_axis.get_lines() if ln.get_label() == "s [float32]")
    baseline = next(ln for ln in time_axis.get_lines() if "trivial" in ln.get_label())
    assert waited.get_linestyle() != baseline.get_linestyle() == "--"
    legend = [t.get_text() for t in time_axis.get_legend().get_texts()]
    assert "dashed: baseline (a trivial predictor's loss)" in legend
    assert any(t.startswith("dash-dot, hollow end: waited for a core") for t in legend)
    # drift: the dtype's line style is named in the legend
    drift = [dict(strategy="a", dtype=d, step=[0, 1], drift=[1e-7, 1e-7]) for d in
             ("float32", "float64")]  # fmt: skip
    legend = [t.get_text() for t in plots.drift_figure(drift).axes[0].get_legend().get_texts()]
    assert "solid: float32" in legend and "dashed: float64" in legend
    # complexity: dashed is the roofline, and the legend says so
    rows = [dict(g="a", n=n, t_s=1.0 * n, r_s=0.5 * n) for n in (4, 8)]
    ax = plots.complexity_figure(rows, "n", "t_s", "g", "x", model="r_s").axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "dashed: roofline (FLOPs or bytes)" in legend


def test_fifteen_series_differ_in_colour_and_coinciding_ones_both_show():
    rgb = [np.array(mcolors.to_rgb(c)) for c in plots.COLOURS[:15]]
    assert min(np.linalg.norm(a - b) for a, b in itertools.combinations(rgb, 2)) > 0.2
    rows = [dict(g=f"s{i}", n=n, t_s=float(n)) for i in range(15) for n in (4, 8)]  # all coincide
    lines = [ln for ln in plots.complexity_figure(rows, "n", "t_s", "g", "x").axes[0].get_lines()
             if ln.get_label().startswith("s")]  # fmt: skip
    widths, sizes = [ln.get_linewidth() for ln in lines], [ln.get_markersize() for ln in lines]
    assert all(a > b for a, b in itertools.pairwise(widths))  # each later one thinner, on top
    assert all(a > b for a, b in itertools.pairwise(sizes))


def test_the_convergence_table_gives_the_geometric_mean_the_figure_plots(tmp_path):
    from stiefel.comparisons.report import geo_mean

    cli.main(["convergence", "--out", str(tmp_path), "--tasks", "procrustes", "--strategies",
              "cwy+adam(lr=0.01)", *TINY])  # fmt: skip
    md = (tmp_path / "convergence.md").read_text()
    assert "*(mean)*: the arithmetic mean over seeds" in md and "the statistic the figures" in md
    row = table_row(md, "| strategy |", "| cwy+adam(lr=0.01)")
    recs = [json.loads(p.read_text())["record"] for p in tmp_path.glob("runs/convergence/*")]
    gaps = [abs(r["gap"]) for r in recs]
    assert math.isclose(float(row["gap to optimum (mean)"]), sum(gaps) / 2, rel_tol=1e-3)
    geo = float(row["gap to optimum (geometric mean)"])
    assert math.isclose(geo, geo_mean(gaps), rel_tol=1e-3)
    curve = plots.convergence_figure(recs, "procrustes").axes[0].get_lines()[0].get_ydata()
    assert math.isclose(geo, curve[-1], rel_tol=1e-3)  # the number at the figure's last step
    # the strategy names its lr: no lr column repeats it (test_the_drift_table_says_the_lr_once)
    assert "| lr |" not in md and "| final loss (mean) | ± std |" in md
    assert geo_mean([0.0, 2.0]) == 0.0 and geo_mean([-1.0, 2.0]) is None


def test_the_drift_table_says_the_lr_once(tmp_path):
    cli.main(["drift", "--out", str(tmp_path / "a"), "--strategies", "cwy+adam(lr=0.01)", *TINY])
    md = (tmp_path / "a" / "drift.md").read_text()
    assert "| task | strategy | dtype | steps |" in md
    assert "| cwy+adam(lr=0.01) | float32 | 30 |" in md
    cli.main(["drift", "--out", str(tmp_path / "b"), "--strategies", "cwy+adam", *TINY])
    assert "| task | strategy | dtype | lr | steps |" in (tmp_path / "b" / "drift.md").read_text()


def _steps() -> list[dict]:
    labels = [*optimizer_steps(), *GEOOPT_STEPS]
    return [dict(optimizer=k, N=64, M=4, flops=1e6 if k in optimizer_steps() else math.nan,
                 step_s=1e-4, peak_bytes=1024) for k in labels]  # fmt: skip


def test_the_step_table_gives_each_formula_once_and_the_geoopt_manifolds():
    md = "\n".join(sections._step_table(_steps(), 3))
    rgd = [k for k in optimizer_steps() if k.startswith("rgd(")]
    formula = optimizer_steps()[rgd[0]][0].formula
    assert len(rgd) > 1 and md.count(formula) == 1  # once, for every variant
    assert all(table_row(md, "| optimizer |", f"| {k} |")["FLOPs (formula) or manifold"] == "[rgd]"
               for k in rgd)  # fmt: skip
    canonical = table_row(md, "| optimizer |", "| geoopt RiemannianAdam CanonicalStiefel")
    assert canonical["FLOPs (formula) or manifold"] == "[CanonicalStiefel]"
    note = next(line for line in md.splitlines() if line.startswith("- [CanonicalStiefel]"))
    assert "N×N system" in note and "O(N³)" in note
    radam = table_row(md, "| optimizer |", "| geoopt_radam |")["FLOPs (formula) or manifold"]
    note = next(line for line in md.splitlines() if line.startswith(f"- {radam}"))
    assert "`Stiefel(N, M)`" in note and "2M×2M Woodbury" in note
    assert "- [EuclideanStiefel]" in md and "QR retraction" in md


def test_the_map_table_defines_saved_and_peak():
    maps = map_costs(["cwy"], [8], [1.0], repeats=1)
    md = "\n".join(sections._map_table(maps, ["cwy"], 1))
    assert "| saved [MiB] | peak fwd+bwd [MiB] |" in md
    assert "*saved*: the bytes autograd saves" in md and "counts k times" in md
    assert "*peak fwd+bwd*: the most bytes of tensors created during forward + backward" in md
    assert "*saved* can exceed the peak" in md


def test_a_task_without_an_optimum_has_no_gap_column(tmp_path):
    # digits has a baseline, no optimum: its gap column was "–" on every row
    cli.main(["convergence", "--out", str(tmp_path), "--tasks", "digits", "--steps", "20",
              "--seeds", "1", "--jobs", "1", "--n", "8", "--batch", "8",
              "--strategies", "cwy+adam(lr=0.01)"])  # fmt: skip
    md = (tmp_path / "convergence.md").read_text()
    row = table_row(md, "| strategy |", "| cwy+adam(lr=0.01)")
    assert "gap to optimum (mean)" not in row and "final loss (geometric mean)" in row
    assert "baseline (a trivial predictor's loss) 2.30259" in md

"""Reports that say what they are: the smoke title, failures split, gaps at rounding, per-task
learning rates, progress lines with an ETA, distinct figure styles, labels only where they apply.
"""

import io
import json
import math
import pathlib

import matplotlib.colors as mcolors
import pytest
import torch

from stiefel import optimizers
from stiefel.comparisons import cli, config, plots, table, tasks
from stiefel.comparisons.complexity import map_costs
from stiefel.comparisons.precision import rounding
from stiefel.comparisons.report import summarize_runs
from stiefel.comparisons.writers import Progress

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--steps", "6", "--seeds", "1", "--jobs", "1", "--n", "5", "--m", "2"]


def _record(gap_first: float, gap: float, failed=None, diverged=False) -> dict:
    return dict(task="procrustes", strategy="s", dtype="float32", lr=0.1, final_loss=1.0 + gap,
                baseline=None, optimum=1.0, drift=[0.0], time=[2.0], cpu_time=[1.0], threads=1,
                diverged=diverged, failed=failed, gap=gap, metrics={},
                loss=[1.0 + gap_first])  # fmt: skip


def test_failures_are_split_into_diverged_and_not_converged():
    rows = [_record(10, 0.0), _record(10, 5.0, "gap 5 above 0.1"), _record(10, math.nan, "diverged",
            True)]  # fmt: skip
    (s,) = summarize_runs(rows)
    assert (s["diverged"], s["unconverged"], s["seeds"]) == (1, 1, 3)
    # wall 2 s against 1 s of CPU on one thread: the run waited for a core (cost.flag's rule)
    assert s["time_flag"].startswith("wall 2.0× CPU")


def test_a_gap_within_rounding_is_zero_and_one_beyond_is_kept(tmp_path):
    task = tasks.make("procrustes", torch.float32, torch.device("cpu"), 0, n=8)
    tol = rounding("float32", task.optimum, task)
    assert tol == 10 * 8 * torch.finfo(torch.float32).eps * max(1.0, abs(task.optimum))
    cli.main(["convergence", "--out", str(tmp_path), "--tasks", "procrustes", "--strategies",
              "cwy+adam(lr=0.05)", "--steps", "300", "--seeds", "1", "--jobs", "1",
              "--n", "8"])  # fmt: skip
    (rec,) = [json.loads(p.read_text())["record"] for p in tmp_path.glob("runs/convergence/*")]
    raw = rec["final_loss"] - rec["optimum"]
    assert rec["gap"] == (0.0 if abs(raw) <= tol else raw) and rec["gap"] >= 0
    md = (tmp_path / "convergence.md").read_text()
    assert "*n=8, m=8, k=64; 1 seed(s) × 300 steps;" in md  # the table says its size
    assert "| diverged / not finite | did not converge |" in md


def test_quick_report_is_titled_a_smoke_preset(tmp_path):
    out = tmp_path / "q"
    cli.main(["drift", "--out", str(out), "--strategies", "cwy+adam", *TINY])
    assert "smoke" not in (out / "report.md").read_text()  # a plain section is not a smoke run
    store = json.loads((out / "manifest.json").read_text())
    store["preset"] = "quick"  # what `quick` records before its sections
    (out / "manifest.json").write_text(json.dumps(store))
    cli.main(["report", "--out", str(out)])
    text = (out / "report.md").read_text()
    assert text.startswith("# stiefel comparison report: `quick`, a smoke preset")
    assert "it cannot rank strategies" in text and "--config configs/drift.toml" in text
    assert (ROOT / "configs" / "drift.toml").exists()


def test_per_task_learning_rates_come_from_the_swept_table(tmp_path):
    lrs = config.tomllib.loads((ROOT / "configs" / "learning_rates.toml").read_text())
    for task, per_optimizer in lrs.items():
        assert task in tasks.available()
        for name, lr in per_optimizer.items():
            assert name in optimizers.available() and lr > 0
            assert config.task_lr(task, name) == lr
    assert config.task_lr("procrustes", "pogo") != optimizers.info("pogo").default_lr
    assert config.task_lr("digits", "pogo") is None  # not swept: the declared lr
    cli.main(["convergence", "--out", str(tmp_path), "--tasks", "procrustes", "brockett",
              "--strategies", "riemannian+pogo", "riemannian+pogo(lr=0.05)", *TINY])  # fmt: skip
    got = {(r["task"], r["strategy"]): r["value"] for r in table.read(tmp_path, metric="lr")}
    assert got == {("procrustes", "riemannian+pogo"): lrs["procrustes"]["pogo"],
                   ("brockett", "riemannian+pogo"): lrs["brockett"]["pogo"],
                   ("procrustes", "riemannian+pogo(lr=0.05)"): 0.05,
                   ("brockett", "riemannian+pogo(lr=0.05)"): 0.05}  # fmt: skip
    md = (tmp_path / "convergence.md").read_text()
    assert "Best final gap: " in md and "not within 10 % of it" in md


def test_progress_off_a_terminal_prints_a_line_per_finished_unit_with_eta(monkeypatch):
    err = io.StringIO()  # not a terminal: no bar, lines
    monkeypatch.setattr("sys.stderr", err)
    clock = iter([0.0, 10.0, 30.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    bar = Progress(4, "convergence", "steps")  # the unit counted is named
    bar.update(1)
    bar.finished("run a")  # 1 of 4 in 10 s: 30 s left
    bar.finished("run b", 1)  # 2 of 4 in 30 s: 30 s left
    bar.close()
    assert err.getvalue().splitlines() == [
        "convergence: 1/4 steps, run a done, ETA 30 s",
        "convergence: 2/4 steps, run b done, ETA 30 s",
    ]


def test_twenty_series_get_distinct_colours_and_markers():
    styles = [plots.style(i) for i in range(20)]
    colours = [mcolors.to_hex(s["color"]) for s in styles]
    assert len(set(colours)) == 20
    rows = [dict(g=f"s{i}", n=n, t_s=float(n + i)) for i in range(20) for n in (4, 8)]
    fig = plots.complexity_figure(rows, "n", "t_s", "g", "twenty")
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("s")]
    assert len({(mcolors.to_hex(ln.get_color()), ln.get_marker()) for ln in lines}) == 20
    assert len({mcolors.to_hex(ln.get_color()) for ln in lines}) == 20


def test_a_map_without_reflections_is_labelled_without_l():
    rows = map_costs(["exp", "householder"], [4], [0.5, 1.0], repeats=1)
    labels = {r["label"] for r in rows}
    assert labels == {"exp", "householder L=0.5n", "householder L=1n"}


def test_convergence_figure_marks_a_run_that_waited_for_a_core():
    runs = [_record(10, 0.5) | dict(step=[0, 5], loss=[11.0, 1.5], time=[0.1, 4.0],
            cpu_time=[0.1, 1.0]) for _ in range(2)]  # fmt: skip
    fig = plots.convergence_figure(runs, "procrustes", flagged={"s [float32]"})
    time_axis = fig.axes[1]
    dashed = [ln for ln in time_axis.get_lines() if ln.get_label() == "s [float32]"]
    assert dashed and dashed[0].get_linestyle() == "-."  # dash-dot: dashed is the baseline
    hollow = [ln for ln in time_axis.get_lines() if ln.get_markerfacecolor() == "white"]
    assert any(list(ln.get_xdata()) == [4.0] for ln in hollow)  # the end, at its wall time
    # its error bar reaches back to the CPU time: a segment from 1.0 to 4.0
    segs = [c.get_segments() for c in time_axis.collections if hasattr(c, "get_segments")]
    assert any(s[0][0][0] == 1.0 and s[0][1][0] == 4.0 for s in segs if len(s))
    assert (
        not plots.convergence_figure(runs, "procrustes").axes[1].get_lines()[0].get_linestyle()
        == "-."
    )


def test_gaps_within_rounding_of_the_optimum_are_zero_on_either_side():
    # a float32 ulp above the optimum (2.4e-7 on a loss of about 2) is at the optimum: the
    # report must not name it "not within 10 %" of a best gap of 0
    from stiefel.comparisons.runner import gap_to_optimum
    from stiefel.comparisons.sections import _near_best

    tol = rounding("float32", 2.07, tasks.make("procrustes", torch.float32, "cpu", 0, n=16))
    assert gap_to_optimum(2.07 + 2.4e-7, 2.07, tol) == 0.0
    assert gap_to_optimum(2.07 - 2.4e-7, 2.07, tol) == 0.0
    assert gap_to_optimum(2.17, 2.07, tol) == pytest.approx(0.1)
    assert gap_to_optimum(1.97, 2.07, tol) == pytest.approx(-0.1)  # below: off the manifold
    rows = [
        {"strategy": s, "dtype": "float32", "gap": gap_to_optimum(2.07 + d, 2.07, tol)}
        for s, d in (("a", 0.0), ("b", 2.4e-7), ("c", 0.5))
    ]
    assert "not within 10 % of it: c (0.5)" in _near_best(rows)


def test_a_run_that_left_the_optimum_is_named_under_its_table():
    # brockett with radam at a learning rate swept at another size: at the optimum from
    # step 160, a jump at step 280; the final columns alone show a small gap and no failure
    from stiefel.comparisons.sections import _rose

    def run(strategy, losses):
        steps = list(range(0, 20 * len(losses), 20))
        return {"strategy": strategy, "optimum": -3.2, "loss": losses, "step": steps,
                "gap": losses[-1] + 3.2}  # fmt: skip

    left = run("riemannian+radam", [-1.0, -3.1, -3.2, -3.2, -2.94, -3.1957])
    stayed = run("cwy+adam", [-1.0, -3.0, -3.19, -3.1999, -3.19995, -3.2])
    text = _rose([left, stayed])
    assert "riemannian+radam (gap 0 at step 40" in text and "cwy+adam" not in text
    assert _rose([stayed]) == ""

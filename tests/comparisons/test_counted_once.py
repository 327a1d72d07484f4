"""What a convergence table counts: each task, strategy and dtype once; a run that ends off
the manifold (or below the optimum) never as converged, in the table or in the figure."""

import json
import math
import re

import numpy as np
import pytest
import torch

from stiefel.comparisons import cli, config, plots, tasks
from stiefel.comparisons.precision import rounding
from stiefel.manifolds import Stiefel

TINY = ["--steps", "4", "--seeds", "2", "--n", "6", "--m", "2", "--jobs", "1"]


@pytest.mark.parametrize(
    ("argv", "first", "again"),
    [
        (["--strategies", "cwy+adam", "cwy+adam", "cwy+adam(lr=0.01)"], "cwy+adam", "cwy+adam"),
        (["--strategies", "cwy+adam(lr=0.01)", "cwy + adam(lr=1e-2)"], "cwy+adam(lr=0.01)",
         "cwy + adam(lr=1e-2)"),
        (["--tasks", "procrustes", "procrustes"], "procrustes", "procrustes"),
        (["--dtype", "float32", "float32"], "float32", "float32"),
    ],
)  # fmt: skip
def test_a_duplicate_is_refused_before_training(tmp_path, argv, first, again):
    base = {"--tasks": ["procrustes"], "--strategies": ["cwy+adam"]}
    flags = [x for k, v in base.items() if k not in argv for x in (k, *v)]
    out = tmp_path / "dup"
    with pytest.raises(ValueError, match="repeats") as info:
        cli.main(["convergence", "--out", str(out), *flags, *argv, *TINY])
    message = str(info.value)
    assert repr(first) in message and repr(again) in message and "allowed: each once" in message
    assert not out.exists()  # nothing trained, nothing written


def test_a_duplicate_in_a_config_table_is_refused(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[convergence]\nstrategies = ["riemannian+rgd", "riemannian+rgd"]\n')
    with pytest.raises(ValueError, match=re.escape(f"--config {cfg}: strategies[1]=")):
        cli.main(["convergence", "--config", str(cfg), "--out", str(tmp_path / "o"), *TINY])
    # the same strategy with and without an lr are two strategies: both rows show their lr
    cli.main(["convergence", "--out", str(tmp_path / "two"), "--tasks", "brockett",
              "--strategies", "cwy+adam", "cwy+adam(lr=0.01)", *TINY])  # fmt: skip
    rows = [ln for ln in (tmp_path / "two" / "convergence.md").read_text().splitlines()
            if ln.startswith("| cwy+adam")]  # fmt: skip
    lr = config.task_lr("brockett", "adam")  # what cwy+adam takes on brockett
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| cwy+adam", "float32", f"{lr:g}"],
        ["| cwy+adam(lr=0.01)", "float32", "0.01"],
    ]
    assert all("| 0 of 2 |" in r for r in rows)  # each counted over its own 2 seeds


def _records(out) -> list[dict]:
    return [json.loads(p.read_text())["record"] for p in sorted(out.glob("runs/*/*.json"))]


def test_a_run_that_ends_off_the_manifold_did_not_converge(tmp_path):
    # landing at lr = 3 leaves St(12, 4) (final ‖XᵀX − I‖_F near 1) and ends below the
    # optimum; rgd at 0.3 stays on it and converges
    out = tmp_path / "off"
    cli.main(["convergence", "--out", str(out), "--tasks", "brockett", "--strategies",
              "riemannian+landing(lr=3)", "riemannian+rgd(lr=0.3)", "--steps", "150", "--seeds",
              "2", "--n", "12", "--m", "4", "--jobs", "1"])  # fmt: skip
    tol = Stiefel(12, 4).default_atol(torch.float32)  # the package's own membership test
    task = tasks.make("brockett", torch.float32, torch.device("cpu"), 0, n=12, m=4)
    off = {}
    for r in _records(out):
        below = r["final_loss"] < r["optimum"] - rounding("float32", r["optimum"], task)
        expected = r["drift"][-1] > tol or below
        assert bool(r["off_manifold"]) == expected, r
        if expected:
            assert r["failed"].startswith("off the manifold"), r["failed"]
        off.setdefault(r["strategy"], []).append(expected)
    assert off == {"riemannian+landing(lr=3)": [True, True], "riemannian+rgd(lr=0.3)": [False] * 2}
    md = (out / "convergence.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| riemannian+landing(lr=3) |"))
    assert row.endswith("| 0 of 2 | 2 of 2 | 2 of 2 |")  # diverged, not converged, off
    assert "Ended off the manifold, not converged: riemannian+landing(lr=3)" in md
    assert "Best final gap: riemannian+landing" not in md


def _run(strategy: str, gaps: list[float], off: str | None, optimum: float = -2.0) -> dict:
    return dict(task="brockett", strategy=strategy, dtype="float32", optimum=optimum,
                baseline=None, step=list(range(len(gaps))), loss=[optimum + g for g in gaps],
                time=[0.1 * i for i in range(len(gaps))], off_manifold=off)  # fmt: skip


def test_the_figure_plots_the_size_of_the_gap_and_dots_runs_off_the_manifold():
    below = [_run("landing", [1.0, -0.3, -0.5], "x"), _run("landing", [2.0, -0.1, -0.2], "x")]
    on = [_run("rgd", [1.0, 0.1, 0.01], None), _run("rgd", [3.0, 0.2, 0.04], None)]
    fig = plots.convergence_figure(below + on, "brockett")
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    off, good = lines["landing [float32]: off the manifold in 2 of 2"], lines["rgd [float32]"]
    assert off.get_linestyle() == ":" and good.get_linestyle() == "-"
    for line, runs in ((off, below), (good, on)):  # geometric mean over seeds of |gap|
        gaps = np.abs([[v - r["optimum"] for v in r["loss"]] for r in runs])
        expected = [math.exp(sum(math.log(g) for g in col) / len(col)) for col in gaps.T]
        np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-6)
    assert "geometric mean" in fig.axes[0].get_ylabel() and "geometric" in fig._suptitle.get_text()
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert "dotted: ended off the manifold (not converged)" in legend


def test_the_docs_name_the_statistic_the_figure_shows():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "comparisons.md").read_text()
    bullet = docs.split("- `convergence_<task>.png`")[1].split("\n- ")[0]
    fig = plots.convergence_figure([_run("rgd", [1.0, 0.1], None)], "brockett")
    assert fig.axes[0].get_ylabel().split(", ")[1].startswith("geometric mean")
    assert "geometric mean over seeds" in bullet and "|loss − optimum|" in bullet


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_optimizer_near_the_manifold_by_design_is_judged_at_its_own_distance(dtype):
    # landing and pogo stay near the manifold at a distance their steps set, in every
    # dtype: float64's 100·n·eps had flagged converged float64 landing runs (drift 1e-6)
    from stiefel.comparisons.runner import INFEASIBLE_ATOL, off_manifold

    weight = torch.zeros(12, 4, dtype=dtype)
    near = {"drift": [0.5, 1e-6], "gap": 1e-3}
    far = {"drift": [0.5, 10 * INFEASIBLE_ATOL], "gap": 1e-3}
    assert off_manifold(near, weight, feasible=False) is None
    assert off_manifold(far, weight, feasible=False) is not None
    if dtype == torch.float64:  # a retraction's tolerance is its rounding: 100·n·eps
        assert off_manifold(near, weight, feasible=True) is not None
    below = {"drift": [1e-6], "gap": -0.1}
    assert "below the optimum" in off_manifold(below, weight, feasible=False)

"""The comparison harness: every subcommand on a tiny configuration, outputs, errors, seeds."""

import json
import math
import pathlib

import pytest
import torch
from _tables import table_row

from stiefel.comparisons import cli, strategies, table
from stiefel.comparisons.runner import RunConfig, run
from stiefel.comparisons.tasks import Brockett, Copying, Procrustes, make

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--n", "6", "--m", "3", "--steps", "12", "--record-every", "4", "--seeds", "1"]
TINY += ["--jobs", "1"]  # no worker processes to start for runs this small


def test_strategy_grammar():
    s = strategies.parse("riemannian+rgd(metric=canonical,retraction=cayley)")
    assert (s.method, s.optimizer) == ("riemannian", "rgd")
    assert s.optimizer_options == {"metric": "canonical", "retraction": "cayley"}
    s = strategies.parse("householder(reflections=4)+radam(lr=1e-3,betas=(0.9,0.99))")
    assert s.method_options == {"reflections": 4}
    assert s.optimizer_options == {"lr": 1e-3, "betas": (0.9, 0.99)}
    assert s.lr() == 1e-3
    with pytest.raises(ValueError, match="METHOD\\+OPTIMIZER"):
        strategies.parse("cwy")
    with pytest.raises(ValueError, match="key=value"):
        strategies.parse("cwy+adam(0.1)")
    with pytest.raises(ValueError, match="unknown method 'qwerty'; available: .*cwy"):
        strategies.parse("qwerty+adam", methods=["cwy", "exp"], optimizers=["adam"])
    with pytest.raises(ValueError, match="unknown optimizer 'sgdd'; available: adam"):
        strategies.parse("cwy+sgdd", methods=["cwy"], optimizers=["adam"])


def test_task_optima_are_exact():
    # Procrustes: no Stiefel point beats the polar-factor optimum (independent check by sampling)
    t = Procrustes(torch.float64, torch.device("cpu"), 0, n=6, m=3, k=10)
    for s in range(50):
        q = torch.linalg.qr(
            torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        )[0]
        assert float(t._value(q)) >= t.optimum - 1e-12
    # Brockett: eigenvectors of the m smallest eigenvalues, ordered, attain the optimum
    b = Brockett(torch.float64, torch.device("cpu"), 0, n=7, m=3)
    lam, vec = torch.linalg.eigh(b.a)
    x = vec[:, :3]
    value = float(((x.T @ b.a @ x).diagonal() * b.d).sum())
    assert abs(value - b.optimum) < 1e-12
    # copying baseline as in the papers
    c = Copying(torch.float32, torch.device("cpu"), 0, n=8, T=100)
    assert abs(c.baseline - 10 * math.log(8) / 120) < 1e-15
    xs, ys = c.sample(4)
    assert xs.shape == (4, 120, 10) and bool((ys[:, -10:] == xs[:, :10].argmax(-1)).all())


def test_unknown_names_list_what_exists(tmp_path):
    with pytest.raises(ValueError, match="task='mnist' is not supported; allowed: adding"):
        make("mnist", torch.float32, torch.device("cpu"), 0)
    with pytest.raises(ValueError, match="unknown method"):
        run(RunConfig("procrustes", "nosuch+adam", steps=2))
    with pytest.raises(ValueError, match="unknown optimizer"):
        run(RunConfig("procrustes", "cwy+nosuch", steps=2))
    with pytest.raises(ValueError, match="dtype='float16'"):
        run(RunConfig("procrustes", "cwy+adam", steps=2, dtype="float16"))
    with pytest.raises(ValueError, match=r"'lstm' is a method of .* only \(the LSTM baseline\)"):
        run(RunConfig("procrustes", "lstm+adam", steps=2))
    with pytest.raises(SystemExit):
        cli.main(["nosuch"])


def test_same_seed_same_numbers():
    cfg = RunConfig(
        "procrustes", "cwy+adam", seed=3, steps=8, dtype="float64", task_options={"n": 5, "m": 2}
    )
    a, b = run(cfg), run(cfg)
    assert a["loss"] == b["loss"] and a["drift"] == b["drift"]
    c = run(
        RunConfig(
            "procrustes",
            "cwy+adam",
            seed=4,
            steps=8,
            dtype="float64",
            task_options={"n": 5, "m": 2},
        )
    )
    assert c["loss"] != a["loss"]


def test_the_maximum_drift_is_over_every_step_not_the_recorded_ones():
    # rgd's Cayley step corrects its drift every k-th step, and a record period that is a
    # multiple of k saw every run at the low point of the cycle: its "max" was 25 % low.
    # The reference is the same run recorded at every step.
    from stiefel.comparisons.report import peak_drift

    def drift_run(every: int) -> dict:
        cfg = RunConfig(
            "procrustes", "riemannian+rgd", steps=48, dtype="float32", record_every=every,
            task_options={"n": 64, "m": 64},
        )  # fmt: skip
        return run(cfg)

    sparse, dense = drift_run(16), drift_run(1)
    assert max(sparse["drift"]) < max(dense["drift"])  # the recorded steps miss the peak
    assert sparse["drift"] == dense["drift"][::16] + [dense["drift"][-1]]
    assert sparse["max_drift"] == dense["max_drift"] == max(dense["drift"])
    assert peak_drift(sparse) == max(dense["drift"])
    legacy = {k: v for k, v in sparse.items() if k != "max_drift"}  # stored before
    assert peak_drift(legacy) == max(sparse["drift"])


def _is_png(path: pathlib.Path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000


def test_drift_subcommand_writes_files(tmp_path):
    cli.main(
        [
            "drift",
            "--out",
            str(tmp_path),
            "--tasks",
            "procrustes",
            "--strategies",
            "cwy+adam",
            "riemannian+rgd(retraction=qr)",
            "--dtype",
            "float32",
            "float64",
            *TINY,
        ]
    )
    for name in ("results.jsonl", "drift.md", "drift.png", "drift.svg", "report.md"):
        assert (tmp_path / name).exists(), name
    assert _is_png(tmp_path / "drift.png")
    final = table.read(tmp_path, metric="final_loss")
    assert len(final) == 4 and {r["section"] for r in final} == {"drift"}
    report = (tmp_path / "report.md").read_text()
    assert "| cwy+adam | float64 |" in report and "drift.png" in report
    # drift values are real measurements: parametrization at the epsilon level
    run64 = table.read(tmp_path, dtype="float64", strategy="cwy+adam", metric="drift")
    assert [r["step"] for r in run64] == [0, 4, 8, 11]  # every 4th step and the last
    assert max(r["value"] for r in run64) < 100 * 6 * torch.finfo(torch.float64).eps


def test_convergence_subcommand_with_sequence_task_and_toml(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("steps = 6\n[convergence]\nseeds = 2\nT = 3\nbatch = 4\nrecord_every = 2\n")
    cli.main(
        [
            "convergence",
            "--out",
            str(tmp_path),
            "--config",
            str(cfg),
            "--tasks",
            "brockett",
            "copying",
            "--strategies",
            "cwy+adam",
            "lstm+rmsprop",
            "--n",
            "6",
            "--m",
            "2",
        ]
    )
    runs = {(r["task"], r["strategy"], r["seed"]) for r in table.read(tmp_path)}
    assert len(runs) == 2 * 1 + 2 * 2  # LSTM runs only on the sequence task; 2 seeds each
    for task, strategy, seed in runs:  # every 2nd step and the last
        losses = table.read(tmp_path, task=task, strategy=strategy, seed=seed, metric="loss")
        assert [r["step"] for r in losses] == [0, 2, 4, 5]
    assert _is_png(tmp_path / "convergence_copying.png")
    assert (tmp_path / "convergence_brockett.svg").exists()
    md = (tmp_path / "convergence.md").read_text()
    assert "### copying" in md and "lstm+rmsprop" in md and "### brockett" in md


def test_complexity_subcommand(tmp_path, monkeypatch):
    from stiefel.comparisons import complexity, cost

    monkeypatch.setattr(complexity, "FIT_MIN_N", 8)  # fit these tiny sizes for the test
    monkeypatch.setattr(complexity, "FIT_MIN_STEP_N", 32)
    monkeypatch.setattr(cost, "BLOCK_S", 1e-4)  # what is measured, not how well: short blocks
    cfg = tmp_path / "cx.toml"
    cfg.write_text("[complexity]\nlimits = { exp = 8, landing = 32 }\n")
    cli.main(
        [
            "complexity",
            "--out",
            str(tmp_path),
            "--config",
            str(cfg),
            "--sizes",
            "8",
            "16",
            "--fractions",
            "0.5",
            "1",
            "--repeats",
            "1",
            "--shapes",
            "32x4",
            "64x4",
        ]
    )
    (rate,) = table.read(tmp_path, task="gemm")
    assert rate["value"] > 0
    maps = table.read(tmp_path, task="maps", metric="method")  # one row per measured map
    methods = {r["value"] for r in maps}
    assert {"householder", "cwy", "exp", "cayley"} <= methods
    # limits: exp only up to n = 8, landing only up to N = 32; the others at every size
    assert {r["step"] for r in maps if r["value"] == "exp"} == {8}
    assert {r["step"] for r in maps if r["value"] == "cwy"} == {8, 16}
    steps = table.read(tmp_path, task="steps", metric="optimizer")
    assert {r["step"] for r in steps if r["value"] == "landing"} == {32}
    # the default limit on geoopt's canonical N×N step stays beside the config's
    limits = json.loads((tmp_path / "manifest.json").read_text())["sections"]["complexity"]
    assert limits["options"]["limits"]["geoopt RiemannianSGD CanonicalStiefel"] == 16384
    assert _is_png(tmp_path / "complexity_maps.png")
    md = (tmp_path / "complexity.md").read_text()
    assert "exponent fwd+bwd" in md and "CWY paper Table 2" in md
    assert "Fitted exponents within 0.3 of the FLOP model's (maps" in md
    # every registered map and every riemannian optimizer × variant is measured
    from stiefel import parametrizations
    from stiefel.comparisons.cost import optimizer_steps

    assert methods == set(parametrizations.maps())
    assert {r["value"] for r in steps} >= set(optimizer_steps())
    # the FLOP model of a reflection map is homogeneous of degree 3 in n at fixed L/n
    cwy = table_row(md, "| method |", "| cwy | L = 0.5·n")
    assert cwy["model exponent"] == "3" and cwy["fitted over n"] == "8–16"
    assert cwy["serial complexity"] == parametrizations.maps()["cwy"].formula
    assert float(cwy["peak fwd+bwd [MiB]"]) > 0
    landing = table_row(md, "| optimizer |", "| landing")
    assert landing["exponent in N"] == landing["model exponent"] == "–"  # one size
    assert landing["fitted over N"] == "–" and float(landing["peak [MiB]"]) > 0
    report = cli.main(["report", "--out", str(tmp_path)])
    assert report == 0 and "## Complexity" in (tmp_path / "report.md").read_text()


def test_fit_exponent_matches_a_least_squares_reference():
    import numpy as np

    from stiefel.comparisons.cost import fit_exponent

    sizes, times = [256, 512, 1024, 2048], [0.011, 0.07, 0.61, 4.2]
    ref = np.polyfit(np.log(sizes), np.log(times), 1)[0]
    assert math.isclose(fit_exponent(sizes, times), ref, rel_tol=1e-12)
    assert math.isclose(fit_exponent([3, 6, 12], [2 * 3**1.5, 2 * 6**1.5, 2 * 12**1.5]), 1.5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--fractions", "1.5"],
            r"fractions\[0\]=1.5 is out of range; allowed: \(0.0, 1.0\]",
        ),
        (["--sizes", "1", "4"], r"sizes\[0\]=1 is not allowed; allowed: an int >= 2"),
        (["--repeats", "0"], r"repeats=0 is not allowed; allowed: an int >= 1"),
        (["--shapes", "4x8"], r"shapes\[0\]=\[4, 8\]; allowed: \[N, M\] with integers N >= M >= 1"),
    ],
)
def test_complexity_bad_options_name_the_option(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        cli.main(["complexity", "--out", str(tmp_path), "--sizes", "8", *argv])
    assert not (tmp_path / "results.jsonl").exists()


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "[complexity]\nlimits = { expm = 8 }\n",
            r"limits: unknown name 'expm'; available: householder, cwy",
        ),
        (
            "[complexity]\nlimits = { exp = 0 }\n",
            r"limits\['exp'\]=0 is not allowed; allowed: an int >= 1",
        ),
        (
            "[complexity]\nsize = [8]\n",
            r"unknown option 'size' in \[complexity\]; available: .*sizes",
        ),
        ("step = 3\n", r"unknown option or table 'step'; options: .*steps"),
        (
            "[convergance]\nsteps = 3\n",
            r"unknown option or table 'convergance'; .*tables: drift, convergence",
        ),
    ],
)
def test_config_with_unknown_or_bad_options_says_what_exists(tmp_path, toml, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml)
    with pytest.raises(ValueError, match=message):
        cli.main(["complexity", "--out", str(tmp_path), "--config", str(cfg), "--sizes", "8"])
    assert not (tmp_path / "results.jsonl").exists()


def test_shapes_flag_needs_n_x_m(capsys):
    with pytest.raises(SystemExit):
        cli.main(["complexity", "--shapes", "4096-64"])
    assert "allowed: NxM with integers, e.g. 4096x64" in capsys.readouterr().err


def test_report_without_results_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results"):
        cli.main(["report", "--out", str(tmp_path)])


@pytest.mark.slow
def test_parallel_jobs_give_the_serial_numbers(tmp_path):
    """``jobs=2`` runs in worker processes and returns the serial runs, in order."""
    from stiefel.comparisons.config import resolve
    from stiefel.comparisons.grid import run_grid
    from stiefel.comparisons.store import RunStore

    flags = dict(
        tasks=["procrustes"],
        strategies=["cwy+adam", "riemannian+rgd"],
        dtypes=["float64"],
        seeds=2,
        steps=6,
        record_every=2,
        n=5,
        m=2,
    )
    with RunStore(tmp_path / "a") as store:
        serial, _ = run_grid(store, "convergence", resolve("convergence", flags))
    with RunStore(tmp_path / "b") as store:
        parallel, _ = run_grid(store, "convergence", resolve("convergence", {**flags, "jobs": 2}))
    assert [(r["strategy"], r["seed"]) for r in parallel] == [
        (r["strategy"], r["seed"]) for r in serial
    ]
    for a, b in zip(serial, parallel, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12, abs=1e-14)
    with pytest.raises(ValueError, match="jobs=0 is not allowed; allowed: an int >= 1"):
        resolve("convergence", {**flags, "jobs": 0})


def test_copying_layout_marker_then_answer():
    task = Copying(torch.float32, torch.device("cpu"), 0, n=8, batch=4, T=12)
    x, y = task.sample(4)
    symbols = x.argmax(-1)
    assert x.shape == (4, 32, 10) and y.shape == (4, 32)
    assert bool((symbols[:, :10] >= 1).all() and (symbols[:, :10] <= 8).all())
    assert bool((symbols[:, 10:21] == 0).all())  # T − 1 = 11 blanks
    assert bool((symbols[:, 21] == 9).all())  # the marker at T + 9
    assert bool((symbols[:, 22:] == 0).all())
    assert torch.equal(y[:, -10:], symbols[:, :10]) and bool((y[:, :-10] == 0).all())


def test_a_run_no_better_than_chance_counts_as_failed():
    from stiefel.comparisons.runner import failure

    digits = make("digits", torch.float32, torch.device("cpu"), 0, n=4)
    rec = {"diverged": False, "final_loss": 0.5, "metrics": {"test_accuracy": 0.6}}
    assert failure(rec, digits) is None
    assert "above the baseline" in failure({**rec, "final_loss": 2.5}, digits)
    assert "at or below chance" in failure({**rec, "metrics": {"test_accuracy": 0.1}}, digits)
    assert failure({**rec, "diverged": True}, digits) == "diverged"
    assert failure({**rec, "final_loss": float("nan")}, digits) == "diverged"
    procrustes = make("procrustes", torch.float64, torch.device("cpu"), 0, n=4)
    opt, start = procrustes.optimum, procrustes.optimum + 10.0  # a first gap of 10
    rec = {**rec, "loss": [start], "metrics": {}}
    assert failure({**rec, "final_loss": opt + 0.99}, procrustes) is None  # closed > 90 %
    assert failure({**rec, "final_loss": opt + 1.01}, procrustes).startswith("gap 1.01 above 0.1")
    assert failure({**rec, "final_loss": 1e9}, procrustes).startswith("gap")  # no baseline needed

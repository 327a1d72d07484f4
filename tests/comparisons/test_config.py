"""Options are checked before any training: each error names the option and what is allowed."""

import re
import sys

import pytest
import torch

from stiefel.comparisons import cli, config, tasks
from stiefel.comparisons.grid import plan

#: why the LSTM baseline does not run on a matrix task (its tasks from the registry)
LSTM_ONLY = (
    f"'lstm' is a method of the task(s) {', '.join(tasks.extra_methods()['lstm'])} only "
    "(the LSTM baseline)"
)
BASE = ["--tasks", "procrustes", "--strategies", "cwy+adam", "--steps", "3", "--n", "4"]
BASE += ["--jobs", "1"]  # no worker processes to start for runs this small


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["--seeds", "0"], ValueError, r"seeds=0 is not allowed; allowed: an int >= 1"),
        (["--seeds", "-2"], ValueError, r"seeds=-2 is not allowed; allowed: an int >= 1"),
        (["--steps", "0"], ValueError, r"steps=0 is not allowed; allowed: an int >= 1"),
        (
            ["--record-every", "0"],
            ValueError,
            r"record_every=0 is not allowed; allowed: an int >= 1",
        ),
        (["--lr", "0"], ValueError, r"lr=0.0 is out of range; allowed: \(0.0, inf\)"),
        (["--jobs", "0"], ValueError, r"jobs=0 is not allowed; allowed: an int >= 1"),
        (
            ["--tasks", "copying", "--T", "0"],
            ValueError,
            r"'copying': T=0 is not allowed; allowed: an int >= 1",
        ),
        (
            ["--tasks", "copying", "--batch", "0"],
            ValueError,
            r"batch=0 is not allowed; allowed: an int >= 1",
        ),
        (["--m", "9"], ValueError, r"task 'procrustes': m=9; allowed: 1 <= m <= n=4"),
        (["--T", "5"], ValueError, r"option 'T' is taken by none .*: procrustes: n=4, m=None"),
        (["--task-option", "q=1"], ValueError, r"option 'q' is taken by none .* k=64"),
        (["--task-option", "k=abc"], TypeError, r"option k='abc' \(str\); allowed: int"),
        (
            ["--strategies", "cwy+adam(lr=abc)"],
            ValueError,
            r"'cwy\+adam\(lr=abc\)': .* lr='abc'; allowed: a number > 0",
        ),
        (
            ["--strategies", "lstm+rmsprop"],
            ValueError,
            r"'procrustes' is of kind 'matrix' and every strategy .* " + re.escape(LSTM_ONLY),
        ),
        (["--tasks", "mnist"], ValueError, r"task='mnist' is not supported; allowed: adding"),
    ],
)
def test_bad_options_are_refused_before_training(tmp_path, argv, error, message):
    with pytest.raises(error, match=message):
        cli.main(["drift", "--out", str(tmp_path / "o"), *BASE, *argv])
    assert not (tmp_path / "o" / "runs").exists()


@pytest.mark.parametrize(
    ("toml", "error", "message"),
    [
        (
            'tasks = "procrustes"\n',
            TypeError,
            r"tasks='procrustes' \(str\); allowed: a list, e.g. \[",
        ),
        ('[drift]\nsteps = "10"\n', ValueError, r"steps='10' is not allowed; allowed: an int >= 1"),
        ("[drift]\nseeds = 1.5\n", ValueError, r"seeds=1.5 is not allowed; allowed: an int >= 1"),
        ("[drift]\ndtypes = [32]\n", ValueError, r"dtypes\[0\]=32; allowed: float32, float64"),
        ("[drift]\ntask_options = 3\n", TypeError, r"task_options=3 \(int\); allowed: a table"),
        ("[quick]\nstepz = 3\n", ValueError, r"unknown option 'stepz' in \[quick\]"),
        ("drift = 3\n", TypeError, r"\[drift\] must be a table"),
    ],
)
def test_toml_of_the_wrong_type_is_refused(tmp_path, toml, error, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    with pytest.raises(error, match=message):
        cli.main(["drift", "--out", str(tmp_path / "o"), "--config", str(cfg)])


def test_layers_merge_in_order_and_quick_table_applies(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("steps = 7\nn = 5\n[drift]\nseeds = 2\n[quick]\nsteps = 9\nrepeats = 2\n")
    opts = config.resolve("drift", {}, cfg)
    assert (opts["steps"], opts["seeds"], opts["task_options"]["n"]) == (7, 2, 5)
    quick = config.resolve("drift", {}, cfg, quick=True)
    assert quick["steps"] == 9 and quick["task_options"] == {"n": 5, "m": 8}  # [quick] wins
    assert config.resolve("complexity", {}, cfg, quick=True)["repeats"] == 2
    flags = config.resolve("drift", {"steps": 11, "task_options": {"n": 6}}, cfg)
    assert flags["steps"] == 11 and flags["task_options"]["n"] == 6  # flags win


def test_task_options_come_from_the_signature():
    assert tasks.options("copying") == {
        "n": 64,
        "batch": 64,
        "T": 100,
        "operator": "auto",
        "nonpositive_bias": False,
    }
    assert tasks.options("procrustes") == {"n": 32, "m": None, "k": 64}
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'q' .*allowed: n=32, m=None, k=64"):
        tasks.check_options("procrustes", {"q": 1})


def test_a_registered_task_gets_its_options_from_the_cli(tmp_path, request):
    from stiefel.comparisons import task as base
    from stiefel.comparisons.tasks.matrix import Procrustes

    saved = base.TASKS.snapshot()
    request.addfinalizer(lambda: base.TASKS.restore(saved))

    @tasks.register("scaled_procrustes")
    class Scaled(Procrustes):
        def __init__(self, dtype, device, seed, scale: float = 1.0, **kw):
            super().__init__(dtype, device, seed, **kw)
            self.scale = scale

        def loss(self, model, step):
            return self.scale * super().loss(model, step)

    assert tasks.options("scaled_procrustes") == {"scale": 1.0, "n": 32, "m": None, "k": 64}
    argv = ["drift", "--out", str(tmp_path), "--tasks", "scaled_procrustes", "--strategies"]
    argv += ["cwy+adam", "--steps", "2", "--seeds", "1", "--dtype", "float64"]
    cli.main([*argv, "--task-option", "scale=3", "--n", "4", "--m", "2"])
    md = (tmp_path / "drift.md").read_text()
    assert "scaled_procrustes: scale=3, n=4, m=2, k=64" in md


def test_lstm_on_a_matrix_task_is_reported(tmp_path):
    opts = config.resolve(
        "convergence",
        {"tasks": ["procrustes"], "strategies": ["cwy+adam", "lstm+rmsprop"], "n": 4},
    )
    jobs, skipped = plan(opts)
    assert {j.strategy for j in jobs} == {"cwy+adam"}
    assert skipped == [f"lstm+rmsprop on procrustes: {LSTM_ONLY}"]
    argv = ["convergence", "--out", str(tmp_path), "--tasks", "procrustes", "--strategies"]
    cli.main([*argv, "cwy+adam", "lstm+rmsprop", "--n", "4", "--steps", "2", "--seeds", "1"])
    assert "not run: lstm+rmsprop on procrustes" in (tmp_path / "report.md").read_text()


def test_help_lists_what_the_registries_hold(capsys):
    with pytest.raises(SystemExit):
        cli.main(["convergence", "--help"])
    out = capsys.readouterr().out
    assert "methods: householder, cwy" in out and "optimizers: " in out and "rgd" in out
    assert "copying (sequence): n=64, batch=64, T=100" in out
    assert "(default: 2000)" in out and "--lr LR" in out and "--task-option KEY=VALUE" in out


def test_lr_flag_sets_strategies_that_name_none(tmp_path):
    argv = ["drift", "--out", str(tmp_path), "--strategies", "cwy+adam", "cwy+adam(lr=0.5)"]
    cli.main([*argv, "--lr", "0.25", "--steps", "2", "--n", "4", "--m", "2", "--seeds", "1"])
    md = (tmp_path / "drift.md").read_text()
    assert "learning rates: cwy+adam 0.25, cwy+adam(lr=0.5) 0.5" in md


def test_every_shipped_config_resolves(monkeypatch):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "configs"
    monkeypatch.syspath_prepend(str(root.parent))  # their imports: experiments/ of the checkout
    files = [p for p in sorted(root.glob("*.toml")) if p.name != "learning_rates.toml"]  # data
    assert files
    for path in files:
        for section in config.SCHEMA:
            if section in config.load_toml(path):
                opts = config.resolve(section, {}, path)
                if "tasks" in opts:
                    plan(opts)  # names, strategies and task options all check


def test_a_task_built_model_is_skipped_on_complex_dtypes():
    opts = config.resolve(
        "convergence",
        {
            "tasks": ["copying"],
            "strategies": ["cwy+adam", "lstm+rmsprop"],
            "dtypes": ["float32", "complex64"],
            "seeds": 1,
        },
    )
    jobs, skipped = plan(opts)
    assert {(j.strategy, j.dtype) for j in jobs} == {
        ("cwy+adam", "float32"),
        ("cwy+adam", "complex64"),
        ("lstm+rmsprop", "float32"),
    }
    assert skipped == ["lstm+rmsprop on copying [complex64]: the LSTM baseline is real"]


# ----------------------------------------------------------------- a config is data
def test_a_config_imports_only_the_checkouts_experiments(tmp_path, monkeypatch, capsys):
    """A module beside the TOML (on the path as the working directory is) is not run."""
    (tmp_path / "beside.py").write_text("import pathlib\npathlib.Path('RAN').write_text('x')\n")
    foreign = tmp_path / "experiments"  # a package that shadows the checkout's by name
    foreign.mkdir()
    (foreign / "__init__.py").write_text("")
    (foreign / "lipschitz.py").write_text("import pathlib\npathlib.Path('RAN').write_text('x')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.partition(".")[0] == "experiments"]:
        monkeypatch.delitem(sys.modules, name)  # as in a fresh process
    cfg = tmp_path / "c.toml"
    argv = ["drift", "--out", str(tmp_path / "o"), "--config", str(cfg), *BASE]
    for name in ("beside", "experiments.lipschitz"):
        cfg.write_text(f'imports = ["{name}"]\n')
        message = rf"--config {cfg}: imports names '{name}', .* pass --trust-config"
        with pytest.raises(ValueError, match=message):
            cli.main(argv)
        assert not (tmp_path / "RAN").exists() and not (tmp_path / "o").exists()
    cfg.write_text('try_imports = ["experiments.lipschitz"]\n')  # skipped, with a note
    cli.main([*argv, "--steps", "1"])
    assert "not imported (not this checkout's experiments package)" in capsys.readouterr().out
    assert not (tmp_path / "RAN").exists()
    cfg.write_text('imports = ["beside"]\n')
    cli.main([*argv, "--trust-config", "--overwrite"])  # the user's explicit choice
    assert (tmp_path / "RAN").exists()


def test_a_module_exiting_at_import_is_an_error_not_exit_0(tmp_path, monkeypatch):
    (tmp_path / "quitter.py").write_text("raise SystemExit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["drift", "--out", str(tmp_path / "o"), "--import", "quitter", *BASE]
    assert cli.run(argv) == 2
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "0"], r"--threads 0; allowed: an integer >= 1"),
        (["--jobs", "100000"], r"jobs=100000 is not allowed; allowed: 1 to \d+ \(4 × the cores\)"),
        (["--task-option", "n=8"], r"--n 4 and --task-option n=8 conflict; give one of them"),
        (["--resume", "--overwrite"], r"--resume and --overwrite together; allowed: one of them"),
    ],
)
def test_bad_machine_and_conflicting_flags_are_refused(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        cli.main(["drift", "--out", str(tmp_path / "o"), *BASE, *argv])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("section", ["drift", "complexity"])
@pytest.mark.parametrize(
    "device", ["tpu", "cuda:64", *([] if torch.cuda.is_available() else ["cuda"])]
)
def test_a_device_the_machine_lacks_is_refused_before_anything_is_written(
    tmp_path, section, device
):
    # a CUDA device on a CPU machine ended in torch's traceback mid-run, with a manifest
    # that marked the section failed and refused the next run without --overwrite
    with pytest.raises(ValueError, match=rf"device='{device}' is not a device.*; allowed: cpu"):
        cli.main([section, "--out", str(tmp_path / "o"), "--device", device])
    assert not (tmp_path / "o").exists()


def test_a_toml_of_two_values_for_one_option_or_bad_syntax_names_the_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("n = 4\ntask_options = { n = 8 }\n")
    with pytest.raises(ValueError, match=rf"--config {cfg}: n = 4 and task_options .* conflict"):
        config.resolve("drift", {}, cfg)
    cfg.write_text("steps = [\n")
    with pytest.raises(ValueError, match=rf"--config {cfg}: not valid TOML: "):
        config.resolve("drift", {}, cfg)


def test_complexity_selection_names_what_exists(tmp_path):
    from stiefel import optimizers, parametrizations

    argv = ["complexity", "--out", str(tmp_path / "o")]
    maps = ", ".join(parametrizations.maps())
    with pytest.raises(ValueError, match=rf"'qwerty' is not a map; available: {maps}$"):
        cli.main([*argv, "--methods", "cwy", "qwerty"])
    stepped = [n for n in optimizers.available() if optimizers.info(n).riemannian]
    listing = re.escape(", ".join([*stepped, "geoopt"]))
    with pytest.raises(ValueError, match=rf"'adamm' is not a registered .*: {listing}$"):
        cli.main([*argv, "--optimizers", "adamm"])
    with pytest.raises(ValueError, match=r"'adam' is not declared riemannian=True"):
        cli.main([*argv, "--optimizers", "rgd", "adam"])
    assert not (tmp_path / "o").exists()

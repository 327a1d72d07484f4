"""A new user's trial of the harness: resume from anywhere, files others can read, every
strategy checked before training, messages that say what is allowed, pages that are true."""

import inspect
import json
import os
import pathlib
import re
import shutil

import pytest
import torch

from stiefel.comparisons import cli, config, tasks
from stiefel.comparisons.grid import plan
from stiefel.comparisons.report import write_report
from stiefel.comparisons.store import RunStore
from stiefel.comparisons.strategies import parse

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--tasks", "procrustes", "--strategies", "cwy+adam", "--steps", "4", "--seeds", "2"]
TINY += ["--n", "4", "--m", "2", "--record-every", "2"]


def _stored(out: pathlib.Path) -> dict[str, str]:
    """Run file → its text (a run that is run again is written again: new times)."""
    return {p.name: p.read_text() for p in out.glob("runs/*/*.json")}


def test_resume_from_a_moved_folder_another_spelling_or_worker_count(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli.main(["convergence", "--out", "a", "--jobs", "1", *TINY])
    before = _stored(tmp_path / "a")
    assert len(before) == 2
    # the same folder by its absolute path, resumed with another worker count
    cli.main(["convergence", "--out", str(tmp_path / "a"), "--resume", "--jobs", "2", *TINY])
    assert "2 of 2 runs already done" in capsys.readouterr().out
    shutil.move(tmp_path / "a", tmp_path / "moved")
    cli.main(["convergence", "--out", "moved", "--resume", "--jobs", "1", *TINY])
    assert "2 of 2 runs already done" in capsys.readouterr().out
    assert _stored(tmp_path / "moved") == before  # reused, never run again
    with pytest.raises(ValueError) as info:
        cli.main(["convergence", "--out", "moved", "--resume", *TINY, "--steps", "5"])
    assert "steps: stored 4, given 5" in str(info.value)


def test_a_resume_that_measures_nothing_keeps_the_measuring_runs_machine(tmp_path, monkeypatch):
    # a resume reusing every run rewrote the section's load average and end time with its
    # own, while the tables still hold the first run's times
    from stiefel.comparisons import store

    out = tmp_path / "a"
    cli.main(["convergence", "--out", str(out), "--jobs", "1", *TINY])
    first = json.loads((out / "manifest.json").read_text())["sections"]["convergence"]
    busy = store.machine() | {"load": 123.0}
    monkeypatch.setattr(store, "machine", lambda workers=1: busy | {"workers": workers})
    monkeypatch.setattr(store, "_now", lambda: "2099-01-01T00:00:00+00:00")  # a later clock
    cli.main(["convergence", "--out", str(out), "--resume", "--jobs", "1", *TINY])
    again = json.loads((out / "manifest.json").read_text())["sections"]["convergence"]
    assert again["machine"] == first["machine"] and again["ended"] == first["ended"]
    assert "123" not in (out / "report.md").read_text()
    # stopped after its last run but before the section ended (figures being written), a
    # resume that measures nothing still keeps the measuring run's machine
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["sections"]["convergence"]["state"] = "interrupted"
    manifest["sections"]["convergence"]["machine"]["load_end"] = None  # stopped before it
    (out / "manifest.json").write_text(json.dumps(manifest))
    cli.main(["convergence", "--out", str(out), "--resume", "--jobs", "1", *TINY])
    again = json.loads((out / "manifest.json").read_text())["sections"]["convergence"]
    assert again["machine"]["load"] == first["machine"]["load"] and again["state"] == "finished"
    assert "none recorded at the end" in (out / "report.md").read_text()
    # a resume that runs a lost run again measures under this load: its machine is recorded
    next(out.glob("runs/convergence/*.json")).unlink()
    cli.main(["convergence", "--out", str(out), "--resume", "--jobs", "1", *TINY])
    third = json.loads((out / "manifest.json").read_text())["sections"]["convergence"]
    assert third["machine"]["load"] == 123.0 and third["ended"].startswith("2099")


def test_a_record_of_a_moved_folder_without_its_manifest_is_reused(tmp_path, capsys):
    cli.main(["convergence", "--out", str(tmp_path / "a"), "--jobs", "1", *TINY])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "manifest.json").unlink()
    cli.main(["convergence", "--out", str(tmp_path / "b"), "--jobs", "2", *TINY])
    assert "2 of 2 runs already done" in capsys.readouterr().out


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_gets_the_permissions_of_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        reference = tmp_path / "reference.txt"  # what open() gives under this umask
        reference.write_text("x")
        out = tmp_path / "out"
        cli.main(["drift", "--out", str(out), "--jobs", "1", *TINY])
    finally:
        os.umask(old)
    expected = reference.stat().st_mode & 0o777
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) >= 7  # report, drift.md, 2 figures, table, manifest, runs
    assert {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in files} == {
        p.relative_to(out).as_posix(): expected for p in files
    }


ADAM_BETAS = inspect.signature(torch.optim.Adam).parameters["betas"].default


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ("cwz+adam", "unknown method 'cwz'"),
        ("cwy+adamm", "unknown optimizer 'adamm'"),
        ("cwy+adam(lr=-1)", "lr=-1; allowed: a number > 0"),
        ("cwy+adam(0.1)", "must look like key=value"),
        ("cwy+adam(betas=1)", f"option betas=1 (int) is refused ('int' object is not "
         f"subscriptable); allowed: a value like its default betas={ADAM_BETAS!r}"),
        ("householder(reflections=100)+adam", "reflections=100 is out of range"),
        # pogo steps plain matrices as points: cwy's free V would be constrained
        ("cwy+pogo", "would constrain the free parameters of the 'cwy' map"),
    ],
)  # fmt: skip
def test_a_bad_strategy_of_a_later_section_fails_before_any_training(tmp_path, strategy, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[convergence]\nstrategies = ["{strategy}"]\n')
    out = tmp_path / "quick"
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        cli.main(["quick", "--config", str(cfg), "--out", str(out)])
    assert not out.exists()  # the drift section did not train first


def test_a_bad_option_of_the_other_weights_optimizer_is_named(tmp_path):
    opts = config.resolve("convergence", {"tasks": ["copying"], "others": "adam(betas=2)"})
    with pytest.raises(TypeError, match=re.escape("betas=2 (int) is refused")):
        plan(opts, build=True)


def test_a_task_option_of_the_wrong_type_says_what_is_allowed(tmp_path):
    default = tasks.options("procrustes")["n"]
    with pytest.raises(TypeError) as info:
        cli.main(["convergence", "--task-option", "n=eight", "--out", str(tmp_path), *TINY[:4]])
    assert str(info.value) == (
        f"task 'procrustes': option n='eight' (str); allowed: int, e.g. its default n={default}"
    )


def test_an_unknown_key_lists_each_table_once(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[nosuch]\na = 1\n")
    with pytest.raises(ValueError) as info:
        config.load_toml(cfg)
    listed = str(info.value).split("tables: ")[1].split(", ")
    assert sorted(listed) == sorted(config.SCHEMA) and len(listed) == len(set(listed))


def test_the_lr_help_says_where_a_strategy_s_rate_comes_from(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["convergence", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    said = text.split("--lr LR ")[1].split(" --task-option")[0]
    assert "default: declared" not in said
    assert said.index("learning_rates.toml") < said.index("declared")
    # what the help says is what a run does: the table's rate first, the declared one after
    opts = config.resolve("convergence", {"tasks": ["brockett", "copying"], "seeds": 1})
    opts["strategies"] = ["riemannian+rgd"]
    lrs = {(j.task, parse(j.strategy).optimizer): j.lr for j in plan(opts)[0]}
    assert lrs[("brockett", "rgd")] == config.task_lr("brockett", "rgd")
    assert lrs[("copying", "rgd")] is None  # the declared lr (no line for copying)


def _table(path: pathlib.Path) -> list[list[str]]:
    lines = [ln for ln in path.read_text().splitlines() if ln[:2] == "| "]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_the_drift_target_row_matches_the_table_it_cites():
    rows = _table(ROOT / "docs" / "results" / "drift" / "drift.md")[1:]
    maps = ("householder", "cwy", "exp", "cayley")
    peak = {d: max(float(r[6]) for r in rows if r[1].split("+")[0] in maps and r[2] == d)
            for d in ("float32", "float64")}  # fmt: skip
    page = (ROOT / "docs" / "results.md").read_text()
    row = next(ln for ln in page.splitlines() if ln.startswith("| parametrizations stay at"))
    said = {d: float(b) for b, d in re.findall(r"≤ ([\d.e+-]+) \((float\d\d)\)", row)}
    assert said == peak  # the largest drift of a map in the report, as it prints it
    # and the page's own table (two digits) rounds it: "final (max)" per dtype
    section = page.split("## Drift over 10⁴ steps")[1].split("\n## ")[0]
    ours = list(re.findall(r"^\| `(\w+)\+adam` \| (.*) \| (.*) \|$", section, re.M))
    assert [r[0] for r in ours] == list(maps)
    for i, dtype in ((1, "float32"), (2, "float64")):
        top = max(float(r[i].split("(")[1].rstrip(")")) for r in ours)
        assert f"{said[dtype]:.1e}" == f"{top:.1e}", (dtype, said[dtype], top)


def test_the_drift_config_runs_at_the_published_learning_rates(monkeypatch):
    published = {}
    for p in (ROOT / "docs" / "results" / "drift" / "runs" / "drift").glob("*.json"):
        r = json.loads(p.read_text())["record"]
        s = parse(r["strategy"])
        published[(s.method, s.optimizer, str(s.optimizer_options))] = r["lr"]
    page = (ROOT / "docs" / "results.md").read_text()
    assert "python -m stiefel.comparisons drift --config configs/drift.toml" in page
    monkeypatch.chdir(ROOT)  # as the page runs it
    opts = config.resolve("drift", {}, pathlib.Path("configs/drift.toml"))
    ran = {}
    for job in plan(opts)[0]:
        s = parse(job.strategy)
        rest = {k: v for k, v in s.optimizer_options.items() if k != "lr"}
        ran[(s.method, s.optimizer, str(rest))] = s.lr(job.lr)
    assert ran == published


def test_the_quick_report_links_the_configs_from_any_out(tmp_path):
    for out in (tmp_path / "results", tmp_path / "deep" / "er" / "out"):
        with RunStore(out) as store:
            store.manifest["preset"] = "quick"
            store.manifest["sections"]["drift"] = {"state": "finished", "runs": [], "outputs": []}
            write_report(store)
        links = re.findall(r"\]\(([^)]*\.toml)\)", (out / "report.md").read_text())
        assert links
        for link in links:
            assert (out / link).resolve() == (config.PRESETS / pathlib.Path(link).name).resolve()


def test_help_lists_the_tasks_of_the_imported_modules(capsys, monkeypatch):
    # docs/comparisons.md: "--help lists them with their defaults"; the parser had been built
    # before --import ran, so an experiment's task never appeared. The experiments import
    # from the checkout's root, as from `python -m stiefel.comparisons` run there
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2]))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convergence", "--import", "experiments.lipschitz", "--help"])
    assert exit_.value.code == 0
    assert "lipschitz_digits" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["drift", "--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
        (["nonsense"], "invalid choice: 'nonsense'"),
        ([], "the following arguments are required: command"),
    ],
)
def test_a_malformed_command_line_is_refused_in_one_line(argv, says, capsys):
    # argparse printed its whole usage block above the error
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "--help)" in err


def test_each_commands_help_lists_the_task_options_it_runs_with(capsys):
    # drift's help showed procrustes at n=32, the task's own default, where configs/defaults.toml
    # runs drift at n=64 (the reference: that file's sections over the task's defaults)
    import tomllib

    defaults = tomllib.loads((ROOT / "configs" / "defaults.toml").read_text())
    for command in ("drift", "convergence"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        want = tasks.options("procrustes") | defaults[command].get("task_options", {})
        shown = ", ".join(f"{k}={want[k]!r}" for k in tasks.options("procrustes"))
        assert f"procrustes (matrix): {shown}" in text, command


def test_a_report_of_a_folder_that_does_not_exist_creates_none(tmp_path):
    # it failed, and left the folder behind with a manifest saying "failed"
    with pytest.raises(FileNotFoundError, match="no results in .*nothere: run drift"):
        cli.main(["report", "--out", str(tmp_path / "nothere")])
    assert not (tmp_path / "nothere").exists()
    (tmp_path / "empty").mkdir()  # nor a manifest in a folder without results
    with pytest.raises(FileNotFoundError, match="no results in"):
        cli.main(["report", "--out", str(tmp_path / "empty")])
    assert not any((tmp_path / "empty").iterdir())

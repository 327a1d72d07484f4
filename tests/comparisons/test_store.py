"""Durable harness runs: per-run files, manifest, --resume, the lock, links, early failures.

The interruption and concurrency tests drive real ``python -m stiefel.comparisons``
processes (SIGINT, SIGKILL, a second writer) and resume in this process.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from stiefel.comparisons import cli, table
from stiefel.comparisons.store import OutputLocked, RunStore

RUN = ["--tasks", "procrustes", "--strategies", "cwy+adam", "--dtype", "float64"]
RUN += ["--steps", "800", "--n", "8", "--m", "4", "--record-every", "100"]
TINY = ["--tasks", "procrustes", "--strategies", "cwy+adam", "--dtype", "float64"]
TINY += ["--steps", "4", "--n", "4", "--m", "2", "--record-every", "2"]


def _default_sigint() -> None:
    # A shell without job control starts background commands with SIGINT ignored, and
    # an ignored signal stays ignored across exec: Python would then never raise
    # KeyboardInterrupt. The child gets the default disposition, as from a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(out: pathlib.Path, *argv: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "stiefel.comparisons", "drift", "--out", str(out), *argv]
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def _manifest(out: pathlib.Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _finished(out: pathlib.Path) -> list[dict]:
    try:
        return _manifest(out)["sections"]["drift"]["runs"]
    except (FileNotFoundError, KeyError, ValueError):
        return []


def _wait_for_runs(out: pathlib.Path, proc: subprocess.Popen, k: int, timeout: float = 240):
    start = time.monotonic()
    while len(_finished(out)) < k:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - start < timeout, "no run finished in time"
        time.sleep(0.2)


def _stamps(out: pathlib.Path) -> dict[str, tuple[int, int]]:
    files = (out / "runs" / "drift").glob("*.json")
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


@pytest.mark.slow  # a harness process of its own: seconds of start-up
def test_a_second_writer_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / "out"
    # far more runs than can finish while the second process starts (imports torch)
    a = _spawn(out, "--seeds", "200", *RUN)
    try:
        _wait_for_runs(out, a, 1)
        b = _spawn(out, "--seeds", "200", *RUN)  # a second writer of the same --out
        _, err = b.communicate(timeout=240)
        assert b.returncode == 2
        assert f"being written by another process (pid {a.pid}" in err
        assert a.poll() is None, "the first writer must be unaffected"
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()


@pytest.mark.slow  # a harness process of its own: seconds of start-up
def test_the_workers_of_a_killed_harness_end_with_it(tmp_path):
    # SIGKILL leaves no shutdown to run: the pool's workers waited for work forever
    # (Note [Workers end with the harness])
    import psutil

    out = tmp_path / "out"
    a = _spawn(out, "--seeds", "200", "--jobs", "2", *RUN)
    try:
        _wait_for_runs(out, a, 1)
        workers = psutil.Process(a.pid).children()
        assert len(workers) >= 2
    finally:
        a.kill()
        a.wait()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"workers {[p.pid for p in alive]} outlived their harness"


@pytest.mark.slow
def test_sigint_then_resume(tmp_path):
    out = tmp_path / "out"
    a = _spawn(out, "--seeds", "12", *RUN)
    try:
        _wait_for_runs(out, a, 1)
        a.send_signal(signal.SIGINT)
        a.communicate(timeout=120)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert a.returncode == 130
    m = _manifest(out)
    assert m["state"] == "interrupted" and m["sections"]["drift"]["state"] == "interrupted"
    assert m["ended"] and m["versions"]["torch"] and not (out / ".lock").exists()
    done = _stamps(out)
    assert 1 <= len(done) < 12 and len(m["sections"]["drift"]["runs"]) == len(done)
    cli.main(["drift", "--out", str(out), "--resume", "--seeds", "12", *RUN])
    after = _stamps(out)
    assert len(after) == 12 and all(after[k] == v for k, v in done.items())  # not redone
    m = _manifest(out)
    assert m["state"] == "finished" and len(m["sections"]["drift"]["runs"]) == 12
    report = (out / "report.md").read_text()
    assert report.count("| procrustes | cwy+adam | float64 |") == 12


@pytest.mark.slow
def test_sigkill_then_resume_takes_over_the_stale_lock(tmp_path):
    out = tmp_path / "out"
    a = _spawn(out, "--seeds", "4", *RUN)
    try:
        _wait_for_runs(out, a, 1)
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert (out / ".lock").read_text() == str(a.pid)  # left behind by the killed process
    assert _manifest(out)["state"] == "running"
    done = _stamps(out)
    assert 1 <= len(done) < 4
    with pytest.raises(ValueError, match="already holds drift results .*--resume"):
        cli.main(["drift", "--out", str(out), "--seeds", "4", *RUN])
    with pytest.raises(ValueError, match=r"options differ .*\(steps: stored \d+, given 9\)"):
        cli.main(["drift", "--out", str(out), "--resume", "--seeds", "4", *RUN, "--steps", "9"])
    cli.main(["drift", "--out", str(out), "--resume", "--seeds", "4", *RUN])
    after = _stamps(out)
    assert len(after) == 4 and all(after[k] == v for k, v in done.items())
    assert _manifest(out)["state"] == "finished" and not (out / ".lock").exists()


def test_lock_of_a_live_process_is_refused_in_process(tmp_path):
    (tmp_path / ".lock").write_text(str(os.getppid()))  # a live process that is not us
    with pytest.raises(OutputLocked, match=f"pid {os.getppid()}"):
        RunStore(tmp_path).open()
    assert (tmp_path / ".lock").read_text() == str(os.getppid())  # left alone


def test_report_uses_the_manifest_only_and_overwrite_replaces(tmp_path):
    (tmp_path / "convergence.md").write_text("STALE convergence of an earlier run")
    (tmp_path / "drift_old.png").write_bytes(b"\x89PNG stale")
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "2", *TINY])
    report = (tmp_path / "report.md").read_text()
    assert "STALE" not in report and "drift_old" not in report and "Convergence" not in report
    assert report.count("| procrustes | cwy+adam |") == 2
    cli.main(["drift", "--out", str(tmp_path), "--overwrite", "--seeds", "1", *TINY])
    assert len(list((tmp_path / "runs" / "drift").glob("*.json"))) == 1
    assert (tmp_path / "report.md").read_text().count("| procrustes | cwy+adam |") == 1


def test_unwritable_out_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    t0 = time.perf_counter()
    with pytest.raises(OSError, match="cannot be written"):
        cli.main(["drift", "--out", str(blocker / "sub"), "--seeds", "1", *RUN])
    assert time.perf_counter() - t0 < 5  # no run of 800 steps started
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OSError, match="cannot be written"):
            cli.main(["drift", "--out", str(ro), "--seeds", "1", *RUN])


def test_links_out_of_out_are_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "drift.md").symlink_to(outside / "victim.md")
    with pytest.raises(ValueError, match="a link to .*outside it"):
        cli.main(["drift", "--out", str(out), "--seeds", "1", *TINY])
    (out / "drift.md").unlink()
    (out / "runs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="a link to .*outside it"):
        cli.main(["drift", "--out", str(out), "--seeds", "1", *TINY])
    assert list(outside.iterdir()) == []
    assert not (out / ".lock").exists()


# ----------------------------------------------------------------- the audit's findings
def _crafted_manifest(out: pathlib.Path, **section) -> None:
    """A manifest.json as an attacker (or a stray edit) would leave it in --out."""
    sec = {"options": {}, "runs": [], "outputs": [], "skipped": [], "state": "finished"}
    out.mkdir(exist_ok=True)
    (out / "manifest.json").write_text(json.dumps({"sections": {"drift": {**sec, **section}}}))


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_overwrite_deletes_no_file_a_crafted_manifest_names_outside_out(tmp_path, where):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    name = "../victim.txt" if where == "relative" else str(victim)
    _crafted_manifest(tmp_path / "out", runs=[{"key": "k", "file": name, "finished": None}])
    with pytest.raises(ValueError, match=f"refusing {name!r} .* named in manifest.*outside --out"):
        cli.main(["drift", "--out", str(tmp_path / "out"), "--overwrite", "--seeds", "1", *TINY])
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out" / ".lock").exists()


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_report_copies_no_file_a_crafted_manifest_names_outside_out(tmp_path, where):
    secret = tmp_path / "secret.md"
    secret.write_text("SECRET outside --out")
    name = "../secret.md" if where == "relative" else str(secret)
    _crafted_manifest(tmp_path / "out", outputs=[name])
    with pytest.raises(ValueError, match=f"refusing {name!r} .* named in manifest.*outside --out"):
        cli.main(["report", "--out", str(tmp_path / "out")])
    report = tmp_path / "out" / "report.md"
    assert not report.exists() or "SECRET" not in report.read_text()


def test_runs_of_other_options_are_not_reused_without_the_manifest(tmp_path, capsys):
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "1", *TINY])  # 4 steps
    (tmp_path / "manifest.json").unlink()
    longer = [*TINY, "--steps", "6"]  # the last flag wins
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "1", *longer])
    assert "already done" not in capsys.readouterr().out
    (final,) = table.read(tmp_path, metric="final_loss")
    assert final["step"] == 5  # trained again for 6 steps, not the stored 4-step run
    (tmp_path / "manifest.json").unlink()  # same options: the stored run is reused
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "1", *longer])
    assert "1 of 1 runs already done" in capsys.readouterr().out


def test_a_lock_whose_owner_has_not_written_its_pid_yet_is_held(tmp_path):
    lock = tmp_path / ".lock"
    lock.write_text("")  # created by a writer that has not written its pid yet
    with pytest.raises(OutputLocked, match="no pid yet"):
        RunStore(tmp_path).open()
    assert lock.exists() and lock.read_text() == ""  # left to its owner
    old = time.time() - 3600  # a pid-less lock an hour old was left by a crash: taken over
    os.utime(lock, (old, old))
    store = RunStore(tmp_path)
    store.open()
    assert lock.read_text() == str(os.getpid())
    store.close("finished")
    assert not lock.exists()


# ----------------------------------------------------------------- damaged records
def test_a_damaged_record_of_another_section_is_named_and_skipped(tmp_path):
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "2", *TINY])
    files = sorted((tmp_path / "runs" / "drift").glob("*.json"))
    kept = json.loads(files[1].read_text())["record"]
    files[0].write_text(files[0].read_text()[:40])  # truncated mid-string, on line 2
    with pytest.warns(UserWarning, match=rf"damaged run record {files[0]} \(line 2: "):
        assert cli.run(["convergence", "--out", str(tmp_path), "--seeds", "1", *TINY]) == 0
    m = _manifest(tmp_path)
    assert m["state"] == "finished" and m["sections"]["convergence"]["state"] == "finished"
    conv = table.read(tmp_path, section="convergence", metric="final_loss")
    assert len(conv) == 1
    drift = table.read(tmp_path, section="drift", metric="final_loss")
    assert [r["value"] for r in drift] == [kept["final_loss"]]  # the intact run is not lost
    with pytest.warns(UserWarning, match=f"damaged run record {files[0]}"):  # run again
        cli.main(["drift", "--out", str(tmp_path), "--resume", "--seeds", "2", *TINY])
    assert len(table.read(tmp_path, section="drift", metric="final_loss")) == 2


def test_a_damaged_manifest_is_kept_and_the_runs_reused(tmp_path, capsys):
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "1", *TINY])
    (tmp_path / "manifest.json").write_text('{"sections": {"dri')
    with pytest.warns(UserWarning, match="manifest.json kept as manifest.json.damaged"):
        cli.main(["drift", "--out", str(tmp_path), "--seeds", "1", *TINY])
    assert (tmp_path / "manifest.json.damaged").read_text() == '{"sections": {"dri'
    assert "1 of 1 runs already done" in capsys.readouterr().out


def test_a_report_of_a_damaged_manifest_says_how_to_rebuild_it(tmp_path):
    # it answered "no results in …: run drift, … first" beside stored runs
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "1", *TINY])
    (tmp_path / "manifest.json").write_text('{"sections": {"dri')
    with pytest.warns(UserWarning), pytest.raises(FileNotFoundError, match="--resume; their"):
        cli.main(["report", "--out", str(tmp_path)])


def test_the_harness_writes_its_warnings_as_one_line_each(tmp_path):
    # a warning printed the source line that raised it ("m = read_json(path, ...)")
    import warnings

    shown = warnings.formatwarning
    cli.main(["drift", "--out", str(tmp_path), "--seeds", "1", *TINY])
    assert warnings.formatwarning is shown  # one-line notes during a run only
    line = cli._one_line(UserWarning("kept as manifest.json.damaged"), UserWarning, "f.py", 3)
    assert line == "UserWarning: kept as manifest.json.damaged\n"


def test_table_read_skips_a_damaged_line_naming_it(tmp_path):
    rows = [{"section": "drift", "metric": "loss", "value": 1.0}]
    (tmp_path / "results.jsonl").write_text(table.dumps(rows) + '{"section": "dr\n')
    with pytest.warns(UserWarning, match=r"damaged line 2 of .*results.jsonl"):
        (row,) = table.read(tmp_path, section="drift")
    assert row["value"] == 1.0

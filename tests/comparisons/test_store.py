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

from stiefel.comparisons import cli
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
    with pytest.raises(ValueError, match="options differ .* for steps"):
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

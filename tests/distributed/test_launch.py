"""The test launcher itself: a start that fails is tried again, a failing worker is raised."""

import socket

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


@pytest.mark.slow
def test_launch_tries_again_when_the_port_is_taken(tmp_path, monkeypatch):
    import _launch

    # the first port handed out is held here: rank 0 cannot bind it, and no rank
    # joins; the second attempt gets a free port and runs the worker
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = _launch.free_port
    handed = []

    def port():
        handed.append(ports.pop() if ports else real())
        return handed[-1]

    monkeypatch.setattr(_launch, "free_port", port)
    try:
        _launch.launch(_launch.hello_worker, 2, tmp_path)
    finally:
        taken.close()
    assert len(handed) == 2
    assert [(tmp_path / f"hello_rank{r}.txt").read_text() for r in range(2)] == ["3", "3"]


@pytest.mark.slow
def test_launch_raises_a_failing_worker_without_retrying(tmp_path, monkeypatch):
    import _launch

    calls = []
    real = _launch.free_port
    monkeypatch.setattr(_launch, "free_port", lambda: calls.append(1) or real())
    with pytest.raises(RuntimeError, match="boom"):
        _launch.launch(_launch.raising_worker, 2, tmp_path)
    assert len(calls) == 1


@pytest.mark.slow  # waits for a stall: about 6 s
def test_launch_stops_a_hang_by_its_stall_not_by_the_wall_clock(tmp_path):
    import time

    import _launch

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no rank used any CPU time for 5"):
        _launch.launch(_launch.sleeping_worker, 2, tmp_path, stall=5.0, timeout=600)
    assert time.monotonic() - start < 120  # stopped by the stall, long before the timeout


@pytest.mark.slow  # runs a busy process past the stall limit: about 7 s
def test_a_busy_process_is_not_a_stall():
    import subprocess
    import sys
    import time

    import _launch

    # a child that computes for 2 s, then sleeps: watched alone (the test process's own
    # background threads, e.g. a compiler's, would count as its CPU time)
    code = "import time\nt = time.monotonic() + 2\nwhile time.monotonic() < t: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        if _launch.cpu_seconds(child.pid) is None:
            pytest.skip("no /proc: only the overall timeout applies")
        # a stall of 3 s: a busy process gets some CPU time in 3 s even on a loaded machine
        watch = _launch._Watch([child.pid], stall=3.0)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # CPU time grew less than 3 s ago: never stalled
            assert not watch.stalled()
            time.sleep(0.05)
        time.sleep(4.0)  # the child is asleep: no CPU time for longer than the stall
        assert watch.stalled()
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_a_rank_killed_once_by_a_signal_is_run_again_with_a_warning(tmp_path):
    import _launch

    # Note [A rank killed by a signal]: the first run's stderr and Python stack come
    # back in the warning, and the second run passes
    with pytest.warns(UserWarning, match="SIGABRT") as caught:
        _launch.launch(_launch.aborting_worker, 2, tmp_path, False)
    report = str(caught[0].message)
    assert "the worker's own last words" in report
    assert "Fatal Python error: Aborted" in report and "aborting_worker" in report


@pytest.mark.slow
def test_a_rank_killed_twice_is_raised_with_both_reports(tmp_path):
    import _launch

    with pytest.raises(RuntimeError, match="killed twice") as info:
        _launch.launch(_launch.aborting_worker, 2, tmp_path, True)
    assert str(info.value).count("the worker's own last words") == 2

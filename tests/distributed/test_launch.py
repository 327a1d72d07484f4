"""The test launcher itself: a start that fails is tried again, a failing worker is raised."""

import socket

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


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
        _launch.launch(_launch.hello_worker, 2, tmp_path, timeout=120)
    finally:
        taken.close()
    assert len(handed) == 2
    assert [(tmp_path / f"hello_rank{r}.txt").read_text() for r in range(2)] == ["3", "3"]


def test_launch_raises_a_failing_worker_without_retrying(tmp_path, monkeypatch):
    import _launch

    calls = []
    real = _launch.free_port
    monkeypatch.setattr(_launch, "free_port", lambda: calls.append(1) or real())
    with pytest.raises(RuntimeError, match="boom"):
        _launch.launch(_launch.raising_worker, 2, tmp_path, timeout=120)
    assert len(calls) == 1

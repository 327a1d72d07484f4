"""Shared fixtures: the devices every GPU-relevant suite runs on.

``device`` is "cpu", and "cuda" when a CUDA device is visible (the cuda case is
skipped otherwise, so a CPU run lists it as skipped). Tests create their tensors
on ``device``, compute references in float64 on the CPU and compare after
``.cpu()``.

The tiers: plain ``pytest`` runs the fast tier (``-m 'not slow'`` in pyproject's
addopts); a test that takes more than a few seconds carries ``@pytest.mark.slow``
and runs with ``pytest -m slow``. ``--cpu-durations=N`` lists the N tests that took
the most CPU time (this process and the child processes it waited for), a measure
that, unlike ``--durations``' wall clock, does not grow on a loaded machine.
"""

import pathlib
import sys
import time

import pytest
import torch

try:
    import resource
except ImportError:  # Windows: this process's CPU time only
    resource = None

# the suites' shared helpers (tests/_models.py) import as top-level modules
_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Note [One intra-op thread for the whole session]
# torch 2.13's CPU build (MKL 2024.2, OpenMP): after torch.set_num_threads(1) and back to
# 2, a batched torch.linalg.solve returns wrong results (a residual of 0.6 on a
# (2, 300, 300) system) or raises "Pivots given to lu_solve must all be greater or equal
# to 1" with MKL's "Parameter 6 was incorrect on entry to DLASWP"; without the round
# trip it is right to rounding. Fixtures that time on one thread restore the count, so a
# test after them failed against its LAPACK reference by the order the tests ran in.
# The session runs on one thread from the start: no count is ever raised again, and one
# thread is what a shared 2-core runner should use anyway.
torch.set_num_threads(1)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The device a test's tensors live on: "cpu", or "cuda" when one is visible."""
    return request.param


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests that took the most CPU time, children included (0: all)",
    )


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its waited-for children."""
    if resource is None:
        return time.process_time()
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


_CPU_KEY = pytest.StashKey[dict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Set-up, call and tear-down of one test, on the CPU clock (with --cpu-durations)."""
    if item.config.getoption("cpu_durations") is None:
        yield
        return
    start = _cpu_seconds()
    yield
    item.config.stash.setdefault(_CPU_KEY, {})[item.nodeid] = _cpu_seconds() - start


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    n = config.getoption("cpu_durations")
    if n is None:
        return
    times = sorted(config.stash.get(_CPU_KEY, {}).items(), key=lambda kv: -kv[1])
    terminalreporter.section(f"CPU time: {'every' if n == 0 else f'the {n} longest'} test(s)")
    for nodeid, seconds in times if n == 0 else times[:n]:
        terminalreporter.write_line(f"{seconds:8.2f}s cpu  {nodeid}")
    total = sum(s for _, s in times)
    terminalreporter.write_line(f"{total:8.2f}s cpu  in all, {len(times)} tests")
